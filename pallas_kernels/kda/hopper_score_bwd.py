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
diagonal tile. Every product is a [64, 64] x [64, 64] wgmma (the K columns in halves of 64); the
score-gradient operands are built once per chunk, the column operands per half. Inputs are read
straight from HBM into registers (Mosaic GPU's plain transfer), outputs stored straight from them.
SMEM: 152 KiB.

Measured on the H200 (2026-12-01, round 14 of kda_pallas_notes.md): correct (compiled against the
compiled Triton kernel b: dq 2.3e-5, dk 3.1e-5, dg 2.2e-6 RMS ratios at 8x4096x16x128) but slower,
6.00 ms against the Triton kernel b's 3.09 (op fwd+bwd 11.25 vs 8.28), so
ops.KernelOptions.hopper_score_bwd stays off. ptxas reports 2.3 KB of register spills a thread and
the code is unrolled over the two halves: kernel a's round-15 remedies (TMA-staged inputs, a loop
over the halves, one product live at a time) are the next step for it.
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

from pallas_kernels.kda.hopper import BF16, CHUNK, F32, HEAD_DIMS, _operand, interpret_params
from pallas_kernels.kda.hopper_bwd import _COL, HALF, _check_shapes, _iota, _load, _split

BT = 16                    # row block (diagonal tile) of the anchored scores
NB = CHUNK // BT


def _check(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk):
    B, T, H, K = q.shape
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS:
        raise ValueError(f"K = {K} must be in {HEAD_DIMS} (wgmma tiles of 64 columns)")
    if q.dtype != BF16 or k.dtype != BF16:
        raise ValueError(f"q and k must be bf16; got {q.dtype}, {k.dtype}")
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
             dq_ref, dk_ref, dg_ref, sc_s, off_s, col_s, kb_s):
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        rb = lax.div(_iota((C, C), 0), BT)
        cb = lax.div(_iota((C, C), 1), BT)
        rb_k = lax.div(_iota((C, HALF), 0), BT)

        # the score-gradient operands, once per chunk: the diagonal tiles split (hi, lo), and
        # row block r's columns left of its diagonal tile, r = 1..3
        dm, daqk = _load(dm_ref.at[bh, rows]), _load(daqk_ref.at[bh, rows])
        _split(jnp.where(rb == cb, dm, 0.0), sc_s.at[0], sc_s.at[1])
        _split(jnp.where(rb == cb, daqk, 0.0), sc_s.at[2], sc_s.at[3])
        for r in range(1, NB):
            below = (rb == r) & (cb < r)
            off_s.at[2 * (r - 1)][...] = jnp.where(below, dm, 0.0).astype(BF16)
            off_s.at[2 * (r - 1) + 1][...] = jnp.where(below, daqk, 0.0).astype(BF16)

        for kh in range(KH):
            cols = pl.ds(kh * HALF, HALF)
            g = _load(G_ref.at[b, rows, hh, cols])
            anc = [None] + [_load(G_ref.at[b, c * C + r * BT - 1, hh, cols], _COL)[None, :] for r in range(1, NB)]
            anc_rows = jnp.zeros_like(g)
            for r in range(1, NB):
                anc_rows = jnp.where(rb_k == r, anc[r], anc_rows)

            def eb(r):                                    # e^{anc_r - G} on blocks <= r, 1 later (<= e^80)
                return jnp.exp(jnp.where(rb_k <= r, anc[r] - g, 0.0))

            def columns():                                # k, kt = k ea, qt = scale q ea, ea [C, HALF]
                kk = _load(k_ref.at[b, rows, hh, cols])
                ea = jnp.exp(g - anc_rows)                # <= 1
                return kk, kk * ea, scale * _load(q_ref.at[b, rows, hh, cols]) * ea, ea
            kk, kt, qt, _ = columns()
            # every wgmma that read these buffers (previous half) finished before the commit that
            # followed its accumulator reads
            _split(kk * jnp.exp(anc_rows - g), col_s.at[0], col_s.at[1])   # k e^{anc - G}, own anchor
            _split(kt, col_s.at[2], col_s.at[3])
            _split(qt, col_s.at[4], col_s.at[5])
            for r in range(1, NB):
                kb_s.at[r - 1][...] = (kk * eb(r)).astype(BF16)
            plgpu.commit_smem()

            def main_dots(a_m, a_q, a_b):                 # sa_m, sa_q (all blocks), sb (diagonal)
                for x, y in ((0, 0), (0, 1), (1, 0)):     # split-bf16: hi hi + hi lo + lo hi
                    plgpu.wgmma(a_m, sc_s.at[x], col_s.at[y])
                    plgpu.wgmma(a_q, sc_s.at[2 + x], col_s.at[y])
                    plgpu.wgmma(a_b, sc_s.at[x].T, col_s.at[2 + y])
                    plgpu.wgmma(a_b, sc_s.at[2 + x].T, col_s.at[4 + y])
                for r in range(1, NB):
                    plgpu.wgmma(a_m, off_s.at[2 * (r - 1)], kb_s.at[r - 1])
                    plgpu.wgmma(a_q, off_s.at[2 * (r - 1) + 1], kb_s.at[r - 1])
                return a_m[...], a_q[...], a_b[...]
            sa_m, sa_q, sb = pl.run_scoped(main_dots, *[plgpu.ACC((C, HALF), F32)] * 3)
            sb = jnp.exp(anc_rows - g) * sb
            for r in range(1, NB):

                def off_dots(acc, r=r):                   # row block r's column side
                    plgpu.wgmma(acc, off_s.at[2 * (r - 1)].T, col_s.at[2])
                    plgpu.wgmma(acc, off_s.at[2 * (r - 1) + 1].T, col_s.at[4])
                    return acc[...]
                sb = sb + eb(r) * pl.run_scoped(off_dots, plgpu.ACC((C, HALF), F32))
            plgpu.commit_smem()                           # all warps' reads of the column buffers are done
            kk, kt, qt, ea = columns()
            dq = _load(dqp_ref.at[bh, rows, cols]) + scale * ea * sa_q
            dk = _load(dkp_ref.at[bh, rows, cols]) + ea * sa_m + sb
            dG = _load(dgp_ref.at[bh, rows, cols]) + kt * sa_m + qt * sa_q - kk * sb
            last = _iota((C, HALF), 0) == C - 1
            dG = dG + jnp.where(last, _load(dgl_ref.at[bh, c, cols], _COL)[None, :], 0.0)
            dq_ref.at[b, rows, hh, cols][...] = dq.astype(BF16)
            dk_ref.at[b, rows, hh, cols][...] = dk.astype(BF16)
            dg_ref.at[b, rows, hh, cols][...] = dG

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, T, H, K), BF16), jax.ShapeDtypeStruct((B, T, H, K), BF16),
                  jax.ShapeDtypeStruct((B, T, H, K), F32)),
        scratch_types=[_operand((4, C, C)), _operand((2 * (NB - 1), C, C)), _operand((6, C, HALF)),
                       _operand((NB - 1, C, HALF))],
        grid=(BH, NT), grid_names=("bh", "c"), interpret=interpret_params(interpret))
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    return kernel(q, k, G, flat(dqp), flat(dkp), flat(dgp), flat(dgl), flat(dM), flat(dAqk))
