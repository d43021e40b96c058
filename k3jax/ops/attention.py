"""Causal softmax attention with document (segment) masking, and rotary position embeddings.

A thin wrapper over `jax.nn.dot_product_attention` (XLA on CPU; cuDNN/XLA on GPU).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_causal_mask(q_segment_ids, kv_segment_ids, q_positions=None, kv_positions=None):
    """Boolean attention mask [B, 1, Tq, Tk]: same document AND key not after query.

    Args:
      q_segment_ids: [B, Tq] int32 document ids of the queries (0 = padding).
      kv_segment_ids: [B, Tk] int32 document ids of the keys.
      q_positions, kv_positions: optional [B, Tq] / [B, Tk] int32 absolute stream positions used for the
        causal part; default: index order (query i may see keys 0..i when Tq == Tk).
    """
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if q_positions is None:
        tq, tk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
        causal = jnp.tril(jnp.ones((tq, tk), bool), k=tk - tq)[None]
    else:
        causal = q_positions[:, :, None] >= kv_positions[:, None, :]
    return (same & causal)[:, None]


def causal_attention(q, k, v, *, segment_ids=None, scale=None):
    """Causal multi-head softmax attention; tokens attend only within their own document.

    Args:
      q: [B, T, H, Dh] queries; k, v: [B, T, H, Dh] keys and values (same dtype as q).
      segment_ids: optional [B, T] int32 document ids (packed sequences); None = one document per row.
      scale: logit scale, default Dh**-0.5.

    Returns:
      [B, T, H, Dh] in q's dtype. Softmax is computed in fp32 by `jax.nn.dot_product_attention`.

    Raises:
      ValueError: if shapes disagree.
    """
    if q.shape != k.shape or k.shape[:3] != v.shape[:3] or q.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, Dh] with matching shapes, got {q.shape=} {k.shape=} {v.shape=}")
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]}, got {segment_ids.shape=}")
    mask = segment_causal_mask(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)


def rope(x, positions, *, theta=10000.0):
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), half-split ("GPT-NeoX") layout.

    Args:
      x: [B, T, H, Dh] with Dh even.
      positions: [B, T] int32 position of each token inside its document.
      theta: frequency base.

    Returns:
      x rotated, same shape and dtype (angles in fp32).
    """
    dh = x.shape[-1]
    if dh % 2:
        raise ValueError(f"rope needs an even head dim, got {x.shape=}")
    freqs = theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2.0 / dh)
    ang = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, Dh/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
