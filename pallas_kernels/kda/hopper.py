"""Hopper (sm_90) Mosaic GPU kernels for KDA: TMA copies and wgmma tensor-core dots (issue 7's lever).

`state_fwd`: the forward's serial state pass (fwd.state_fwd_vp's math and layouts, fla's
chunk_gated_delta_rule_fwd_h), one warpgroup per (batch x head, V block of 64 rows of the
transposed state, segment). Per chunk c of 64 tokens, with the transposed state S^T [BV, K] in fp32
registers:
  h_c = S^T (stored bf16), V' = U - W S, S^T <- S^T Diag(e^{G_last}) + V'^T Kd,
the two products as wgmma with bf16 operands in swizzled SMEM (W [64, K] x (S^T)^T, a transposed
view of the S^T buffer; V'^T, a transposed view of the V' buffer, x Kd [64, K]) and fp32
accumulators: the rounding of fwd.state_fwd_vp with common.BF16_OPERANDS (the op's default
bf16_state_dots). W arrives in fp32 and is rounded to bf16 in the kernel, or (the op's default,
ops.KernelOptions.hopper_bf16_w) already in bf16, copied straight into a double-buffered operand.
The next chunk's TMA loads (Kd, W, U, e^{G_last}) are issued before this chunk's dots (two buffers
per input), so only the first chunk's load is exposed.

`state_output_fwd`: state_fwd with the output fused in (the default forward on Hopper,
ops.KernelOptions.hopper_fused_output): per chunk also o = Qg S + Aqk V' (two more wgmma into one
accumulator), stored bf16 token-major; V' stays in SMEM and the per-chunk states are written only
when asked (the differentiated forward needs them).

`state_bwd`: the backward's reverse serial pass (bwd.state_bwd's math and layouts, fla's
chunk_gated_delta_rule_bwd_dhu), one warpgroup per (batch x head, V block, segment), dS^T [BV, K] in
fp32 registers. Per chunk, last to first:
  dh_c = dS^T (stored bf16), dV' = Aqk^T dO + Kd dS, dS^T <- dS^T Diag(e^{G_last}) + dO^T Qg - dV'^T W,
four wgmma with bf16 operands (bwd.state_bwd with common.BF16_OPERANDS, the op's default
bf16_state_bwd_dots), two into each accumulator (-dV' is stored negated, exact in bf16). dO is read
token-major [B, T, H, V] as the op has it. The previous chunk's Qg, Kd, Aqk, dO, e^{G_last} are
loaded two buffers deep; an fp32 W (32 KiB a chunk) has one buffer, refilled as soon as this chunk's
W is rounded into the bf16 operand buffer; a bf16 W (hopper_bf16_w) is loaded two deep like the
rest, straight into its operand buffers.

Layouts: the same as fwd.state_fwd_vp (the transposed states [V, K] of the Triton kernels), so the
op can call either: h [B, H, NT, V, K], h0 / ht [B, H, V, K] or per segment [B, H, NS, V, K].

Synchronisation: each step waits for the previous step's TMA stores to have read SMEM (a wait that
ends in a warpgroup barrier) before it issues the next chunk's loads into the buffers the previous
step's wgmma read, and fences (`commit_smem`, a proxy fence plus a warpgroup barrier) between every
generic SMEM write and the TMA store or wgmma that reads it, and between every generic read of a
loaded buffer and the load that refills it. Tested with the interpreter's race detector, which runs
wgmma synchronously (so the first rule is argued, not tested).

Measured (H200, 2026-12-01, kda_pallas_notes.md rounds 7 to 11; the load-after-barrier order of
the first rule came after those runs, see round 12). Dispatch: ops.KernelOptions hopper_state_fwd,
hopper_fused_output and hopper_state_bwd.
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
HEAD_DIMS = (64, 128)      # K: wgmma tiles; one warpgroup holds S^T [64, K] fp32 (<= 64 registers per thread)


def _operand(shape):
    """A bf16 wgmma operand buffer in SMEM: 64-element (128-byte) tiles with the 128-byte swizzle."""
    return plgpu.SMEM(shape, BF16, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


# Helpers shared by the Mosaic GPU kernels of the intra-chunk backward (hopper_bwd.py,
# hopper_score_bwd.py): register layouts, loads, split-bf16 operands, TMA staging buffers.
_WG = plgpu.Layout.WGMMA
_ROW, _COL = _WG.reduce(1), _WG.reduce(0)      # a [C] per-row and a [N] per-column vector


def _iota(shape, dim):
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), _WG)


def _load(ref, layout=_WG, smem=False):
    """ref into registers in `layout`, as fp32: Mosaic GPU's "optimized" transfer for the bf16
    operand buffers (smem=True), else the plain one (a vector load per register; GMEM, or the fp32
    staging buffers)."""
    return plgpu.load(ref, layout=layout, optimized=smem).astype(F32)


def _split(x, hi_s, lo_s):
    """x fp32 -> hi = bf16(x), lo = bf16(x - hi) into two operand buffers (split-bf16 operands)."""
    hi = x.astype(BF16)
    hi_s[...] = hi
    lo_s[...] = (x - hi.astype(F32)).astype(BF16)


def _staging(shape, dtype):
    """A TMA destination in SMEM, tiled and swizzled for its minor dimension (128-byte swizzle for
    64 bf16 / 32 fp32 columns), read back into registers with _load(..., smem=False)."""
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)))


def _check_shapes(arrays, want, context):
    """Raises a ValueError naming every array of `arrays` ({name: array}) whose shape is not
    want[name], with `context` (what the expected shapes follow from)."""
    bad = {n: a.shape for n, a in arrays.items() if a.shape != want[n]}
    if bad:
        raise ValueError(f"shapes do not match {context}: {bad}; expected { {n: want[n] for n in bad} }")


# The intra-chunk kernels' compiler parameters: approximate exp (ex2.approx.ftz after a multiply by
# log2(e)) instead of the precise libdevice expf, which costs ~10 instructions more per element
# (round 17 of kda_pallas_notes.md: 314M -> 220M instructions in the forward kernel a). Not the
# rounding of the Triton kernels they replace (Pallas-Triton lowers jnp.exp to libdevice __nv_expf):
# the relative error grows with |x| (the log2(e) product's rounding, ~|x| 2^-24: ~5e-6 at the bounded
# gates' largest exponent, 80) against bf16's 4e-3; measured, the op's errors vs the fp32
# recurrence moved by < 1e-5 (o 4.0019e-3 -> 4.0001e-3, kda_round17_h200/v4_ab_*.json).
EXP_PARAMS = plgpu.CompilerParams(approx_math=True)


def _check_qk(q, k):
    """The checks shared by the intra-chunk kernels that take token-major q, k [B, T, H, K]: T a
    multiple of CHUNK, K in HEAD_DIMS, both bf16 (ValueError naming what is wrong). Returns
    (B, T, H, K)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {q.shape}")
    B, T, H, K = q.shape
    if T % CHUNK:
        raise ValueError(f"q's T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS:
        raise ValueError(f"K = {K} must be in {HEAD_DIMS} (wgmma tiles of 64 columns)")
    if q.dtype != BF16 or k.dtype != BF16:
        raise ValueError(f"q and k must be bf16; got {q.dtype}, {k.dtype}")
    return B, T, H, K


def interpret_params(interpret):
    """plgpu.kernel's `interpret` argument from ours: False / None -> compiled, True -> default
    Mosaic GPU interpret mode (CPU), or an InterpretGPUParams as given (e.g. detect_races=True)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def is_hopper(device=None) -> bool:
    """Whether `device` (default: JAX's first device) is a CUDA GPU of compute capability 9.x."""
    device = jax.devices()[0] if device is None else device
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def _store_final(state, buf, dst):
    """A kernel's last step: the fp32 state [BV, K] from registers through the SMEM buffer `buf`
    (free by then) to its GMEM slice `dst`, waiting for the store to finish."""
    buf[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst)
    plgpu.wait_smem_to_gmem(0)


def _check_forward_args(kd, w, u, gl, h0):
    """Validates state_fwd's / state_output_fwd's common arguments (see state_fwd's Raises); returns
    (B, H, T, K, V, NT, per_segment, NS)."""
    B, H, T, K = kd.shape
    V = u.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS:
        raise ValueError(f"K = {K} must be one of {HEAD_DIMS} (wgmma tiles; one warpgroup holds S^T [64, K] fp32)")
    if V % BLOCK_V:
        raise ValueError(f"V = {V} must be a multiple of {BLOCK_V}")
    if kd.dtype != BF16:
        raise ValueError(f"kd must be bf16 (a wgmma operand); got {kd.dtype}")
    if not all(x.dtype == F32 for x in (u, gl, h0)) or w.dtype not in (F32, BF16):
        raise ValueError(f"u, gl and h0 must be fp32 and w fp32 or bf16; got {u.dtype}, {gl.dtype}, {h0.dtype}, "
                         f"w {w.dtype}")
    NT = T // CHUNK
    per_segment = h0.ndim == 5
    NS = h0.shape[2] if per_segment else 1
    if (w.shape != kd.shape or u.shape != (B, H, T, V) or gl.shape != (B, H, NT, K)
            or h0.shape != ((B, H, NS, V, K) if per_segment else (B, H, V, K))):
        raise ValueError(f"shapes do not match: kd {kd.shape}, w {w.shape}, u {u.shape}, gl {gl.shape}, "
                         f"h0 {h0.shape} (expected w = kd, u [B, H, T, V], gl [B, H, T/64, K], "
                         "h0 [B, H, V, K] or [B, H, NS, V, K])")
    if NS < 1 or NT % NS:
        raise ValueError(f"h0's segment count NS = {NS} must divide the chunk count T / 64 = {NT}")
    return B, H, T, K, V, NT, per_segment, NS


def state_fwd(kd, w, u, gl, h0, *, interpret: bool | plgpu.InterpretGPUParams = False):
    """Forward serial state pass on Hopper (module docstring); chunk 64, V blocks of 64.

    Args:
      kd: [B, H, T, K] bf16 (intra_fwd's Kd = k e^{G_last - G}).
      w: [B, H, T, K] fp32 (intra_fwd's W; rounded to bf16 in the kernel as the bf16-operand dot of
        fwd.state_fwd_vp does), or bf16 (then copied straight into a double-buffered operand; the
        fused forward kernel's with ops.KernelOptions.hopper_bf16_w).
      u: [B, H, T, V] fp32 (U).
      gl: [B, H, T / 64, K] fp32, e^{G_last} of each chunk (a decay in (0, 1], not a log).
      h0: [B, H, V, K] fp32 initial state, TRANSPOSED (as fwd.state_fwd_vp), or [B, H, NS, V, K]: the
        start of each of NS segments of T / NS tokens (the sequence split's starts; NS divides T / 64).
      interpret: True: Mosaic GPU interpret mode (CPU; plgpu.InterpretGPUParams()), or the
        InterpretGPUParams to run with (e.g. detect_races=True).
    Returns: vp = V' [B, H, T, V] fp32; h [B, H, T / 64, V, K] bf16 (the transposed state entering each
      chunk); ht fp32 of h0's shape (the state after the last chunk of the sequence / each segment).
    Raises: ValueError for T not a multiple of 64, K not in HEAD_DIMS, V not a multiple of 64, kd not
      bf16, u / gl / h0 not fp32, w neither fp32 nor bf16, NS not dividing T / 64, or shapes that do
      not match.
    """
    B, H, T, K, V, NT, per_segment, NS = _check_forward_args(kd, w, u, gl, h0)
    C, BV, L = CHUNK, BLOCK_V, NT // NS
    BH = B * H
    w_bf16 = w.dtype == BF16

    def body(kd_ref, w_ref, u_ref, gl_ref, h0_ref, vp_ref, h_ref, ht_ref,
             kd_s, w32_s, u_s, gl_s, w_s, st_b, vn_s, vp_s, st_s, bar_in, bar_h0):
        bh, iv, sg = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("s")
        vrows = pl.ds(iv * BV, BV)
        plgpu.copy_gmem_to_smem(h0_ref.at[bh, sg, vrows], st_s, bar_h0.at[0])

        def load(j, slot):                                # chunk j of this segment into buffer `slot`
            c = sg * L + j
            tok = pl.ds(c * C, C)
            # W: fp32 into its staging buffer (rounded below), or bf16 straight into its operand
            w_dst = w_s.at[slot] if w_bf16 else w32_s.at[slot]
            for src, dst in ((kd_ref.at[bh, tok], kd_s.at[slot]), (w_ref.at[bh, tok], w_dst),
                             (u_ref.at[bh, tok, vrows], u_s.at[slot]), (gl_ref.at[bh, c], gl_s.at[slot])):
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[slot])

        load(0, 0)
        plgpu.barrier_wait(bar_h0.at[0])

        def step(j, St):
            slot = lax.rem(j, 2)
            c = sg * L + j

            # chunk j - 1's stores have read st_b, vp_s; the wait ends in a warpgroup barrier, after
            # which every warp's wgmma of chunk j - 1 has finished reading the other buffer
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(j + 1 < L)
            def _():             # the other buffer's last reads (chunk j - 1) are fenced or waited on
                load(j + 1, 1 - slot)

            plgpu.barrier_wait(bar_in.at[slot])
            if not w_bf16:
                w_s[...] = plgpu.load(w32_s.at[slot], (), layout=plgpu.Layout.WGMMA).astype(BF16)
            w_op = w_s.at[slot] if w_bf16 else w_s
            st_b[...] = St.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_b, h_ref.at[bh, c, vrows])

            def recall(acc):                                   # W [C, K] @ S [K, BV]
                plgpu.wgmma(acc, w_op, st_b.T)
                return acc[...]
            vn = (plgpu.load(u_s.at[slot], (), layout=plgpu.Layout.WGMMA)
                  - pl.run_scoped(recall, plgpu.ACC((C, BV), F32)))
            # every generic read of this chunk's loaded buffers comes before the fence below: the
            # TMA load into them two chunks on (issued at chunk j + 1) must not race it
            decay = plgpu.load(gl_s.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
            vn_s[...] = vn.astype(BF16)
            vp_s[...] = vn
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vp_s, vp_ref.at[bh, pl.ds(c * C, C), vrows])

            def update(acc):                                   # V'^T [BV, C] @ Kd [C, K]
                plgpu.wgmma(acc, vn_s.T, kd_s.at[slot])
                return acc[...]
            return St * decay[None, :] + pl.run_scoped(update, plgpu.ACC((BV, K), F32))

        St = lax.fori_loop(0, L, step, plgpu.load(st_s, (), layout=plgpu.Layout.WGMMA))
        _store_final(St, st_s, ht_ref.at[bh, sg, vrows])   # st_s's other use, h0's load, was waited on

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, T, V), F32), jax.ShapeDtypeStruct((BH, NT, V, K), BF16),
                  jax.ShapeDtypeStruct((BH, NS, V, K), F32)),
        scratch_types=[_operand((2, C, K)), plgpu.SMEM((2, 8, 32) if w_bf16 else (2, C, K), F32),   # (bf16 W: unused)
                       plgpu.SMEM((2, C, BV), F32), plgpu.SMEM((2, K), F32),
                       _operand((2, C, K) if w_bf16 else (C, K)), _operand((BV, K)), _operand((C, BV)),
                       plgpu.SMEM((C, BV), F32), plgpu.SMEM((BV, K), F32),
                       plgpu.Barrier(num_arrivals=4, num_barriers=2), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(BH, V // BV, NS), grid_names=("bh", "v", "s"), interpret=interpret_params(interpret),
        kernel_name="kda_state_fwd_hopper")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    h0s = h0 if per_segment else h0[:, :, None]
    vp, h, ht = kernel(flat(kd), flat(w), flat(u), flat(gl), flat(h0s))
    ht = ht.reshape(B, H, NS, V, K)
    return vp.reshape(B, H, T, V), h.reshape(B, H, NT, V, K), (ht if per_segment else ht[:, :, 0])


def _begin_chunk(j, L, slot, state, state_b, *, load, load_w, bar_in, bar_w, w32_s, w_s, gl_s):
    """The start of serial step j (of L) shared by state_output_fwd and state_bwd, whose fp32 W buffer
    is single: issue the next chunk's loads into the other buffer `1 - slot` (its last reads, at step
    j - 1, are fenced or waited on), wait for this chunk's loads and W, wait until step j - 1's
    stores have read the SMEM they store from, round W into its bf16 operand buffer, read e^{G_last},
    store the carried (transposed) state as the bf16 operand `state_b`, fence (which also orders the
    reads of W's buffer and e^{G_last} before the loads that overwrite them), then refill W's buffer
    with the next chunk's. Returns the decay [K] in the WGMMA column layout. load_w None: W is bf16
    and arrives with the chunk's other loads, straight into a double-buffered operand (no rounding
    step, no W barrier).

    Order: the next chunk's loads are issued only after the wait for step j - 1's stores, whose
    lowering ends in a warpgroup barrier: a warp's wgmma wait covers only its own part of the
    warpgroup's wgmma, so without a barrier the elected thread's TMA could overwrite an operand
    buffer another warp's part of step j - 1's last wgmma still reads (the interpreter runs wgmma
    synchronously and cannot show this; found in review, 2026-12-01)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(j + 1 < L)
    def _():
        load(j + 1, 1 - slot)

    plgpu.barrier_wait(bar_in.at[slot])
    if load_w is not None:
        plgpu.barrier_wait(bar_w.at[0])
        w_s[...] = plgpu.load(w32_s, (), layout=plgpu.Layout.WGMMA).astype(BF16)
    decay = plgpu.load(gl_s.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
    state_b[...] = state.astype(BF16)
    plgpu.commit_smem()

    if load_w is not None:
        @pl.when(j + 1 < L)
        def _():
            load_w(j + 1)
    return decay


def state_output_fwd(kd, w, u, gl, h0, qg, aqk, *, out_dtype=BF16, write_states: bool = True,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """The forward state pass with the output fused in (jla's and fla's fused forward; round 11 of
    kda_pallas_notes.md): per chunk, besides state_fwd's two dots, o = Qg S + Aqk V' (two more
    wgmma into one accumulator, the same bf16 operands as fwd.output_fwd with
    common.BF16_OPERANDS) is stored token-major, so V' never goes to HBM and, with
    write_states=False (forward-only calls), neither do the per-chunk states.

    Args: kd, w, u, gl, h0 as state_fwd; qg [B, H, T, K] bf16 (intra_fwd's Qg = scale q e^{G});
      aqk [B, H, T, 64] bf16 (lower-triangular per chunk); out_dtype: o's dtype (bf16);
      write_states: also write h; interpret: as state_fwd.
    w may also be bf16 (see SMEM below).
    Returns: o [B, T, H, V] out_dtype (the user's token-major layout); h [B, H, T / 64, V, K] bf16 or
      None (write_states=False); ht as state_fwd.
    Raises: ValueError as state_fwd, for qg / aqk not bf16 of shapes [B, H, T, K] / [B, H, T, 64], and
      for out_dtype not bf16.
    SMEM: W's fp32 buffer is single (refilled after the fence that follows its rounding, as state_bwd)
    and also stages h0 and ht: 193 KiB at K = 128. With w bf16 (the fused forward kernel's, ops.
    KernelOptions.hopper_bf16_w) W is TMA-copied with the chunk's other inputs straight into a
    double-buffered operand (no rounding step in the serial loop): 209 KiB.
    """
    B, H, T, K, V, NT, per_segment, NS = _check_forward_args(kd, w, u, gl, h0)
    if jnp.dtype(out_dtype) != jnp.dtype(BF16):
        raise ValueError(f"out_dtype must be bf16 (o is staged in a 128-byte-swizzled bf16 buffer); got {out_dtype}")
    if qg.dtype != BF16 or aqk.dtype != BF16 or qg.shape != kd.shape or aqk.shape != (B, H, T, CHUNK):
        raise ValueError(f"qg must be bf16 [B, H, T, K] = {kd.shape} and aqk bf16 [B, H, T, {CHUNK}]; got "
                         f"qg {qg.dtype} {qg.shape}, aqk {aqk.dtype} {aqk.shape}")
    C, BV, L = CHUNK, BLOCK_V, NT // NS
    BH = B * H
    w_bf16 = w.dtype == BF16

    def body(kd_ref, w_ref, u_ref, gl_ref, qg_ref, aqk_ref, h0_ref, o_ref, *rest):
        if write_states:
            h_ref, ht_ref, *scratch = rest
        else:
            ht_ref, *scratch = rest
        kd_s, u_s, gl_s, qg_s, aqk_s, w32_s, w_s, st_b, vn_s, o_s, bar_in, bar_w, bar_h0 = scratch
        bh, iv, sg = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("s")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        vrows = pl.ds(iv * BV, BV)

        def load(j, slot):                                # chunk j of this segment into buffer `slot`
            c = sg * L + j
            tok = pl.ds(c * C, C)
            copies = [(kd_ref.at[bh, tok], kd_s.at[slot]), (u_ref.at[bh, tok, vrows], u_s.at[slot]),
                      (gl_ref.at[bh, c], gl_s.at[slot]), (qg_ref.at[bh, tok], qg_s.at[slot]),
                      (aqk_ref.at[bh, tok], aqk_s.at[slot])]
            if w_bf16:                                    # W straight into its (double) operand buffer
                copies.append((w_ref.at[bh, tok], w_s.at[slot]))
            for src, dst in copies:
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[slot])

        def load_w(j):
            plgpu.copy_gmem_to_smem(w_ref.at[bh, pl.ds((sg * L + j) * C, C)], w32_s, bar_w.at[0])

        load(0, 0)
        plgpu.copy_gmem_to_smem(h0_ref.at[bh, sg, vrows], w32_s, bar_h0.at[0])   # h0 staged in W's buffer
        plgpu.barrier_wait(bar_h0.at[0])
        St0 = plgpu.load(w32_s, (), layout=plgpu.Layout.WGMMA)
        if not w_bf16:
            plgpu.commit_smem()                            # the read above before W's load overwrites it
            load_w(0)

        def step(j, St):
            slot = lax.rem(j, 2)
            c = sg * L + j
            rows = pl.ds(c * C, C)

            decay = _begin_chunk(j, L, slot, St, st_b, load=load, load_w=None if w_bf16 else load_w,
                                 bar_in=bar_in, bar_w=bar_w, w32_s=w32_s, w_s=w_s, gl_s=gl_s)
            if write_states:
                plgpu.copy_smem_to_gmem(st_b, h_ref.at[bh, c, vrows])
            w_op = w_s.at[slot] if w_bf16 else w_s

            def recall(acc):                                   # W [C, K] @ S [K, BV]
                plgpu.wgmma(acc, w_op, st_b.T)
                return acc[...]
            vn = (plgpu.load(u_s.at[slot], (), layout=plgpu.Layout.WGMMA)
                  - pl.run_scoped(recall, plgpu.ACC((C, BV), F32)))
            vn_s[...] = vn.astype(BF16)
            plgpu.commit_smem()

            def output_and_update(o_acc, s_acc):
                plgpu.wgmma(o_acc, qg_s.at[slot], st_b.T)     # Qg [C, K] @ S [K, BV]
                plgpu.wgmma(o_acc, aqk_s.at[slot], vn_s)      # + Aqk [C, C] @ V' [C, BV]
                plgpu.wgmma(s_acc, vn_s.T, kd_s.at[slot])     # V'^T [BV, C] @ Kd [C, K]
                return o_acc[...], s_acc[...]
            o, upd = pl.run_scoped(output_and_update, plgpu.ACC((C, BV), F32), plgpu.ACC((BV, K), F32))
            o_s[...] = o.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, rows, hh, vrows])
            return St * decay[None, :] + upd

        St = lax.fori_loop(0, L, step, St0)
        # W's fp32 buffer (with bf16 W only h0's and ht's): its last TMA load was waited on, its
        # reads fenced
        _store_final(St, w32_s, ht_ref.at[bh, sg, vrows])

    out_type = [jax.ShapeDtypeStruct((B, T, H, V), out_dtype)]
    if write_states:
        out_type.append(jax.ShapeDtypeStruct((BH, NT, V, K), BF16))
    out_type.append(jax.ShapeDtypeStruct((BH, NS, V, K), F32))
    out_operand = plgpu.SMEM((C, BV), out_dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                             plgpu.SwizzleTransform(128)))
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type),
        scratch_types=[_operand((2, C, K)), plgpu.SMEM((2, C, BV), F32), plgpu.SMEM((2, K), F32),
                       _operand((2, C, K)), _operand((2, C, C)), plgpu.SMEM((C, K), F32),
                       _operand((2, C, K) if w_bf16 else (C, K)),
                       _operand((BV, K)), _operand((C, BV)), out_operand,
                       plgpu.Barrier(num_arrivals=6 if w_bf16 else 5, num_barriers=2),
                       plgpu.Barrier(num_arrivals=1, num_barriers=1), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(BH, V // BV, NS), grid_names=("bh", "v", "s"), interpret=interpret_params(interpret),
        kernel_name="kda_state_output_fwd_hopper")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    h0s = h0 if per_segment else h0[:, :, None]
    outs = kernel(flat(kd), flat(w), flat(u), flat(gl), flat(qg), flat(aqk), flat(h0s))
    o, ht = outs[0], outs[-1].reshape(B, H, NS, V, K)
    h = outs[1].reshape(B, H, NT, V, K) if write_states else None
    return o, h, (ht if per_segment else ht[:, :, 0])


def state_bwd(qg, kd, w, aqk, gl, do, dht, *, interpret: bool | plgpu.InterpretGPUParams = False):
    """Backward reverse serial state pass on Hopper (module docstring); chunk 64, V blocks of 64.

    Args:
      qg, kd: [B, H, T, K] bf16 (intra_fwd's Qg, Kd).
      w: [B, H, T, K] fp32 (W; rounded to bf16 in the kernel, as bwd.state_bwd's bf16-operand dot),
        or bf16 (copied with the chunk's other inputs straight into a double-buffered operand).
      aqk: [B, H, T, 64] bf16 (intra_fwd's Aqk, lower-triangular per chunk).
      gl: [B, H, T / 64, K] fp32, e^{G_last} of each chunk (a decay, not a log).
      do: [B, T, H, V] bf16, the output gradient (token-major, the user's layout).
      dht: [B, H, V, K] fp32, the TRANSPOSED gradient of the final state, or [B, H, NS, V, K]: the
        gradient at the end of each of NS segments (the sequence split; NS divides T / 64).
      interpret: as state_fwd.
    Returns: du = dV' [B, H, T, V] fp32; dh [B, H, T / 64, V, K] bf16 (the transposed gradient of the
      state after each chunk); dh0 fp32 of dht's shape (at the start of the sequence / each segment).
    Raises: ValueError for T not a multiple of 64, K not in HEAD_DIMS, V not a multiple of 64, qg / kd /
      aqk / do not bf16, gl / dht not fp32, w neither fp32 nor bf16, NS not dividing T / 64, or
      shapes that do not match.
    """
    B, H, T, K = qg.shape
    V = do.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS:
        raise ValueError(f"K = {K} must be one of {HEAD_DIMS} (wgmma tiles; one warpgroup holds dS^T [64, K] fp32)")
    if V % BLOCK_V:
        raise ValueError(f"V = {V} must be a multiple of {BLOCK_V}")
    if not all(x.dtype == BF16 for x in (qg, kd, aqk, do)):
        raise ValueError(f"qg, kd, aqk and do must be bf16 (wgmma operands); got {qg.dtype}, {kd.dtype}, "
                         f"{aqk.dtype}, {do.dtype}")
    if not all(x.dtype == F32 for x in (gl, dht)) or w.dtype not in (F32, BF16):
        raise ValueError(f"gl and dht must be fp32 and w fp32 or bf16; got {gl.dtype}, {dht.dtype}, w {w.dtype}")
    NT = T // CHUNK
    per_segment = dht.ndim == 5
    NS = dht.shape[2] if per_segment else 1
    if (kd.shape != qg.shape or w.shape != qg.shape or aqk.shape != (B, H, T, CHUNK)
            or gl.shape != (B, H, NT, K) or do.shape != (B, T, H, V)
            or dht.shape != ((B, H, NS, V, K) if per_segment else (B, H, V, K))):
        raise ValueError(f"shapes do not match: qg {qg.shape}, kd {kd.shape}, w {w.shape}, aqk {aqk.shape}, "
                         f"gl {gl.shape}, do {do.shape}, dht {dht.shape} (expected kd = w = qg [B, H, T, K], "
                         "aqk [B, H, T, 64], gl [B, H, T/64, K], do [B, T, H, V], dht [B, H, V, K] or "
                         "[B, H, NS, V, K])")
    if NS < 1 or NT % NS:
        raise ValueError(f"dht's segment count NS = {NS} must divide the chunk count T / 64 = {NT}")
    C, BV, L = CHUNK, BLOCK_V, NT // NS
    BH = B * H
    w_bf16 = w.dtype == BF16

    def body(qg_ref, kd_ref, w_ref, aqk_ref, gl_ref, do_ref, dht_ref, du_ref, dh_ref, dh0_ref,
             qg_s, kd_s, aqk_s, do_s, gl_s, w32_s, w_s, ds_b, dvn_s, dv_s, st_s, bar_in, bar_w, bar_h):
        bh, iv, sg = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("s")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        vcols = pl.ds(iv * BV, BV)
        plgpu.copy_gmem_to_smem(dht_ref.at[bh, sg, vcols], st_s, bar_h.at[0])

        def chunk(j):                                     # step j runs chunk c, last to first
            return sg * L + (L - 1 - j)

        def load(j, slot):
            c = chunk(j)
            tok = pl.ds(c * C, C)
            copies = [(qg_ref.at[bh, tok], qg_s.at[slot]), (kd_ref.at[bh, tok], kd_s.at[slot]),
                      (aqk_ref.at[bh, tok], aqk_s.at[slot]), (do_ref.at[b, tok, hh, vcols], do_s.at[slot]),
                      (gl_ref.at[bh, c], gl_s.at[slot])]
            if w_bf16:                                    # W straight into its (double) operand buffer
                copies.append((w_ref.at[bh, tok], w_s.at[slot]))
            for src, dst in copies:
                plgpu.copy_gmem_to_smem(src, dst, bar_in.at[slot])

        def load_w(j):
            plgpu.copy_gmem_to_smem(w_ref.at[bh, pl.ds(chunk(j) * C, C)], w32_s, bar_w.at[0])

        load(0, 0)
        if not w_bf16:
            load_w(0)
        plgpu.barrier_wait(bar_h.at[0])

        def step(j, dSt):
            slot = lax.rem(j, 2)
            c = chunk(j)

            decay = _begin_chunk(j, L, slot, dSt, ds_b, load=load, load_w=None if w_bf16 else load_w,
                                 bar_in=bar_in, bar_w=bar_w, w32_s=w32_s, w_s=w_s, gl_s=gl_s)
            w_op = w_s.at[slot] if w_bf16 else w_s
            plgpu.copy_smem_to_gmem(ds_b, dh_ref.at[bh, c, vcols])

            def dvp_dot(acc):                     # Aqk^T dO + Kd dS: [C, C] [C, BV] + [C, K] [K, BV]
                plgpu.wgmma(acc, aqk_s.at[slot].T, do_s.at[slot])
                plgpu.wgmma(acc, kd_s.at[slot], ds_b.T)
                return acc[...]
            dvp = pl.run_scoped(dvp_dot, plgpu.ACC((C, BV), F32))
            dvn_s[...] = (-dvp).astype(BF16)
            dv_s[...] = dvp
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_s, du_ref.at[bh, pl.ds(c * C, C), vcols])

            def ds_dot(acc):                      # dO^T Qg - dV'^T W: [BV, C] [C, K] twice
                plgpu.wgmma(acc, do_s.at[slot].T, qg_s.at[slot])
                plgpu.wgmma(acc, dvn_s.T, w_op)
                return acc[...]
            return dSt * decay[None, :] + pl.run_scoped(ds_dot, plgpu.ACC((BV, K), F32))

        dSt = lax.fori_loop(0, L, step, plgpu.load(st_s, (), layout=plgpu.Layout.WGMMA))
        _store_final(dSt, st_s, dh0_ref.at[bh, sg, vcols])  # st_s's other use, dht's load, was waited on

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((BH, T, V), F32), jax.ShapeDtypeStruct((BH, NT, V, K), BF16),
                  jax.ShapeDtypeStruct((BH, NS, V, K), F32)),
        scratch_types=[_operand((2, C, K)), _operand((2, C, K)), _operand((2, C, C)), _operand((2, C, BV)),
                       plgpu.SMEM((2, K), F32), plgpu.SMEM((8, 32) if w_bf16 else (C, K), F32),   # placeholder for bf16 W
                       _operand((2, C, K) if w_bf16 else (C, K)), _operand((BV, K)),
                       _operand((C, BV)), plgpu.SMEM((C, BV), F32), plgpu.SMEM((BV, K), F32),
                       plgpu.Barrier(num_arrivals=6 if w_bf16 else 5, num_barriers=2),
                       plgpu.Barrier(num_arrivals=1, num_barriers=1), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(BH, V // BV, NS), grid_names=("bh", "v", "s"), interpret=interpret_params(interpret),
        kernel_name="kda_state_bwd_hopper")
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    dhts = dht if per_segment else dht[:, :, None]
    du, dh, dh0 = kernel(flat(qg), flat(kd), flat(w), flat(aqk), flat(gl), do, flat(dhts))
    dh0 = dh0.reshape(B, H, NS, V, K)
    return du.reshape(B, H, T, V), dh.reshape(B, H, NT, V, K), (dh0 if per_segment else dh0[:, :, 0])
