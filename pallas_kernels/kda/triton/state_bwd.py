"""Backward reverse state pass (portable Pallas, Triton on GPU), fla's `chunk_gated_delta_rule_bwd_dhu`.

One program per (batch, head, V block, segment), dS^T [BV, K] fp32 in registers. Per chunk with the
forward V' = U - W S, O = Qg S + Aqk V', S_next = D S + Kd^T V' (D = Diag(e^{G_last})), last to first:
  dV' = Aqk^T dO + Kd dS_next;  dS = Qg^T dO + D dS_next - W^T dV',
saving dS_next per chunk. The products with the forward states (dQg, dW, dKd, dAqk, d e^{G_last})
are parallel over chunks and left to the intra-chunk backward.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _state_bwd_kernel(qg_ref, kd_ref, w_ref, aqk_ref, gl_ref, do_ref, dht_ref, du_ref, dh_ref, dh0_ref, *,
                      chunk_size, precision):
    C = chunk_size
    NT = qg_ref.shape[0] // C
    p = precision

    def body(i, dSt):                                   # dSt: [BV, K] grad of the state after chunk c
        c = NT - 1 - i
        rows = pl.ds(c * C, C)
        dh_ref[c] = dSt.astype(dh_ref.dtype)
        do = do_ref[rows, :].astype(F32)
        dvp = cm.dot_tn(aqk_ref[rows, :].astype(F32), do, p) + cm.dot_nt(kd_ref[rows, :].astype(F32), dSt, p)
        du_ref[rows, :] = dvp.astype(du_ref.dtype)
        return (cm.dot_tn(do, qg_ref[rows, :].astype(F32), p) + dSt * gl_ref[pl.ds(c, 1), :]
                - cm.dot_tn(dvp, w_ref[rows, :].astype(F32), p))

    dh0_ref[...] = lax.fori_loop(0, NT, body, dht_ref[...].astype(F32))


def state_bwd(qg, kd, w, aqk, gl, do, dht, *, state_dtype, chunk_size: int = 64, block_v: int = 64,
              num_warps: int = 4, interpret: bool = False):
    """The backward's reverse state pass (module docstring).

    Args: the intra_fwd outputs qg, kd, w [B, H, T, K], aqk [B, H, T, C], gl [B, H, NT, K];
      do [B, T, H, V] (token-major); dht [B, H, V, K] (transposed final-state gradient) or
      [B, H, NS, V, K] (the true gradient at the end of each of NS segments); state_dtype: storage
      dtype of du and dh (and the dots' rounding, as state_fwd).
    Returns: du = dV' [B, H, T, V] and dh [B, H, NT, V, K] (the transposed gradient of the state
      after each chunk), both in state_dtype (du: the rounding of solve_bwd's operands); dh0 fp32 of
      dht's rank (per segment: the gradient at its start).
    """
    B, H, T, K = qg.shape
    V = do.shape[-1]
    C, BV = chunk_size, block_v
    NT = T // C
    lay = cm.serial_layout(dht, T, K, C, BV)
    L = lay.chunks_per_segment * C
    fo = pl.BlockSpec((None, L, None, BV), lambda b, hh, iv, s: (b, s, hh, iv))
    p, _ = cm.precisions(state_dtype)
    du, dh, dh0 = pl.pallas_call(
        functools.partial(_state_bwd_kernel, chunk_size=C, precision=p),
        grid=(B, H, V // BV, lay.num_segments),
        in_specs=[lay.k, lay.k, lay.k, lay.a, lay.g, fo, lay.s], out_specs=[lay.v, lay.h, lay.s],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, V), state_dtype),
                   jax.ShapeDtypeStruct((B, H, NT, V, K), state_dtype),
                   jax.ShapeDtypeStruct((B, H, lay.num_segments, V, K), F32)],
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_state_bwd",
    )(qg, kd, w, aqk, gl, do, lay.state)
    return du, dh, (dh0 if lay.per_segment else dh0[:, :, 0])
