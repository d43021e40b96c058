"""KDA chunk backward kernels: the reverse state pass and the intra-chunk gradients.

Same layouts and units as fwd.py (head-major, states transposed [V, K] fp32, gates in nats).

Per chunk with incoming state S, the forward is
  V' = U - W S;  O = Qg S + Aqk V';  S_next = D S + Kd^T V'
(Qg = scale Q e^G, Kd = K e^{G_last - G}, D = Diag(e^{G_last})). Given dO and dS_next:
  dV' = Aqk^T dO + Kd dS_next;  dS = Qg^T dO + D dS_next - W^T dV'
  dQg = dO S^T;  dAqk = dO V'^T;  dKd = V' dS_next^T;  dU = dV';  dW = -dV' S^T;
  d e^{G_last} = rowsum(S * dS_next).
The reverse pass (serial over chunks) produces these; the intra kernel (parallel over chunks)
recomputes the chunk factors and pushes them to dq, dk, dv, dbeta, dg:
  dA = dW X^T + dU Y^T,  dX = A^T dW,  dY = A^T dU,  dL = -A^T dA A^T (strictly lower),
  pair scores M_ij = sum_c a_ic b_jc e^{G_ic - G_jc}: with a~ = a e^{G - anc}, b~ = b e^{anc - G},
  da = e^{G-anc} (dM b~), db = e^{anc-G} (dM^T a~), dG_i += a~ (dM b~), dG_j -= b~ (dM^T a~),
  and dg = reverse cumsum of dG within the chunk (plus dG_last on every row).
Diagonal tiles of the backward and the dL = -A^T dA A^T products use fp32 operands with
Precision.HIGHEST (IEEE fp32 on the Triton lowering); the other backward dots use fp32 operands at
`common.mm_precision(input dtype)`: HIGHEST for fp32 inputs, default (TF32 on GPU) for bf16 inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import common as cm
from pallas_kernels.kda.common import BT, F32, HIGHEST


def _state_bwd_kernel(qg_ref, kd_ref, w_ref, u_ref, aqk_ref, gl_ref, h_ref, do_ref, dht_ref,
                      dqg_ref, dkd_ref, dw_ref, du_ref, daqk_ref, dgl_ref, dh0_ref, *, chunk_size,
                      precision):
    C = chunk_size
    NT = qg_ref.shape[0] // C

    p = precision

    def body(i, dSt):                                   # dSt: [BV, K] grad of the state after chunk c
        c = NT - 1 - i
        rows = pl.ds(c * C, C)
        St = h_ref[c]
        w = w_ref[rows, :]
        qg = qg_ref[rows, :]
        kd = kd_ref[rows, :]
        vp = u_ref[rows, :] - cm.dot_nt(w, St, p)
        do = do_ref[rows, :].astype(F32)
        dvp = cm.dot_tn(aqk_ref[rows, :], do, p) + cm.dot_nt(kd, dSt, p)
        du_ref[rows, :] = dvp
        dw_ref[rows, :] = -cm.dot(dvp, St, p)
        dqg_ref[rows, :] = cm.dot(do, St, p)
        daqk_ref[rows, :] = cm.dot_nt(do, vp, p)
        dkd_ref[rows, :] = cm.dot(vp, dSt, p)
        gl = gl_ref[pl.ds(c, 1), :]
        dgl_ref[pl.ds(c, 1), :] = jnp.sum(St * dSt, axis=0, keepdims=True)
        return cm.dot_tn(do, qg, p) + dSt * gl - cm.dot_tn(dvp, w, p)

    dh0_ref[...] = lax.fori_loop(0, NT, body, dht_ref[...].astype(F32))


def state_bwd(qg, kd, w, u, aqk, gl, h, do, dht, *, chunk_size: int, block_v: int,
              interpret: bool, precision=None):
    """Reverse serial pass, one program per (batch, head, V-block).

    Args: intra_fwd outputs; h [B, H, NT, V, K] saved states; do [B, H, T, V]; dht [B, H, V, K].
    Returns (fp32): dqg, dkd, dw [NV, B, H, T, K] and daqk [NV, B, H, T, C], dgl [NV, B, H, NT, K]
      (partial sums over V-blocks, summed by the caller); du [B, H, T, V]; dh0 [B, H, V, K].
    """
    B, H, T, K = qg.shape
    V = u.shape[-1]
    C = chunk_size
    NT = T // C
    BV = block_v
    NV = V // BV
    fk = pl.BlockSpec((None, None, T, K), lambda b, hh, iv: (b, hh, 0, 0))
    fv = pl.BlockSpec((None, None, T, BV), lambda b, hh, iv: (b, hh, 0, iv))
    fa = pl.BlockSpec((None, None, T, C), lambda b, hh, iv: (b, hh, 0, 0))
    fg = pl.BlockSpec((None, None, NT, K), lambda b, hh, iv: (b, hh, 0, 0))
    fs = pl.BlockSpec((None, None, BV, K), lambda b, hh, iv: (b, hh, iv, 0))
    fh = pl.BlockSpec((None, None, NT, BV, K), lambda b, hh, iv: (b, hh, 0, iv, 0))
    pk = pl.BlockSpec((None, None, None, T, K), lambda b, hh, iv: (iv, b, hh, 0, 0))
    pa = pl.BlockSpec((None, None, None, T, C), lambda b, hh, iv: (iv, b, hh, 0, 0))
    pg = pl.BlockSpec((None, None, None, NT, K), lambda b, hh, iv: (iv, b, hh, 0, 0))
    return pl.pallas_call(
        functools.partial(_state_bwd_kernel, chunk_size=C, precision=precision), grid=(B, H, NV),
        in_specs=[fk, fk, fk, fv, fa, fg, fh, fv, fs],
        out_specs=[pk, pk, pk, fv, pa, pg, fs],
        out_shape=[jax.ShapeDtypeStruct((NV, B, H, T, K), F32)] * 3
        + [jax.ShapeDtypeStruct((B, H, T, V), F32),
           jax.ShapeDtypeStruct((NV, B, H, T, C), F32),
           jax.ShapeDtypeStruct((NV, B, H, NT, K), F32),
           jax.ShapeDtypeStruct((B, H, V, K), F32)],
        interpret=interpret, compiler_params=cm.COMPILER_PARAMS, name="kda_state_bwd",
    )(qg, kd, w, u, aqk, gl, h, do, dht)


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, dqg_ref, dkd_ref, dw_ref, du_ref,
                      daqk_ref, dgl_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, scale, dtype):
    C = q_ref.shape[0]
    ns = C // BT
    G, anc, G_last = cm.gate_cumsum(g_ref, ns)
    q = cm.load_tiles(q_ref, ns, F32)
    k = cm.load_tiles(k_ref, ns, F32)
    v = cm.load_tiles(v_ref, ns, F32)
    b = [x.astype(F32)[:, None] for x in cm.load_tiles(beta_ref, ns)]
    dqg = cm.load_tiles(dqg_ref, ns)
    dkd = cm.load_tiles(dkd_ref, ns)
    dW = cm.load_tiles(dw_ref, ns)
    dU = cm.load_tiles(du_ref, ns)
    eG = [jnp.exp(x) for x in G]

    # Qg = scale q e^G and Kd = k e^{G_last - G}; e^{G_last} from the state decay.
    dq = [scale * eG[r] * dqg[r] for r in range(ns)]
    dG = [scale * q[r] * eG[r] * dqg[r] for r in range(ns)]
    dk, dbeta = [], []
    dG_last = jnp.exp(G_last) * dgl_ref[...].reshape(G_last.shape)
    for r in range(ns):
        ekd = jnp.exp(G_last - G[r])
        dk.append(ekd * dkd[r])
        t = k[r] * ekd * dkd[r]
        dG[r] = dG[r] - t
        dG_last = dG_last + jnp.sum(t, axis=0, keepdims=True)

    # Recompute the chunk factors (forward precision, so A matches the forward's A).
    f = cm.chunk_factors(q, k, v, b, G, anc, scale=scale, dtype=dtype)
    A, X, Y, M = f["A"], f["X"], f["Y"], f["M"]
    p = cm.mm_precision(dtype)

    # W = A X, U = A Y.
    dv = []
    for s in range(ns):
        dX = dY = None
        for r in range(s, ns):
            tx, ty = cm.dot_tn(A[(r, s)], dW[r], p), cm.dot_tn(A[(r, s)], dU[r], p)
            dX = tx if dX is None else dX + tx
            dY = ty if dY is None else dY + ty
        dk[s] = dk[s] + b[s] * eG[s] * dX
        dG[s] = dG[s] + X[s] * dX
        dv.append(b[s] * dY)
        dbeta.append(jnp.sum(eG[s] * k[s] * dX, axis=1, keepdims=True)
                     + jnp.sum(v[s] * dY, axis=1, keepdims=True))
    dA = {(r, qq): cm.dot_nt(dW[r], X[qq], p) + cm.dot_nt(dU[r], Y[qq], p)
          for r in range(ns) for qq in range(r + 1)}
    # dL = -A^T dA A^T on the lower block triangle: T1_rq = sum_{p >= r} A_pr^T dA_pq (q <= r).
    T1 = {}
    for r in range(ns):
        for qq in range(r + 1):
            acc = None
            for m in range(r, ns):
                t = cm.dot_tn(A[(m, r)], dA[(m, qq)], HIGHEST)
                acc = t if acc is None else acc + t
            T1[(r, qq)] = acc
    strict = cm.mask(True)
    full = cm.mask(False)
    for r in range(ns):
        ar = anc[r]
        er = jnp.exp(G[r] - ar)
        qt = scale * q[r] * er                     # a~ for Aqk
        kt_r = k[r] * er                           # a~ for M
        for s in range(r + 1):
            acc = None
            for qq in range(s + 1):
                t = cm.dot_nt(T1[(r, qq)], A[(s, qq)], HIGHEST)
                acc = t if acc is None else acc + t
            dL = -acc
            dmaqk = daqk_ref[pl.ds(r * BT, BT), pl.ds(s * BT, BT)]
            if s == r:
                dL = jnp.where(strict, dL, 0.0)
                dmaqk = jnp.where(full, dmaqk, 0.0)
            dbeta[r] = dbeta[r] + jnp.sum(dL * M[(r, s)], axis=1, keepdims=True)
            dM = b[r] * dL
            prec = HIGHEST if s == r else p
            es = jnp.exp(ar - G[s])
            kt_s = k[s] * es                       # b~ (k) for both M and Aqk
            da_m = cm.dot(dM, kt_s, prec)          # [BT, K]
            da_q = cm.dot(dmaqk, kt_s, prec)
            db = cm.dot_tn(dM, kt_r, prec) + cm.dot_tn(dmaqk, qt, prec)
            dk[r] = dk[r] + er * da_m
            dq[r] = dq[r] + scale * er * da_q
            dG[r] = dG[r] + kt_r * da_m + qt * da_q
            dk[s] = dk[s] + es * db
            dG[s] = dG[s] - kt_s * db

    # dg = reverse cumsum of dG within the chunk, plus dG_last on every row.
    upper = jnp.where(lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
                      >= lax.broadcasted_iota(jnp.int32, (BT, BT), 0), 1.0, 0.0).astype(F32)
    carry = dG_last
    for r in reversed(range(ns)):
        rows = pl.ds(r * BT, BT)
        dg_ref[rows, :] = (cm.dot(upper, dG[r], HIGHEST) + carry).astype(dg_ref.dtype)
        carry = carry + jnp.sum(dG[r], axis=0, keepdims=True)
        dq_ref[rows, :] = dq[r].astype(dq_ref.dtype)
        dk_ref[rows, :] = dk[r].astype(dk_ref.dtype)
        dv_ref[rows, :] = dv[r].astype(dv_ref.dtype)
        dbeta_ref[rows] = dbeta[r].reshape(BT).astype(dbeta_ref.dtype)


def intra_bwd(q, k, v, g, beta, dqg, dkd, dw, du, daqk, dgl, *, scale: float, chunk_size: int,
              interpret: bool):
    """Intra-chunk gradients, one program per (batch, head, chunk).

    Args: forward inputs (as intra_fwd) and the summed fp32 outputs of state_bwd.
    Returns: dq, dk [B, H, T, K] (q's dtype), dv [B, H, T, V] (v's dtype), dg [B, H, T, K] fp32,
      dbeta [B, H, T] fp32.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    tk = pl.BlockSpec((None, None, C, K), lambda b, h, c: (b, h, c, 0))
    tv = pl.BlockSpec((None, None, C, V), lambda b, h, c: (b, h, c, 0))
    tb = pl.BlockSpec((None, None, C), lambda b, h, c: (b, h, c))
    ta = pl.BlockSpec((None, None, C, C), lambda b, h, c: (b, h, c, 0))
    tg = pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, h, c, 0))
    kernel = functools.partial(_intra_bwd_kernel, scale=scale, dtype=q.dtype)
    return pl.pallas_call(
        kernel, grid=(B, H, NT),
        in_specs=[tk, tk, tv, tk, tb, tk, tk, tk, tv, ta, tg],
        out_specs=[tk, tk, tv, tk, tb],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, K), q.dtype),
                   jax.ShapeDtypeStruct((B, H, T, K), k.dtype),
                   jax.ShapeDtypeStruct((B, H, T, V), v.dtype),
                   jax.ShapeDtypeStruct((B, H, T, K), F32),
                   jax.ShapeDtypeStruct((B, H, T), F32)],
        interpret=interpret, compiler_params=cm.COMPILER_PARAMS, name="kda_intra_bwd",
    )(q, k, v, g, beta, dqg, dkd, dw, du, daqk, dgl)
