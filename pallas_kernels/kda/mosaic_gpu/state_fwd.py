"""Forward serial state pass with the output fused in, on Hopper (Mosaic GPU: TMA, wgmma).

One warpgroup per (batch x head, V block of 64 rows of the transposed state, segment). Per chunk c of
64 tokens, with S^T [BV, K] fp32 in registers (the Triton stage's math, triton/state_fwd.py, fused
with its output kernel, as fla's and jla's fused forward):
  h_c = S^T (stored bf16 when the backward needs it);  V' = U - W S;
  o_c = Qg S + Aqk V' (stored bf16, token-major);      S^T <- S^T Diag(e^{G_last}) + V'^T Kd.
Every product is a wgmma with bf16 operands in 128-byte-swizzled SMEM and an fp32 accumulator
(V' and S rounded to bf16 as operands). The next chunk's TMA loads (Kd, W, U, e^{G_last}, Qg, Aqk)
are issued before this chunk's dots (two buffers each), so only the first load is exposed.

Synchronisation: each step waits for the previous step's TMA stores to have read SMEM (a wait that
ends in a warpgroup barrier) before it issues the next chunk's loads into the buffers the previous
step's wgmma read, and fences (`commit_smem`) between every generic SMEM write and the TMA store or
wgmma that reads it. Tested with the interpreter's race detector (which runs wgmma synchronously, so
the first rule is argued, not tested: a warp's wgmma wait covers only its own part of the
warpgroup's wgmma).
"""
from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu.common import (BF16, BLOCK_V, CHUNK, F32, HEAD_DIMS, WG, check_dtypes,
                                                  interpret_params, operand, store_final)


def begin_chunk(j, L, slot, state, state_b, *, load, bar_in, gl_s):
    """The start of serial step j (of L), shared with state_bwd: wait until step j - 1's stores have
    read SMEM (the wait ends in a warpgroup barrier, so every warp's wgmma of step j - 1 is done),
    issue the next chunk's loads into buffer 1 - slot, wait for this chunk's, read e^{G_last} and
    store the carried state as the bf16 operand `state_b`, then fence. Returns the decay [K]."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(j + 1 < L)
    def _():
        load(j + 1, 1 - slot)

    plgpu.barrier_wait(bar_in.at[slot])
    decay = plgpu.load(gl_s.at[slot], (), layout=WG.reduce(0))
    state_b[...] = state.astype(BF16)
    plgpu.commit_smem()
    return decay


def check_serial_args(kd, w, u, gl, h0):
    """The checks of the forward pass's common arguments; returns (B, H, T, K, V, NT, per_segment, NS)."""
    B, H, T, K = kd.shape
    V = u.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"K = {K} and V = {V} must be in {HEAD_DIMS}")
    check_dtypes(dict(kd=kd, w=w), BF16)
    check_dtypes(dict(u=u), BF16)
    check_dtypes(dict(gl=gl, h0=h0), F32)
    NT = T // CHUNK
    per_segment = h0.ndim == 5
    NS = h0.shape[2] if per_segment else 1
    if (w.shape != kd.shape or u.shape != (B, H, T, V) or gl.shape != (B, H, NT, K)
            or h0.shape != ((B, H, NS, V, K) if per_segment else (B, H, V, K))):
        raise ValueError(f"shapes do not match: {kd.shape=}, {w.shape=}, {u.shape=}, {gl.shape=}, {h0.shape=} "
                         "(expected w = kd, u [B, H, T, V], gl [B, H, T/64, K], h0 [B, H, V, K] or [B, H, NS, V, K])")
    if NS < 1 or NT % NS:
        raise ValueError(f"h0's segment count NS = {NS} must divide the chunk count T / 64 = {NT}")
    return B, H, T, K, V, NT, per_segment, NS


