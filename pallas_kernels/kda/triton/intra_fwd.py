"""Intra-chunk forward (portable Pallas, Triton on GPU): the chunk factors, in two kernels.

`scores_solve` (one program per (batch, head, chunk)): the anchored score tiles M = k.k (strictly
lower) and Aqk = scale q.k (lower), A = (I + beta M)^-1, and the elementwise factors
qg = scale q e^G, kd = k e^{G_last - G}, gl = e^{G_last}. `wu` (fla's recompute_w_u): W = A (beta
e^G k) and U = A (beta v) from A. Split so that neither body holds the scores, the solve and the
W / U operands at once.

Layouts: the user's token-major q, k, G [B, T, H, K], v [B, T, H, V], beta [B, T, H] are read through
BlockSpecs (one head's [C, K] rows; no transposes in XLA); the factors are head-major [B, H, T, .].
T is a multiple of 64, K and V powers of two >= 16 (api.py pads).
Source: Kimi Linear (arXiv 2510.26692) chunk form as fla `chunk_kda`:
  A = (I + L)^-1,  W = A (beta e^G K),  U = A (beta V),  L = beta M.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _scores_solve_kernel(q_ref, k_ref, G_ref, beta_ref, *refs, scale, centre, unbounded, segmented, save_m):
    seg_ref, refs = (refs[0], refs[1:]) if segmented else (None, refs)
    qg_ref, kd_ref, aqk_ref, gl_ref, a_ref, *m_ref = refs
    gate = cm.Gate(G_ref, centre)
    seg = cm.segments_of(seg_ref)       # documents (segment_ids): selects, see cm.Segments
    p, _ = cm.precisions(q_ref.dtype)
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    qg_ref[...] = cm.keep(scale * q * jnp.exp(gate.G), seg, "row_in").astype(qg_ref.dtype)
    kd_ref[...] = cm.keep(k * jnp.exp(gate.G_last - gate.G), seg, "in_last").astype(kd_ref.dtype)
    gl_ref[...] = cm.keep(jnp.exp(gate.G_last), seg, "carry").reshape(gl_ref.shape)
    C = q.shape[0]
    rows, cols = cm.iotas(C, C)
    if unbounded:                       # exact diagonal tiles; row-block GEMMs over earlier blocks
        M_all, Aqk_all = cm.own_block_scores(
            [cm.anchored_scores(k, k, gate, precision=p, own_block=False),
             cm.anchored_scores(scale * q, k, gate, precision=p, own_block=False)],
            [k, scale * q], gate, lambda j: k_ref[pl.ds(j, 1), :].astype(F32),
            lambda j: G_ref[pl.ds(j, 1), :].astype(F32))
    else:
        M_all = cm.anchored_scores(k, k, gate, precision=p)
        Aqk_all = cm.anchored_scores(scale * q, k, gate, precision=p)
    M = cm.keep(jnp.where(rows > cols, M_all, 0.0), seg, "same")
    aqk_ref[...] = cm.keep(jnp.where(rows >= cols, Aqk_all, 0.0), seg, "same").astype(aqk_ref.dtype)
    # A only enters W, U and the backward: bulk precision (bf16 operands for bf16 inputs).
    a_ref[...] = cm.unit_lower_inverse(b * M, p)
    if save_m:
        m_ref[0][...] = M


def _wu_kernel(k_ref, v_ref, G_ref, beta_ref, a_ref, *refs, segmented):
    seg_ref, (w_ref, u_ref) = (refs[0], refs[1:]) if segmented else (None, refs)
    p, _ = cm.precisions(k_ref.dtype)
    b = beta_ref[...].astype(F32)[:, None]
    A = a_ref[...]
    X = cm.keep(b * jnp.exp(G_ref[...].astype(F32)) * k_ref[...].astype(F32), cm.segments_of(seg_ref), "row_in")
    w_ref[...] = cm.dot(A, X, p).astype(w_ref.dtype)
    u_ref[...] = cm.dot(A, b * v_ref[...].astype(F32), p).astype(u_ref.dtype)


def intra_fwd(q, k, v, G, beta, *, scale: float, centre: int, unbounded: bool, segments=None,
              save_solve: bool = False, chunk_size: int = 64, num_warps: int = 8, interpret: bool = False):
    """The chunk factors (module docstring).

    Args:
      q, k: [B, T, H, K] (bf16 or fp32); v: [B, T, H, V]; G: [B, T, H, K] fp32, the chunk-local
        inclusive cumsum of g (nats); beta: [B, T, H]. T % chunk_size == 0.
      scale: query scale; centre: the diagonal tiles' centre exponent s (plan.centre_exponent), 0
        with unbounded; unbounded: no lower bound (any g <= 0): exact diagonal tiles
        (cm.own_block_scores) instead of one anchored dot per tile.
      segments: None or rel [B, T] int32 (api.document_offsets): packed documents; the factors are
        masked (cm.Segments) so that the unchanged state passes reset the state at every document
        start.
      save_solve: also return M (the backward's). num_warps: Triton warps (plan.Tuning).
    Returns: qg, kd, w [B, H, T, K], u [B, H, T, V] (q's dtype, as fla, jla); aqk [B, H, T, C] (q's dtype;
      lower-triangular per chunk); gl = e^{G_last} [B, H, T / C, K] fp32; A [B, H, T, C] fp32; with
      save_solve M [B, H, T, C] fp32 (strictly lower, beta-free).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    sp = cm.chunk_specs(C, K, V)
    segmented = segments is not None
    extra = [segments] if segmented else []
    params = cm.compiler_params(num_warps)
    qg, kd, aqk, gl, A, *M = pl.pallas_call(
        functools.partial(_scores_solve_kernel, scale=scale, centre=0 if unbounded else centre,
                          unbounded=unbounded, segmented=segmented, save_m=save_solve),
        grid=(B, H, NT), in_specs=[sp.ik, sp.ik, sp.ik, sp.ib] + ([sp.seg] if segmented else []),
        out_specs=[sp.tk, sp.tk, sp.ta, sp.tg, sp.ta] + ([sp.ta] if save_solve else []),
        out_shape=[jax.ShapeDtypeStruct((B, H, T, K), q.dtype), jax.ShapeDtypeStruct((B, H, T, K), q.dtype),
                   jax.ShapeDtypeStruct((B, H, T, C), q.dtype), jax.ShapeDtypeStruct((B, H, NT, K), F32),
                   jax.ShapeDtypeStruct((B, H, T, C), F32)]
                  + ([jax.ShapeDtypeStruct((B, H, T, C), F32)] if save_solve else []),
        interpret=interpret, compiler_params=params, name="kda_intra_fwd_scores",
    )(q, k, G, beta, *extra)
    w, u = pl.pallas_call(
        functools.partial(_wu_kernel, segmented=segmented), grid=(B, H, NT),
        in_specs=[sp.ik, sp.iv, sp.ik, sp.ib, sp.ta] + ([sp.seg] if segmented else []),
        out_specs=[sp.tk, sp.tv],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, K), q.dtype), jax.ShapeDtypeStruct((B, H, T, V), q.dtype)],
        interpret=interpret, compiler_params=params, name="kda_intra_fwd_wu",
    )(k, v, G, beta, A, *extra)
    return (qg, kd, w, u, aqk, gl, A) + (tuple(M) if save_solve else ())
