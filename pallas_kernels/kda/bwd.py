"""KDA chunk backward kernels: the reverse state pass and the intra-chunk gradients.

Same layouts and units as fwd.py (user-facing tensors and their gradients token-major [B, T, H, .],
intermediates head-major, states transposed [V, K], gates in nats).

Per chunk with incoming state S, the forward is
  V' = U - W S;  O = Qg S + Aqk V';  S_next = D S + Kd^T V'
(Qg = scale Q e^G, Kd = K e^{G_last - G}, D = Diag(e^{G_last})). Given dO and dS_next:
  dV' = Aqk^T dO + Kd dS_next;  dS = Qg^T dO + D dS_next - W^T dV'
  dQg = dO S^T;  dAqk = dO V'^T;  dKd = V' dS_next^T;  dU = dV';  dW = -dV' S^T;
  d e^{G_last} = rowsum(S * dS_next).
The reverse pass (serial over chunks) runs only the dV' / dS recurrence and saves dS_next per chunk
(as fla's `chunk_bwd_dhu`); the intra kernel (parallel over chunks) reads the saved S and dS_next,
forms dQg, dW, dKd, dAqk, d e^{G_last}, reads the forward's A, M, W, U (saved) and pushes all of it
to dq, dk, dv, dbeta, dg:
  dA = dW X^T + dU Y^T,  dX = A^T dW,  dY = A^T dU,  dL = -A^T dA A^T (strictly lower),
  pair scores M_ij = sum_c a_ic b_jc e^{G_ic - G_jc}: with a~ = a e^{G - anc}, b~ = b e^{anc - G},
  da = e^{G-anc} (dM b~), db = e^{anc-G} (dM^T a~), dG_i += a~ (dM b~), dG_j -= b~ (dM^T a~),
  and dg = reverse cumsum of dG within the chunk (plus dG_last on every row).
Precision (common.py): the dL = -A^T dA A^T products and the diagonal-tile part of the anchored
score backward (whose dG terms cancel in the reverse cumsum; b~ up to e^80) use fp32 operands at
`common.exact_precision`: HIGHEST (IEEE) for fp32 inputs, BF16_BF16_F32_X3 (split-bf16 tensor-core
dots) for bf16 inputs. The off-diagonal score tiles (exponents <= 0), dX, dY, dA use
`common.mm_precision`: HIGHEST for fp32 inputs, default (TF32 on GPU) for bf16 inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import common as cm
from pallas_kernels.kda.common import F32


def _state_bwd_kernel(qg_ref, kd_ref, w_ref, aqk_ref, gl_ref, do_ref, dht_ref,
                      du_ref, dh_ref, dh0_ref, *, chunk_size, precision):
    C = chunk_size
    NT = qg_ref.shape[0] // C
    p = precision

    def body(i, dSt):                                   # dSt: [BV, K] grad of the state after chunk c
        c = NT - 1 - i
        rows = pl.ds(c * C, C)
        dh_ref[c] = dSt.astype(dh_ref.dtype)
        do = do_ref[rows, :].astype(F32)
        dvp = (cm.dot_tn(aqk_ref[rows, :].astype(F32), do, p)
               + cm.dot_nt(kd_ref[rows, :].astype(F32), dSt, p))
        du_ref[rows, :] = dvp
        gl = gl_ref[pl.ds(c, 1), :]
        return (cm.dot_tn(do, qg_ref[rows, :].astype(F32), p) + dSt * gl
                - cm.dot_tn(dvp, w_ref[rows, :].astype(F32), p))

    dh0_ref[...] = lax.fori_loop(0, NT, body, dht_ref[...].astype(F32))


def state_bwd(qg, kd, w, aqk, gl, do, dht, *, chunk_size: int, block_v: int, interpret: bool,
              precision=None, state_dtype=F32):
    """Reverse serial pass over chunks, one program per (batch, head, V-block, segment); fp32 dS in
    registers.

    Only what the recurrence needs runs here: dV' = Aqk^T dO + Kd dS_next and
    dS = Qg^T dO + D dS_next - W^T dV' (none of it needs the forward states). The products with
    the states (dQg, dW, dKd, dAqk, d e^{G_last}) are parallel over chunks and left to intra_bwd.

    Args: the intra_fwd outputs qg, kd, w [B, H, T, K], aqk [B, H, T, C], gl [B, H, NT, K];
      do [B, T, H, V]; dht [B, H, V, K] (transposed final-state gradient), or [B, H, NS, V, K]: the
      true gradient at the end of each of NS equal segments (split.segment_scan, reverse), which then
      run in parallel; precision of the fp32 dots; state_dtype: storage dtype of dh.
    Returns: du = dV' [B, H, T, V] fp32; dh [B, H, NT, V, K] (state_dtype; grad of the state after
      each chunk, transposed); dh0 fp32 of dht's rank (per segment: the gradient at its start).
    """
    B, H, T, K = qg.shape
    V = do.shape[-1]
    C = chunk_size
    NT = T // C
    BV = block_v
    per_segment = dht.ndim == 5
    dht = dht if per_segment else dht[:, :, None]
    NS = dht.shape[2]
    Ls = NT // NS
    L = Ls * C
    fk = pl.BlockSpec((None, None, L, K), lambda b, hh, iv, s: (b, hh, s, 0))
    fv = pl.BlockSpec((None, None, L, BV), lambda b, hh, iv, s: (b, hh, s, iv))
    fo = pl.BlockSpec((None, L, None, BV), lambda b, hh, iv, s: (b, s, hh, iv))
    fa = pl.BlockSpec((None, None, L, C), lambda b, hh, iv, s: (b, hh, s, 0))
    fg = pl.BlockSpec((None, None, Ls, K), lambda b, hh, iv, s: (b, hh, s, 0))
    fs = pl.BlockSpec((None, None, None, BV, K), lambda b, hh, iv, s: (b, hh, s, iv, 0))
    fh = pl.BlockSpec((None, None, Ls, BV, K), lambda b, hh, iv, s: (b, hh, s, iv, 0))
    du, dh, dh0 = pl.pallas_call(
        functools.partial(_state_bwd_kernel, chunk_size=C, precision=precision),
        grid=(B, H, V // BV, NS),
        in_specs=[fk, fk, fk, fa, fg, fo, fs],
        out_specs=[fv, fh, fs],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, V), F32),
                   jax.ShapeDtypeStruct((B, H, NT, V, K), state_dtype),
                   jax.ShapeDtypeStruct((B, H, NS, V, K), F32)],
        interpret=interpret, compiler_params=cm.STATE_PARAMS, name="kda_state_bwd",
    )(qg, kd, w, aqk, gl, do, dht)
    return du, dh, (dh0 if per_segment else dh0[:, :, 0])


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                      w_ref, u_ref, a_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, scale,
                      dtype, ablate=frozenset()):
    if "compute" in ablate:                   # profiling: the I/O + launch floor (wrong results)
        _intra_bwd_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                           w_ref, u_ref, a_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref)
        return
    C = q_ref.shape[0]
    gate = cm.Gate(g_ref[...].astype(F32), ablate)
    G, G_last = gate.G, gate.G_last
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    p = cm.BF16_OPERANDS if "bf16_dots" in ablate else cm.mm_precision(dtype)
    exact = p if "exact_dots" in ablate else cm.exact_precision(dtype)
    rows, cols = cm.iotas(C, C)
    ones = jnp.ones((1, C), F32)
    rs = cm.row_sums

    # The forward's solve and factors (saved, not recomputed); X, Y are elementwise.
    A = a_ref[...]
    M = m_ref[...]
    X = b * jnp.exp(G) * k
    Y = b * v

    # The state products (St = S^T [V, K] entering the chunk, dSt = dS^T after it):
    # V' = U - W S;  dQg = dO S^T;  dW = -dV' S^T;  dKd = V' dS^T;  dAqk = dO V'^T;
    # d e^{G_last} = colsum(S^T * dS^T).
    St = h_ref[...].astype(F32)
    dSt = dh_ref[...].astype(F32)
    do = do_ref[...].astype(F32)
    dU = du_ref[...].astype(F32)
    if "state_products" in ablate:
        vp = u_ref[...].astype(F32)
        dqg, dW, dkd = q * rs(do), -w_ref[...].astype(F32) * rs(dU), k * rs(vp)
        daqk = rs(do) * ones
    else:
        vp = u_ref[...].astype(F32) - cm.dot_nt(w_ref[...].astype(F32), St, p)
        dqg = cm.dot(do, St, p)
        dW = -cm.dot(dU, St, p)
        dkd = cm.dot(vp, dSt, p)
        daqk = cm.dot_nt(do, vp, p)
    dgl = jnp.sum(St * dSt, axis=0, keepdims=True)

    # Qg = scale q e^G and Kd = k e^{G_last - G}; e^{G_last} from the state decay.
    eG = jnp.exp(G)
    dq = scale * eG * dqg
    dG = q * dq
    ekd = jnp.exp(G_last - G)
    dk = ekd * dkd
    t = k * dk
    dG = dG - t
    dG_last = jnp.exp(G_last) * dgl + jnp.sum(t, axis=0, keepdims=True)

    # W = A X, U = A Y.
    if "dXY" in ablate:
        dX, dY = dW, dU
    else:
        dX = cm.dot_tn(A, dW, p)
        dY = cm.dot_tn(A, dU, p)
    dk = dk + b * eG * dX
    dG = dG + X * dX
    dv = b * dY
    dbeta = (jnp.sum(eG * k * dX, axis=1, keepdims=True)
             + jnp.sum(v * dY, axis=1, keepdims=True))
    # A = (I + L)^-1: dL = -A^T dA A^T on the strict lower triangle (dA restricted to A's support).
    if "dA" in ablate:
        dA = jnp.where(rows >= cols, (rs(dW) + rs(A)) * ones, 0.0)
    else:
        dA = jnp.where(rows >= cols, cm.dot_nt(dW, X, p) + cm.dot_nt(dU, Y, p), 0.0)
    if "dL" in ablate:
        dL = jnp.where(rows > cols, dA, 0.0)
    else:
        dL = jnp.where(rows > cols, -cm.dot_nt(cm.dot_tn(A, dA, exact), A, exact), 0.0)
    dbeta = dbeta + jnp.sum(dL * M, axis=1, keepdims=True)
    dM = b * dL
    dAqk = jnp.where(rows >= cols, daqk, 0.0)

    # Anchored score tiles: S_ij = a~_i . b~_j with a~ = a e^{G - anc}, b~ = b e^{anc - G}:
    # da = e^{G - anc} (dS b~), db = e^{anc - G} (dS^T a~), dG += a~ (dS b~), dG -= b~ (dS^T a~).
    # Diagonal 16x16 tiles (all row blocks at once, each with its own anchor; b~ up to e^{16|lb|}):
    # one dot per side at exact precision. Off-diagonal tiles (row block r, anchor anc_r, b~ <= 1):
    # one dot per side and row block at mm precision (round 1's split, which the GPU tests passed).
    kt = k * gate.ea                                  # a~ of M
    qt = scale * q * gate.ea                          # a~ of Aqk
    rb, cb = lax.div(rows, jnp.int32(cm.BT)), lax.div(cols, jnp.int32(cm.BT))
    ebd = gate.eb_own()                               # e^{anc - G} with each row's own anchor
    kbd = k * ebd
    dm_d = jnp.where(rb == cb, dM, 0.0)
    dq_d = jnp.where(rb == cb, dAqk, 0.0)
    if "score_diag" in ablate:
        sa_m, sa_q = kbd * rs(dm_d), kbd * rs(dq_d)
        sb = ebd * (kt * rs(dm_d) + qt * rs(dq_d))
    else:
        sa_m = cm.dot(dm_d, kbd, exact)
        sa_q = cm.dot(dq_d, kbd, exact)
        sb = ebd * (cm.dot_tn(dm_d, kt, exact) + cm.dot_tn(dq_d, qt, exact))
    dm_o = jnp.where(rb > cb, dM, 0.0)
    dq_o = jnp.where(rb > cb, dAqk, 0.0)
    for r in range(1, gate.ns) if "score_offdiag" not in ablate else ():
        eb = gate.eb(r)
        kb = k * eb
        dm_r = jnp.where(gate.rb == r, dm_o, 0.0)
        dq_r = jnp.where(gate.rb == r, dq_o, 0.0)
        sa_m = sa_m + cm.dot(dm_r, kb, p)
        sa_q = sa_q + cm.dot(dq_r, kb, p)
        sb = sb + eb * (cm.dot_tn(dm_r, kt, p) + cm.dot_tn(dq_r, qt, p))
    dk = dk + gate.ea * sa_m + sb
    dq = dq + scale * gate.ea * sa_q
    dG = dG + kt * sa_m + qt * sa_q - k * sb

    # dg = reverse cumsum of dG within the chunk (total - inclusive cumsum + dG), plus dG_last.
    if "cumsum" in ablate or "gate" in ablate:
        dg = dG + dG_last
    else:
        dg = jnp.sum(dG, axis=0, keepdims=True) - jnp.cumsum(dG, axis=0) + dG + dG_last
    dg_ref[...] = dg.astype(dg_ref.dtype)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dbeta_ref[...] = dbeta.reshape(C).astype(dbeta_ref.dtype)


def _intra_bwd_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                       w_ref, u_ref, a_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref):
    """The "compute" ablation: every input read, every output written, no chunk arithmetic."""
    rs = cm.row_sums
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)
    g = g_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    dgl = jnp.sum(h_ref[...].astype(F32) * dh_ref[...].astype(F32), axis=0, keepdims=True)
    dq_ref[...] = (q * rs(do_ref[...].astype(F32)) + w_ref[...].astype(F32)).astype(dq_ref.dtype)
    dk_ref[...] = (k * rs(a_ref[...]) + rs(m_ref[...]) + dgl).astype(dk_ref.dtype)
    dv_ref[...] = (v * rs(du_ref[...].astype(F32)) + u_ref[...].astype(F32)).astype(dv_ref.dtype)
    dg_ref[...] = (g * b).astype(dg_ref.dtype)
    dbeta_ref[...] = rs(b * q).reshape(q.shape[0]).astype(dbeta_ref.dtype)


def intra_bwd(q, k, v, g, beta, do, du, h, dh, w, u, A, M, *, scale: float, chunk_size: int,
              interpret: bool, _ablate: tuple[str, ...] = (), _params=None):
    """Intra-chunk gradients, one program per (batch, head, chunk).

    Args: forward inputs (as intra_fwd, token-major); do [B, T, H, V]; du [B, H, T, V] fp32
      (state_bwd);
      h [B, H, NT, V, K] (state_fwd: transposed state entering each chunk); dh [B, H, NT, V, K]
      (state_bwd: transposed grad of the state after each chunk); w [B, H, T, K], u [B, H, T, V]
      (intra_fwd, as the state pass used them); A, M [B, H, T, C] fp32 (intra_fwd save_solve).
    Returns (token-major): dq, dk [B, T, H, K] (q's dtype), dv [B, T, H, V] (v's dtype),
      dg [B, T, H, K] fp32, dbeta [B, T, H] fp32.
    _ablate: PRIVATE profiling option (static; results WRONG, timing only): names from
      common.BWD_ABLATIONS whose part of the kernel body is replaced by a cheap stand-in.
    _params: PRIVATE profiling option: Triton compiler params (default common.INTRA_PARAMS).
    Raises: ValueError for an unknown _ablate name.
    """
    ablate = cm.check_ablate(_ablate, cm.BWD_ABLATIONS, "_ablate")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    ik = pl.BlockSpec((None, C, None, K), lambda b, h, c: (b, c, h, 0))
    iv = pl.BlockSpec((None, C, None, V), lambda b, h, c: (b, c, h, 0))
    ib = pl.BlockSpec((None, C, None), lambda b, h, c: (b, c, h))
    tv = pl.BlockSpec((None, None, C, V), lambda b, h, c: (b, h, c, 0))
    ts = pl.BlockSpec((None, None, None, V, K), lambda b, h, c: (b, h, c, 0, 0))
    tk = pl.BlockSpec((None, None, C, K), lambda b, h, c: (b, h, c, 0))
    ta = pl.BlockSpec((None, None, C, C), lambda b, h, c: (b, h, c, 0))
    kernel = functools.partial(_intra_bwd_kernel, scale=scale, dtype=q.dtype, ablate=ablate)
    return pl.pallas_call(
        kernel, grid=(B, H, NT),
        in_specs=[ik, ik, iv, ik, ib, iv, tv, ts, ts, tk, tv, ta, ta],
        out_specs=[ik, ik, iv, ik, ib],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), F32),
                   jax.ShapeDtypeStruct((B, T, H), F32)],
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_bwd",
    )(q, k, v, g, beta, do, du, h, dh, w, u, A, M)
