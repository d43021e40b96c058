"""Hopper (sm_90) Mosaic GPU kernels for KDA: TMA copies and wgmma tensor-core dots (issue 7's lever).

PREPARED, NOT YET RUN ON A GPU (2026-12-01): tested in Mosaic GPU interpret mode on CPU and lowered
for CUDA on CPU; not dispatched by ops.kda_pallas. The portable Triton kernels (fwd.py, bwd.py) stay
the default; this file holds the Hopper versions that the benchmark can time next to them.

`state_fwd`: the forward's serial state pass (fwd.state_fwd_vp's math, fla's
chunk_gated_delta_rule_fwd_h), one warpgroup per (batch, head, V block of 64 columns). Per chunk c
of 64 tokens, with the state S [K, BV] in fp32 registers:
  h_c = S (stored bf16), V' = U - W S, S <- Diag(e^{G_last}) S + Kd^T V',
the two products as wgmma with bf16 operands in swizzled SMEM (W [64, K] x S [K, 64]; Kd^T, a
transposed view of the loaded Kd [64, K], x V' [64, 64]) and fp32 accumulators: the rounding of
fwd.state_fwd_vp with common.BF16_OPERANDS (ops.KernelOptions.bf16_state_dots). This first version
loads each chunk synchronously (no software pipelining or warp specialisation yet).

Layout: unlike the Triton kernels' transposed states [V, K], the state here is S [K, V] (wgmma's
operand majors): h is [B, H, NT, K, V] and h0 / ht are [B, H, K, V].

Source: Kimi Linear (arXiv 2510.26692) chunk form as fla `chunk_kda`; Mosaic GPU API of jax 0.11.2
(jax.experimental.pallas.mosaic_gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32, BF16 = jnp.float32, jnp.bfloat16
CHUNK = 64
BLOCK_V = 64


def _operand(shape):
    """A bf16 wgmma operand buffer in SMEM: 64-element (128-byte) tiles with the 128-byte swizzle."""
    return plgpu.SMEM(shape, BF16, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def state_fwd(kd, w, u, gl, h0, *, interpret: bool | plgpu.InterpretGPUParams = False):
    """Forward serial state pass on Hopper (module docstring), chunk 64, V blocks of 64.

    Args:
      kd, w: [B, H, T, K] bf16 (intra_fwd's Kd = k e^{G_last - G} and W; the caller casts W to bf16,
        which is what the bf16-operand dot of fwd.state_fwd_vp does to it).
      u: [B, H, T, V] fp32 (U).
      gl: [B, H, T / 64, K] fp32, e^{G_last} of each chunk (a decay in (0, 1], not a log).
      h0: [B, H, K, V] fp32 initial state (NOT transposed).
      interpret: True: run in Mosaic GPU interpret mode (CPU; plgpu.InterpretGPUParams()), or the
        InterpretGPUParams to run with (e.g. detect_races=True).
    Returns: vp = V' [B, H, T, V] fp32; h [B, H, T / 64, K, V] bf16 (the state entering each chunk);
      ht [B, H, K, V] fp32 (after the last chunk).
    Raises: ValueError for T not a multiple of 64, K not in (64, 128), V not a multiple of 64, kd / w
      not bf16, u / gl / h0 not fp32, or shapes that do not match.
    """
    B, H, T, K = kd.shape
    V = u.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in (64, 128):
        raise ValueError(f"K = {K} must be 64 or 128 (wgmma tiles; one warpgroup holds S [K, 64] fp32)")
    if V % BLOCK_V:
        raise ValueError(f"V = {V} must be a multiple of {BLOCK_V}")
    if kd.dtype != BF16 or w.dtype != BF16:
        raise ValueError(f"kd and w must be bf16 (wgmma operands); got {kd.dtype}, {w.dtype}")
    if not all(x.dtype == F32 for x in (u, gl, h0)):
        raise ValueError(f"u, gl and h0 must be fp32; got {u.dtype}, {gl.dtype}, {h0.dtype}")
    if (w.shape != kd.shape or u.shape != (B, H, T, V) or gl.shape != (B, H, T // CHUNK, K)
            or h0.shape != (B, H, K, V)):
        raise ValueError(f"shapes do not match: kd {kd.shape}, w {w.shape}, u {u.shape}, gl {gl.shape}, "
                         f"h0 {h0.shape} (expected w = kd, u [B, H, T, V], gl [B, H, T/64, K], h0 [B, H, K, V])")
    C, BV, NT = CHUNK, BLOCK_V, T // CHUNK

    def body(kd_ref, w_ref, u_ref, gl_ref, h0_ref, vp_ref, h_ref, ht_ref,
             kd_s, w_s, u_s, gl_s, s_s, vn_s, vp_s, st_s, bar_in, bar_h0):
        b, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        vcols = pl.ds(iv * BV, BV)
        plgpu.copy_gmem_to_smem(h0_ref.at[b, hh, :, vcols], st_s, bar_h0.at[0])
        plgpu.barrier_wait(bar_h0.at[0])

        def step(c, S):
            tok = pl.ds(c * C, C)
            for src, dst in ((kd_ref.at[b, hh, tok], kd_s), (w_ref.at[b, hh, tok], w_s),
                             (u_ref.at[b, hh, tok, vcols], u_s), (gl_ref.at[b, hh, c], gl_s)):
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's stores have read s_s, vp_s
            s_s[...] = S.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_s, h_ref.at[b, hh, c, :, vcols])
            plgpu.barrier_wait(bar_in.at[0])

            def recall(acc):                                   # W [C, K] @ S [K, BV]
                plgpu.wgmma(acc, w_s, s_s)
                return acc[...]
            vn = plgpu.load(u_s, (), layout=plgpu.Layout.WGMMA) - pl.run_scoped(recall, plgpu.ACC((C, BV), F32))
            # every read of this chunk's loaded buffers comes before the fence below: the next
            # chunk's TMA writes into them must not race a generic-proxy read
            decay = plgpu.load(gl_s, (), layout=plgpu.Layout.WGMMA.reduce(1))
            vn_s[...] = vn.astype(BF16)
            vp_s[...] = vn
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vp_s, vp_ref.at[b, hh, tok, vcols])

            def update(acc):                                   # Kd^T [K, C] @ V' [C, BV]
                plgpu.wgmma(acc, kd_s.T, vn_s)
                return acc[...]
            return S * decay[:, None] + pl.run_scoped(update, plgpu.ACC((K, BV), F32))

        S = lax.fori_loop(0, NT, step, plgpu.load(st_s, (), layout=plgpu.Layout.WGMMA))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        st_s[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, ht_ref.at[b, hh, :, vcols])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, H, T, V), F32), jax.ShapeDtypeStruct((B, H, NT, K, V), BF16),
                  jax.ShapeDtypeStruct((B, H, K, V), F32)),
        scratch_types=[_operand((C, K)), _operand((C, K)), plgpu.SMEM((C, BV), F32), plgpu.SMEM((K,), F32),
                       _operand((K, BV)), _operand((C, BV)), plgpu.SMEM((C, BV), F32), plgpu.SMEM((K, BV), F32),
                       plgpu.Barrier(num_arrivals=4, num_barriers=1), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(B, H, V // BV), grid_names=("b", "h", "v"),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None))
    return kernel(kd, w, u, gl, h0)
