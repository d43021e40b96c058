"""Intra-chunk backward (portable Pallas, Triton on GPU), in two kernels, one program per (batch, head, chunk).

With the forward per chunk (incoming state S): V' = U - W S; O = Qg S + Aqk V'; S_next = D S + Kd^T V'
(Qg = scale Q e^G, Kd = K e^{G_last - G}, D = Diag(e^{G_last})) and the reverse pass's dV', dS_next:
`solve_bwd` forms the state products dQg = dO S^T, dW = -dV' S^T, dKd = V' dS_next^T, dAqk = dO V'^T,
d e^{G_last} = colsum(S^T * dS_next^T), then the W / U / solve backward
  dA = dW X^T + dU Y^T,  dX = A^T dW,  dY = A^T dU,  dL = -A^T dA A^T (strictly lower),
and writes dv, dbeta (final) and the partial dq, dk, dG, dG_last with the score gradients dM = beta dL,
dAqk. `score_bwd` pushes the score gradients through the anchored tiles
  S_ij = sum_c a_ic b_jc e^{G_ic - G_jc}:  da_i = sum_j dS_ij b_j e^{G_i - G_j},
  db_j = sum_i dS_ij a_i e^{G_i - G_j},  dG_i += a_i da_i,  dG_j -= b_j db_j,
row block by row block on ref slices, and writes dq, dk and dG per row (dG_last on the chunk's last
row; the reverse cumsum stage makes dg).
Precision (triton/common.precisions): dL and the diagonal score tiles at the exact precision
(bf16x3 for bf16 inputs), everything else with bf16 operands (IEEE fp32 for fp32 inputs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _solve_bwd_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref, w_ref, u_ref,
                      a_ref, m_ref, *refs, scale, segmented):
    seg_ref, refs = (refs[0], refs[1:]) if segmented else (None, refs)
    dv_ref, dbeta_ref, dq_ref, dk_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref = refs
    p, exact = cm.precisions(q_ref.dtype)
    seg = cm.segments_of(seg_ref)
    gate = cm.Gate(G_ref)
    G, G_last = gate.G, gate.G_last
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    St, dSt = h_ref[...].astype(F32), dh_ref[...].astype(F32)
    do, dU = do_ref[...].astype(F32), du_ref[...].astype(F32)
    w, u = w_ref[...].astype(F32), u_ref[...].astype(F32)
    A, M = a_ref[...], m_ref[...]
    C = q.shape[0]
    rows, cols = cm.iotas(C, C)

    # the state products
    vp = u - cm.dot_nt(w, St, p)
    dqg = cm.keep(cm.dot(do, St, p), seg, "row_in")
    dW = -cm.dot(dU, St, p)
    dkd = cm.keep(cm.dot(vp, dSt, p), seg, "in_last")
    daqk = cm.dot_nt(do, vp, p)
    dgl = cm.keep(jnp.sum(St * dSt, axis=0, keepdims=True), seg, "carry")
    # U = A Y with Y = beta v
    Y = b * v
    dY = cm.dot_tn(A, dU, p)
    dbeta = jnp.sum(v * dY, axis=1, keepdims=True)
    dv_ref[...] = (b * dY).astype(dv_ref.dtype)
    # Qg = scale q e^G, Kd = k e^{G_last - G}, e^{G_last}
    eG = jnp.exp(G)
    dq = scale * eG * dqg
    dG = q * dq
    dk = jnp.exp(G_last - G) * dkd
    t = k * dk
    dG = dG - t
    dG_last = jnp.exp(G_last) * dgl + jnp.sum(t, axis=0, keepdims=True)
    # W = A X with X = beta e^G k (rows that read the incoming state)
    X = cm.keep(b * eG * k, seg, "row_in")
    dX = cm.keep(cm.dot_tn(A, dW, p), seg, "row_in")
    dk = dk + b * eG * dX
    dG = dG + X * dX
    dbeta = dbeta + jnp.sum(eG * k * dX, axis=1, keepdims=True)
    # A = (I + L)^-1: dL = -A^T dA A^T on the strict lower triangle (dA restricted to A's support)
    dA = jnp.where(rows >= cols, cm.dot_nt(dW, X, p) + cm.dot_nt(dU, Y, p), 0.0)
    dL = cm.keep(jnp.where(rows > cols, -cm.dot_nt(cm.dot_tn(A, dA, exact), A, exact), 0.0), seg, "same")
    dbeta = dbeta + jnp.sum(dL * M, axis=1, keepdims=True)
    dbeta_ref[...] = dbeta.reshape(C).astype(dbeta_ref.dtype)
    dq_ref[...] = dq
    dk_ref[...] = dk
    dgp_ref[...] = dG
    dgl_ref[...] = dG_last.reshape(dgl_ref.shape)
    dm_ref[...] = b * dL
    daqk_ref[...] = jnp.where(rows >= cols, cm.keep(daqk, seg, "same"), 0.0)


def solve_bwd(q, k, v, G, beta, do, du, h, dh, w, u, A, M, *, scale: float, segments=None,
              chunk_size: int = 64, num_warps: int = 8, interpret: bool = False):
    """The state products and the W / U / solve backward (module docstring).

    Args: q, k, G [B, T, H, K], v, do [B, T, H, V], beta [B, T, H] (token-major; G the chunk cumsum
      of g); du [B, H, T, V] (state_bwd's; bf16 for bf16 inputs); h [B, H, NT, V, K] (transposed
      state entering each chunk), dh (transposed gradient of the state after it); the forward's w [B, H, T, K]
      and u [B, H, T, V] (q's dtype) and A, M [B, H, T, C] fp32; segments: None or rel [B, T] int32 (the
      forward's).
    Returns: dv [B, T, H, V] (v's dtype), dbeta [B, T, H] fp32 (final, token-major); head-major fp32
      partial dq, dk, dG [B, H, T, K], dG_last [B, H, NT, K], dM, dAqk [B, H, T, C].
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    sp = cm.chunk_specs(C, K, V)
    segmented = segments is not None
    return pl.pallas_call(
        functools.partial(_solve_bwd_kernel, scale=scale, segmented=segmented), grid=(B, H, NT),
        in_specs=[sp.ik, sp.ik, sp.iv, sp.ik, sp.ib, sp.iv, sp.tv, sp.ts, sp.ts, sp.tk, sp.tv, sp.ta, sp.ta]
                 + ([sp.seg] if segmented else []),
        out_specs=[sp.iv, sp.ib, sp.tk, sp.tk, sp.tk, sp.tg, sp.ta, sp.ta],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), v.dtype), jax.ShapeDtypeStruct((B, T, H), F32)]
                  + [jax.ShapeDtypeStruct((B, H, T, K), F32)] * 3 + [jax.ShapeDtypeStruct((B, H, NT, K), F32)]
                  + [jax.ShapeDtypeStruct((B, H, T, C), F32)] * 2,
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_intra_bwd_solve",
    )(q, k, v, G, beta, do, du, h, dh, w, u, A, M, *([segments] if segmented else []))


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _own_block_bwd(dm_d, dq_d, k, qs, G, k_row, G_row, first: int):
    """Exact diagonal-tile score backward of one 16-row block, for unbounded gates.

    dm_d, dq_d: the block's [16, 16] tiles of dM (strictly lower) and dAqk (lower), zero above the
    diagonal; k, qs = scale q, G: the block's rows [16, K] fp32; k_row(j), G_row(j): row j [1, K] of
    k and G from refs; first: the block's first row. With e_ij = exp(min(G_i - G_j, 0)) (every exp
    argument <= 0) returns (pm, pq, sb) [16, K] fp32:
      pm_i = sum_j dM_ij k_j e_ij,  pq_i = sum_j dAqk_ij k_j e_ij,  sb_j = sum_i (dM_ij k_i + dAqk_ij qs_i) e_ij,
    so that dq += scale pq, dk += pm + sb, dG += k pm + qs pq - k sb. One fori_loop step per column.
    """
    n = dm_d.shape[0]
    _, tc = cm.iotas(n, n)
    rvec = lax.broadcasted_iota(jnp.int32, (n, 1), 0)

    def step(d, carry):
        pm, pq, sb = carry
        e = jnp.exp(jnp.minimum(G - G_row(first + d), 0.0))            # [16, K]: e_{i, j}
        cm_d = jnp.sum(jnp.where(tc == d, dm_d, 0.0), axis=1, keepdims=True)   # dM[:, j]
        cq_d = jnp.sum(jnp.where(tc == d, dq_d, 0.0), axis=1, keepdims=True)   # dAqk[:, j]
        ke = k_row(first + d) * e
        s = jnp.sum((cm_d * k + cq_d * qs) * e, axis=0, keepdims=True)         # [1, K]: sb_j
        return pm + cm_d * ke, pq + cq_d * ke, jnp.where(rvec == d, s, sb)

    zero = jnp.zeros_like(k)
    return lax.fori_loop(0, n, step, (zero, zero, zero))


