"""Thin Flax NNX modules for the depth-residual schemes; the math is in `k3jax.ops.residuals`.

`DepthMix`: one Block AttnRes depth mix (arXiv 2603.15031 §3) — a zero-initialised pseudo-query and
the key RMSNorm scale. The model holds one per sublayer plus one before the final norm.
`BlockScale`: the learned scalar α of the seed article's literal block boundary ("article_block").
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.ops import residuals as residual_ops


class DepthMix(nnx.Module):
    """Softmax mix over depth sources with a learned pseudo-query (Block AttnRes).

    Params (fp32 by default): `pseudo_query [D]` zeros (uniform weights at init, as the paper),
    `key_norm_scale [D]` ones (the RMSNorm scale applied to the keys only).

    `__call__(sources, num_valid=None, return_weights=False)`: `sources` `[S, B, T, D]` or a sequence
    of S arrays `[B, T, D]` -> `[B, T, D]` in the sources' dtype (and fp32 weights `[S, B, T]` with
    `return_weights=True`); see `k3jax.ops.residuals.depth_attention` (fp32 softmax over depth).
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive int, got {d_model=}")
        del rngs  # deterministic init; kept for the uniform NNX constructor signature
        self.eps = eps
        self.pseudo_query = nnx.Param(jnp.zeros((d_model,), param_dtype))
        self.key_norm_scale = nnx.Param(jnp.ones((d_model,), param_dtype))

    def __call__(self, sources, num_valid=None, return_weights: bool = False):
        return residual_ops.depth_attention(sources, self.pseudo_query[...], self.key_norm_scale[...],
                                            eps=self.eps, num_valid=num_valid, return_weights=return_weights)


class BlockScale(nnx.Module):
    """The article-literal boundary scale: `x -> α · x` with a learned scalar α (init 1.0).

    Why 1.0: see `k3jax.ops.residuals.article_block_forward`. The product is cast back to x's dtype.
    """

    def __init__(self, *, init: float = 1.0, param_dtype=jnp.float32, rngs: nnx.Rngs):
        del rngs
        self.alpha = nnx.Param(jnp.asarray(init, param_dtype))

    def __call__(self, x):
        return (self.alpha[...] * x).astype(x.dtype)
