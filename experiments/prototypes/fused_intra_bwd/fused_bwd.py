"""PROTOTYPE (not in the package): solve_bwd and score_bwd as one Mosaic GPU kernel.

Per (batch x head, chunk), one warpgroup, one CTA an SM:
  P0  TMA St (both halves), dO, W, U, G's anchor rows; V' = U - W S; dAqk = dO V'^T (masked) -> SMEM fp32
  P1  TMA dU (bf16 operand), A (split hi / lo)
  P2  per K half: TMA k, G of the half; dW_h = -dU S_h^T (into W's buffer); X_h = beta e^G k
  P3  TMA v, M; dY = A^T dU, dA = dW X^T + dU Y^T; dv, dbeta; dL = -A^T dA A^T; dM = beta dL;
      the cotangents' power-of-two scale; dM, dAqk split-bf16 (into the P1-P3 buffers, now dead)
  P4  per K half, last half first (its k, G are resident): TMA q, dS_h (and k, G); the score products
      (score_bwd's row-block loop); then the partials one product at a time, combined in registers:
      dq, dk (bf16), dG (fp32, dG_last on the last row) written once.
No partial, dM or dAqk ever reaches HBM.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu.common import (BF16, BT, CHUNK, COL, EXP_PARAMS, F32, HALF, ROW, WG, Segments,
                                                  along_rows, block_anchor, interpret_params, iota, keep, load,
                                                  operand, own_anchors, segment_masks, splat, split_bf16, staging)
from pallas_kernels.kda.mosaic_gpu.intra_bwd import NB, _check, _dl, _lower, _pow2_scale


def fused_bwd(q, k, v, G, beta, do, du, h, dh, w, u, A, M, *, scale: float, centre: int, segments=None,
              interpret=False):
    """Returns dv [B, T, H, V] bf16, dbeta [B, T, H] fp32, dq, dk [B, T, H, K] bf16, dG [B, T, H, K] fp32
    (per row, dG_last added on each chunk's last row: score_bwd's outputs)."""
    B, T, H, K, V, NT = _check(q, k, v, G, beta, do, du, h, dh, w, u, A, M)
    segmented = segments is not None
    C, KH, BH = CHUNK, K // HALF, B * H
    c_hi, c_lo = 2.0 ** int(centre), 2.0 ** -int(centre)
    c_a, c_b = 2.0 ** (int(centre) // 2), 2.0 ** (int(centre) - int(centre) // 2)

    def body(q_ref, k_ref, v_ref, G_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref, w_ref, u_ref, A_ref, M_ref,
             *rest):
        seg_ref, rest = (rest[0], rest[1:]) if segmented else (None, rest)
        (dv_ref, dbeta_ref, dq_ref, dk_ref, dg_ref,
         h_s, do_s, vp_s, w_s, a_hi, anc_s, diag_s, k_h, g_h, u1, u2, u3,
         bar0, bar1, bars_kg, bar3, bars_4) = rest
        # three unions, each one set of P0-P3 buffers with one set of P4 buffers (disjoint lifetimes)
        (u_in, a_in), (v_s, m_in), (dm_hi, dm_lo, dq_hi, dq_lo) = u1
        (du_s, a_lo, x_s), (fa_hi, fa_lo, fb_hi, fb_lo, q_h) = u2
        (daqk_s, t_hi, t_lo), (dh_h,) = u3
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        seg = None if seg_ref is None else Segments(seg_ref.at[b, c])
        halves = [pl.ds(kh * HALF, HALF) for kh in range(KH)]

        def fetch_kg(kh, slot):               # k, G of K half kh (traced) on barrier slot
            cols = pl.ds(kh * HALF, HALF)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hh, cols], k_h, bars_kg.at[slot])
            plgpu.copy_gmem_to_smem(G_ref.at[b, rows, hh, cols], g_h, bars_kg.at[slot])

        # P0: St halves, dO, W halves, U, the anchor rows
        for kh in range(KH):
            plgpu.copy_gmem_to_smem(h_ref.at[bh, c, :, halves[kh]], h_s.at[kh], bar0)
            plgpu.copy_gmem_to_smem(w_ref.at[bh, rows, halves[kh]], w_s.at[kh], bar0)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, hh], do_s, bar0)
        plgpu.copy_gmem_to_smem(u_ref.at[bh, rows], u_in, bar0)
        for r in range(NB - 1):
            plgpu.copy_gmem_to_smem(G_ref.at[b, c * C + (r + 1) * BT - 1, hh], anc_s.at[r], bar0)
        beta_c = load(beta_ref.at[bh, rows], ROW)[:, None]
        plgpu.barrier_wait(bar0)

        def vp_dot(acc):
            for kh in range(KH):
                plgpu.wgmma(acc, w_s.at[kh], h_s.at[kh].T)
            return acc[...]
        vp_s[...] = (load(u_in, smem=True) - pl.run_scoped(vp_dot, plgpu.ACC((C, V), F32))).astype(BF16)
        plgpu.commit_smem()                   # every read of u_in, w_s is done
        # P1: dU, A (a_in is u_in's neighbour: free now)
        plgpu.copy_gmem_to_smem(du_ref.at[bh, rows], du_s, bar1)
        plgpu.copy_gmem_to_smem(A_ref.at[bh, rows], a_in, bar1)
        fetch_kg(0, 0)

        def daqk_dot(acc):
            plgpu.wgmma(acc, do_s, vp_s.T)
            return acc[...]
        if seg is None:
            daqk_s[...] = jnp.where(_lower(C), pl.run_scoped(daqk_dot, plgpu.ACC((C, C), F32)), 0.0)
        else:
            rel = (seg.vec(0, ROW), seg.vec(1, COL))
            daqk = pl.run_scoped(daqk_dot, plgpu.ACC((C, C), F32))
            daqk_s[...] = jnp.where(_lower(C) & seg.same(*rel), daqk, 0.0)
        plgpu.barrier_wait(bar1)
        split_bf16(load(a_in), a_hi, a_lo)
        plgpu.commit_smem()                   # every read of a_in is done: v, M into u_in / a_in's bytes
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hh], v_s, bar3)
        plgpu.copy_gmem_to_smem(M_ref.at[bh, rows], m_in, bar3)

        # P2: per half, dW_h (into W's buffer) and X_h
        def p2(kh, carry):
            plgpu.barrier_wait(bars_kg.at[kh])
            rel_r = None if seg is None else seg.vec(0, ROW)

            def dw_dot(acc):
                plgpu.wgmma(acc, du_s, h_s.at[kh])
                return acc[...]
            w_s.at[kh][...] = (-pl.run_scoped(dw_dot, plgpu.ACC((C, HALF), F32))).astype(BF16)
            x_s.at[kh][...] = keep(beta_c * jnp.exp(load(g_h)) * load(k_h, smem=True), seg, "row_in", (C, HALF),
                                   rel_r).astype(BF16)
            plgpu.commit_smem()               # every read of k_h, g_h is done

            @pl.when(kh + 1 < KH)
            def _():
                fetch_kg(kh + 1, kh + 1)
            return carry
        lax.fori_loop(0, KH, p2, 0)

        # P3 (v, M fetched during P2): dY, dA; dv, dbeta; dL; dM
        plgpu.barrier_wait(bar3)

        def dy_dot(acc):                      # A^T dU
            plgpu.wgmma(acc, a_hi.T, du_s)
            return acc[...]
        dy = pl.run_scoped(dy_dot, plgpu.ACC((C, V), F32))
        dv_ref.at[b, rows, hh][...] = (beta_c * dy).astype(dv_ref.dtype)
        dbeta = jnp.sum(load(v_s, smem=True) * dy, axis=1)

        def da_dots(a_x, a_y):                # dW X^T; dU v^T (dU Y^T = its columns times beta)
            for kh in range(KH):
                plgpu.wgmma(a_x, w_s.at[kh], x_s.at[kh].T)
            plgpu.wgmma(a_y, du_s, v_s.T)
            return a_x[...], a_y[...]
        dA_x, dA_y = pl.run_scoped(da_dots, plgpu.ACC((C, C), F32), plgpu.ACC((C, C), F32))
        beta_col = plgpu.layout_cast(jnp.broadcast_to(load(beta_ref.at[bh, rows], COL)[None, :], (C, C)), WG)
        dA = dA_x + dA_y * beta_col
        dL = _dl(dA, a_hi, a_lo, t_hi, t_lo, seg)
        dbeta = dbeta + jnp.sum(dL * load(m_in), axis=1)
        dm = beta_c * dL
        da = load(daqk_s)
        diagonal = iota((C, C), 0) == iota((C, C), 1)
        d_diag = jnp.sum(jnp.where(diagonal, da, 0.0), axis=1)
        da = jnp.where(diagonal, 0.0, da)
        mx = jnp.max(jnp.maximum(jnp.max(jnp.abs(dm), axis=1), jnp.max(jnp.abs(da), axis=1)), axis=0)
        inv = _pow2_scale(splat(mx, (C, C)))[0]
        plgpu.commit_smem()                   # every read of the P1-P3 buffers is done: split into them
        diag_s[...] = d_diag
        split_bf16(dm * inv, dm_hi, dm_lo)
        split_bf16(da * inv, dq_hi, dq_lo)
        plgpu.commit_smem()

        def x3(acc, a_hi_, a_lo_, b_hi, b_lo):
            plgpu.wgmma(acc, a_hi_, b_hi)
            plgpu.wgmma(acc, a_lo_, b_hi)
            plgpu.wgmma(acc, a_hi_, b_lo)

        # P4: per half, last first
        def p4(i, dbeta):
            kh = KH - 1 - i
            cols = pl.ds(kh * HALF, HALF)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hh, cols], q_h, bars_4.at[kh])
            plgpu.copy_gmem_to_smem(dh_ref.at[bh, c, :, cols], dh_h, bars_4.at[kh])

            @pl.when(i > 0)
            def _():
                fetch_kg(kh, KH + kh)
                plgpu.barrier_wait(bars_kg.at[KH + kh])
            plgpu.barrier_wait(bars_4.at[kh])

            def block_step(r, acc):
                da_m, da_q, sb = acc
                rb = iota((C, HALF), 0) >> 4
                anc = block_anchor(anc_s, r, cols)[None, :]
                g = load(g_h)
                split_bf16(load(k_h, smem=True) * (jnp.exp(jnp.where(rb <= r, anc - g, 0.0)) * c_lo), fa_hi, fa_lo)
                plgpu.commit_smem()

                def row_dots(a_m, a_q):
                    x3(a_m, dm_hi, dm_lo, fa_hi, fa_lo)
                    x3(a_q, dq_hi, dq_lo, fa_hi, fa_lo)
                    return a_m[...], a_q[...]
                p_m, p_q = pl.run_scoped(row_dots, plgpu.ACC((C, HALF), F32), plgpu.ACC((C, HALF), F32))
                own = (iota((C, HALF), 0) >> 4) == r
                da_m, da_q = jnp.where(own, p_m, da_m), jnp.where(own, p_q, da_q)
                plgpu.commit_smem()
                eh = jnp.exp(jnp.where(rb >= r, 0.5 * (load(g_h) - anc), 0.0))
                ea_a, ea_b = eh * c_a, eh * c_b
                split_bf16(jnp.where(rb >= r, (load(k_h, smem=True) * ea_a) * ea_b, 0.0), fa_hi, fa_lo)
                split_bf16(jnp.where(rb >= r, (scale * load(q_h, smem=True) * ea_a) * ea_b, 0.0), fb_hi, fb_lo)
                plgpu.commit_smem()

                def col_dots(a_s):
                    x3(a_s, dm_hi.T, dm_lo.T, fa_hi, fa_lo)
                    x3(a_s, dq_hi.T, dq_lo.T, fb_hi, fb_lo)
                    return a_s[...]
                p_s = pl.run_scoped(col_dots, plgpu.ACC((C, HALF), F32))
                sb = jnp.where((iota((C, HALF), 0) >> 4) == r, p_s, sb)
                plgpu.commit_smem()
                return da_m, da_q, sb

            zero = plgpu.layout_cast(jnp.zeros((C, HALF), F32), WG)
            da_m, da_q, sb = lax.fori_loop(0, NB, block_step, (zero, zero, zero))
            g = load(g_h)
            anc = own_anchors(anc_s, cols, (C, HALF))
            un = _pow2_scale(splat(mx, (C, HALF)))[1]
            ea = jnp.exp(g - anc) * c_hi
            da_m, da_q = (da_m * ea) * un, (da_q * ea) * un
            sb = (sb * (jnp.exp(anc - g) * c_lo)) * un
            kf, qs = load(k_h, smem=True), scale * load(q_h, smem=True)
            d = along_rows(load(diag_s, ROW), (C, HALF))
            dk = da_m + sb + d * qs
            dG = kf * (da_m - sb) + qs * da_q
            eg = jnp.exp(g)
            rel_r, last_r, carry_r = (None,) * 3 if seg is None else (seg.vec(i_, ROW) for i_ in (0, 2, 3))

            def qg_dot(acc):                  # dO S^T on this half
                plgpu.wgmma(acc, do_s, h_s.at[kh])
                return acc[...]
            dqp = scale * eg * keep(pl.run_scoped(qg_dot, plgpu.ACC((C, HALF), F32)), seg, "row_in", (C, HALF), rel_r)
            dq_ref.at[b, rows, hh, cols][...] = (dqp + scale * (da_q + d * kf)).astype(dq_ref.dtype)
            dG = dG + load(q_h, smem=True) * dqp

            def dx_dot(acc):                  # A^T dW on this half
                plgpu.wgmma(acc, a_hi.T, w_s.at[kh])
                return acc[...]
            egdx = eg * keep(pl.run_scoped(dx_dot, plgpu.ACC((C, HALF), F32)), seg, "row_in", (C, HALF), rel_r)
            dk = dk + beta_c * egdx
            kdx = kf * egdx
            dbeta = dbeta + jnp.sum(kdx, axis=1)
            dG = dG + beta_c * kdx

            def kd_dot(acc):                  # V' dS^T on this half
                plgpu.wgmma(acc, vp_s, dh_h)
                return acc[...]
            gl_v = jnp.sum(jnp.where(iota((C, HALF), 0) == C - 1, g, 0.0), axis=0)
            dkd = jnp.exp(gl_v[None, :] - g) * keep(pl.run_scoped(kd_dot, plgpu.ACC((C, HALF), F32)), seg, "in_last",
                                                    (C, HALF), last_r)
            dk_ref.at[b, rows, hh, cols][...] = (dk + dkd).astype(dk_ref.dtype)
            t = kf * dkd
            sts = sum(jnp.sum(keep(load(h_s.at[kh, pl.ds(j * C, C)], smem=True) * load(dh_h.at[pl.ds(j * C, C)], smem=True),
                                   seg, "carry_rows", (C, HALF), carry_r), axis=0) for j in range(V // C))
            dgl = jnp.exp(gl_v) * sts + jnp.sum(t, axis=0)
            dG = dG - t
            dg_ref.at[b, rows, hh, cols][...] = jnp.where(iota((C, HALF), 0) == C - 1, dG + dgl[None, :], dG)
            plgpu.commit_smem()               # every read of q_h, k_h, g_h, dh_h is done
            return dbeta
        dbeta = lax.fori_loop(0, KH, p4, dbeta)
        dbeta_ref.at[bh, rows][...] = dbeta

    tok = jax.ShapeDtypeStruct((B, T, H, K), BF16)
    out_type = (jax.ShapeDtypeStruct((B, T, H, V), BF16), jax.ShapeDtypeStruct((BH, T), F32), tok, tok,
                jax.ShapeDtypeStruct((B, T, H, K), F32))
    u1 = plgpu.RefUnion((operand((C, V)), staging((C, C), F32)), (operand((C, V)), staging((C, C), F32)),
                        tuple(operand((C, C)) for _ in range(4)))
    u2 = plgpu.RefUnion((operand((C, V)), operand((C, C)), operand((KH, C, HALF))),
                        tuple(operand((C, HALF)) for _ in range(5)))
    u3 = plgpu.RefUnion((staging((C, C), F32), operand((C, C)), operand((C, C))), (operand((V, HALF)),))
    kernel = plgpu.kernel(
        body, out_type=out_type,
        scratch_types=[operand((KH, V, HALF)), operand((C, V)), operand((C, V)), operand((KH, C, HALF)),
                       operand((C, C)), plgpu.SMEM((NB - 1, K), F32), plgpu.SMEM((C,), F32),
                       operand((C, HALF)), staging((C, HALF), F32), u1, u2, u3,
                       plgpu.Barrier(num_arrivals=2 * KH + 2 + NB - 1), plgpu.Barrier(num_arrivals=2),
                       plgpu.Barrier(num_arrivals=2, num_barriers=2 * KH), plgpu.Barrier(num_arrivals=2),
                       plgpu.Barrier(num_arrivals=2, num_barriers=KH)],
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret), kernel_name="kda_intra_bwd_fused_mgpu")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731
    beta_hm = jnp.swapaxes(beta, 1, 2).reshape(BH, T).astype(F32)
    dv, dbeta, dq, dk, dg = kernel(
        q, k, v, G, beta_hm, do, flat(du), flat(h), flat(dh), flat(w), flat(u), flat(A), flat(M),
        *([segment_masks(segments)] if segmented else []))
    return dv, jnp.swapaxes(dbeta.reshape(B, H, T), 1, 2), dq, dk, dg