def state_fwd(kd, w, u, gl, h0, qg, aqk, *, write_states: bool = True,
              interpret: bool | plgpu.InterpretGPUParams = False):
    """Forward state pass and output on Hopper (module docstring); chunk 64, V blocks of 64.

    Args:
      kd, w, qg: [B, H, T, K] bf16 (intra_fwd's Kd = k e^{G_last - G}, W, Qg = scale q e^G).
      u: [B, H, T, V] bf16 (U).  aqk: [B, H, T, 64] bf16 (lower-triangular per chunk).
      gl: [B, H, T / 64, K] fp32, e^{G_last} per chunk (a decay in (0, 1], not a log).
      h0: [B, H, V, K] fp32 initial state, TRANSPOSED, or [B, H, NS, V, K]: the start of each of NS
        segments (the sequence split; NS divides T / 64).
      write_states: also write h (the differentiated forward's; forward-only calls skip it).
      interpret: True: Mosaic GPU interpret mode (CPU), or the InterpretGPUParams to run with.
    Returns: o [B, T, H, V] bf16 (token-major); h [B, H, T / 64, V, K] bf16 (the transposed state
      entering each chunk) or None; ht fp32 of h0's shape (after the last chunk / each segment).
    Raises: ValueError for T not a multiple of 64, K or V not in HEAD_DIMS, wrong dtypes, NS not
      dividing T / 64, or shapes that do not match. SMEM: 193 KiB at K = V = 128.
    """
    B, H, T, K, V, NT, per_segment, NS = check_serial_args(kd, w, u, gl, h0)
    check_dtypes(dict(qg=qg, aqk=aqk), BF16)
    if qg.shape != kd.shape or aqk.shape != (B, H, T, CHUNK):
        raise ValueError(f"qg must be [B, H, T, K] = {kd.shape} and aqk [B, H, T, {CHUNK}]; got {qg.shape=}, "
                         f"{aqk.shape=}")
    C, BV, L = CHUNK, BLOCK_V, NT // NS
    BH = B * H

    def body(kd_ref, w_ref, u_ref, gl_ref, qg_ref, aqk_ref, h0_ref, o_ref, *rest):
        if write_states:
            h_ref, ht_ref, *scratch = rest
        else:
            ht_ref, *scratch = rest
        kd_s, u_s, gl_s, qg_s, aqk_s, st_s, w_s, st_b, vn_s, o_s, bar_in, bar_h0 = scratch
        bh, iv, sg = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("s")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        vrows = pl.ds(iv * BV, BV)

        def load(j, slot):                                # chunk j of this segment into buffer `slot`
            c = sg * L + j
            tok = pl.ds(c * C, C)
            for src, dst in ((kd_ref.at[bh, tok], kd_s.at[slot]), (u_ref.at[bh, tok, vrows], u_s.at[slot]),
                             (gl_ref.at[bh, c], gl_s.at[slot]), (qg_ref.at[bh, tok], qg_s.at[slot]),
                             (aqk_ref.at[bh, tok], aqk_s.at[slot]), (w_ref.at[bh, tok], w_s.at[slot])):
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[slot])

        load(0, 0)
        plgpu.copy_gmem_to_smem(h0_ref.at[bh, sg, vrows], st_s, bar_h0.at[0])
        plgpu.barrier_wait(bar_h0.at[0])
        St0 = plgpu.load(st_s, (), layout=WG)

        def step(j, St):
            slot = lax.rem(j, 2)
            c = sg * L + j
            decay = begin_chunk(j, L, slot, St, st_b, load=load, bar_in=bar_in, gl_s=gl_s)
            if write_states:
                plgpu.copy_smem_to_gmem(st_b, h_ref.at[bh, c, vrows])

            def recall(acc):                                   # W [C, K] @ S [K, BV]
                plgpu.wgmma(acc, w_s.at[slot], st_b.T)
                return acc[...]
            vn = plgpu.load(u_s.at[slot], (), layout=WG).astype(F32) - pl.run_scoped(recall, plgpu.ACC((C, BV), F32))
            vn_s[...] = vn.astype(BF16)
            plgpu.commit_smem()

            def output_and_update(o_acc, s_acc):
                plgpu.wgmma(o_acc, qg_s.at[slot], st_b.T)     # Qg [C, K] @ S [K, BV]
                plgpu.wgmma(o_acc, aqk_s.at[slot], vn_s)      # + Aqk [C, C] @ V' [C, BV]
                plgpu.wgmma(s_acc, vn_s.T, kd_s.at[slot])     # V'^T [BV, C] @ Kd [C, K]
                return o_acc[...], s_acc[...]
            o, upd = pl.run_scoped(output_and_update, plgpu.ACC((C, BV), F32), plgpu.ACC((BV, K), F32))
            o_s[...] = o.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(c * C, C), hh, vrows])
            return St * decay[None, :] + upd

        St = lax.fori_loop(0, L, step, St0)
        store_final(St, st_s, ht_ref.at[bh, sg, vrows])    # st_s's other use, h0's load, was waited on

    out_type = [jax.ShapeDtypeStruct((B, T, H, V), BF16)]
    if write_states:
        out_type.append(jax.ShapeDtypeStruct((BH, NT, V, K), BF16))
    out_type.append(jax.ShapeDtypeStruct((BH, NS, V, K), F32))
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type),
        scratch_types=[operand((2, C, K)), plgpu.SMEM((2, C, BV), BF16), plgpu.SMEM((2, K), F32),
                       operand((2, C, K)), operand((2, C, C)), plgpu.SMEM((BV, K), F32), operand((2, C, K)),
                       operand((BV, K)), operand((C, BV)), operand((C, BV)),
                       plgpu.Barrier(num_arrivals=6, num_barriers=2), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(BH, V // BV, NS), grid_names=("bh", "v", "s"), interpret=interpret_params(interpret),
        kernel_name="kda_state_fwd_mgpu")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    outs = kernel(flat(kd), flat(w), flat(u), flat(gl), flat(qg), flat(aqk), flat(h0 if per_segment else h0[:, :, None]))
    o, ht = outs[0], outs[-1].reshape(B, H, NS, V, K)
    h = outs[1].reshape(B, H, NT, V, K) if write_states else None
    return o, h, (ht if per_segment else ht[:, :, 0])
