"""The intra-chunk backward on Hopper (Mosaic GPU): solve_bwd (state products, W / U and solve
backward), then score_bwd (the score gradients; its own docstring).

solve_bwd: one warpgroup per (batch x head, chunk of 64 tokens), bounded or unbounded gates (it forms no
e^{anc - G}), packed documents optional (segments: a static option; without it the kernel traces
as before). The math, document selects and bf16 operand rounding of triton/intra_bwd.py's
solve_bwd, whose outputs score_bwd (below, or the Triton one) consumes. Per chunk, from the saved transposed states
St = S^T, dSt = dS^T [V, K] (bf16), dO [C, V], dU = dV' [C, V] and the forward's W, U, A, M:
  V' = U - W S;  dAqk = dO V'^T;  dKd = V' dS^T;  dQg = dO S^T;  dW = -dU S^T;  dX = A^T dW;
  dY = A^T dU;  dA = dW X^T + dU Y^T;  dL = -A^T dA A^T (strictly lower);  d e^{G_last} = colsum(St * dSt);
then the elementwise chain rule to the partial dq, dk, dG, dG_last, the final dv, dbeta and the
score gradients dM = beta dL, dAqk. Every product is a wgmma with bf16 operands and an fp32
accumulator; the two dL products take split-bf16 operands (hi + lo, three wgmma each, as the
Triton kernel's bf16x3 dots). The [C, K] work is a loop over halves of 64 columns (unrolled, it
overflowed the instruction cache), one [C, 64] product at a time, so that one warpgroup fits in 255
registers a thread.

I/O: every input but beta and the document masks (direct loads, each before the product it masks)
arrives by TMA in five phases (one barrier each): 0 the states and dO; 1 W and U; 2 dU (straight
into its operand) and A; 3 G, q and k; 4 v and M (into the states' SMEM, free by then). SMEM 224 KiB
at K = V = 128 (one CTA an SM; plgpu.RefUnion shares the staging buffers between phases).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu.common import (BF16, BT, CHUNK, COL, EXP_PARAMS, F32, HALF, HEAD_DIMS, ROW, WG,
                                                  Segments, along_rows, block_anchor, check_dtypes, check_qk,
                                                  check_shapes, interpret_params, iota, keep, load, operand,
                                                  own_anchors, segment_masks, splat, split_bf16, staging)


def _lower(n, strict=False):
    """The [n, n] lower-triangle mask (diagonal included unless strict), made where it is used (held
    across the kernel, two int32 iotas would take 64 registers a thread)."""
    r, c = iota((n, n), 0), iota((n, n), 1)
    return r > c if strict else r >= c


def _dl(dA, a_hi, a_lo, t_hi, t_lo, seg=None):
    """dL = -A^T dA A^T on the strict lower triangle (dA masked to rows >= cols first), both products
    with split-bf16 operands (hi hi + hi lo + lo hi); t_hi, t_lo: two free [C, C] operand buffers;
    seg: Segments or None (documents: dL on same-document pairs only, in the same select; its rel
    vectors are loaded before the products)."""
    rel = None if seg is None else (seg.vec(0, ROW), seg.vec(1, COL))
    split_bf16(jnp.where(_lower(dA.shape[0]), dA, 0.0), t_hi, t_lo)
    plgpu.commit_smem()

    def r_dot(acc):                                       # A^T dA
        plgpu.wgmma(acc, a_hi.T, t_hi)
        plgpu.wgmma(acc, a_hi.T, t_lo)
        plgpu.wgmma(acc, a_lo.T, t_hi)
        return acc[...]
    r = pl.run_scoped(r_dot, plgpu.ACC(dA.shape, F32))
    plgpu.commit_smem()                                   # every warp's reads of t_hi, t_lo are done
    split_bf16(r, t_hi, t_lo)
    plgpu.commit_smem()

    def l_dot(acc):                                       # (A^T dA) A^T
        plgpu.wgmma(acc, t_hi, a_hi.T)
        plgpu.wgmma(acc, t_hi, a_lo.T)
        plgpu.wgmma(acc, t_lo, a_hi.T)
        return acc[...]
    support = _lower(dA.shape[0], strict=True)
    support = support if seg is None else support & seg.same(*rel)
    return jnp.where(support, -pl.run_scoped(l_dot, plgpu.ACC(dA.shape, F32)), 0.0)


def _check(q, k, v, G, beta, do, du, h, dh, w, u, A, M):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"K = {K} and V = {V} must be in {HEAD_DIMS} (wgmma tiles of 64 columns)")
    check_dtypes(dict(q=q, k=k, v=v, do=do, du=du, h=h, dh=dh, w=w, u=u), BF16)
    check_dtypes(dict(G=G, A=A, M=M), F32)
    if not jnp.issubdtype(beta.dtype, jnp.floating):
        raise ValueError(f"beta must be a float array; got {beta.dtype}")
    NT, C = T // CHUNK, CHUNK
    want = dict(k=(B, T, H, K), v=(B, T, H, V), G=(B, T, H, K), beta=(B, T, H), do=(B, T, H, V),
                du=(B, H, T, V), h=(B, H, NT, V, K), dh=(B, H, NT, V, K), w=(B, H, T, K),
                u=(B, H, T, V), A=(B, H, T, C), M=(B, H, T, C))
    check_shapes(dict(k=k, v=v, G=G, beta=beta, do=do, du=du, h=h, dh=dh, w=w, u=u, A=A, M=M), want,
                 f"q {q.shape} (B, T, H, K) and v's V = {V}")
    return B, T, H, K, V, NT


def solve_bwd(q, k, v, G, beta, do, du, h, dh, w, u, A, M, *, scale: float, segments=None,
              interpret: bool | plgpu.InterpretGPUParams = False):
    """The state products and the W / U / (I + L)^-1 backward on Hopper (module docstring); chunk 64.

    Args:
      q, k: [B, T, H, K] bf16; v: [B, T, H, V] bf16; G: [B, T, H, K] fp32, the chunk-local inclusive
        cumsum of g (nats); beta: [B, T, H] float; do: [B, T, H, V] bf16 (token-major).
      du: [B, H, T, V] bf16 (dV' of the reverse state pass); h, dh: [B, H, T / 64, V, K] bf16, the
        transposed state entering each chunk and the transposed gradient of the state after it.
      w: [B, H, T, K] bf16, u: [B, H, T, V] bf16 (the forward's W, U); A, M: [B, H, T, 64] fp32.
      scale: the query scale; segments: None or rel [B, T] int32 (the forward's): packed documents,
        the selects of triton/intra_bwd.py's solve_bwd (dQg, X and dX on the rows of the incoming
        state's document, dKd on the last document's, d e^{G_last} only without a start, dAqk and
        dL on same-document pairs); None traces the dense kernel unchanged; interpret: as state_fwd.
    Returns (as triton.intra_bwd.solve_bwd): dv [B, T, H, V] bf16 and dbeta [B, T, H] fp32 (final);
      head-major fp32 partial dq, dk, dG [B, H, T, K], dG_last [B, H, T / 64, K] and the score
      gradients dM, dAqk [B, H, T, 64].
    Raises: ValueError for T not a multiple of 64, K or V not in HEAD_DIMS, wrong dtypes or shapes.
    """
    B, T, H, K, V, NT = _check(q, k, v, G, beta, do, du, h, dh, w, u, A, M)
    segmented = segments is not None
    if segmented:
        check_shapes(dict(segments=segments), dict(segments=(B, T)), f"q {q.shape} (B, T, H, K)")
    C, KH, BH = CHUNK, K // HALF, B * H

    def body(q_ref, k_ref, v_ref, G_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref, w_ref, u_ref, A_ref,
             M_ref, *rest):
        seg_ref, rest = (rest[0], rest[1:]) if segmented else (None, rest)
        (dv_ref, dbeta_ref, dq_ref, dk_ref, dg_ref, dgl_ref, dm_ref, daqk_ref,
         w_s, du_s, vp_s, x_s, a_hi, a_lo, states, staged, *bars) = rest
        (h_s, dh_s, do_s), (t_hi, t_lo, v_in, m_in) = states
        (u_in,), (a_in,), (g_in, q_in, k_in) = staged
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        # documents: selects from the chunk's masks in HBM (no SMEM left at K = V = 128), each vector
        # loaded before the product it masks
        seg = None if seg_ref is None else Segments(seg_ref.at[b, c])
        halves = [pl.ds(kh * HALF, HALF) for kh in range(KH)]

        def fetch(phase, copies):         # phases 1-4; one barrier per phase, each used once per CTA
            for src, dst in copies:
                plgpu.copy_gmem_to_smem(src, dst, bars[phase])

        def arrived(phase):
            plgpu.barrier_wait(bars[phase])

        # phase 0: the states and dO (operands); phase 1: W and U
        for kh in range(KH):
            plgpu.copy_gmem_to_smem(h_ref.at[bh, c, :, halves[kh]], h_s.at[kh], bars[0])
            plgpu.copy_gmem_to_smem(dh_ref.at[bh, c, :, halves[kh]], dh_s.at[kh], bars[0])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, hh], do_s, bars[0])
        fetch(1, [(w_ref.at[bh, rows, halves[kh]], w_s.at[kh]) for kh in range(KH)] + [(u_ref.at[bh, rows], u_in)])
        # beta: one 256-byte read straight from HBM
        beta_c = load(beta_ref.at[bh, rows], ROW)[:, None]
        arrived(1)
        arrived(0)

        def vp_dot(acc):                                  # W S = sum over halves W_h (St_h)^T
            for kh in range(KH):
                plgpu.wgmma(acc, w_s.at[kh], h_s.at[kh].T)
            return acc[...]
        vp_s[...] = (load(u_in, smem=True) - pl.run_scoped(vp_dot, plgpu.ACC((C, V), F32))).astype(BF16)
        plgpu.commit_smem()                               # also: every read of u_in is done

        # phase 2: dU (bf16, into its operand) and A (split into operands after dO V'^T)
        fetch(2, [(du_ref.at[bh, rows], du_s), (A_ref.at[bh, rows], a_in)])

        def daqk_dot(acc):                                # dO V'^T
            plgpu.wgmma(acc, do_s, vp_s.T)
            return acc[...]
        if seg is None:
            daqk_ref.at[bh, rows][...] = jnp.where(_lower(C), pl.run_scoped(daqk_dot, plgpu.ACC((C, C), F32)), 0.0)
        else:                                             # the rel vectors' loads before the product
            rel = (seg.vec(0, ROW), seg.vec(1, COL))
            daqk = pl.run_scoped(daqk_dot, plgpu.ACC((C, C), F32))
            daqk_ref.at[bh, rows][...] = jnp.where(_lower(C) & seg.same(*rel), daqk, 0.0)
        arrived(2)
        split_bf16(load(a_in), a_hi, a_lo)
        plgpu.commit_smem()                               # also: every read of a_in is done

        # phase 3: G, q, k
        fetch(3, [(G_ref.at[b, rows, hh, halves[kh]], g_in.at[kh]) for kh in range(KH)]
              + [(q_ref.at[b, rows, hh, halves[kh]], q_in.at[kh]) for kh in range(KH)]
              + [(k_ref.at[b, rows, hh, halves[kh]], k_in.at[kh]) for kh in range(KH)])
        arrived(3)

        def half_step(kh, dbeta):                          # one K half (a loop: half the code)
            cols = pl.ds(kh * HALF, HALF)
            # documents: rel, in_last, carry along the rows (2 registers each), loaded before dU S^T
            rel_r, last_r, carry_r = (None,) * 3 if seg is None else (seg.vec(i, ROW) for i in (0, 2, 3))
            # one [C, HALF] product at a time, consumed at once (one warpgroup: 255 registers a thread)
            def dw_dot(acc):                              # dU S^T on this half
                plgpu.wgmma(acc, du_s, h_s.at[kh])
                return acc[...]
            # w_s's half kh is free: every warp's wgmma reading it (V') finished before the commit
            # that followed vp_s's store
            w_s.at[kh][...] = (-pl.run_scoped(dw_dot, plgpu.ACC((C, HALF), F32))).astype(BF16)
            eg = jnp.exp(load(g_in.at[kh]))
            x_s.at[kh][...] = keep(beta_c * eg * load(k_in.at[kh], smem=True), seg, "row_in", (C, HALF), rel_r).astype(BF16)
            plgpu.commit_smem()

            def dx_dot(acc):                              # A^T dW on this half
                plgpu.wgmma(acc, a_hi.T, w_s.at[kh])
                return acc[...]
            egdx = eg * keep(pl.run_scoped(dx_dot, plgpu.ACC((C, HALF), F32)), seg, "row_in", (C, HALF), rel_r)
            dk_x = beta_c * egdx                          # dX's share of dk
            kdx = load(k_in.at[kh], smem=True) * egdx
            dbeta = dbeta + jnp.sum(kdx, axis=1)
            dG = beta_c * kdx                             # and of dG

            def qg_dot(acc):                              # dO S^T on this half
                plgpu.wgmma(acc, do_s, h_s.at[kh])
                return acc[...]
            dq = scale * eg * keep(pl.run_scoped(qg_dot, plgpu.ACC((C, HALF), F32)), seg, "row_in", (C, HALF), rel_r)
            dq_ref.at[bh, rows, cols][...] = dq
            dG = dG + load(q_in.at[kh], smem=True) * dq

            def kd_dot(acc):                              # V' dS^T on this half
                plgpu.wgmma(acc, vp_s, dh_s.at[kh])
                return acc[...]
            g_h = load(g_in.at[kh])
            gl_v = jnp.sum(jnp.where(iota((C, HALF), 0) == C - 1, g_h, 0.0), axis=0)   # G's last row
            dk = jnp.exp(gl_v[None, :] - g_h) * keep(pl.run_scoped(kd_dot, plgpu.ACC((C, HALF), F32)), seg, "in_last",
                                                     (C, HALF), last_r)
            t = load(k_in.at[kh], smem=True) * dk
            dg_ref.at[bh, rows, cols][...] = dG - t
            dk_ref.at[bh, rows, cols][...] = dk + dk_x
            # colsum(St * dSt), zero when the chunk holds a start (carry: the same along the V rows)
            sts = sum(jnp.sum(keep(load(h_s.at[kh, pl.ds(i * C, C)], smem=True)
                                   * load(dh_s.at[kh, pl.ds(i * C, C)], smem=True), seg, "carry_rows", (C, HALF),
                                   carry_r), axis=0) for i in range(V // C))
            dgl_ref.at[bh, c, cols][...] = jnp.exp(gl_v) * sts + jnp.sum(t, axis=0)
            return dbeta
        dbeta = lax.fori_loop(0, KH, half_step, jnp.zeros((C,), F32))
        plgpu.commit_smem()                               # every read of h_s, dh_s, do_s is done

        # phase 4 (into the states' SMEM): v and M
        fetch(4, [(v_ref.at[b, rows, hh], v_in), (M_ref.at[bh, rows], m_in)])
        arrived(4)
        # the V side: Y = beta v into V''s buffer (its last wgmma reads finished before the commits above)
        vp_s[...] = (beta_c * load(v_in, smem=True)).astype(BF16)
        plgpu.commit_smem()

        def dy_da_dots(a_dy, a_da):                       # A^T dU; dW X^T + dU Y^T
            plgpu.wgmma(a_dy, a_hi.T, du_s)
            for kh in range(KH):
                plgpu.wgmma(a_da, w_s.at[kh], x_s.at[kh].T)
            plgpu.wgmma(a_da, du_s, vp_s.T)
            return a_dy[...], a_da[...]
        dy, dA = pl.run_scoped(dy_da_dots, plgpu.ACC((C, V), F32), plgpu.ACC((C, C), F32))
        dv_ref.at[b, rows, hh][...] = (beta_c * dy).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(load(v_in, smem=True) * dy, axis=1)

        dL = _dl(dA, a_hi, a_lo, t_hi, t_lo, seg)
        dbeta = dbeta + jnp.sum(dL * load(m_in), axis=1)
        dm_ref.at[bh, rows][...] = beta_c * dL
        dbeta_ref.at[bh, rows][...] = dbeta

    out_type = (jax.ShapeDtypeStruct((B, T, H, V), BF16), jax.ShapeDtypeStruct((BH, T), F32),
                *[jax.ShapeDtypeStruct((BH, T, K), F32)] * 3, jax.ShapeDtypeStruct((BH, NT, K), F32),
                *[jax.ShapeDtypeStruct((BH, T, C), F32)] * 2)
    # SMEM (K = V = 128): the operands 80 KiB; the states and dO (phase 0), later the dL operands, v
    # and M (phase 4), 80 KiB; the staged inputs of phases 1 / 2 / 3, 64 KiB at most.
    states = plgpu.RefUnion(
        (operand((KH, V, HALF)), operand((KH, V, HALF)), operand((C, V))),
        (operand((C, C)), operand((C, C)), operand((C, V)), staging((C, C), F32)))
    staged = plgpu.RefUnion(
        (operand((C, V)),),
        (staging((C, C), F32),),
        (staging((KH, C, HALF), F32), operand((KH, C, HALF)), operand((KH, C, HALF))))
    kernel = plgpu.kernel(
        body, out_type=out_type,
        scratch_types=[operand((KH, C, HALF)), operand((C, V)), operand((C, V)), operand((KH, C, HALF)),
                       operand((C, C)), operand((C, C)), states, staged,
                       *[plgpu.Barrier(num_arrivals=n) for n in (2 * KH + 1, KH + 1, 2, 3 * KH, 2)]],
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret),
        kernel_name="kda_intra_bwd_solve_mgpu")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    beta_hm = jnp.swapaxes(beta, 1, 2).reshape(BH, T).astype(F32)   # head-major rows: one direct read a chunk
    dv, dbeta, dq, dk, dg, dgl, dm, daqk = kernel(
        q, k, v, G, beta_hm, do, flat(du), flat(h), flat(dh), flat(w), flat(u), flat(A), flat(M),
        *([segment_masks(segments)] if segmented else []))
    hm = lambda x: x.reshape(B, H, *x.shape[1:])   # noqa: E731
    return (dv, jnp.swapaxes(dbeta.reshape(B, H, T), 1, 2), hm(dq), hm(dk), hm(dg), hm(dgl), hm(dm),
            hm(daqk))


NB = CHUNK // BT


def _pow2_scale(m):
    """For m >= 0 fp32 (an array): (2^-e, 2^e) with 2^e <= m < 2^(e + 1), exact powers of two built
    from m's exponent bits; e within [-126, 126]: where m is 0 or subnormal (2^126, 2^-126) (the
    products of such a chunk are at most ~1e-38 and flushed), where m >= 2^127, inf or NaN (2^-126,
    2^126) (inf and NaN stay in the products they enter)."""
    e = jnp.clip(lax.shift_right_logical(lax.bitcast_convert_type(m, jnp.int32), 23), 1, 253)
    as_f32 = lambda x: lax.bitcast_convert_type(lax.shift_left(x, 23), F32)   # noqa: E731
    return as_f32(254 - e), as_f32(e)


def score_bwd(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk, *, scale: float, centre: int,
              interpret: bool | plgpu.InterpretGPUParams = False):
    """The score-tile backward on Hopper: triton/intra_bwd.py's score_bwd for bounded gates; chunk 64.

    With the 16-row blocks r, their causal anchors anc_r (G before block r, 0 for r = 0) and the
    centre exponent s (plan.centre_exponent), the score gradients dM (strictly lower) and dAqk
    (lower) go through the anchored factors of the forward (intra_fwd.py):
      da_m = ea * sum_r rows_r(dM kb_r),  da_q = ea * sum_r rows_r(dAqk kb_r),
      sb   = eb * sum_r rows_r(dM^T ka_r + dAqk^T qa_r),
    kb_r = k e^{anc_r - G} 2^-s on the rows of blocks <= r, ka_r, qa_r = (k, scale q) e^{G - anc_r} 2^s
    on the rows of blocks >= r (selects on the exp argument: the other rows would overflow, and dM,
    dAqk are zero against them; e^{G - anc_r} 2^s as two half-exponent factors, since e^{G - anc_r}
    alone underflows fp32 on later rows where the product is still normal), ea = e^{G - anc} 2^s and
    eb = e^{anc - G} 2^-s with each row's own anchor; then dq = dqp + scale da_q,
    dk = dkp + da_m + sb, dG = dgp + k da_m + scale q da_q - k sb (+ dG_last on the chunk's last row).
    dAqk's diagonal stays out of the products: it adds scale dAqk_ii k_i to dq_i and dAqk_ii scale q_i
    to dk_i elementwise, and nothing to dG, where its two terms cancel exactly (through the products
    they left dG at the bound, a ~1% difference of its terms, 1 ulp of those terms off, and broke
    the op's loss-scale invariance test on the GPU, 2026-12-06).
    Every product is a wgmma [64, 64] x [64, 64] (one K half at a time) on split-bf16 operands (hi hi
    + lo hi + hi lo, as the Triton kernel's bf16x3 diagonal tiles; it runs bf16 off them). dM and dAqk
    are first scaled by 2^-e, e the exponent of the chunk's largest |entry| (exact), so that the
    products, their lo parts included (2^-9 of a term, times factors down to e^-40), are the same at
    any loss scale on GPUs, which flush subnormals. Packed documents need no select here: dM, dAqk
    are zero across documents.
    I/O: dM, dAqk by TMA (into the factors' SMEM); q, k, G one K half at a time by TMA (the next half
    after the last read of the current one) with G's anchor rows; the partials straight from HBM.
    SMEM 101 KiB at K = 128 (100 at K = 64): two CTAs an SM, one computing while the other waits on memory.

    Args:
      q, k: [B, T, H, K] bf16; G: [B, T, H, K] fp32, the chunk-local inclusive cumsum of g (nats);
      dqp, dkp, dgp: [B, H, T, K] fp32 (solve_bwd's partials); dgl: [B, H, T / 64, K] fp32;
      dM, dAqk: [B, H, T, 64] fp32 (solve_bwd's score gradients); scale: the query scale;
      centre: the forward's centre exponent s; interpret: as state_fwd.
    Returns: dq, dk [B, T, H, K] bf16; dG [B, T, H, K] fp32 per row (dG_last added on each chunk's
      last row), before the reverse cumsum (as triton.intra_bwd.score_bwd).
    Raises: ValueError for T not a multiple of 64, K not in HEAD_DIMS, wrong dtypes or shapes.
    """
    B, T, H, K = check_qk(q, k)
    NT, C, KH, BH = T // CHUNK, CHUNK, K // HALF, B * H
    check_dtypes(dict(G=G, dqp=dqp, dkp=dkp, dgp=dgp, dgl=dgl, dM=dM, dAqk=dAqk), F32)
    want = dict(k=(B, T, H, K), G=(B, T, H, K), dqp=(B, H, T, K), dkp=(B, H, T, K), dgp=(B, H, T, K), dgl=(B, H, NT, K),
                dM=(B, H, T, C), dAqk=(B, H, T, C))
    check_shapes(dict(k=k, G=G, dqp=dqp, dkp=dkp, dgp=dgp, dgl=dgl, dM=dM, dAqk=dAqk), want, f"q {q.shape} (B, T, H, K)")
    c_hi, c_lo = 2.0 ** int(centre), 2.0 ** -int(centre)
    c_a, c_b = 2.0 ** (int(centre) // 2), 2.0 ** (int(centre) - int(centre) // 2)    # c_a c_b = 2^s

    def body(q_ref, k_ref, G_ref, dqp_ref, dkp_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref, dq_ref, dk_ref, dg_ref,
             q_h, k_h, g_h, anc_s, diag_s, dm_hi, dm_lo, dq_hi, dq_lo, shared, bar_s, bars_h):
        (dm_in, daqk_in), (fa_hi, fa_lo, fb_hi, fb_lo) = shared
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)

        def fetch_half(kh):                  # q, k, G of K half kh (and the anchor rows with half 0)
            for src, dst in ((q_ref, q_h), (k_ref, k_h), (G_ref, g_h)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, hh, pl.ds(kh * HALF, HALF)], dst, bars_h.at[kh])

        plgpu.copy_gmem_to_smem(dm_ref.at[bh, rows], dm_in, bar_s)
        plgpu.copy_gmem_to_smem(daqk_ref.at[bh, rows], daqk_in, bar_s)
        for r in range(NB - 1):              # G's rows 15, 31, 47: the anchors of blocks 1 .. 3
            plgpu.copy_gmem_to_smem(G_ref.at[b, c * C + (r + 1) * BT - 1, hh], anc_s.at[r], bar_s)
        fetch_half(0)
        plgpu.barrier_wait(bar_s)
        dm, da = load(dm_in), load(daqk_in)
        # dAqk's diagonal enters dq, dk alone (elementwise, exact): its two terms of dG cancel exactly
        # (scale q_i dAqk_ii k_i - k_i dAqk_ii scale q_i), and formed by products they would not
        diagonal = iota((C, C), 0) == iota((C, C), 1)
        diag_s[...] = jnp.sum(jnp.where(diagonal, da, 0.0), axis=1)
        da = jnp.where(diagonal, 0.0, da)
        mx = jnp.max(jnp.maximum(jnp.max(jnp.abs(dm), axis=1), jnp.max(jnp.abs(da), axis=1)), axis=0)
        inv = _pow2_scale(splat(mx, (C, C)))[0]
        split_bf16(dm * inv, dm_hi, dm_lo)
        split_bf16(da * inv, dq_hi, dq_lo)
        plgpu.commit_smem()                  # every read of dm_in, daqk_in (the factors' memory) done

        def x3(acc, a_hi, a_lo, b_hi, b_lo):  # a b on split operands: hi hi + lo hi + hi lo
            plgpu.wgmma(acc, a_hi, b_hi)
            plgpu.wgmma(acc, a_lo, b_hi)
            plgpu.wgmma(acc, a_hi, b_lo)

        def half_step(kh, carry):
            cols = pl.ds(kh * HALF, HALF)
            plgpu.barrier_wait(bars_h.at[kh])

            def block_step(r, acc):          # row block r's factors, then its rows of the products
                da_m, da_q, sb = acc
                rb = iota((C, HALF), 0) >> 4
                anc = block_anchor(anc_s, r, cols)[None, :]
                g = load(g_h)
                split_bf16(load(k_h, smem=True) * (jnp.exp(jnp.where(rb <= r, anc - g, 0.0)) * c_lo), fa_hi, fa_lo)
                plgpu.commit_smem()

                def row_dots(a_m, a_q):      # dM kb_r, dAqk kb_r
                    x3(a_m, dm_hi, dm_lo, fa_hi, fa_lo)
                    x3(a_q, dq_hi, dq_lo, fa_hi, fa_lo)
                    return a_m[...], a_q[...]
                p_m, p_q = pl.run_scoped(row_dots, plgpu.ACC((C, HALF), F32), plgpu.ACC((C, HALF), F32))
                own = (iota((C, HALF), 0) >> 4) == r
                da_m, da_q = jnp.where(own, p_m, da_m), jnp.where(own, p_q, da_q)
                plgpu.commit_smem()          # every warp's wgmma reads of fa are done
                eh = jnp.exp(jnp.where(rb >= r, 0.5 * (load(g_h) - anc), 0.0))
                ea_a, ea_b = eh * c_a, eh * c_b
                split_bf16(jnp.where(rb >= r, (load(k_h, smem=True) * ea_a) * ea_b, 0.0), fa_hi, fa_lo)
                split_bf16(jnp.where(rb >= r, (scale * load(q_h, smem=True) * ea_a) * ea_b, 0.0), fb_hi, fb_lo)
                plgpu.commit_smem()

                def col_dots(a_s):           # dM^T ka_r + dAqk^T qa_r
                    x3(a_s, dm_hi.T, dm_lo.T, fa_hi, fa_lo)
                    x3(a_s, dq_hi.T, dq_lo.T, fb_hi, fb_lo)
                    return a_s[...]
                p_s = pl.run_scoped(col_dots, plgpu.ACC((C, HALF), F32))
                sb = jnp.where((iota((C, HALF), 0) >> 4) == r, p_s, sb)
                plgpu.commit_smem()          # every warp's wgmma reads of fa, fb are done
                return da_m, da_q, sb

            zero = plgpu.layout_cast(jnp.zeros((C, HALF), F32), WG)
            da_m, da_q, sb = lax.fori_loop(0, NB, block_step, (zero, zero, zero))
            # each row's own anchor: ea, eb; the cotangents' scale undone
            g = load(g_h)
            anc = own_anchors(anc_s, cols, (C, HALF))
            # the scale last: e^{G - anc} 2^s times it could be subnormal (flushed) at small loss scales
            un = _pow2_scale(splat(mx, (C, HALF)))[1]
            ea = jnp.exp(g - anc) * c_hi
            da_m, da_q = (da_m * ea) * un, (da_q * ea) * un
            sb = (sb * (jnp.exp(anc - g) * c_lo)) * un
            kf, qs = load(k_h, smem=True), scale * load(q_h, smem=True)
            d = along_rows(load(diag_s, ROW), (C, HALF))
            plgpu.commit_smem()              # every read of this half's q, k, G is done: fetch the next

            @pl.when(kh + 1 < KH)
            def _():
                fetch_half(kh + 1)
            dG = load(dgp_ref.at[bh, rows, cols]) + kf * (da_m - sb) + qs * da_q
            dq_ref.at[b, rows, hh, cols][...] = (load(dqp_ref.at[bh, rows, cols]) + scale * (da_q + d * kf)).astype(
                dq_ref.dtype)
            dk_ref.at[b, rows, hh, cols][...] = (load(dkp_ref.at[bh, rows, cols]) + da_m + sb + d * qs).astype(
                dk_ref.dtype)
            dg_ref.at[b, rows, hh, cols][...] = jnp.where(iota((C, HALF), 0) == C - 1,
                                                          dG + load(dgl_ref.at[bh, c, cols], COL)[None, :], dG)
            return carry

        lax.fori_loop(0, KH, half_step, 0)

    tok = jax.ShapeDtypeStruct((B, T, H, K), BF16)
    # SMEM (K = 128): one K half of q, k, G 32 KiB; dM, dAqk split 32 KiB; dM, dAqk staged, later
    # the factors, 32 KiB; the anchor rows 1.5 KiB; the reduction scratch 2 KiB (101 KiB measured)
    shared = plgpu.RefUnion((staging((C, C), F32), staging((C, C), F32)), tuple(operand((C, HALF)) for _ in range(4)))
    kernel = plgpu.kernel(
        body, out_type=(tok, tok, jax.ShapeDtypeStruct((B, T, H, K), F32)),
        scratch_types=[operand((C, HALF)), operand((C, HALF)), staging((C, HALF), F32), plgpu.SMEM((NB - 1, K), F32),
                       plgpu.SMEM((C,), F32), *[operand((C, C))] * 4, shared, plgpu.Barrier(num_arrivals=2 + NB - 1),
                       plgpu.Barrier(num_arrivals=3, num_barriers=KH)],
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret), kernel_name="kda_intra_bwd_scores_mgpu")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731
    return kernel(q, k, G, flat(dqp), flat(dkp), flat(dgp), flat(dgl), flat(dM), flat(dAqk))
