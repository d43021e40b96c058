"""Chunk-local cumsum of the gate (portable Pallas, Triton on GPU): one read and one write of g or dG.

One program per (batch, chunk, head) loads its [C, K] block once (Triton's in-register scan over the
C rows). Rounding: a parallel prefix sum, so G can differ from a sequential fp32 sum by a few ulps
of |G| (the kernels allow that: exp of such a residue above 0 is ~1). The reverse sum is total -
inclusive prefix + x (the Triton lowering has no reverse scan): the same suffix sums up to fp32
rounding of the prefix.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _cumsum_kernel(x_ref, out_ref, *, reverse: bool):
    x = x_ref[...].astype(F32)                                   # [C, K]
    prefix = lax.cumsum(x, axis=0)
    if reverse:                     # total = the prefix's last row (a masked sum: no value slicing)
        last = lax.broadcasted_iota(jnp.int32, x.shape, 0) == x.shape[0] - 1
        total = jnp.sum(jnp.where(last, prefix, 0.0), axis=0, keepdims=True)
        prefix = total - prefix + x
    out_ref[...] = prefix


def chunk_cumsum(x, chunk_size: int = 64, *, reverse: bool = False, num_warps: int = 4, interpret: bool = False):
    """Chunk-local inclusive cumsum over T of x [B, T, H, K] (any float dtype) -> fp32 [B, T, H, K].

    reverse=False: sum_{j <= i} within each chunk (the forward's G from g, nats); True: the suffix
    sums sum_{j >= i} (the backward's dg from dG). Compiled for the GPU, K must be a power of two.
    Raises: ValueError when x is not 4-D or T is not a positive multiple of chunk_size.
    """
    if x.ndim != 4:
        raise ValueError(f"x must be [B, T, H, K]; got {x.shape=}")
    B, T, H, K = x.shape
    C = chunk_size
    if C <= 0 or T % C:
        raise ValueError(f"T = {T} must be a positive multiple of {chunk_size=}")
    spec = pl.BlockSpec((None, C, None, K), lambda b, c, h: (b, c, h, 0))
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, reverse=reverse), grid=(B, T // C, H),
        in_specs=[spec], out_specs=spec, out_shape=jax.ShapeDtypeStruct((B, T, H, K), F32),
        interpret=interpret, compiler_params=cm.compiler_params(num_warps),
        name="kda_cumsum_reverse" if reverse else "kda_cumsum",
    )(x)
