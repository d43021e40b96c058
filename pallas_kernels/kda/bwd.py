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
`common.mm_precision`: HIGHEST for fp32 inputs, default (TF32 on GPU) for bf16 inputs. With
ops.KernelOptions.compact_offdiag_bwd the same sums run row block by row block on ref slices
(_intra_bwd_b_compact_kernel), the column side anchored at the end of each column block.
Unbounded gates (`unbounded=True`, no lower_bound) run only in that compact kernel (with the XLA
gate cumsum): its diagonal tiles use the exact pairwise form (_own_block_bwd, every exp argument
<= 0); the row-side and column-side dots already have exponents <= 0. The other kernels need no
bound: the reverse state pass only reads stored factors, and kernel a's (_state_solve_bwd) only
exps are exp(G), exp(G_last - G), exp(G_last) and Gate.ea = exp(G - anc), all of non-positive
numbers (it never forms Gate.eb / eb_own).
With ops.KernelOptions.tile_state_bwd kernel a forms its state products over V blocks of
STATE_BLOCK_V columns (_state_products_tiled: [BV, K] row slices of the saved state refs, [C, BV]
column slices of dO, dV', U, V and dv), so that neither whole [V, K] fp32 state is live; the rest
of kernel a (_solve_bwd) is shared with the whole-state form.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import common as cm
from pallas_kernels.kda.common import F32


# Kernel a's V block with ops.KernelOptions.tile_state_bwd (intra_bwd_a's state_block_v). 64: the
# two live [BV, K] fp32 state blocks then take 2 x 64 x 128 x 4 B = 64 KiB per program (64 registers
# per thread at 8 warps, half of the whole states' 128), the size of fla's largest dqkwg tile on
# Hopper (BK 64 x BV 128), in 2 blocks of 7 dots each; BV = 32 would free 32 more registers per
# thread at twice the dot count (28 small dots; round 3's compact kernel b showed that small dots
# are not free). The bench times both (--ablate rows "tile_state" and "tile_state32").
STATE_BLOCK_V = 64
# The private profiling ablations of kernel a (intra_bwd_a): its pieces of common.BWD_ABLATIONS.
A_ABLATIONS = ("state_products", "dXY", "dA", "dL", "exact_dots", "compute")


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
    lay = cm.serial_layout(dht, T, K, C, BV)
    dht, per_segment, NS, L = lay.state, lay.per_segment, lay.num_segments, lay.chunks_per_segment * C
    fk, fv, fa, fg, fs, fh = lay.k, lay.v, lay.a, lay.g, lay.s, lay.h
    fo = pl.BlockSpec((None, L, None, BV), lambda b, hh, iv, s: (b, s, hh, iv))
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


def _state_solve_bwd(gate, q, k, v, b, St, dSt, do, dU, w, u, A, M, *, scale, p, exact, ablate,
                     seg=None):
    """Part 1 of the intra-chunk backward: everything before the anchored score-tile backward.

    From the saved state St = S^T [V, K] entering the chunk, dSt = dS^T after it, dO [C, V],
    dU = dV' [C, V], the saved w, u, A, M and the chunk inputs (all fp32 values). Returns dict:
    dq, dk [C, K] (the parts through Qg, Kd, X), dG [C, K] (per-row gate gradient so far), dG_last
    [1, K], dv [C, V] and dbeta [C, 1] (final), dM [C, C] (strictly lower, = beta dL) and dAqk
    [C, C] (lower incl. diagonal): the score gradients the score-tile backward consumes.
    seg: Segments of the chunk or None: the forward's selects (cm.Segments) applied to the
    gradients of the masked factors (Qg, Kd, e^{G_last}, X rows; dL and dAqk across documents).
    The state products here take the whole [V, K] states (both live at once); _state_products_tiled
    forms the same sums over [BV, K] row blocks of them (ops.KernelOptions.tile_state_bwd). The rest
    is _solve_bwd, shared by both.
    """
    C = q.shape[0]
    ones = jnp.ones((1, C), F32)
    rs = cm.row_sums
    Y = b * v

    # The state products: V' = U - W S;  dQg = dO S^T;  dW = -dV' S^T;  dKd = V' dS^T;
    # dAqk = dO V'^T;  d e^{G_last} = colsum(S^T * dS^T).
    if "state_products" in ablate:
        vp = u
        dqg, dW, dkd = q * rs(do), -w * rs(dU), k * rs(vp)
        daqk = rs(do) * ones
    else:
        vp = u - cm.dot_nt(w, St, p)
        dqg = cm.dot(do, St, p)
        dW = -cm.dot(dU, St, p)
        dkd = cm.dot(vp, dSt, p)
        daqk = cm.dot_nt(do, vp, p)
    dgl = jnp.sum(St * dSt, axis=0, keepdims=True)
    # The V-side of U = A Y: dY = A^T dU, dv = beta dY; its parts of dbeta and of dA (dU Y^T).
    dY = dU if "dXY" in ablate else cm.dot_tn(A, dU, p)
    dbeta_v = jnp.sum(v * dY, axis=1, keepdims=True)
    dA_u = None if "dA" in ablate else cm.dot_nt(dU, Y, p)
    r = _solve_bwd(gate, q, k, b, A, M, dqg, dW, dkd, daqk, dgl, dA_u, dbeta_v, scale=scale, p=p,
                   exact=exact, ablate=ablate, seg=seg)
    r["dv"] = b * dY
    return r


def _state_products_tiled(q, k, b, A, w_ref, do_ref, du_ref, u_ref, v_ref, h_ref, dh_ref, dv_ref, *,
                          block_v, p, ablate):
    """The V-dependent half of _state_solve_bwd over V blocks of BV = block_v columns (a static
    loop; ops.KernelOptions.tile_state_bwd), so that only [BV, K] row blocks of the two saved
    [V, K] states are live at a time, never the whole states.

    Block j (columns c in [j BV, (j + 1) BV)) loads St_j, dSt_j [BV, K] (row slices of h_ref,
    dh_ref: the transposed states) and the column blocks do_j, dU_j, u_j, v_j [C, BV] of do_ref,
    du_ref, u_ref, v_ref, and accumulates, in fp32 (same dots and precisions as the whole-state
    form, contraction over V split into blocks; fla's chunk_kda backward loops over V blocks the
    same way):
      V'_j = u_j - W St_j^T;  dQg += do_j St_j;  dW -= dU_j St_j;  dKd += V'_j dSt_j;
      dAqk += do_j V'_j^T;  d e^{G_last} += colsum(St_j * dSt_j);
      dY_j = A^T dU_j (dv_j = beta dY_j is stored to dv_ref[:, block j]);
      dbeta_v += rowsum(v_j * dY_j);  dA_u += dU_j (beta v_j)^T.
    Args: q, k [C, K], beta [C, 1], A [C, C] (fp32 values); the refs of the kernel (w_ref [C, K]
      is loaded per block, not held across blocks); block_v must divide V; p: the mm precision;
      ablate: the profiling ablations "state_products", "dXY", "dA" (common.BWD_ABLATIONS).
    Returns (dqg, dW, dkd [C, K], daqk [C, C], dgl [1, K], dA_u [C, C] or None with "dA",
      dbeta_v [C, 1]), fp32, unmasked (_solve_bwd applies the document selects).
    """
    C, K = q.shape
    V = h_ref.shape[0]
    rs = cm.row_sums
    ones = jnp.ones((1, C), F32)
    dqg = dW = dkd = jnp.zeros((C, K), F32)
    daqk = dA_u = jnp.zeros((C, C), F32)
    dgl = jnp.zeros((1, K), F32)
    dbeta_v = jnp.zeros((C, 1), F32)
    for j in range(V // block_v):
        cols = pl.ds(j * block_v, block_v)
        St = h_ref[cols, :].astype(F32)
        dSt = dh_ref[cols, :].astype(F32)
        do = do_ref[:, cols].astype(F32)
        dU = du_ref[:, cols].astype(F32)
        u = u_ref[:, cols].astype(F32)
        v = v_ref[:, cols].astype(F32)
        if "state_products" in ablate:
            vp = u
            dqg = dqg + q * rs(do)
            dW = dW - w_ref[...].astype(F32) * rs(dU)
            dkd = dkd + k * rs(vp)
            daqk = daqk + rs(do) * ones
        else:
            vp = u - cm.dot_nt(w_ref[...].astype(F32), St, p)
            dqg = dqg + cm.dot(do, St, p)
            dW = dW - cm.dot(dU, St, p)
            dkd = dkd + cm.dot(vp, dSt, p)
            daqk = daqk + cm.dot_nt(do, vp, p)
        dgl = dgl + jnp.sum(St * dSt, axis=0, keepdims=True)
        dY = dU if "dXY" in ablate else cm.dot_tn(A, dU, p)
        dv_ref[:, cols] = (b * dY).astype(dv_ref.dtype)
        dbeta_v = dbeta_v + jnp.sum(v * dY, axis=1, keepdims=True)
        if "dA" not in ablate:
            dA_u = dA_u + cm.dot_nt(dU, b * v, p)
    return dqg, dW, dkd, daqk, dgl, (None if "dA" in ablate else dA_u), dbeta_v


def _solve_bwd(gate, q, k, b, A, M, dqg, dW, dkd, daqk, dgl, dA_u, dbeta_v, *, scale, p, exact,
               ablate, seg):
    """The V-independent rest of _state_solve_bwd, from the state products.

    Args: gate (cm.Gate), q, k [C, K], beta [C, 1], A, M [C, C]; dqg = dO S^T, dW = -dV' S^T,
      dkd = V' dS^T [C, K], daqk = dO V'^T [C, C], dgl = colsum(S^T * dS^T) [1, K] (unmasked);
      dA_u = dU Y^T [C, C] (None with the "dA" ablation) and dbeta_v = rowsum(v * dY) [C, 1]: the
      V-side parts of dA and dbeta (all fp32 values).
    Returns the dict of _state_solve_bwd without dv.
    """
    C = q.shape[0]
    G, G_last = gate.G, gate.G_last
    rows, cols = cm.iotas(C, C)
    ones = jnp.ones((1, C), F32)
    rs = cm.row_sums
    X = cm.keep(b * jnp.exp(G) * k, seg, "row_in")
    dqg = cm.keep(dqg, seg, "row_in")
    dkd = cm.keep(dkd, seg, "in_last")
    dgl = cm.keep(dgl, seg, "carry")

    # Qg = scale q e^G and Kd = k e^{G_last - G}; e^{G_last} from the state decay.
    eG = jnp.exp(G)
    dq = scale * eG * dqg
    dG = q * dq
    ekd = jnp.exp(G_last - G)
    dk = ekd * dkd
    t = k * dk
    dG = dG - t
    dG_last = jnp.exp(G_last) * dgl + jnp.sum(t, axis=0, keepdims=True)

    # W = A X (U = A Y: dY, dv and dbeta_v come from the caller).
    dX = dW if "dXY" in ablate else cm.dot_tn(A, dW, p)
    dX = cm.keep(dX, seg, "row_in")
    dk = dk + b * eG * dX
    dG = dG + X * dX
    dbeta = jnp.sum(eG * k * dX, axis=1, keepdims=True) + dbeta_v
    # A = (I + L)^-1: dL = -A^T dA A^T on the strict lower triangle (dA restricted to A's support).
    if "dA" in ablate:
        dA = jnp.where(rows >= cols, (rs(dW) + rs(A)) * ones, 0.0)
    else:
        dA = jnp.where(rows >= cols, cm.dot_nt(dW, X, p) + dA_u, 0.0)
    if "dL" in ablate:
        dL = jnp.where(rows > cols, dA, 0.0)
    else:
        dL = jnp.where(rows > cols, -cm.dot_nt(cm.dot_tn(A, dA, exact), A, exact), 0.0)
    dL = cm.keep(dL, seg, "same")
    daqk = cm.keep(daqk, seg, "same")
    dbeta = dbeta + jnp.sum(dL * M, axis=1, keepdims=True)
    return dict(dq=dq, dk=dk, dG=dG, dG_last=dG_last, dbeta=dbeta, dM=b * dL,
                dAqk=jnp.where(rows >= cols, daqk, 0.0))


def _score_bwd(gate, q, k, dq, dk, dG, dM, dAqk, *, scale, p, exact, ablate):
    """Part 2 of the intra-chunk backward: the anchored score tiles of M (k.k) and Aqk (q.k).

    Adds the score gradients dM, dAqk [C, C] (fp32) to dq, dk, dG [C, K] and returns them.
    S_ij = a~_i . b~_j with a~ = a e^{G - anc}, b~ = b e^{anc - G}: da = e^{G - anc} (dS b~),
    db = e^{anc - G} (dS^T a~), dG += a~ (dS b~), dG -= b~ (dS^T a~). Diagonal 16x16 tiles (all row
    blocks at once, each with its own anchor; b~ up to e^{16|lb|}): one dot per side at `exact`
    precision. Off-diagonal tiles (row block r, anchor anc_r, b~ <= 1): one dot per side and row
    block at `p` (round 1's split, which the GPU tests passed).
    """
    C = q.shape[0]
    rows, cols = cm.iotas(C, C)
    rs = cm.row_sums
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
    return dq, dk, dG


def _reverse_cumsum(dG, ablate):
    """dg_i = sum_{j >= i} dG_j within the chunk (total - inclusive cumsum + dG)."""
    if "cumsum" in ablate or "gate" in ablate:
        return dG
    return jnp.sum(dG, axis=0, keepdims=True) - jnp.cumsum(dG, axis=0) + dG


def _last_row_plus(dG, dG_last):
    """dG [C, K] with dG_last [1, K] added to its last row."""
    last = lax.broadcasted_iota(jnp.int32, (dG.shape[0], 1), 0) == dG.shape[0] - 1
    return dG + jnp.where(last, dG_last, 0.0)


def _precisions(dtype, ablate):
    """(p, exact): the mm and exact dot precisions of the backward for inputs of `dtype`."""
    p = cm.BF16_OPERANDS if "bf16_dots" in ablate else cm.mm_precision(dtype)
    return p, (p if "exact_dots" in ablate else cm.exact_precision(dtype))


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                      w_ref, u_ref, a_ref, m_ref, *refs, scale, dtype, ablate=frozenset(),
                      gate_cumsum=False, segmented=False):
    seg_ref, refs = (refs[0], refs[1:]) if segmented else (None, refs)
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = refs
    if "compute" in ablate:                   # profiling: the I/O + launch floor (wrong results)
        _intra_bwd_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                           w_ref, u_ref, a_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref)
        return
    C = q_ref.shape[0]
    gate = cm.gate_of(g_ref, ablate, gate_cumsum)
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    p, exact = _precisions(dtype, ablate)
    r = _state_solve_bwd(gate, q, k, v_ref[...].astype(F32), beta_ref[...].astype(F32)[:, None],
                         h_ref[...].astype(F32), dh_ref[...].astype(F32), do_ref[...].astype(F32),
                         du_ref[...].astype(F32), w_ref[...].astype(F32), u_ref[...].astype(F32),
                         a_ref[...], m_ref[...], scale=scale, p=p, exact=exact, ablate=ablate,
                         seg=cm.segments_of(seg_ref))
    dq, dk, dG = _score_bwd(gate, q, k, r["dq"], r["dk"], r["dG"], r["dM"], r["dAqk"], scale=scale,
                            p=p, exact=exact, ablate=ablate)
    # dg = reverse cumsum of dG within the chunk, plus dG_last on every row (gate_cumsum: the
    # caller's XLA reverse cumsum spreads dG_last, added to the last row, over the chunk).
    dg = _last_row_plus(dG, r["dG_last"]) if gate_cumsum else _reverse_cumsum(dG, ablate) + r["dG_last"]
    dg_ref[...] = dg.astype(dg_ref.dtype)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = r["dv"].astype(dv_ref.dtype)
    dbeta_ref[...] = r["dbeta"].reshape(C).astype(dbeta_ref.dtype)


