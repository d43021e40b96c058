"""LM-head cross-entropy without the whole [tokens, vocab] fp32 logits: a scan over token chunks.

The plain loss multiplies the final hidden states [N, D] by the head [D, V] into logits [N, V], casts them
to fp32 and takes the softmax cross-entropy: at N = 32 x 2048 tokens and V = 131072 that is 32 GiB of fp32
logits, plus as much again for their gradient. `chunked_cross_entropy` computes the same sum one chunk of
C tokens at a time inside a `jax.lax.scan`, with the chunk's loss under `jax.checkpoint`: the forward
keeps only each chunk's scalar, the backward recomputes the chunk's logits, so at most one chunk's
[C, V] logits (and their gradient) are live at any time. The head gradient accumulates over chunks in
fp32 (the head parameter's dtype). Per token, the logits are computed exactly as the model's head
computes them (hidden and head cast to the compute dtype, one matmul, the product cast to fp32; optax's
integer-label softmax cross-entropy), so the sum equals the plain loss up to summation order (tested in
value and gradient). Cost: one extra head matmul per chunk in the backward (the recomputation), as in
any rematerialised loss (Liger's fused linear cross-entropy, MaxText's vocabulary tiling).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _check(hidden, weight, targets, loss_mask):
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [D, V] with D = hidden.shape[-1]; got {hidden.shape=}, {weight.shape=}")
    if targets.shape != hidden.shape[:-1] or loss_mask.shape != targets.shape:
        raise ValueError(f"targets and loss_mask must be hidden.shape[:-1]; got {hidden.shape=}, {targets.shape=}, "
                         f"{loss_mask.shape=}")


def _chunk_nats(weight, hidden, targets, mask, dtype):
    """Summed nats of one chunk: hidden [C, D], weight [D, V] fp32, targets [C], mask [C] fp32."""
    logits = jnp.dot(hidden.astype(dtype), weight.astype(dtype)).astype(jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)


def cross_entropy(hidden, weight, targets, loss_mask, *, dtype=None):
    """The plain loss: the whole logits [..., V] at once. Same contract as `chunked_cross_entropy`."""
    _check(hidden, weight, targets, loss_mask)
    dtype = hidden.dtype if dtype is None else dtype
    mask = loss_mask.astype(jnp.float32)
    return _chunk_nats(weight, hidden, targets, mask, dtype), jnp.sum(mask)


def chunked_cross_entropy(hidden, weight, targets, loss_mask, *, chunk_size: int, dtype=None):
    """Summed cross-entropy of the head `hidden @ weight` over `loss_mask`, `chunk_size` tokens at a time.

    Args:
      hidden: [..., D] final (normed) hidden states, any float dtype.
      weight: [D, V] head matrix (fp32 parameter; a tied head passes the embedding table transposed).
      targets: [...] int32 ids < V. loss_mask: [...] bool (or 0/1).
      chunk_size: tokens per chunk C (> 0); the flattened tokens are zero-padded (mask 0) to a multiple
        of min(C, tokens).
      dtype: compute dtype of the matmul (the model's `cfg.dtype`); None = hidden's.

    Returns:
      (sum_nats fp32 scalar, count fp32 scalar), as `k3jax.train.step.masked_cross_entropy`.

    Raises:
      ValueError: shapes that do not fit, or chunk_size < 1.
    """
    _check(hidden, weight, targets, loss_mask)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = hidden.dtype if dtype is None else dtype
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    t = targets.reshape(-1).astype(jnp.int32)
    m = loss_mask.reshape(-1).astype(jnp.float32)
    n = h.shape[0]
    c = min(chunk_size, max(n, 1))
    pad = -n % c
    if pad:
        h, t, m = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad)), jnp.pad(m, (0, pad))
    k = (n + pad) // c
    chunk_nats = jax.checkpoint(lambda w, hc, tc, mc: _chunk_nats(w, hc, tc, mc, dtype), prevent_cse=False)

    def body(total, xs):
        return total + chunk_nats(weight, *xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h.reshape(k, c, d), t.reshape(k, c), m.reshape(k, c)))
    return total, jnp.sum(m)


def auto_chunk_size(padded_vocab_size: int, *, threshold: int = 32768, logits_budget: int = 1 << 27) -> int:
    """The chunk the trainer uses when `train.loss_chunk_size` is None: 0 (the plain loss) below
    `threshold` ids, else the largest power of two <= logits_budget / V tokens (>= 128): 4096 tokens at
    V = 32768, 1024 at 131072, i.e. at most 2^27 fp32 logits (512 MiB) per chunk."""
    if padded_vocab_size < threshold:
        return 0
    c = max(128, logits_budget // padded_vocab_size)
    return 1 << (c.bit_length() - 1)