def _score_bwd_kernel(q_ref, k_ref, G_ref, dqp_ref, dkp_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref,
                      dq_ref, dk_ref, dg_ref, *, scale, centre, unbounded):
    """Row block r (rows i in [16 r, 16 r + 16), the same block as columns j for the column side):
      diagonal tile: bounded: 4 [16, 16] x [16, K] dots at the exact precision with the centred
        factors e^{G - anc_r} 2^s, e^{anc_r - G} 2^-s (within e^{+-40}; uncentred, dS e^-80 is formed
        and flushed where denormals are, and dS e^80 overflows for large dS);
        unbounded: _own_block_bwd's exact elementwise form;
      row side (columns j < 16 r, anchor anc_r, both factors <= 1): [16, n] x [n, K] dots with
        n = 16, 32, 64 for r = 1, 2, 3 (columns >= 16 r zeroed in the operand by a select);
      column side (rows of the later blocks, anchored at the END of block r, both factors <= 1):
        [n, 16]^T x [n, K] dots on rows [C - n, C), n = 64, 32, 16 for r = 0, 1, 2."""
    C, K = k_ref.shape
    BT = cm.BT
    ns = C // BT
    p, exact = cm.precisions(q_ref.dtype)
    c_hi, c_lo = 2.0 ** int(centre), 2.0 ** -int(centre)
    zero_row = jnp.zeros((1, K), F32)

    def G_row(i):                                  # row i of G as [1, K]; i < 0: the chunk start
        return zero_row if i < 0 else G_ref[pl.ds(i, 1), :].astype(F32)

    for r in reversed(range(ns)):
        rows = pl.ds(r * BT, BT)
        anc = G_row(r * BT - 1)
        G = G_ref[rows, :].astype(F32)
        k = k_ref[rows, :].astype(F32)
        qs = scale * q_ref[rows, :].astype(F32)
        dm_d, dq_d = dm_ref[rows, rows], daqk_ref[rows, rows]
        # da_m, da_q: the gradients of the a side (k of M, scale q of Aqk); sb: of the b side (k)
        if unbounded:
            pm, pq, sb = _own_block_bwd(dm_d, dq_d, k, qs, G, lambda j: k_ref[pl.ds(j, 1), :].astype(F32),
                                        lambda j: G_ref[pl.ds(j, 1), :].astype(F32), r * BT)
            da_m, da_q = pm, pq
        else:
            ead = jnp.exp(G - anc) * c_hi
            ebd = jnp.exp(anc - G) * c_lo
            kbd = k * ebd
            da_m = ead * cm.dot(dm_d, kbd, exact)
            da_q = ead * cm.dot(dq_d, kbd, exact)
            sb = ebd * (cm.dot_tn(dm_d, k * ead, exact) + cm.dot_tn(dq_d, qs * ead, exact))
        if r > 0:                                  # row side: columns j < 16 r, anchor anc_r
            n = BT * _pow2_at_least(r)
            cols = pl.ds(0, n)
            Gc = G_ref[cols, :].astype(F32)
            kc = k_ref[cols, :].astype(F32)
            if n == r * BT:
                kb = kc * jnp.exp(anc - Gc)
            else:
                before = lax.broadcasted_iota(jnp.int32, (n, 1), 0) < r * BT
                kb = jnp.where(before, kc * jnp.exp(jnp.where(before, anc - Gc, 0.0)), 0.0)
            ea = jnp.exp(G - anc)                  # <= 1
            da_m = da_m + ea * cm.dot(dm_ref[rows, cols], kb, p)
            da_q = da_q + ea * cm.dot(daqk_ref[rows, cols], kb, p)
        if r < ns - 1:                             # column side: rows of the later blocks
            anc1 = G_row(r * BT + BT - 1)
            n = BT * _pow2_at_least(ns - 1 - r)
            start = C - n
            rr = pl.ds(start, n)
            e = G_ref[rr, :].astype(F32) - anc1
            ka, qa = k_ref[rr, :].astype(F32), scale * q_ref[rr, :].astype(F32)
            if start >= (r + 1) * BT:
                e = jnp.exp(e)
                ka, qa = ka * e, qa * e
            else:
                after = start + lax.broadcasted_iota(jnp.int32, (n, 1), 0) >= (r + 1) * BT
                e = jnp.exp(jnp.where(after, e, 0.0))
                ka, qa = jnp.where(after, ka * e, 0.0), jnp.where(after, qa * e, 0.0)
            sb = sb + jnp.exp(anc1 - G) * (cm.dot_tn(dm_ref[rr, rows], ka, p) + cm.dot_tn(daqk_ref[rr, rows], qa, p))
        dq = dqp_ref[rows, :] + scale * da_q
        dk = dkp_ref[rows, :] + da_m + sb
        dG = dgp_ref[rows, :] + k * da_m + qs * da_q - k * sb
        if r == ns - 1:                            # dG_last on the last row; the reverse cumsum spreads it
            last = lax.broadcasted_iota(jnp.int32, (BT, 1), 0) == BT - 1
            dG = dG + jnp.where(last, dgl_ref[...].reshape(1, K), 0.0)
        dg_ref[rows, :] = dG.astype(dg_ref.dtype)
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)