def _intra_bwd_a_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                        w_ref, u_ref, a_ref, m_ref, *refs, scale, dtype, flags=frozenset(),
                        ablate=frozenset(), block_v=None):
    seg_ref, refs = (refs[0], refs[1:]) if "segmented" in flags else (None, refs)
    dv_ref, dbeta_ref, dq_ref, dk_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref, *g_out = refs
    if "compute" in ablate:                   # profiling: the I/O + launch floor (wrong results)
        _intra_bwd_a_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                             w_ref, u_ref, a_ref, m_ref, *refs)
        return
    C = q_ref.shape[0]
    gate = cm.gate_of(g_ref, gate_cumsum="gate_cumsum" in flags)
    if g_out:                                 # compact kernel b reads row slices of G
        g_out[0][...] = gate.G
    p, exact = _precisions(dtype, flags | ablate)
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    seg = cm.segments_of(seg_ref)
    if block_v is None:
        r = _state_solve_bwd(gate, q, k, v_ref[...].astype(F32), b, h_ref[...].astype(F32),
                             dh_ref[...].astype(F32), do_ref[...].astype(F32),
                             du_ref[...].astype(F32), w_ref[...].astype(F32),
                             u_ref[...].astype(F32), a_ref[...], m_ref[...], scale=scale, p=p,
                             exact=exact, ablate=ablate, seg=seg)
        dv_ref[...] = r["dv"].astype(dv_ref.dtype)
    else:                                     # dv is stored per V block inside
        A = a_ref[...]
        parts = _state_products_tiled(q, k, b, A, w_ref, do_ref, du_ref, u_ref, v_ref, h_ref, dh_ref,
                                      dv_ref, block_v=block_v, p=p, ablate=ablate)
        r = _solve_bwd(gate, q, k, b, A, m_ref[...], *parts, scale=scale, p=p, exact=exact,
                       ablate=ablate, seg=seg)
    dbeta_ref[...] = r["dbeta"].reshape(C).astype(dbeta_ref.dtype)
    dq_ref[...] = r["dq"]
    dk_ref[...] = r["dk"]
    dgp_ref[...] = r["dG"]
    dgl_ref[...] = r["dG_last"].reshape(dgl_ref.shape)
    dm_ref[...] = r["dM"]
    daqk_ref[...] = r["dAqk"]


