"""Backward reverse serial state pass on Hopper (Mosaic GPU: TMA, wgmma).

One warpgroup per (batch x head, V block, segment), dS^T [BV, K] fp32 in registers. Per chunk, last
to first (the Triton stage's math, triton/state_bwd.py; fla's chunk_gated_delta_rule_bwd_dhu):
  dh_c = dS^T (stored bf16);  dV' = Aqk^T dO + Kd dS;  dS^T <- dS^T Diag(e^{G_last}) + dO^T Qg - dV'^T W,
four wgmma with bf16 operands, two into each accumulator (-dV' is stored negated, exact in bf16).
dO is read token-major [B, T, H, V]. The previous chunk's inputs are loaded two buffers deep
(synchronisation as mosaic_gpu/state_fwd.py).
"""
from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu.common import (BF16, BLOCK_V, CHUNK, F32, HEAD_DIMS, WG, check_dtypes,
                                                  interpret_params, operand, store_final)
from pallas_kernels.kda.mosaic_gpu.state_fwd import begin_chunk


def state_bwd(qg, kd, w, aqk, gl, do, dht, *, interpret: bool | plgpu.InterpretGPUParams = False):
    """Backward reverse state pass on Hopper (module docstring); chunk 64, V blocks of 64.

    Args:
      qg, kd, w: [B, H, T, K] bf16 (intra_fwd's Qg, Kd, W).  aqk: [B, H, T, 64] bf16.
      gl: [B, H, T / 64, K] fp32, e^{G_last} per chunk.  do: [B, T, H, V] bf16 (token-major).
      dht: [B, H, V, K] fp32, the TRANSPOSED final-state gradient, or [B, H, NS, V, K]: the gradient
        at the end of each of NS segments (the sequence split).
      interpret: as state_fwd.
    Returns: du = dV' [B, H, T, V] bf16 (solve_bwd's operand rounding); dh [B, H, T / 64, V, K] bf16
      (the transposed gradient of the state after each chunk); dh0 fp32 of dht's shape.
    Raises: ValueError for T not a multiple of 64, K or V not in HEAD_DIMS, wrong dtypes, NS not
      dividing T / 64, or shapes that do not match.
    """
    B, H, T, K = qg.shape
    V = do.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"K = {K} and V = {V} must be in {HEAD_DIMS}")
    check_dtypes(dict(qg=qg, kd=kd, w=w, aqk=aqk, do=do), BF16)
    check_dtypes(dict(gl=gl, dht=dht), F32)
    NT = T // CHUNK
    per_segment = dht.ndim == 5
    NS = dht.shape[2] if per_segment else 1
    if (kd.shape != qg.shape or w.shape != qg.shape or aqk.shape != (B, H, T, CHUNK)
            or gl.shape != (B, H, NT, K) or do.shape != (B, T, H, V)
            or dht.shape != ((B, H, NS, V, K) if per_segment else (B, H, V, K))):
        raise ValueError(f"shapes do not match: {qg.shape=}, {kd.shape=}, {w.shape=}, {aqk.shape=}, {gl.shape=}, "
                         f"{do.shape=}, {dht.shape=}")
    if NS < 1 or NT % NS:
        raise ValueError(f"dht's segment count NS = {NS} must divide the chunk count T / 64 = {NT}")
    C, BV, L = CHUNK, BLOCK_V, NT // NS
    BH = B * H

    def body(qg_ref, kd_ref, w_ref, aqk_ref, gl_ref, do_ref, dht_ref, du_ref, dh_ref, dh0_ref,
             qg_s, kd_s, aqk_s, do_s, gl_s, w_s, ds_b, dvn_s, dv_s, st_s, bar_in, bar_h):
        bh, iv, sg = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("s")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        vcols = pl.ds(iv * BV, BV)
        plgpu.copy_gmem_to_smem(dht_ref.at[bh, sg, vcols], st_s, bar_h.at[0])

        def chunk(j):                                     # step j runs chunk c, last to first
            return sg * L + (L - 1 - j)

        def load(j, slot):
            c = chunk(j)
            tok = pl.ds(c * C, C)
            for src, dst in ((qg_ref.at[bh, tok], qg_s.at[slot]), (kd_ref.at[bh, tok], kd_s.at[slot]),
                             (aqk_ref.at[bh, tok], aqk_s.at[slot]), (do_ref.at[b, tok, hh, vcols], do_s.at[slot]),
                             (gl_ref.at[bh, c], gl_s.at[slot]), (w_ref.at[bh, tok], w_s.at[slot])):
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[slot])

        load(0, 0)
        plgpu.barrier_wait(bar_h.at[0])

        def step(j, dSt):
            slot = lax.rem(j, 2)
            c = chunk(j)
            decay = begin_chunk(j, L, slot, dSt, ds_b, load=load, bar_in=bar_in, gl_s=gl_s)
            plgpu.copy_smem_to_gmem(ds_b, dh_ref.at[bh, c, vcols])

            def dvp_dot(acc):                     # Aqk^T dO + Kd dS: [C, C] [C, BV] + [C, K] [K, BV]
                plgpu.wgmma(acc, aqk_s.at[slot].T, do_s.at[slot])
                plgpu.wgmma(acc, kd_s.at[slot], ds_b.T)
                return acc[...]
            dvp = pl.run_scoped(dvp_dot, plgpu.ACC((C, BV), F32))
            dvn_s[...] = (-dvp).astype(BF16)
            dv_s[...] = dvp.astype(BF16)                  # its consumers' rounding (bf16 operands)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_s, du_ref.at[bh, pl.ds(c * C, C), vcols])

            def ds_dot(acc):                      # dO^T Qg - dV'^T W: [BV, C] [C, K] twice
                plgpu.wgmma(acc, do_s.at[slot].T, qg_s.at[slot])
                plgpu.wgmma(acc, dvn_s.T, w_s.at[slot])
                return acc[...]
            return dSt * decay[None, :] + pl.run_scoped(ds_dot, plgpu.ACC((BV, K), F32))

        dSt = lax.fori_loop(0, L, step, plgpu.load(st_s, (), layout=WG))
        store_final(dSt, st_s, dh0_ref.at[bh, sg, vcols])  # st_s's other use, dht's load, was waited on

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, T, V), BF16), jax.ShapeDtypeStruct((BH, NT, V, K), BF16),
                  jax.ShapeDtypeStruct((BH, NS, V, K), F32)),
        scratch_types=[operand((2, C, K)), operand((2, C, K)), operand((2, C, C)), operand((2, C, BV)),
                       plgpu.SMEM((2, K), F32), operand((2, C, K)), operand((BV, K)),
                       operand((C, BV)), plgpu.SMEM((C, BV), BF16), plgpu.SMEM((BV, K), F32),
                       plgpu.Barrier(num_arrivals=6, num_barriers=2), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(BH, V // BV, NS), grid_names=("bh", "v", "s"), interpret=interpret_params(interpret),
        kernel_name="kda_state_bwd_mgpu")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    du, dh, dh0 = kernel(flat(qg), flat(kd), flat(w), flat(aqk), flat(gl), do,
                         flat(dht if per_segment else dht[:, :, None]))
    dh0 = dh0.reshape(B, H, NS, V, K)
    return du.reshape(B, H, T, V), dh.reshape(B, H, NT, V, K), (dh0 if per_segment else dh0[:, :, 0])
