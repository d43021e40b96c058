"""Hopper (sm_90) Mosaic GPU kernel b of the intra-chunk backward: the anchored score-tile backward.

`intra_bwd_b` is a drop-in for bwd.intra_bwd_b with bounded gates and the op's default options
(bf16_dots=True, gate_cumsum=True): from kernel a's partial dq, dk, dG, dG_last and the score
gradients dM (the k.k tile, strictly lower) and dAqk (the q.k tile, lower incl. the diagonal) it
forms the final dq, dk and the per-row dg (before the caller's reverse cumsum), one warpgroup per
(batch x head, chunk of 64 tokens). The math is bwd._score_bwd's (the masked form; the Triton
default, _intra_bwd_b_compact_kernel, groups the column side differently and agrees up to rounding):
with the 16-row blocks r, their anchors anc_0 = 0, anc_r = G_{16 r - 1}, ea = e^{G - anc(row)},
kt = k ea, qt = scale q ea,
  diagonal tiles (own anchor, b~ = e^{anc - G} up to e^{16 |lower_bound|}):
    sa_m = dM_d (k e^{anc - G}),  sa_q = dAqk_d (k e^{anc - G}),
    sb = e^{anc - G} (dM_d^T kt + dAqk_d^T qt)          (split-bf16 operands, three wgmma each product)
  off-diagonal row block r = 1..3 (columns of the earlier blocks, anchor anc_r, factors <= 1):
    sa_m += dM_r (k e^{anc_r - G}),  sa_q += dAqk_r (k e^{anc_r - G}),
    sb += e^{anc_r - G} (dM_r^T kt + dAqk_r^T qt)        (bf16 operands)
  dq = dq' + scale ea sa_q;  dk = dk' + ea sa_m + sb;  dg = dG' + kt sa_m + qt sa_q - k sb
  (plus dG_last on the chunk's last row).
dM_d / dAqk_d keep the diagonal 16 x 16 tiles, dM_r / dAqk_r row block r's columns left of its
diagonal tile. Every product is a [64, 64] x [64, 64] wgmma; the score-gradient operands are built
once per chunk, the column operands per K half. The halves are a loop (not unrolled) and the three
sums are formed one accumulator at a time, each consumed into the outputs before the next (sa_q,
then sa_m, then sb), each accumulator's wgmma in the masked form's order.
I/O by TMA: dM and dAqk once per chunk; per K half q, k (into bf16 SMEM) and the partials dq', dk',
dG' (fp32, into the memory dM and dAqk used: plgpu.RefUnion), all issued at the half's start, the
partials waited for after the first product; G, its three anchor rows and dG_last are read straight
from HBM into registers; the outputs are written straight from registers. SMEM: 216 KiB at K = 128.

Measured on the H200 (2026-12-01, round 14 of kda_pallas_notes.md), its first version (direct HBM
reads, both halves unrolled, three accumulators live): correct (compiled against the compiled Triton
kernel b: dq 2.3e-5, dk 3.1e-5, dg 2.2e-6 RMS ratios at 8x4096x16x128) but slower, 6.00 ms against
the Triton kernel b's 3.09 (op fwd+bwd 11.25 vs 8.28), ptxas: 2.3 KB of register spills a thread.
This version (round 16: kernel a's round-15 remedies), measured on the H200 (2026-12-01 18:26 UTC,
kda_round16_h200/): correct (dq 2.3e-5, dk 2.7e-5 / 3.1e-5, dg 2.1e-6 RMS ratios), 2.72 ms against
the Triton kernel b's 2.85 in the kernel rows, ptxas 1.4 KB of spills; in the op forward+backward
6.86 -> 6.74 ms at 8x4096x16x128 and 15.58 -> 15.63 at 1x65536x16x128, within the rows' spread, so
ops.KernelOptions.hopper_score_bwd stays off. With approximate exp (hopper.EXP_PARAMS, round 17):
2.60 ms against the Triton kernel b's 2.65; op forward+backward 6.58 -> 6.48 ms (with the forward
kernel a on both sides), one measurement.
Unbounded gates keep the Triton kernel's exact diagonal tiles.
Source: Kimi Linear (arXiv 2510.26692) chunk form as fla `chunk_kda`'s backward (anchored
16-token sub-chunks as fla's safe_gate path); Mosaic GPU API of jax 0.11.2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.hopper import (BF16, CHUNK, F32, _COL, _check_qk, _check_shapes, _iota, _load, _operand,
                                      _split, _staging, EXP_PARAMS, interpret_params)
from pallas_kernels.kda.hopper_bwd import HALF

BT = 16                    # row block (diagonal tile) of the anchored scores
NB = CHUNK // BT


def _check(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk):
    B, T, H, K = _check_qk(q, k)
    if not all(x.dtype == F32 for x in (G, dqp, dkp, dgp, dgl, dM, dAqk)):
        raise ValueError("G, dqp, dkp, dgp, dgl, dM and dAqk must be fp32; got "
                         f"{[x.dtype for x in (G, dqp, dkp, dgp, dgl, dM, dAqk)]}")
    NT = T // CHUNK
    want = dict(k=(B, T, H, K), G=(B, T, H, K), dqp=(B, H, T, K), dkp=(B, H, T, K), dgp=(B, H, T, K),
                dgl=(B, H, NT, K), dM=(B, H, T, CHUNK), dAqk=(B, H, T, CHUNK))
    _check_shapes(dict(k=k, G=G, dqp=dqp, dkp=dkp, dgp=dgp, dgl=dgl, dM=dM, dAqk=dAqk), want,
                  f"q {q.shape} (B, T, H, K)")
    return B, T, H, K, NT


def intra_bwd_b(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk, *, scale: float,
                interpret: bool | plgpu.InterpretGPUParams = False):
    """Kernel b of the intra-chunk backward on Hopper (module docstring); chunk 64, bounded gates
    (every g >= lower_bound >= -5, so e^{anc - G} <= e^80 within a 16-row block).

    Args:
      q, k: [B, T, H, K] bf16; G: [B, T, H, K] fp32, the chunk-local inclusive cumsum of g (nats)
        (token-major, the user's layout).
      dqp, dkp, dgp: [B, H, T, K] fp32, dG_last: [B, H, T / 64, K] fp32, dM, dAqk: [B, H, T, 64] fp32:
        kernel a's outputs (bwd.intra_bwd_a or hopper_bwd.intra_bwd_a).
      scale: the query scale; interpret: as hopper.state_fwd.
    Returns (as bwd.intra_bwd_b with gate_cumsum=True): dq, dk [B, T, H, K] bf16 and dg [B, T, H, K]
      fp32, the per-row gate gradient before the reverse chunk cumsum (dG_last added on each
      chunk's last row).
    Raises: ValueError for T not a multiple of 64, K not in HEAD_DIMS, wrong dtypes or shapes.
    """
    B, T, H, K, NT = _check(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk)
    C, KH, BH = CHUNK, K // HALF, B * H

    def body(q_ref, k_ref, G_ref, dqp_ref, dkp_ref, dgp_ref, dgl_ref, dm_ref, daqk_ref,
             dq_ref, dk_ref, dg_ref, sc_s, off_s, col_s, kb_s, qk_in, staged, bar0, bar_qk, bar_p):
        (dm_in, daqk_in), (dqp_in, dkp_in, dgp_in) = staged
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        plgpu.copy_gmem_to_smem(dm_ref.at[bh, rows], dm_in, bar0)
        plgpu.copy_gmem_to_smem(daqk_ref.at[bh, rows], daqk_in, bar0)
        plgpu.barrier_wait(bar0)

        # the score-gradient operands, once per chunk: the diagonal tiles split (hi, lo), and
        # row block r's columns left of its diagonal tile, r = 1..3
        rb, cb = lax.div(_iota((C, C), 0), BT), lax.div(_iota((C, C), 1), BT)
        dm, daqk = _load(dm_in), _load(daqk_in)
        _split(jnp.where(rb == cb, dm, 0.0), sc_s.at[0], sc_s.at[1])
        _split(jnp.where(rb == cb, daqk, 0.0), sc_s.at[2], sc_s.at[3])
        for r in range(1, NB):
            below = (rb == r) & (cb < r)
            off_s.at[2 * (r - 1)][...] = jnp.where(below, dm, 0.0).astype(BF16)
            off_s.at[2 * (r - 1) + 1][...] = jnp.where(below, daqk, 0.0).astype(BF16)
        plgpu.commit_smem()                               # also: every read of dm_in, daqk_in is done

        def half_step(kh, carry):                         # one K half (a loop: half the code)
            cols = pl.ds(kh * HALF, HALF)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hh, cols], qk_in.at[0], bar_qk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hh, cols], qk_in.at[1], bar_qk)
            for dst, src in ((dqp_in, dqp_ref), (dkp_in, dkp_ref), (dgp_in, dgp_ref)):
                plgpu.copy_gmem_to_smem(src.at[bh, rows, cols], dst, bar_p)
            # G, its anchor rows and dG_last straight from HBM while the copies fly
            g = _load(G_ref.at[b, rows, hh, cols])
            anc = [None] + [_load(G_ref.at[b, c * C + r * BT - 1, hh, cols], _COL)[None, :] for r in range(1, NB)]
            dgl_v = _load(dgl_ref.at[bh, c, cols], _COL)
            rb_k = lax.div(_iota((C, HALF), 0), BT)
            anc_rows = jnp.zeros_like(g)
            for r in range(1, NB):
                anc_rows = jnp.where(rb_k == r, anc[r], anc_rows)

            def eb(r):                                    # e^{anc_r - G} on blocks <= r, 1 later (<= e^80)
                return jnp.exp(jnp.where(rb_k <= r, anc[r] - g, 0.0))

            def ea():                                     # e^{G - anc}, own anchor (<= 1)
                return jnp.exp(g - anc_rows)

            def kk():
                return _load(qk_in.at[1], smem=True)

            def qt():                                     # scale q e^{G - anc}
                return scale * _load(qk_in.at[0], smem=True) * ea()

            plgpu.barrier_wait(bar_qk)
            _split(kk() * jnp.exp(anc_rows - g), col_s.at[0], col_s.at[1])   # k e^{anc - G}, own anchor
            _split(kk() * ea(), col_s.at[2], col_s.at[3])                     # kt
            _split(qt(), col_s.at[4], col_s.at[5])
            for r in range(1, NB):
                kb_s.at[r - 1][...] = (kk() * eb(r)).astype(BF16)
            plgpu.commit_smem()

            # one product at a time (one warpgroup: 255 registers a thread), each accumulator's
            # wgmma in the same order as before: split diagonal tiles, then the row blocks
            def sa_dots(acc, which):                      # which 0: sa_m (dM), 2: sa_q (dAqk)
                for x, y in ((0, 0), (0, 1), (1, 0)):     # split-bf16: hi hi + hi lo + lo hi
                    plgpu.wgmma(acc, sc_s.at[which + x], col_s.at[y])
                for r in range(1, NB):
                    plgpu.wgmma(acc, off_s.at[2 * (r - 1) + which // 2], kb_s.at[r - 1])
                return acc[...]
            sa_q = pl.run_scoped(lambda acc: sa_dots(acc, 2), plgpu.ACC((C, HALF), F32))
            plgpu.barrier_wait(bar_p)
            dq_ref.at[b, rows, hh, cols][...] = (_load(dqp_in) + scale * ea() * sa_q).astype(BF16)
            dG = _load(dgp_in) + qt() * sa_q
            sa_m = pl.run_scoped(lambda acc: sa_dots(acc, 0), plgpu.ACC((C, HALF), F32))
            dk = _load(dkp_in) + ea() * sa_m
            dG = dG + kk() * ea() * sa_m

            def sb_dots(acc):                             # sb, the diagonal tiles' column side
                for x, y in ((0, 0), (0, 1), (1, 0)):
                    plgpu.wgmma(acc, sc_s.at[x].T, col_s.at[2 + y])
                    plgpu.wgmma(acc, sc_s.at[2 + x].T, col_s.at[4 + y])
                return acc[...]
            sb = jnp.exp(anc_rows - g) * pl.run_scoped(sb_dots, plgpu.ACC((C, HALF), F32))
            for r in range(1, NB):

                def off_dots(acc, r=r):                   # row block r's column side
                    plgpu.wgmma(acc, off_s.at[2 * (r - 1)].T, col_s.at[2])
                    plgpu.wgmma(acc, off_s.at[2 * (r - 1) + 1].T, col_s.at[4])
                    return acc[...]
                sb = sb + eb(r) * pl.run_scoped(off_dots, plgpu.ACC((C, HALF), F32))
            dk_ref.at[b, rows, hh, cols][...] = (dk + sb).astype(BF16)
            last = _iota((C, HALF), 0) == C - 1
            dg_ref.at[b, rows, hh, cols][...] = dG - kk() * sb + jnp.where(last, dgl_v[None, :], 0.0)
            plgpu.commit_smem()                           # every read of qk_in, the partials, col_s, kb_s is done
            return carry
        lax.fori_loop(0, KH, half_step, 0)

    # SMEM (K = 128): the operands 152 KiB; q, k 16 KiB; dM and dAqk, later the partials, 48 KiB
    staged = plgpu.RefUnion((_staging((C, C), F32), _staging((C, C), F32)),
                            tuple(_staging((C, HALF), F32) for _ in range(3)))
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, T, H, K), BF16), jax.ShapeDtypeStruct((B, T, H, K), BF16),
                  jax.ShapeDtypeStruct((B, T, H, K), F32)),
        scratch_types=[_operand((4, C, C)), _operand((2 * (NB - 1), C, C)), _operand((6, C, HALF)),
                       _operand((NB - 1, C, HALF)), _operand((2, C, HALF)), staged,
                       plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=3)],
        grid=(BH, NT), grid_names=("bh", "c"), compiler_params=EXP_PARAMS,
        interpret=interpret_params(interpret),
        kernel_name="kda_intra_bwd_b_hopper")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    return kernel(q, k, G, flat(dqp), flat(dkp), flat(dgp), flat(dgl), flat(dM), flat(dAqk))
