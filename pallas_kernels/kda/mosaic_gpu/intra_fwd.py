"""Intra-chunk forward on Hopper (Mosaic GPU): anchored scores, the solve, W and U in one kernel.

One warpgroup per (batch x head, chunk of 64 tokens); bounded gates only (every g >= lower_bound >=
-5). The math of the two Triton kernels (triton/intra_fwd.py) with their bf16 operands: with the
16-row blocks r, anchors anc_0 = 0, anc_r = G_{16 r - 1} and the centre exponent s (plan.centre_exponent),
  M    = rows of block r of (k ea) (k eb_r)^T, strictly lower;   ea = e^{G - anc(row)} 2^s
  Aqk  = rows of block r of (scale q ea) (k eb_r)^T, lower;      eb_r = e^{anc_r - G} 2^-s (rows <= r)
  A    = (I + beta M)^-1 (recursive blocked substitution, D <- D - (D Loff_s) D, s = 2 .. 32),
  W = A (beta e^G k) (stored bf16),  U = A (beta v),  qg = scale q e^G,  kd = k e^{G_last - G},
  gl = e^{G_last}.
Packed documents (segments: rel, a static option; without it the kernel traces as before): the
selects of triton/intra_fwd.py, M and Aqk on same-document pairs (rel along the rows and the
columns of the [64, 64] accumulator, as the causal iota mask), qg and X on rows of the incoming
state's document, kd on the last document's rows, gl zero when the chunk holds a start.
Each score product is a wgmma [64, K] x [K, 64] (both factors within e^{+-40} on the tile), each
solve product [64, 64] x [64, 64], W / U [64, 64] x [64, 64] per half; the four row blocks and the
five solve levels are loops (one traced body each, for the instruction cache), one pair of
accumulators live at a time.
I/O: q, k, G by TMA per K half, G's anchor rows and G_last by TMA (with documents: the chunk's masks
too), v by TMA during the solve, beta straight from HBM; outputs written from registers. SMEM 98 KiB
(99 with documents) at K = V = 128 (two CTAs an SM;
plgpu.RefUnion shares q with the column operand and X, G and the row operands with the solve's
buffers and v).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu.common import (BF16, BT, CHUNK, COL, EXP_PARAMS, F32, HALF, HEAD_DIMS, ROW, WG,
                                                  Segments, block_anchor, check_qk, check_shapes, fetch_segments,
                                                  interpret_params, iota, keep, load, operand, own_anchors,
                                                  segment_masks, segments_smem, staging)

NB = CHUNK // BT
LEVELS = 5                 # solve merges: blocks of 2 -> 4 -> .. -> 64


def intra_fwd(q, k, v, G, beta, *, scale: float, centre: int, save_solve: bool = False, segments=None,
              interpret: bool | plgpu.InterpretGPUParams = False):
    """The chunk factors of the forward on Hopper (module docstring); chunk 64, bounded gates.

    Args:
      q, k: [B, T, H, K] bf16; v: [B, T, H, V] bf16 (K, V in HEAD_DIMS); G: [B, T, H, K] fp32, the
        chunk-local inclusive cumsum of g (nats); beta: [B, T, H] float; scale: the query scale;
      centre: the centre exponent s of the diagonal tiles' factors (plan.centre_exponent);
      save_solve: also return A and M (the backward's); segments: None or rel [B, T] int32
        (api.document_offsets): packed documents, the selects of triton/intra_fwd.py (Segments: M
        and Aqk keep same-document pairs, qg and X the rows of the incoming state's document, kd
        the rows of the last document, gl only chunks without a start); None traces the dense
        kernel unchanged; interpret: as state_fwd.
    Returns: qg, kd [B, H, T, K] bf16; w [B, H, T, K] bf16; u [B, H, T, V] bf16 (as fla, jla); aqk [B, H, T, 64]
      bf16 (lower-triangular per chunk); gl [B, H, T / 64, K] fp32 (e^{G_last}); with save_solve
      also A = (I + beta M)^-1 and M (strictly lower, beta-free), [B, H, T, 64] fp32.
    Raises: ValueError for T not a multiple of 64, K or V not in HEAD_DIMS, q / k / v not bf16, G
      not fp32, beta not a float array, or shapes that do not match.
    """
    segmented = segments is not None
    B, T, H, K = check_qk(q, k)
    if G.dtype != F32:
        raise ValueError(f"G must be fp32 (the chunk cumsum of g); got {G.dtype=}")
    if not jnp.issubdtype(beta.dtype, jnp.floating):
        raise ValueError(f"beta must be a float array; got {beta.dtype=}")
    if v.dtype != BF16 or v.ndim != 4 or v.shape[:3] != q.shape[:3] or v.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"v must be bf16 [B, T, H, V] with (B, T, H) = {q.shape[:3]} and V in {HEAD_DIMS}; "
                         f"got {v.dtype=} {v.shape=}")
    check_shapes(dict(k=k, G=G, beta=beta) | (dict(segments=segments) if segmented else {}),
                 dict(k=(B, T, H, K), G=(B, T, H, K), beta=(B, T, H), segments=(B, T)), f"q {q.shape} (B, T, H, K)")
    C, KH, BH, NT = CHUNK, K // HALF, B * H, T // CHUNK
    V = v.shape[-1]
    VH = V // HALF
    c_hi, c_lo = 2.0 ** int(centre), 2.0 ** -int(centre)

    def body(q_ref, k_ref, v_ref, G_ref, beta_ref, *rest):
        seg_ref, rest = (rest[0], rest[1:]) if segmented else (None, rest)
        qg_ref, kd_ref, w_ref, u_ref, aqk_ref, gl_ref, *rest = rest
        a_ref, m_ref = (rest[0], rest[1]) if save_solve else (None, None)
        seg_s, rest = (rest[-1], rest[:-1]) if segmented else (None, rest)
        k_in, anc_s, first, second, bar, bar_v = rest[-6:]
        q_in, bk_s = first                   # q, then the column operand, then X (x_s = bk_s)
        x_s = bk_s
        (g_in, ak_s, aq_s), (d_s, l_s, n_s, v_s) = second     # the solve's operands and v after the scores
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        seg = None if seg_ref is None else Segments(seg_s)     # documents: selects
        halves = [pl.ds(kh * HALF, HALF) for kh in range(KH)]
        if segmented:
            fetch_segments(seg_ref, seg_s, b, c, bar)
        for kh in range(KH):
            for src, dst in ((q_ref, q_in), (k_ref, k_in), (G_ref, g_in)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, hh, halves[kh]], dst.at[kh], bar)
        for r in range(NB):                  # G's rows 15, 31, 47 (the anchors) and 63 (G_last)
            plgpu.copy_gmem_to_smem(G_ref.at[b, c * C + (r + 1) * BT - 1, hh], anc_s.at[r], bar)
        beta_c = load(beta_ref.at[bh, rows], ROW)[:, None]            # one 256-byte read
        rb_k = iota((C, HALF), 0) >> 4              # row block (BT = 16)

        plgpu.barrier_wait(bar)
        # the row operands (k ea, scale q ea) and the elementwise outputs, per K half
        for kh in range(KH):
            g = load(g_in.at[kh])
            kf, qf = load(k_in.at[kh], smem=True), load(q_in.at[kh], smem=True)
            ea = jnp.exp(g - own_anchors(anc_s, halves[kh], g.shape)) * c_hi
            ak_s.at[kh][...] = (kf * ea).astype(BF16)
            aq_s.at[kh][...] = (scale * qf * ea).astype(BF16)
            gl = load(anc_s.at[NB - 1, halves[kh]], COL)
            qg_ref.at[bh, rows, halves[kh]][...] = keep(scale * qf * jnp.exp(g), seg, "row_in", g.shape).astype(BF16)
            kd_ref.at[bh, rows, halves[kh]][...] = keep(kf * jnp.exp(gl[None, :] - g), seg, "in_last",
                                                        g.shape).astype(BF16)
            gl_ref.at[bh, c, halves[kh]][...] = keep(jnp.exp(gl), seg, "carry")
        plgpu.commit_smem()                  # ak, aq written; every read of q_in (bk_s's memory) done

        rb = iota((C, C), 0) >> 4

        def score_step(r, carry):            # row block r: its column operand, then M and Aqk's rows
            m, aqk = carry
            for kh in range(KH):
                g = load(g_in.at[kh])
                eb = jnp.exp(jnp.where(rb_k <= r, block_anchor(anc_s, r, halves[kh])[None, :] - g, 0.0)) * c_lo
                bk_s.at[kh][...] = (load(k_in.at[kh], smem=True) * eb).astype(BF16)
            plgpu.commit_smem()

            def dots(acc_m, acc_q):
                for kh in range(KH):
                    plgpu.wgmma(acc_m, ak_s.at[kh], bk_s.at[kh].T)
                for kh in range(KH):
                    plgpu.wgmma(acc_q, aq_s.at[kh], bk_s.at[kh].T)
                return acc_m[...], acc_q[...]
            s_m, s_q = pl.run_scoped(dots, plgpu.ACC((C, C), F32), plgpu.ACC((C, C), F32))
            plgpu.commit_smem()              # every warp's wgmma reads of bk_s are done (one buffer)
            return jnp.where(rb == r, s_m, m), jnp.where(rb == r, s_q, aqk)

        zero = plgpu.layout_cast(jnp.zeros((C, C), F32), WG)
        m, aqk = lax.fori_loop(0, NB, score_step, (zero, zero))
        # (the last step's fence: the solve's buffers, g_in / ak_s / aq_s's memory, are free)
        for kh in range(KH):                 # X = beta e^G k into the column operand's memory
            x_s.at[kh][...] = keep(beta_c * jnp.exp(load(g_in.at[kh])) * load(k_in.at[kh], smem=True), seg, "row_in",
                                   (C, HALF)).astype(BF16)
        plgpu.commit_smem()                  # every read of g_in done; X fenced
        for vh in range(VH):                 # v into the second union while the solve runs
            plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hh, pl.ds(vh * HALF, HALF)], v_s.at[vh], bar_v)
        ri, ci = iota((C, C), 0), iota((C, C), 1)
        if seg is None:
            aqk_ref.at[bh, rows][...] = jnp.where(ri >= ci, aqk, 0.0).astype(BF16)
            m = jnp.where(ri > ci, m, 0.0)
        else:                                # same-document pairs only (one mask for both)
            same = seg.same()
            aqk_ref.at[bh, rows][...] = jnp.where((ri >= ci) & same, aqk, 0.0).astype(BF16)
            m = jnp.where((ri > ci) & same, m, 0.0)
        if save_solve:
            m_ref.at[bh, rows][...] = m
        L = beta_c * m

        # (I + L)^-1: D starts as the inverse on the 2 x 2 diagonal blocks (exact), then each level
        # merges pairs of diagonal blocks of size s: D <- D - (D Loff_s) D
        d0 = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(((ri >> 1) == (ci >> 1)) & (ri > ci), L, 0.0)

        def level(t, d):                     # blocks of s = 2^(t + 1) rows merge into 2 s
            sh = lax.convert_element_type(t + 1, jnp.int32)   # shifts: a traced divisor costs ~20x more
            rs, cs = lax.shift_right_logical(iota((C, C), 0), sh), lax.shift_right_logical(iota((C, C), 1), sh)
            slot = lax.rem(t, 2)             # D is read by both products: two buffers
            d_s.at[slot][...] = d.astype(BF16)
            l_s[...] = jnp.where(((rs >> 1) == (cs >> 1)) & (rs > cs), L, 0.0).astype(BF16)
            plgpu.commit_smem()

            def n_dot(acc):                  # D Loff
                plgpu.wgmma(acc, d_s.at[slot], l_s)
                return acc[...]
            n_s[...] = pl.run_scoped(n_dot, plgpu.ACC((C, C), F32)).astype(BF16)
            plgpu.commit_smem()              # also: every warp's reads of l_s are done

            def nd_dot(acc):                 # (D Loff) D
                plgpu.wgmma(acc, n_s, d_s.at[slot])
                return acc[...]
            return d - pl.run_scoped(nd_dot, plgpu.ACC((C, C), F32))

        a = lax.fori_loop(0, LEVELS, level, d0)
        if a_ref is not None:
            a_ref.at[bh, rows][...] = a
        # A into l_s (its last reader, the last level's D Loff, is behind that level's fence);
        # Y = beta v in place once v has arrived
        l_s[...] = a.astype(BF16)
        plgpu.barrier_wait(bar_v)
        for vh in range(VH):
            v_s.at[vh][...] = (beta_c * load(v_s.at[vh], smem=True)).astype(BF16)
        plgpu.commit_smem()
        for dst, src, n in ((w_ref, x_s, KH), (u_ref, v_s, VH)):
            for i in range(n):               # one [C, HALF] product at a time, written from registers

                def wu_dot(acc, src=src, i=i):
                    plgpu.wgmma(acc, l_s, src.at[i])
                    return acc[...]
                dst.at[bh, rows, pl.ds(i * HALF, HALF)][...] = pl.run_scoped(
                    wu_dot, plgpu.ACC((C, HALF), F32)).astype(dst.dtype)

    bf_k, f_c = jax.ShapeDtypeStruct((BH, T, K), BF16), jax.ShapeDtypeStruct((BH, T, C), F32)
    out_type = [bf_k, bf_k, bf_k, jax.ShapeDtypeStruct((BH, T, V), BF16),
                jax.ShapeDtypeStruct((BH, T, C), BF16), jax.ShapeDtypeStruct((BH, NT, K), F32)]
    out_type += [f_c, f_c] if save_solve else []
    # SMEM (K = V = 128), 98 KiB so that two CTAs share an SM: k 16 KiB; the anchor rows 2 KiB; q,
    # later the column operand, later X, 16 KiB; G and the row operands, later the solve's D (two
    # buffers), Loff, D Loff and v, 64 KiB
    first = plgpu.RefUnion(operand((KH, C, HALF)), operand((KH, C, HALF)))
    second = plgpu.RefUnion((staging((KH, C, HALF), F32), operand((KH, C, HALF)), operand((KH, C, HALF))),
                            (operand((2, C, C)), operand((C, C)), operand((C, C)), operand((VH, C, HALF))))
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type),
        scratch_types=[operand((KH, C, HALF)), plgpu.SMEM((NB, K), F32), first, second,
                       plgpu.Barrier(num_arrivals=3 * KH + NB + segmented), plgpu.Barrier(num_arrivals=VH)]
                      + ([segments_smem()] if segmented else []),
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret), kernel_name="kda_intra_fwd_mgpu")
    beta_hm = jnp.swapaxes(beta, 1, 2).reshape(BH, T).astype(F32)   # head-major rows: one direct read a chunk
    outs = kernel(q, k, v, G, beta_hm, *([segment_masks(segments)] if segmented else []))
    return tuple(x.reshape(B, H, *x.shape[1:]) for x in outs)
