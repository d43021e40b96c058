"""Causal softmax self-attention layer (flax NNX) with optional RoPE and a KV cache for decoding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.ops import attention as attention_ops


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with document masking.

    q, k, v projections -> optional RoPE (positions restart in each document) -> softmax attention
    (`k3jax.ops.attention.causal_attention` with `implementation`, None = the fastest supported) ->
    output projection. Parameters fp32, compute in `dtype`.

    Call: `x [B, T, D]`, `segment_ids [B, T]`, `positions [B, T]` -> `[B, T, D]`.
    Decode: `init_cache(B, max_len)` then `decode(x [B, 1, D], cache, position=[B])`.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rope: bool = True,
                 rope_theta: float = 10000.0, implementation: str | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.rope, self.rope_theta = num_heads, head_dim, rope, rope_theta
        self.implementation = implementation
        self.dtype = dtype
        init = nnx.initializers.normal(d_model ** -0.5)
        self.qkv = nnx.Linear(d_model, 3 * num_heads * head_dim, use_bias=False, kernel_init=init,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.o = nnx.Linear(num_heads * head_dim, d_model, use_bias=False,
                            kernel_init=nnx.initializers.normal((num_heads * head_dim) ** -0.5),
                            dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.num_heads, self.head_dim), 3, axis=2)
        if self.rope:
            q = attention_ops.rope(q, positions, theta=self.rope_theta)
            k = attention_ops.rope(k, positions, theta=self.rope_theta)
        return q, k, v

    def __call__(self, x, *, segment_ids, positions):
        b, t, _ = x.shape
        q, k, v = self._qkv(x, positions)
        o = attention_ops.causal_attention(q, k, v, segment_ids=segment_ids, implementation=self.implementation)
        return self.o(o.reshape(b, t, self.num_heads * self.head_dim))

    def init_cache(self, batch_size: int, max_len: int):
        shape = (batch_size, max_len, self.num_heads, self.head_dim)
        return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype)}

    def decode(self, x, cache, *, position):
        """One token per row at `position` ([B] int32, equal across rows); returns (y [B,1,D], cache)."""
        b = x.shape[0]
        q, k, v = self._qkv(x, position[:, None])
        pos = position[0]
        kc = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, axis=1)
        valid = (jnp.arange(kc.shape[1]) <= pos)[None, None, None, :]
        o = jax.nn.dot_product_attention(q, kc, vc, mask=jnp.broadcast_to(valid, (b, 1, 1, kc.shape[1])))
        return self.o(o.reshape(b, 1, self.num_heads * self.head_dim)), {"k": kc, "v": vc}
