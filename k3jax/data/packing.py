"""Windows of a token stream -> next-token training examples with document segmentation.

A window is T+1 consecutive stream tokens w. The example is `inputs = w[:-1]`, `targets = w[1:]`
and, per input position t (all [T]):

- `segment_ids` int32: 1 at t = 0, +1 at the token after each EOS, so an EOS belongs to the
  document it ends. Attention is allowed only where query and key segment ids are equal
  (`jax.nn.dot_product_attention`'s segment masking / MaxText's `inputs_segmentation`).
- `positions` int32: position within the document, 0 at each segment start. A window that starts
  mid-document starts at 0 too: positions are relative to the window, which is what the model sees.
- `loss_mask` bool: target t is in the same document as input t, i.e. `inputs[t] != EOS`. The
  EOS token itself is a target (the model learns where documents end); the token after it is not
  predicted from the previous document.

Example (E = EOS), w = [a b E c d E e f E], T = 8:
  inputs       a b E c d E e f
  targets      b E c d E e f E
  segment_ids  1 1 1 2 2 2 3 3
  positions    0 1 2 0 1 2 0 1
  loss_mask    1 1 0 1 1 0 1 1
"""
from __future__ import annotations

import numpy as np

from k3jax.data.tokenizer import EOS_ID

EXAMPLE_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def pack_windows(windows, *, eos_id: int = EOS_ID) -> dict[str, np.ndarray]:
    """Batched `pack_window`: windows [B, T+1] (any integer dtype) -> dict of [B, T] arrays.

    Returns:
      {"inputs": int32, "targets": int32, "segment_ids": int32, "positions": int32,
       "loss_mask": bool}, each [B, T]; see the module docstring.

    Raises:
      ValueError: `windows` is not a 2-D integer array with at least 2 columns.
    """
    w = np.asarray(windows)
    if w.ndim != 2 or w.shape[1] < 2 or not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"windows must be an integer array [B, T+1] with T >= 1, got {w.shape=} "
                         f"{w.dtype=}")
    w = w.astype(np.int32)
    inputs, targets = w[:, :-1], w[:, 1:]
    t = inputs.shape[1]
    is_eos = inputs == eos_id
    # A new segment starts at t = 0 and right after every EOS.
    starts = np.zeros_like(is_eos)
    starts[:, 0] = True
    starts[:, 1:] = is_eos[:, :-1]
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(t, dtype=np.int32), inputs.shape)
    segment_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": segment_ids,
        "positions": (index - segment_start).astype(np.int32),
        "loss_mask": ~is_eos,
    }


def pack_window(window, *, eos_id: int = EOS_ID) -> dict[str, np.ndarray]:
    """One window [T+1] of stream tokens -> dict of [T] arrays (see the module docstring).

    Raises:
      ValueError: `window` is not a 1-D integer array of length >= 2.
    """
    w = np.asarray(window)
    if w.ndim != 1 or w.shape[0] < 2 or not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"window must be an integer array [T+1] with T >= 1, got {w.shape=} "
                         f"{w.dtype=}")
    return {k: v[0] for k, v in pack_windows(w[None], eos_id=eos_id).items()}
