"""grain pipelines over a token stream: a resumable shuffled train loader and a fixed eval slice.

Train loader (`make_train_loader`): the stream is cut into non-overlapping windows of stride T =
seq_len (window i covers tokens [i*T, i*T + T] inclusive, T+1 tokens, so consecutive windows share
one boundary token and every stream token except the first is a target exactly once per epoch).
The pipeline is

    grain.MapDataset.range(num_windows)
        .shuffle(seed)            # a different permutation each epoch (grain uses seed + epoch)
        .repeat(num_epochs)       # None = forever
        .map(window -> pack_window(...))
        .batch(batch_size, drop_remainder=True)
        .to_iter_dataset(read_options)

and yields dicts of numpy arrays [B, T] with the keys of `k3jax.data.packing.EXAMPLE_KEYS`.
Batches run across epoch boundaries (batch k holds shuffled-stream elements k*B .. k*B + B - 1).

Resuming: the iterator's `get_state()` is a small JSON-able dict (the index of the next element);
`set_state(state)` on an iterator built with the same arguments continues with exactly the batch
that would have come next. With orbax, save it as one item of a `CheckpointManager` checkpoint
through grain's own orbax handler (`grain.checkpoint.CheckpointSave/CheckpointRestore`, which write
`process_<i>-of-<n>.json` with the state); `iterator_save_args`/`iterator_restore_args` return them:

    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data=iterator_save_args(train_iter)))
    ...
    train_iter = make_train_loader(tokens, batch_size=..., seq_len=..., seed=...)  # same args
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=iterator_restore_args(train_iter)))
    train_iter = restored["data"]  # the same object, its state set in place

The item lands in `<step>/data/process_<i>-of-<n>.json`. A manager built with explicit
`item_handlers` must map the data item to `grain.checkpoint.CheckpointHandler()`.

Eval (`eval_batches`): sequential windows from the start of the stream, no shuffling, the same
slice every call, so validation numbers are comparable across steps and runs.
"""
from __future__ import annotations

from typing import Any

import grain
import numpy as np

from k3jax.data.packing import pack_window, pack_windows
from k3jax.data.tokenizer import EOS_ID

DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


def num_windows(tokens, seq_len: int) -> int:
    """Number of non-overlapping windows of stride `seq_len` (T+1 tokens each) in `tokens`."""
    return max(0, (int(np.shape(tokens)[0]) - 1) // seq_len)


def _is_positive_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _check(tokens, batch_size: int, seq_len: int) -> int:
    if not _is_positive_int(seq_len):
        raise ValueError(f"seq_len must be a positive int, got {seq_len=}")
    if not _is_positive_int(batch_size):
        raise ValueError(f"batch_size must be a positive int, got {batch_size=}")
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens must be a 1-D token stream, got {np.shape(tokens)=}")
    n = num_windows(tokens, seq_len)
    if n == 0:
        raise ValueError(f"tokens holds {np.shape(tokens)[0]} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1} needed for one window ({seq_len=})")
    return n


class _PackWindow(grain.transforms.Map):
    """Window index -> packed example (picklable, so grain may run it in worker processes)."""

    def __init__(self, tokens, seq_len: int, eos_id: int = EOS_ID):
        self._tokens = tokens
        self._seq_len = seq_len
        self._eos_id = eos_id

    def map(self, element):
        start = int(element) * self._seq_len
        return pack_window(np.asarray(self._tokens[start:start + self._seq_len + 1]), eos_id=self._eos_id)


def make_train_loader(tokens, *, batch_size: int, seq_len: int, seed: int,
                      num_epochs: int | None = None,
                      read_options: grain.ReadOptions | None = None,
                      eos_id: int = EOS_ID) -> grain.DatasetIterator:
    """A resumable grain iterator of shuffled packed training batches.

    Args:
      tokens: 1-D integer token stream [N] (e.g. `Corpus.tokens`, a uint16 memmap); not copied.
      batch_size: B, examples per batch.
      seq_len: T, tokens per example (each window reads T+1 stream tokens).
      seed: shuffle seed in [0, 2**32); epoch e uses grain's permutation for seed + e.
      num_epochs: passes over the windows; None repeats forever. With a finite count the last
        partial batch is dropped.
      read_options: grain thread/prefetch options; default 1 thread, 8 batches of prefetch.
      eos_id: the stream's end-of-document id (segments and loss mask; the tokenizer's `eos_id`).

    Returns:
      A `grain.DatasetIterator` yielding {"inputs","targets","segment_ids","positions"} int32
      [B, T] and "loss_mask" bool [B, T] (see `k3jax.data.packing`); `get_state()`/`set_state()`
      resume exactly (see the module docstring for orbax).

    Raises:
      ValueError: non-positive `batch_size`/`seq_len`, `seed` outside [0, 2**32), non-positive
        `num_epochs`, or a stream shorter than seq_len + 1 (message names seq_len).
    """
    n = _check(tokens, batch_size, seq_len)
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed=}")
    if num_epochs is not None and not _is_positive_int(num_epochs):
        raise ValueError(f"num_epochs must be None or a positive int, got {num_epochs=}")
    ds = (grain.MapDataset.range(n)
          .shuffle(seed=int(seed))
          .repeat(num_epochs)
          .map(_PackWindow(tokens, int(seq_len), int(eos_id)))
          .batch(int(batch_size), drop_remainder=True))
    return iter(ds.to_iter_dataset(read_options or DEFAULT_READ_OPTIONS))


def eval_batches(tokens, *, batch_size: int, seq_len: int,
                 max_batches: int, eos_id: int = EOS_ID) -> list[dict[str, np.ndarray]]:
    """A fixed evaluation slice: windows 0, 1, 2, ... (stride seq_len) from the start, in order.

    Returns min(max_batches, num_windows // batch_size) full batches, or, when the stream holds
    fewer than `batch_size` windows, one smaller batch of all of them. Each batch is a dict of
    [b, T] arrays as `make_train_loader` yields (`eos_id` as there).

    Raises:
      ValueError: non-positive `batch_size`/`seq_len`/`max_batches`, or a stream shorter than
        seq_len + 1 (message names seq_len).
    """
    n = _check(tokens, batch_size, seq_len)
    if not _is_positive_int(max_batches):
        raise ValueError(f"max_batches must be a positive int, got {max_batches=}")
    sizes = [batch_size] * min(max_batches, n // batch_size) or [n]
    batches, window = [], 0
    for b in sizes:
        starts = (window + np.arange(b)) * seq_len
        rows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts])
        batches.append(pack_windows(rows, eos_id=eos_id))
        window += b
    return batches


def iterator_save_args(iterator: grain.DatasetIterator) -> Any:
    """orbax `CheckpointArgs` that save `iterator`'s state: `grain.checkpoint.CheckpointSave`.

    Use as one item of `ocp.args.Composite` in `CheckpointManager.save` (module docstring).
    """
    return grain.checkpoint.CheckpointSave(iterator)


def iterator_restore_args(iterator: grain.DatasetIterator) -> Any:
    """orbax `CheckpointArgs` restoring `iterator` in place: `grain.checkpoint.CheckpointRestore`.

    `iterator` must come from `make_train_loader` with the arguments of the saved one; the
    restored item returned by `CheckpointManager.restore` is that same iterator.
    """
    return grain.checkpoint.CheckpointRestore(iterator)
