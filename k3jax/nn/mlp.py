"""SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer", FFN_SwiGLU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class SwiGLU(nnx.Module):
    """y = W_down (SiLU(x W_gate) * (x W_up)); `x [..., D]` -> `[..., D]`; params fp32, compute in `dtype`."""

    def __init__(self, d_model: int, d_ff: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up = nnx.Linear(d_model, 2 * d_ff, kernel_init=nnx.initializers.normal(d_model ** -0.5), **kw)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=nnx.initializers.normal(d_ff ** -0.5), **kw)

    def __call__(self, x):
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)
