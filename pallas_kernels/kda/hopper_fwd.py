"""Hopper (sm_90) Mosaic GPU kernel a of the intra-chunk forward: the anchored scores and the solve.

`intra_fwd_a` is a drop-in for kernel a of fwd.intra_fwd_split ("kda_intra_fwd_a") with bounded
gates and the op's default options (bf16_dots=True, gate_cumsum=True, no segment_ids), one
warpgroup per (batch x head, chunk of 64 tokens). The math is common.solve_factors' with the
BF16_OPERANDS dots: with the 16-row blocks r, their anchors anc_0 = 0, anc_r = G_{16 r - 1} and
ea = e^{G - anc(row)} (<= 1),
  M    = rows of block r of (k ea) (k e^{anc_r - G})^T, r = 0..3, strictly lower;
  Aqk  = rows of block r of (scale q ea) (k e^{anc_r - G})^T, lower incl. the diagonal;
  A    = (I + beta M)^-1 by common.unit_lower_inverse's recursive blocked substitution
         (D <- D - (D Loff_s) D for s = 2, 4, .., 32, both products with bf16 operands);
  qg   = scale q e^{G},  kd = k e^{G_last - G},  gl = e^{G_last}.
Each score product is a wgmma [64, K] x [K, 64] with bf16 operands (e^{anc_r - G} <= e^{16 |lb|}
on the rows of blocks <= r, 1 on later rows, whose products the row select drops), each solve
product a wgmma [64, 64] x [64, 64]; the four row blocks and the five solve levels are loops (one
traced body each: kernel a of the backward overflowed the instruction cache unrolled, round 15 of
kda_pallas_notes.md), one pair of accumulators live at a time.
I/O: q, k and G by TMA per K half, G's anchor rows and G_last by TMA (one barrier); beta straight
from HBM; the outputs written straight from registers. SMEM: 98 KiB at K = 128 (two CTAs an SM): q
shares its memory with the column operand, G and the row operands with the solve's (plgpu.RefUnion).

Measured on the H200 (2026-12-01, round 17 of kda_pallas_notes.md; kda_round17_h200/): with the
precise exp (v1, v2) outputs bit-identical to the compiled Triton kernel a at 8x4096x16x128 and
2x1024x4x{64,128}; with approximate exp (hopper.EXP_PARAMS, this version) within the GPU test's
tolerances (RMS ratios <= 1e-3 bf16, 1e-5 gl; values not printed under xdist). Kernel rows at
8x4096x16x128: v1 (160 KiB of SMEM, one CTA an SM; anchors read from HBM inside the row-block loop)
1.59 ms, v2 (98 KiB, two CTAs an SM, anchors by TMA) 1.11, v4 (approximate exp: 314M -> 220M
instructions) 1.05, against the Triton kernel a's 1.05-1.12 in the same runs: a tie as a kernel row.
In the op (one process, v4): forward 1.88 -> 1.75 ms, forward+backward 6.76 -> 6.58 at 8x4096x16
(ops.KernelOptions.hopper_intra_fwd, on by default).
`intra_fwd` is the same kernel with W = A X and U = A Y formed in it too (the Triton kernel b's work;
ops.KernelOptions.hopper_fused_wu, on by default; round 18, kda_round18_h200/): 206 registers, no
spills; against the compiled Triton pair w 1.6e-5, u 1.4e-6 (RMS ratios) at 8x4096x16x128; kernel
row 1.28 ms (intra_fwd_a alone 1.09, its Triton kernel b 0.34 in the op); op forward 1.78 -> 1.51 ms,
forward+backward 6.61 -> 6.33 at 8x4096x16.
Source: Kimi Linear (arXiv 2510.26692) chunk form as fla `chunk_kda`'s forward (anchored 16-token
sub-chunks as fla's safe_gate path; fla's solve_tril merges); Mosaic GPU API of jax 0.11.2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.hopper import (BF16, CHUNK, F32, HEAD_DIMS, _COL, _ROW, _WG, _check_qk, _check_shapes, _iota,
                                      _load, _operand, _staging, EXP_PARAMS, interpret_params)
from pallas_kernels.kda.hopper_bwd import HALF

BT = 16                    # row block (diagonal tile) of the anchored scores
NB = CHUNK // BT
LEVELS = 5                 # solve merges: blocks of 2 -> 4 -> .. -> 64


def _check(q, k, G, beta):
    B, T, H, K = _check_qk(q, k)
    if G.dtype != F32:
        raise ValueError(f"G must be fp32 (the chunk cumsum of g); got {G.dtype}")
    if not jnp.issubdtype(beta.dtype, jnp.floating):
        raise ValueError(f"beta must be a float array; got {beta.dtype}")
    _check_shapes(dict(k=k, G=G, beta=beta), dict(k=(B, T, H, K), G=(B, T, H, K), beta=(B, T, H)),
                  f"q {q.shape} (B, T, H, K)")
    return B, T, H, K


def intra_fwd_a(q, k, G, beta, *, scale: float, save_solve: bool = False,
                interpret: bool | plgpu.InterpretGPUParams = False):
    """Kernel a of the intra-chunk forward on Hopper (module docstring); chunk 64, bounded gates
    (every g >= lower_bound >= -5, so e^{anc - G} <= e^80 within a 16-row block).

    Args:
      q, k: [B, T, H, K] bf16; G: [B, T, H, K] fp32, the chunk-local inclusive cumsum of the
        log-decay g (nats; the op's xla_gate_cumsum form), token-major as the user's layout;
      beta: [B, T, H], any float dtype; scale: the query scale;
      save_solve: also return M (the differentiated forward saves it for the backward);
      interpret: as hopper.state_fwd.
    Returns (as fwd.intra_fwd_split's kernel a with bf16 inputs, bf16_dots and gate_cumsum):
      qg, kd [B, H, T, K] bf16; aqk [B, H, T, 64] bf16 (lower-triangular per chunk); gl
      [B, H, T / 64, K] fp32 (e^{G_last}, a decay, not a log); A [B, H, T, 64] fp32 ((I + beta M)^-1
      per chunk); with save_solve also M [B, H, T, 64] fp32 (strictly lower, beta-free).
    Raises: ValueError for T not a multiple of 64, K not in HEAD_DIMS, q / k not bf16, G not fp32,
      beta not a float array, or shapes that do not match.
    """
    return _intra(q, k, None, G, beta, scale=scale, save_solve=save_solve, interpret=interpret)


def intra_fwd(q, k, v, G, beta, *, scale: float, save_solve: bool = False, bf16_w: bool = False,
              interpret: bool | plgpu.InterpretGPUParams = False):
    """Both intra-chunk forward kernels in one (intra_fwd_a and the Triton kernel b, fwd.intra_fwd_b,
    fla's recompute_w_u): intra_fwd_a's kernel, then with (I + beta M)^-1 still in registers
      W = A (beta e^{G} k),  U = A (beta v),
    both [64, 64] x [64, HALF] wgmma with bf16 operands per K / V half (bf16_dots' rounding). A is
    written only with save_solve (the backward's); k, G and beta are read once. X = beta e^G k goes
    to the memory of the column operand after the scores, v arrives by TMA during the solve into
    the row operands' memory: SMEM as intra_fwd_a (98 KiB at K = V = 128).

    Args: v [B, T, H, V] bf16 (V in HEAD_DIMS); bf16_w: write W in bf16 (the rounding every
      bf16-operand consumer of W applies; ops.KernelOptions.hopper_bf16_w); the rest as intra_fwd_a.
    Returns (as fwd.intra_fwd_split with bf16 inputs, bf16_dots and gate_cumsum): qg, kd [B, H, T, K]
      bf16; w [B, H, T, K] fp32 (bf16 with bf16_w); u [B, H, T, V] fp32; aqk [B, H, T, 64] bf16; gl [B, H, T / 64, K] fp32;
      with save_solve also A, M [B, H, T, 64] fp32.
    Raises: ValueError as intra_fwd_a, and for v not bf16 [B, T, H, V] with V in HEAD_DIMS.
    Measured: round 18 of kda_pallas_notes.md (ops.KernelOptions.hopper_fused_wu, on by default).
    """
    if v.dtype != BF16:
        raise ValueError(f"v must be bf16; got {v.dtype}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3] or v.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"v must be [B, T, H, V] with (B, T, H) = {q.shape[:3]} and V in {HEAD_DIMS}; "
                         f"got {v.shape}")
    return _intra(q, k, v, G, beta, scale=scale, save_solve=save_solve, interpret=interpret, bf16_w=bf16_w)


def _intra(q, k, v, G, beta, *, scale, save_solve, interpret, bf16_w=False):
    """intra_fwd_a (v None) or intra_fwd's kernel."""
    B, T, H, K = _check(q, k, G, beta)
    C, KH, BH, NT = CHUNK, K // HALF, B * H, T // CHUNK
    wu = v is not None
    V = v.shape[-1] if wu else 0
    VH = V // HALF

    def body(*refs):
        if wu:
            q_ref, k_ref, v_ref, G_ref, beta_ref, qg_ref, kd_ref, w_ref, u_ref, aqk_ref, gl_ref, *rest = refs
            a_ref, m_ref = (rest[0], rest[1]) if save_solve else (None, None)
        else:
            q_ref, k_ref, G_ref, beta_ref, qg_ref, kd_ref, aqk_ref, gl_ref, a_ref, *rest = refs
            m_ref = rest[0] if save_solve else None
        k_in, anc_s, first, second, bar, bar_v = rest[-6:]
        q_in, bk_s = first                   # q, then the column operand (later X: x_s = bk_s)
        x_s = bk_s
        (g_in, ak_s, aq_s), (d_s, l_s, n_s, *v_s) = second    # the solve's operands (and v) after the scores
        v_s = v_s[0] if wu else None
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        halves = [pl.ds(kh * HALF, HALF) for kh in range(KH)]
        for kh in range(KH):
            for src, dst in ((q_ref, q_in), (k_ref, k_in), (G_ref, g_in)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, hh, halves[kh]], dst.at[kh], bar)
        for r in range(NB):                  # G's rows 15, 31, 47 (the anchors) and 63 (G_last)
            plgpu.copy_gmem_to_smem(G_ref.at[b, c * C + (r + 1) * BT - 1, hh], anc_s.at[r], bar)
        beta_c = _load(beta_ref.at[bh, rows], _ROW)[:, None]          # one 256-byte read
        rb_k = _iota((C, HALF), 0) >> 4             # row block (BT = 16)

        def anchor(r, cols):                 # G_{16 r - 1} [HALF] (r may be traced); 0 for r = 0
            return _load(anc_s.at[jnp.maximum(r - 1, 0), cols], _COL) * jnp.asarray(r > 0, F32)

        plgpu.barrier_wait(bar)
        # the row operands (k ea, scale q ea) and the elementwise outputs, per K half
        for kh in range(KH):
            g = _load(g_in.at[kh])
            kf, qf = _load(k_in.at[kh], smem=True), _load(q_in.at[kh], smem=True)
            anc_rows = jnp.zeros_like(g)
            for r in range(1, NB):
                anc_rows = jnp.where(rb_k == r, anchor(r, halves[kh])[None, :], anc_rows)
            ea = jnp.exp(g - anc_rows)
            ak_s.at[kh][...] = (kf * ea).astype(BF16)
            aq_s.at[kh][...] = (scale * qf * ea).astype(BF16)
            gl = _load(anc_s.at[NB - 1, halves[kh]], _COL)
            qg_ref.at[bh, rows, halves[kh]][...] = (scale * qf * jnp.exp(g)).astype(BF16)
            kd_ref.at[bh, rows, halves[kh]][...] = (kf * jnp.exp(gl[None, :] - g)).astype(BF16)
            gl_ref.at[bh, c, halves[kh]][...] = jnp.exp(gl)
        plgpu.commit_smem()                  # ak, aq written; every read of q_in (bk_s's memory) done

        rb = _iota((C, C), 0) >> 4

        def score_step(r, carry):            # row block r: its column operand, then M and Aqk's rows
            m, aqk = carry
            for kh in range(KH):
                g = _load(g_in.at[kh])
                eb = jnp.exp(jnp.where(rb_k <= r, anchor(r, halves[kh])[None, :] - g, 0.0))
                bk_s.at[kh][...] = (_load(k_in.at[kh], smem=True) * eb).astype(BF16)
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

        zero = plgpu.layout_cast(jnp.zeros((C, C), F32), _WG)
        m, aqk = lax.fori_loop(0, NB, score_step, (zero, zero))
        # (the last step's fence: the solve's buffers, g_in / ak_s / aq_s's memory, are free)
        if wu:
            for kh in range(KH):             # X = beta e^G k into the column operand's memory
                x_s.at[kh][...] = (beta_c * jnp.exp(_load(g_in.at[kh])) * _load(k_in.at[kh], smem=True)).astype(BF16)
            plgpu.commit_smem()              # every read of g_in done; X fenced
            for vh in range(VH):             # v into the second union while the solve runs
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hh, pl.ds(vh * HALF, HALF)], v_s.at[vh], bar_v)
        ri, ci = _iota((C, C), 0), _iota((C, C), 1)
        aqk_ref.at[bh, rows][...] = jnp.where(ri >= ci, aqk, 0.0).astype(BF16)
        m = jnp.where(ri > ci, m, 0.0)
        if save_solve:
            m_ref.at[bh, rows][...] = m
        L = beta_c * m

        # (I + L)^-1: D starts as the inverse on the 2 x 2 diagonal blocks (exact), then each level
        # merges pairs of diagonal blocks of size s: D <- D - (D Loff_s) D
        d0 = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(((ri >> 1) == (ci >> 1)) & (ri > ci), L, 0.0)

        def level(t, d):                     # blocks of s = 2^(t + 1) rows merge into 2 s
            sh = lax.convert_element_type(t + 1, jnp.int32)   # shifts: a traced divisor costs ~20x more
            rs, cs = lax.shift_right_logical(_iota((C, C), 0), sh), lax.shift_right_logical(_iota((C, C), 1), sh)
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
        if wu:
            # A into l_s (its last reader, the last level's D Loff, is behind that level's fence);
            # Y = beta v in place once v has arrived
            l_s[...] = a.astype(BF16)
            plgpu.barrier_wait(bar_v)
            for vh in range(VH):
                v_s.at[vh][...] = (beta_c * _load(v_s.at[vh], smem=True)).astype(BF16)
            plgpu.commit_smem()
            for dst, src, n in ((w_ref, x_s, KH), (u_ref, v_s, VH)):
                for h in range(n):           # one [C, HALF] product at a time, written from registers

                    def wu_dot(acc, src=src, h=h):
                        plgpu.wgmma(acc, l_s, src.at[h])
                        return acc[...]
                    dst.at[bh, rows, pl.ds(h * HALF, HALF)][...] = pl.run_scoped(
                        wu_dot, plgpu.ACC((C, HALF), F32)).astype(dst.dtype)

    bf_k, f_k, f_c = (jax.ShapeDtypeStruct((BH, T, K), BF16), jax.ShapeDtypeStruct((BH, T, K), F32),
                      jax.ShapeDtypeStruct((BH, T, C), F32))
    out_type = [bf_k, bf_k] + ([bf_k if bf16_w else f_k, jax.ShapeDtypeStruct((BH, T, V), F32)] if wu else [])
    out_type += [jax.ShapeDtypeStruct((BH, T, C), BF16), jax.ShapeDtypeStruct((BH, NT, K), F32)]
    out_type += ([f_c] if not wu or save_solve else []) + ([f_c] if save_solve else [])
    # SMEM (K = V = 128), 98 KiB so that two CTAs share an SM (v1, 160 KiB, one CTA: 1.5x slower than
    # the Triton kernel a): k 16 KiB; the anchor rows 2 KiB; q, later the column operand, later X,
    # 16 KiB; G and the row operands, later the solve's D (two buffers), Loff and D Loff and v, 64 KiB
    first = plgpu.RefUnion(_operand((KH, C, HALF)), _operand((KH, C, HALF)))
    second = plgpu.RefUnion((_staging((KH, C, HALF), F32), _operand((KH, C, HALF)), _operand((KH, C, HALF))),
                            (_operand((2, C, C)), _operand((C, C)), _operand((C, C)))
                            + ((_operand((VH, C, HALF)),) if wu else ()))
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type),
        scratch_types=[_operand((KH, C, HALF)), plgpu.SMEM((NB, K), F32), first, second,
                       plgpu.Barrier(num_arrivals=3 * KH + NB), plgpu.Barrier(num_arrivals=max(VH, 1))],
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret),
        kernel_name="kda_intra_fwd_hopper" if wu else "kda_intra_fwd_a_hopper")
    beta_hm = jnp.swapaxes(beta, 1, 2).reshape(BH, T).astype(F32)   # head-major rows: one direct read a chunk
    outs = kernel(q, k, *([v] if wu else []), G, beta_hm)
    return tuple(x.reshape(B, H, *x.shape[1:]) for x in outs)
