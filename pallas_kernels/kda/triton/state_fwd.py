"""Forward state pass (portable Pallas, Triton on GPU): the serial pass over chunks, then the output.

`state_fwd` (fla's `chunk_gated_delta_rule_fwd_h`): one program per (batch, head, V block, segment)
with the transposed state S^T [BV, K] fp32 in registers; per chunk V' = U - W S and
S^T <- S^T Diag(e^{G_last}) + V'^T Kd, writing V' and the state entering each chunk.
`output_fwd` (fla's `chunk_gla_fwd_o`): o = Qg S + tril(Aqk) V' in parallel over chunks.
States are stored TRANSPOSED as [V, K] so that e^{G_last} [1, K] broadcasts along rows.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _state_kernel(kd_ref, w_ref, u_ref, gl_ref, h0_ref, vp_ref, h_ref, ht_ref, *, chunk_size, precision):
    C = chunk_size
    NT = kd_ref.shape[0] // C

    def body(c, St):                                    # St: [BV, K] fp32 state entering chunk c
        rows = pl.ds(c * C, C)
        h_ref[c] = St.astype(h_ref.dtype)
        vp = u_ref[rows, :].astype(F32) - cm.dot_nt(w_ref[rows, :].astype(F32), St, precision)
        vp_ref[rows, :] = vp.astype(vp_ref.dtype)
        return St * gl_ref[pl.ds(c, 1), :] + cm.dot_tn(vp, kd_ref[rows, :].astype(F32), precision)

    ht_ref[...] = jax.lax.fori_loop(0, NT, body, h0_ref[...].astype(F32))


def state_fwd(kd, w, u, gl, h0, *, state_dtype, chunk_size: int = 64, block_v: int = 64, num_warps: int = 4,
              interpret: bool = False):
    """The forward's serial state pass (module docstring).

    Args: kd, w [B, H, T, K], u [B, H, T, V], gl [B, H, NT, K] (intra_fwd outputs); h0 [B, H, V, K]
      fp32 (transposed initial state) or [B, H, NS, V, K] (the true start of each of NS segments,
      sequence_split.segment_scan), which then run in parallel; state_dtype: storage dtype of h (and
      the dots' rounding: bf16 operands for bf16 states, IEEE fp32 for fp32).
    Returns: vp = V' [B, H, T, V] fp32; h [B, H, NT, V, K] (state_dtype; the transposed state
      entering each chunk); ht fp32 of h0's rank (after the last chunk / each segment).
    """
    B, H, T, K = kd.shape
    V = u.shape[-1]
    C, BV = chunk_size, block_v
    NT = T // C
    lay = cm.serial_layout(h0, T, K, C, BV)
    p, _ = cm.precisions(state_dtype)
    vp, h, ht = pl.pallas_call(
        functools.partial(_state_kernel, chunk_size=C, precision=p),
        grid=(B, H, V // BV, lay.num_segments),
        in_specs=[lay.k, lay.k, lay.v, lay.g, lay.s], out_specs=[lay.v, lay.h, lay.s],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, V), F32), jax.ShapeDtypeStruct((B, H, NT, V, K), state_dtype),
                   jax.ShapeDtypeStruct((B, H, lay.num_segments, V, K), F32)],
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_state_fwd",
    )(kd, w, u, gl, lay.state)
    return vp, h, (ht if lay.per_segment else ht[:, :, 0])


def _output_kernel(qg_ref, aqk_ref, vp_ref, h_ref, o_ref, *, precision):
    o = (cm.dot_nt(qg_ref[...].astype(F32), h_ref[...].astype(F32), precision)
         + cm.dot(aqk_ref[...].astype(F32), vp_ref[...].astype(F32), precision))
    o_ref[...] = o.astype(o_ref.dtype)


def output_fwd(qg, aqk, vp, h, *, out_dtype, chunk_size: int = 64, num_warps: int = 4, interpret: bool = False):
    """o = Qg S_c + tril(Aqk) V' per chunk, one program per (batch, head, chunk).

    Args: qg [B, H, T, K], aqk [B, H, T, C] (intra_fwd); vp [B, H, T, V], h [B, H, NT, V, K]
      (state_fwd); the dots round as h's dtype says (bf16 operands for bf16 states).
    Returns: o [B, T, H, V] in out_dtype (token-major).
    """
    B, H, T, K = qg.shape
    V = vp.shape[-1]
    C = chunk_size
    p, _ = cm.precisions(h.dtype)
    return pl.pallas_call(
        functools.partial(_output_kernel, precision=p), grid=(B, H, T // C),
        in_specs=[pl.BlockSpec((None, None, C, K), lambda b, hh, c: (b, hh, c, 0)),
                  pl.BlockSpec((None, None, C, C), lambda b, hh, c: (b, hh, c, 0)),
                  pl.BlockSpec((None, None, C, V), lambda b, hh, c: (b, hh, c, 0)),
                  pl.BlockSpec((None, None, None, V, K), lambda b, hh, c: (b, hh, c, 0, 0))],
        out_specs=pl.BlockSpec((None, C, None, V), lambda b, hh, c: (b, c, hh, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
        interpret=interpret, compiler_params=cm.compiler_params(num_warps, None), name="kda_output_fwd",
    )(qg, aqk, vp, h)