def score_bwd(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk, *, scale: float, centre: int, unbounded: bool,
              chunk_size: int = 64, num_warps: int = 8, interpret: bool = False):
    """The score-tile backward (module docstring; the row-block structure in _score_bwd_kernel).

    Args: q, k, G [B, T, H, K] (token-major; G the chunk cumsum); dqp, dkp, dgp [B, H, T, K], dgl
      [B, H, NT, K], dM, dAqk [B, H, T, C] (solve_bwd's fp32 outputs); centre: the forward's centre
      exponent s (plan.centre_exponent); unbounded: exact diagonal tiles (centre ignored).
    Returns: dq, dk [B, T, H, K] (q's dtype), dG [B, T, H, K] fp32 per row (dG_last added on each
      chunk's last row), before the reverse cumsum.
    """
    B, T, H, K = q.shape
    C = chunk_size
    sp = cm.chunk_specs(C, K, K)
    return pl.pallas_call(
        functools.partial(_score_bwd_kernel, scale=scale, centre=0 if unbounded else centre, unbounded=unbounded),
        grid=(B, H, T // C),
        in_specs=[sp.ik, sp.ik, sp.ik, sp.tk, sp.tk, sp.tk, sp.tg, sp.ta, sp.ta], out_specs=[sp.ik, sp.ik, sp.ik],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, K), q.dtype), jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), F32)],
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_intra_bwd_scores",
    )(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk)