def _intra_bwd_a_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref,
                         w_ref, u_ref, a_ref, m_ref, dv_ref, dbeta_ref, dq_ref, dk_ref, dgp_ref,
                         dgl_ref, dm_ref, daqk_ref, *g_out):
    """Kernel a's "compute" ablation: every input read, every output written, no chunk arithmetic."""
    rs = cm.row_sums
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    g = g_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    a, m = a_ref[...], m_ref[...]
    dgl = jnp.sum(h_ref[...].astype(F32) * dh_ref[...].astype(F32), axis=0, keepdims=True)
    dv_ref[...] = (v_ref[...].astype(F32) * rs(du_ref[...].astype(F32))
                   + u_ref[...].astype(F32)).astype(dv_ref.dtype)
    dbeta_ref[...] = rs(b * q).reshape(q.shape[0]).astype(dbeta_ref.dtype)
    dq_ref[...] = q * rs(do_ref[...].astype(F32)) + w_ref[...].astype(F32)
    dk_ref[...] = k * rs(a) + rs(m)
    dgp_ref[...] = g * b
    dgl_ref[...] = dgl.reshape(dgl_ref.shape)
    dm_ref[...] = a * b
    daqk_ref[...] = m + rs(a)
    if g_out:
        g_out[0][...] = g


