"""Chunk-local gate cumsum as one Pallas kernel (ops.KernelOptions.pallas_cumsum).

With ops.KernelOptions.xla_gate_cumsum the intra-chunk kernels read the chunk-local inclusive cumsum
G of the log-decay g (forward) and the op reverse-cumsums their dG (backward) outside the kernels.
XLA runs `lax.cumsum` on the GPU as an associative scan, one fused loop that the 2026-12-01 profile
timed at 0.32 ms for 8x4096x16x128 fp32 (kda_peers_h200.md; 0.27 GB read + 0.27 GB written, ~0.11 ms
at the H200's HBM bandwidth). Here one program per (batch, chunk, head) loads its [C, K] block once
and writes it once (Triton's in-register scan over the C rows).

Rounding: the forward is a parallel prefix sum (not left to right), so G can differ from a
sequential fp32 sum by a few ulps of |G| (common.py's header: the kernels allow that). The reverse
sum is formed as total - inclusive prefix + x with total = the prefix's last row (the Triton lowering
has no reverse scan): the same suffix sums up to fp32 rounding of the prefix (|error| <= a few ulps
of the largest |prefix| in the chunk; the last row is x exactly).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import common as cm
from pallas_kernels.kda.common import F32


def _cumsum_kernel(x_ref, out_ref, *, reverse: bool):
    x = x_ref[...].astype(F32)                                   # [C, K]
    prefix = lax.cumsum(x, axis=0)
    if reverse:                     # total = the prefix's last row (a masked sum: no value slicing)
        last = lax.broadcasted_iota(jnp.int32, x.shape, 0) == x.shape[0] - 1
        total = jnp.sum(jnp.where(last, prefix, 0.0), axis=0, keepdims=True)
        prefix = total - prefix + x
    out_ref[...] = prefix


def chunk_cumsum(x, chunk_size: int, *, reverse: bool = False, interpret: bool = False):
    """Chunk-local inclusive cumsum over T of x [B, T, H, K] as a Pallas kernel.

    Same result as common.chunk_cumsum (XLA) up to fp32 rounding (module docstring).
    Args:
      x: [B, T, H, K], any float dtype (log-decays in nats for the forward, dG for the backward).
      chunk_size: C; T must be a multiple of C.
      reverse: False: sum_{j <= i} within each chunk; True: the suffix sums sum_{j >= i}.
      interpret: Pallas interpret mode (CPU).
    Returns: [B, T, H, K] fp32.
    Compiled for the GPU, K must be a power of two (Triton block shapes; ops.kda_pallas pads K).
    Raises: ValueError when T is not a multiple of chunk_size or x is not 4-D.
    """
    if x.ndim != 4:
        raise ValueError(f"x must be [B, T, H, K]; got shape {x.shape}")
    B, T, H, K = x.shape
    C = chunk_size
    if C <= 0 or T % C:
        raise ValueError(f"T = {T} must be a positive multiple of chunk_size = {C}")
    spec = pl.BlockSpec((None, C, None, K), lambda b, c, h: (b, c, h, 0))
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, reverse=reverse), grid=(B, T // C, H),
        in_specs=[spec], out_specs=spec, out_shape=jax.ShapeDtypeStruct((B, T, H, K), F32),
        interpret=interpret, compiler_params=cm.CUMSUM_PARAMS,
        name="kda_chunk_cumsum_rev" if reverse else "kda_chunk_cumsum",
    )(x)