def _intra_bwd_b_kernel(q_ref, k_ref, g_ref, dqp_ref, dkp_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref,
                        dq_ref, dk_ref, dg_ref, *, scale, dtype, flags=frozenset()):
    gate = cm.gate_of(g_ref, gate_cumsum="gate_cumsum" in flags)
    p, exact = _precisions(dtype, flags)
    dq, dk, dG = _score_bwd(gate, q_ref[...].astype(F32), k_ref[...].astype(F32), dqp_ref[...],
                            dkp_ref[...], dgp_ref[...], dm_ref[...], daqk_ref[...], scale=scale,
                            p=p, exact=exact, ablate=frozenset())
    dgl = dgl_ref[...].reshape(1, dG.shape[1])
    if "gate_cumsum" in flags:
        dg_ref[...] = _last_row_plus(dG, dgl).astype(dg_ref.dtype)
    else:
        dg_ref[...] = (_reverse_cumsum(dG, frozenset()) + dgl).astype(dg_ref.dtype)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _own_block_bwd(dm_d, dq_d, k, qs, G, k_row, G_row, first: int):
    """Exact diagonal-tile score backward of one 16-row block, for unbounded gates.

    dm_d, dq_d: the block's [16, 16] tiles of dM (strictly lower) and dAqk (lower incl. the
    diagonal), zero above the diagonal; k, qs = scale q, G: the block's rows [16, K] fp32;
    k_row(j), G_row(j): row j [1, K] fp32 of k and G loaded from refs; first: the block's first row.
    Returns (pm, pq, sb), each [16, K] fp32, with e_ij = exp(min(G_i - G_j, 0)) (= e^{G_i - G_j}
    for j <= i; the min only guards the zero coefficients above the diagonal, so every exp
    argument is <= 0 and no g <= 0 overflows):
      pm_i = sum_j dM_ij k_j e_ij,  pq_i = sum_j dAqk_ij k_j e_ij   (gradient of the a side),
      sb_j = sum_i (dM_ij k_i + dAqk_ij qs_i) e_ij                 (gradient of the b side),
    so that dq += scale pq, dk += pm + sb, dG += k pm + qs pq - k sb (the own-anchor terms of
    _score_bwd without the anchor). One fori_loop step per column j: an exp, the tile's column j by
    a masked reduction and ~10 elementwise [16, K] ops, fp32 (CUDA cores, no dot).
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


def _intra_bwd_b_compact_kernel(q_ref, k_ref, G_ref, dqp_ref, dkp_ref, dgp_ref, dgl_ref, dm_ref,
                                daqk_ref, dq_ref, dk_ref, dg_ref, *, scale, dtype,
                                flags=frozenset()):
    """Kernel b of intra_bwd_split with compact_offdiag: the score-tile backward row block by row
    block on row slices of the refs, no masked [C, C] x [C, K] dots.

    Row block r (rows i in [16 r, 16 r + 16), the same block as columns j for the column side):
      diagonal tile (own anchor anc_r, b~ up to e^{16|lb|}): 4 [16, 16] x [16, K] dots at `exact`;
      row side (columns j < 16 r, anchor anc_r, as _score_bwd): [16, n] x [n, K] dots at `p` with
        n = 16, 32, 64 for r = 1, 2, 3 (j >= 16 r zeroed in the operand by a select);
      column side (rows i in the later blocks, re-anchored at the END of block r: anc_{r+1} = G of
        row 16 r + 15, so a~_i = a_i e^{G_i - anc_{r+1}} <= 1 and b~_j = b_j e^{anc_{r+1} - G_j} <= 1
        for every later block at once): [n, 16]^T x [n, K] dots on rows [C - n, C), n = 64, 32, 16
        for r = 0, 1, 2 (rows of blocks <= r zeroed by a select).
    Same sums as _score_bwd (whose column side groups by the row block's anchor instead): equal up
    to rounding. G_ref holds the chunk cumsum G (fp32; XLA's with gate_cumsum, else kernel a's).
    dq, dk, dg are stored per row block; the reverse cumsum of dG (without gate_cumsum) runs from
    the last block to the first with the running total of the later blocks.
    flags "unbounded" (no lower_bound): the diagonal tile is _own_block_bwd's exact elementwise form
    instead of the 4 own-anchor dots (whose e^{anc_r - G} overflows); the row side and the column
    side are unchanged (their exponents are <= 0 for any g <= 0).
    """
    C, K = k_ref.shape
    BT = cm.BT
    ns = C // BT
    p, exact = _precisions(dtype, flags)
    gate_cumsum = "gate_cumsum" in flags
    unbounded = "unbounded" in flags
    dgl = dgl_ref[...].reshape(1, K)
    zero_row = jnp.zeros((1, K), F32)

    def G_row(i):                                  # row i of G as [1, K]; i < 0: the chunk start
        return zero_row if i < 0 else G_ref[pl.ds(i, 1), :].astype(F32)

    later = zero_row                               # sum of dG over the blocks after r
    for r in reversed(range(ns)):
        rows = pl.ds(r * BT, BT)
        anc = G_row(r * BT - 1)
        G = G_ref[rows, :].astype(F32)
        k = k_ref[rows, :].astype(F32)
        q = q_ref[rows, :].astype(F32)
        ea = jnp.exp(G - anc)                      # <= 1
        kt, qt = k * ea, scale * q * ea
        if unbounded:                              # exact diagonal tile; row side below (if any)
            dm_d, dq_d = dm_ref[rows, rows], daqk_ref[rows, rows]
            pm, pq, sb = _own_block_bwd(dm_d, dq_d, k, scale * q, G,
                                        lambda j: k_ref[pl.ds(j, 1), :].astype(F32),
                                        lambda j: G_ref[pl.ds(j, 1), :].astype(F32), r * BT)
            sa_m = sa_q = None
        else:
            ebd = jnp.exp(anc - G)                 # <= e^{16|lb|}
            kbd = k * ebd
            dm_d, dq_d = dm_ref[rows, rows], daqk_ref[rows, rows]
            sa_m = cm.dot(dm_d, kbd, exact)
            sa_q = cm.dot(dq_d, kbd, exact)
            sb = ebd * (cm.dot_tn(dm_d, kt, exact) + cm.dot_tn(dq_d, qt, exact))
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
            if unbounded:
                sa_m = cm.dot(dm_ref[rows, cols], kb, p)
                sa_q = cm.dot(daqk_ref[rows, cols], kb, p)
            else:
                sa_m = sa_m + cm.dot(dm_ref[rows, cols], kb, p)
                sa_q = sa_q + cm.dot(daqk_ref[rows, cols], kb, p)
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
            sb = sb + jnp.exp(anc1 - G) * (cm.dot_tn(dm_ref[rr, rows], ka, p)
                                           + cm.dot_tn(daqk_ref[rr, rows], qa, p))
        if not unbounded:
            dq = dqp_ref[rows, :] + scale * ea * sa_q
            dk = dkp_ref[rows, :] + ea * sa_m + sb
            dG = dgp_ref[rows, :] + kt * sa_m + qt * sa_q - k * sb
        elif sa_m is None:                         # block 0: no earlier columns
            dq = dqp_ref[rows, :] + scale * pq
            dk = dkp_ref[rows, :] + pm + sb
            dG = dgp_ref[rows, :] + k * pm + scale * q * pq - k * sb
        else:
            dq = dqp_ref[rows, :] + scale * (ea * sa_q + pq)
            dk = dkp_ref[rows, :] + (ea * sa_m + pm) + sb
            dG = dgp_ref[rows, :] + (kt * sa_m + k * pm) + (qt * sa_q + scale * q * pq) - k * sb
        if gate_cumsum:
            dg = _last_row_plus(dG, dgl) if r == ns - 1 else dG
        else:
            total = jnp.sum(dG, axis=0, keepdims=True)
            dg = later + total - jnp.cumsum(dG, axis=0) + dG + dgl
            later = later + total
        dg_ref[rows, :] = dg.astype(dg_ref.dtype)
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)


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
              interpret: bool, split: bool = False, bf16_dots: bool = False,
              gate_cumsum: bool = False, segments=None, compact_offdiag: bool = False,
              unbounded: bool = False, state_block_v: int | None = None,
              _ablate: tuple[str, ...] = (), _params=None):
    """Intra-chunk gradients, one program per (batch, head, chunk).

    Args: forward inputs (as intra_fwd, token-major); do [B, T, H, V]; du [B, H, T, V] fp32
      (state_bwd);
      h [B, H, NT, V, K] (state_fwd: transposed state entering each chunk); dh [B, H, NT, V, K]
      (state_bwd: transposed grad of the state after each chunk); w [B, H, T, K], u [B, H, T, V]
      (intra_fwd, as the state pass used them); A, M [B, H, T, C] fp32 (intra_fwd save_solve).
    Returns (token-major): dq, dk [B, T, H, K] (q's dtype), dv [B, T, H, V] (v's dtype),
      dg [B, T, H, K] fp32, dbeta [B, T, H] fp32.
    split: run it as two kernels (intra_bwd_split) instead of one: fewer live values per kernel
      for ~2.7 GB more HBM traffic at 8x4096x16, K = V = 128; the same dots in the same order.
    bf16_dots: bf16 inputs only: the mm-precision dots (state products, dX, dY, dA, off-diagonal
      score tiles) take bf16 operands (BF16_OPERANDS, as fla) instead of fp32 operands at TF32; the
      exact dots stay bf16x3 (ops.KernelOptions.bf16_intra_dots).
    gate_cumsum: g is the chunk-local cumsum G (as intra_fwd's), and the returned dg is per row
      BEFORE the reverse cumsum (dG with dG_last added on each chunk's last row): the caller applies
      common.chunk_cumsum(dg, C, reverse=True) or its Pallas form cumsum.chunk_cumsum
      (ops.KernelOptions.xla_gate_cumsum, pallas_cumsum).
    segments: None or rel [B, T] int32 as intra_fwd's (the forward must have used the same): the
      forward's document masks applied in the chain rule (common.Segments).
    compact_offdiag: the score-tile backward row block by row block on ref slices, without the
      masked 3/4-zero dots (_intra_bwd_b_compact_kernel; ops.KernelOptions.compact_offdiag_bwd).
      It needs dM, dAqk and G in refs, so it runs the split kernels (implies split=True).
    unbounded: g has no lower bound (any g <= 0): the compact kernel's diagonal tiles use the exact
      elementwise form (_own_block_bwd). Needs compact_offdiag=True and gate_cumsum=True (the
      tested combination); False: the bounded kernels, unchanged.
    state_block_v: None, or BV > 0: kernel a of the split backward forms the state products over
      V blocks of min(BV, V) columns (intra_bwd_a; ops.KernelOptions.tile_state_bwd); it exists
      only in the split kernels, so it implies split=True.
    _ablate: PRIVATE profiling option (static; results WRONG, timing only): names from
      common.BWD_ABLATIONS whose part of the kernel body is replaced by a cheap stand-in.
    _params: PRIVATE profiling option: Triton compiler params (default common.INTRA_PARAMS).
    Raises: ValueError for an unknown _ablate name, any _ablate with split / compact_offdiag /
      state_block_v (kernel a's ablations: intra_bwd_a), unbounded without compact_offdiag and
      gate_cumsum, or a bad state_block_v.
    """
    ablate = cm.check_ablate(_ablate, cm.BWD_ABLATIONS, "_ablate")
    if unbounded and not (compact_offdiag and gate_cumsum):
        raise ValueError(f"{unbounded=} runs only in the compact score-tile backward with the XLA "
                         f"gate cumsum; got {compact_offdiag=}, {gate_cumsum=}")
    if split or compact_offdiag or state_block_v is not None:
        if ablate:
            raise ValueError(f"{_ablate=} applies to the fused kernel only (split=False)")
        return intra_bwd_split(q, k, v, g, beta, do, du, h, dh, w, u, A, M, scale=scale,
                               chunk_size=chunk_size, interpret=interpret, bf16_dots=bf16_dots,
                               gate_cumsum=gate_cumsum, segments=segments,
                               compact_offdiag=compact_offdiag, unbounded=unbounded,
                               state_block_v=state_block_v, _params=_params)
    if bf16_dots and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16):
        ablate = ablate | {"bf16_dots"}          # the same code path as the timing ablation
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    sp = cm.chunk_specs(C, K, V)
    ik, iv, ib, tv, ts, tk, ta = sp.ik, sp.iv, sp.ib, sp.tv, sp.ts, sp.tk, sp.ta
    segmented = segments is not None
    if segmented and "compute" in ablate:
        raise ValueError(f"{_ablate=}: the 'compute' ablation does not take segments")
    kernel = functools.partial(_intra_bwd_kernel, scale=scale, dtype=q.dtype, ablate=ablate,
                               gate_cumsum=gate_cumsum, segmented=segmented)
    return pl.pallas_call(
        kernel, grid=(B, H, NT),
        in_specs=[ik, ik, iv, ik, ib, iv, tv, ts, ts, tk, tv, ta, ta]
                 + ([cm.seg_spec(C)] if segmented else []),
        out_specs=[ik, ik, iv, ik, ib],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), F32),
                   jax.ShapeDtypeStruct((B, T, H), F32)],
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_bwd",
    )(q, k, v, g, beta, do, du, h, dh, w, u, A, M, *([segments] if segmented else []))


def check_state_block_v(state_block_v, V: int) -> int | None:
    """The V block of kernel a's tiled state products for head dim V: min(state_block_v, V), or
    None for the whole-state form (state_block_v None). Raises ValueError unless state_block_v is
    None or a positive int whose min with V divides V."""
    if state_block_v is None:
        return None
    if not isinstance(state_block_v, int) or state_block_v <= 0 or V % min(state_block_v, V):
        raise ValueError(f"state_block_v must be None or a positive int whose min with V = {V} "
                         f"divides V; got {state_block_v=}")
    return min(state_block_v, V)


def intra_bwd_a(q, k, v, g, beta, do, du, h, dh, w, u, A, M, *, scale: float, chunk_size: int,
                interpret: bool, bf16_dots: bool = False, gate_cumsum: bool = False,
                segments=None, write_G: bool = False, state_block_v: int | None = None,
                _ablate: tuple[str, ...] = (), _params=None):
    """Kernel a of intra_bwd_split ("kda_intra_bwd_a"), one program per (batch, head, chunk): the
    state products, the W / U and (I + L)^-1 backward (_state_solve_bwd).

    Args: as intra_bwd (forward inputs token-major; du [B, H, T, V] fp32; h, dh [B, H, NT, V, K];
      w [B, H, T, K], u [B, H, T, V]; A, M [B, H, T, C] fp32); bf16_dots, gate_cumsum, segments as
      intra_bwd; write_G: also write the chunk cumsum G (kernel b's compact form without
      gate_cumsum reads it).
    state_block_v: None: the state products on the whole [V, K] states (both live at once);
      BV > 0: over V blocks of min(BV, V) columns (_state_products_tiled; ops.KernelOptions.
      tile_state_bwd uses STATE_BLOCK_V): [BV, K] row slices of h, dh and column slices of do, du,
      u, v, dv, so that no whole state is live; same sums, the contraction over V split into
      blocks (equal up to fp32 rounding; bit-identical when BV >= V).
    _ablate: PRIVATE profiling option (timing only, results WRONG): names from A_ABLATIONS
      (common.BWD_ABLATIONS' pieces of this kernel: state_products, dXY, dA, dL, exact_dots,
      compute); "compute" takes no segments.
    _params: PRIVATE profiling option: Triton compiler params (default common.INTRA_PARAMS).
    Returns: dv [B, T, H, V] (v's dtype) and dbeta [B, T, H] fp32 (final, token-major); head-major
      fp32 partial dq, dk, dG [B, H, T, K], dG_last [B, H, NT, K], the score gradients dM, dAqk
      [B, H, T, C]; with write_G also G [B, H, T, K] fp32.
    Raises: ValueError for an unknown _ablate name, "compute" with segments, or a bad state_block_v.
    """
    ablate = cm.check_ablate(_ablate, A_ABLATIONS, "_ablate")
    if segments is not None and "compute" in ablate:
        raise ValueError(f"{_ablate=}: the 'compute' ablation does not take segments")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    bv = check_state_block_v(state_block_v, V)
    sp = cm.chunk_specs(C, K, V)
    ik, iv, ib, tv, ts, tk, ta, tg = sp.ik, sp.iv, sp.ib, sp.tv, sp.ts, sp.tk, sp.ta, sp.tg
    flags = cm.split_kernel_flags(q.dtype, bf16_dots=bf16_dots, gate_cumsum=gate_cumsum,
                         segmented=segments is not None, unbounded=False)
    return pl.pallas_call(
        functools.partial(_intra_bwd_a_kernel, scale=scale, dtype=q.dtype, flags=flags,
                          ablate=ablate, block_v=bv), grid=(B, H, NT),
        in_specs=[ik, ik, iv, ik, ib, iv, tv, ts, ts, tk, tv, ta, ta]
                 + ([cm.seg_spec(C)] if segments is not None else []),
        out_specs=[iv, ib, tk, tk, tk, tg, ta, ta] + ([tk] if write_G else []),
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                   jax.ShapeDtypeStruct((B, T, H), F32)]
                  + [jax.ShapeDtypeStruct((B, H, T, K), F32)] * 3
                  + [jax.ShapeDtypeStruct((B, H, NT, K), F32)]
                  + [jax.ShapeDtypeStruct((B, H, T, C), F32)] * 2
                  + ([jax.ShapeDtypeStruct((B, H, T, K), F32)] if write_G else []),
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_bwd_a",
    )(q, k, v, g, beta, do, du, h, dh, w, u, A, M, *([segments] if segments is not None else []))


def intra_bwd_b(q, k, g, dqp, dkp, dgp, dgl, dM, dAqk, *, scale: float, chunk_size: int,
                interpret: bool, bf16_dots: bool = False, gate_cumsum: bool = False,
                compact_offdiag: bool = False, unbounded: bool = False, g_head_major: bool = False,
                _params=None):
    """Kernel b of intra_bwd_split ("kda_intra_bwd_b"), one program per (batch, head, chunk): the
    anchored score-tile backward and the per-row dg.

    Args: q, k [B, T, H, K] (token-major forward inputs); g: the gate as kernel a read it
      ([B, T, H, K]: g, or its chunk cumsum G with gate_cumsum), or with g_head_major kernel a's
      G output [B, H, T, K] fp32 (write_G: compact_offdiag without gate_cumsum); dqp, dkp, dgp
      [B, H, T, K], dgl [B, H, NT, K], dM, dAqk [B, H, T, C] (kernel a's fp32 outputs).
      bf16_dots, gate_cumsum, compact_offdiag, unbounded as intra_bwd_split.
    Returns: dq, dk [B, T, H, K] (q's dtype), dg [B, T, H, K] fp32 (per row before the reverse
      cumsum with gate_cumsum; else final).
    Raises: ValueError for unbounded without compact_offdiag and gate_cumsum.
    """
    if unbounded and not (compact_offdiag and gate_cumsum):
        raise ValueError(f"{unbounded=} runs only in the compact score-tile backward with the XLA "
                         f"gate cumsum; got {compact_offdiag=}, {gate_cumsum=}")
    B, T, H, K = q.shape
    C = chunk_size
    sp = cm.chunk_specs(C, K, K)
    ik, tk, ta, tg = sp.ik, sp.tk, sp.ta, sp.tg
    flags = cm.split_kernel_flags(q.dtype, bf16_dots=bf16_dots, gate_cumsum=gate_cumsum, segmented=False,
                         unbounded=unbounded)
    kernel_b = _intra_bwd_b_compact_kernel if compact_offdiag else _intra_bwd_b_kernel
    return pl.pallas_call(
        functools.partial(kernel_b, scale=scale, dtype=q.dtype, flags=flags), grid=(B, H, T // C),
        in_specs=[ik, ik, tk if g_head_major else ik, tk, tk, tk, tg, ta, ta],
        out_specs=[ik, ik, ik],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K), F32)],
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_bwd_b",
    )(q, k, g, dqp, dkp, dgp, dgl, dM, dAqk)


def intra_bwd_split(q, k, v, g, beta, do, du, h, dh, w, u, A, M, *, scale: float, chunk_size: int,
                    interpret: bool, bf16_dots: bool = False, gate_cumsum: bool = False,
                    segments=None, compact_offdiag: bool = False, unbounded: bool = False,
                    state_block_v: int | None = None, _params=None):
    """intra_bwd as two kernels, each one program per (batch, head, chunk); same args and returns.

    Kernel a ("kda_intra_bwd_a", intra_bwd_a): the state products, the W / U and (I + L)^-1
    backward (_state_solve_bwd): writes dv, dbeta (final, token-major) and, head-major fp32, the
    partial dq, dk, dG [B, H, T, K], dG_last [B, H, NT, K] and the score gradients dM, dAqk
    [B, H, T, C]. Kernel b ("kda_intra_bwd_b", intra_bwd_b): the anchored score-tile backward
    (_score_bwd) and the reverse cumsum (or, with gate_cumsum, the per-row dg as intra_bwd's): dq,
    dk, dg. Round-3 lever 1 (kda_pallas_notes.md): the fused kernel keeps the [V, K] states and
    the score-tile values live at once; split, each body holds about half. With segments only
    kernel a reads them (dM and dAqk leave it masked).
    compact_offdiag: kernel b is _intra_bwd_b_compact_kernel (row-block slices of the refs, no
    3/4-zero masked dots); without gate_cumsum kernel a then also writes the chunk cumsum G
    [B, H, T, K] fp32 for it (32 KiB per chunk written and read).
    unbounded (needs compact_offdiag and gate_cumsum): kernel b's diagonal tiles are exact
    (_own_block_bwd); kernel a is unchanged (it needs no bound).
    state_block_v: kernel a's state products over V blocks (see intra_bwd_a); None: whole states.
    Raises: ValueError for unbounded without compact_offdiag and gate_cumsum, or a bad
      state_block_v.
    """
    if unbounded and not (compact_offdiag and gate_cumsum):
        raise ValueError(f"{unbounded=} runs only in the compact score-tile backward with the XLA "
                         f"gate cumsum; got {compact_offdiag=}, {gate_cumsum=}")
    write_G = compact_offdiag and not gate_cumsum
    dv, dbeta, dqp, dkp, dgp, dgl, dM, dAqk, *G = intra_bwd_a(
        q, k, v, g, beta, do, du, h, dh, w, u, A, M, scale=scale, chunk_size=chunk_size,
        interpret=interpret, bf16_dots=bf16_dots, gate_cumsum=gate_cumsum, segments=segments,
        write_G=write_G, state_block_v=state_block_v, _params=_params)
    dq, dk, dg = intra_bwd_b(q, k, G[0] if write_G else g, dqp, dkp, dgp, dgl, dM, dAqk,
                             scale=scale, chunk_size=chunk_size, interpret=interpret,
                             bf16_dots=bf16_dots, gate_cumsum=gate_cumsum,
                             compact_offdiag=compact_offdiag, unbounded=unbounded,
                             g_head_major=write_G, _params=_params)
    return dq, dk, dv, dg, dbeta
