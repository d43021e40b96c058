"""Helpers shared by the Mosaic GPU (sm_90) KDA kernels: SMEM operand buffers, register layouts,
loads, split-bf16 operands, checks and compiler parameters (jax 0.11.2's
jax.experimental.pallas.mosaic_gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

F32, BF16 = jnp.float32, jnp.bfloat16
CHUNK = 64
BLOCK_V = 64               # rows of the transposed state per program of the serial passes
HEAD_DIMS = (64, 128)      # K and V: wgmma tiles; one warpgroup holds S^T [64, K] fp32 (<= 64 registers a thread)
HALF = 64                  # columns per loop step of the intra kernels (one 128-byte swizzle tile of bf16)
BT = 16                    # diagonal tile (row block) of the anchored scores
WG = plgpu.Layout.WGMMA
ROW, COL = WG.reduce(1), WG.reduce(0)          # a [C] per-row and an [N] per-column vector
# Approximate exp (ex2.approx.ftz after a multiply by log2(e)) in the intra kernels: ~10 instructions
# fewer per element than libdevice expf (forward intra 314M -> 220M instructions); relative error
# ~|x| 2^-24, which moved the op's errors vs the fp32 recurrence by < 1e-5.
EXP_PARAMS = plgpu.CompilerParams(approx_math=True)


def operand(shape):
    """A bf16 wgmma operand buffer in SMEM: 64-element (128-byte) tiles with the 128-byte swizzle."""
    return plgpu.SMEM(shape, BF16, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def staging(shape, dtype):
    """A TMA destination in SMEM, tiled and swizzled for its minor dimension, read back with load()."""
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)))


def iota(shape, dim):
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), WG)


def load(ref, layout=WG, smem=False):
    """ref into registers in `layout`, as fp32 (smem=True: the "optimized" transfer for the bf16
    operand buffers; else a plain vector load per register)."""
    return plgpu.load(ref, layout=layout, optimized=smem).astype(F32)


def along_rows(v, shape):
    """A ROW vector [C] along the rows of a WGMMA-layout tile of `shape` ([C, n])."""
    return plgpu.layout_cast(jnp.broadcast_to(v[:, None], shape), WG)


def splat(x, shape):
    """A scalar as a WGMMA-layout tile of `shape`."""
    return plgpu.layout_cast(jnp.broadcast_to(x, shape), WG)


def block_anchor(anc_s, r, cols):
    """The causal anchor of row block r: G_{16 r - 1} on the columns `cols` ([HALF], COL layout; r may
    be traced), 0 for r = 0. anc_s [NB - 1 or more, K] fp32 in SMEM holds G's rows 15, 31, 47 (.., 63)."""
    return load(anc_s.at[jnp.maximum(r - 1, 0), cols], COL) * jnp.asarray(r > 0, F32)


def own_anchors(anc_s, cols, shape):
    """[C, HALF] in the WGMMA layout: each row's own block anchor (block_anchor of its row block)."""
    rb = iota(shape, 0) >> 4
    anc = plgpu.layout_cast(jnp.zeros(shape, F32), WG)
    for r in range(1, shape[0] // BT):
        anc = jnp.where(rb == r, block_anchor(anc_s, r, cols)[None, :], anc)
    return anc


def segment_masks(rel):
    """The Mosaic GPU kernels' document input from rel [B, T] int32 (api.document_offsets): seg
    [B, T / C, 4, C] bf16 (integers 0 .. 64, exact), one contiguous 512-byte block per chunk (one TMA
    copy into the intra forward's SMEM, or direct loads), per token i of the chunk: rel_i twice (read in the ROW and in the COL layout: two
    identical loads would be merged into one value, whose two layouts layout inference cannot
    satisfy); in_last_i (1 where rel_i = rel of the chunk's last token, else 0); carry (1 where that
    last rel is 0, else 0: the same for the chunk's 64 tokens). The masks of triton/common.Segments
    without in-kernel reductions."""
    B, T = rel.shape
    if T % CHUNK:
        raise ValueError(f"segments' T = {T} must be a multiple of {CHUNK}")
    rel = rel.astype(jnp.int32)
    last = jnp.repeat(rel[:, CHUNK - 1::CHUNK], CHUNK, axis=1)              # [B, T]
    seg = jnp.stack([rel, rel, rel == last, last == 0], axis=1).astype(BF16)  # [B, 4, T]
    return seg.reshape(B, 4, T // CHUNK, CHUNK).transpose(0, 2, 1, 3)


def segments_smem():
    """The SMEM buffer of one chunk's document masks ([4, C] bf16, 512 bytes; Segments reads it)."""
    return plgpu.SMEM((4, CHUNK), BF16)


def fetch_segments(seg_ref, seg_s, b, c, barrier):
    """TMA copy of chunk c's masks of row b (seg [B, T / C, 4, C], segment_masks) into seg_s; one
    arrival on `barrier`, which the kernel waits for before its first select."""
    plgpu.copy_gmem_to_smem(seg_ref.at[b, c], seg_s, barrier)


class Segments:
    """Document masks of one chunk inside a Mosaic GPU kernel (packed sequences, segment_ids), as
    triton/common.Segments: same [C, C] (rel_i == rel_j: the score tiles M, Aqk and their
    gradients), row_in (rel_i == 0: Qg, X and their gradients), in_last (rel_i == rel_last: Kd, dKd)
    per row, carry (rel_last == 0: e^{G_last} and its gradient). `ref` is the chunk's [4, C] block
    of segment_masks, in SMEM (fetch_segments) or in HBM (seg.at[b, c]). Each mask is built where it
    is used from a [C] vector loaded in the ROW or COL layout of the WGMMA tile it masks (2 resp. 16
    registers a thread), so that no mask lives across the kernel; a kernel that reads HBM loads the
    vectors (vec) before the product whose result they mask and passes them in, so that the load's
    latency hides behind the product."""

    def __init__(self, ref):
        self.ref = ref

    def vec(self, i, layout):
        """Row i of the chunk's masks ([C]: 0 rel, 1 rel again, 2 in_last, 3 carry) in `layout`."""
        return load(self.ref.at[i], layout)

    def same(self, rel_rows=None, rel_cols=None):
        """[C, C] in the WGMMA layout (rel_rows = vec(0, ROW), rel_cols = vec(1, COL) if preloaded)."""
        C = CHUNK
        rel_rows = self.vec(0, ROW) if rel_rows is None else rel_rows
        rel_cols = self.vec(1, COL) if rel_cols is None else rel_cols
        cols = plgpu.layout_cast(jnp.broadcast_to(rel_cols[None, :], (C, C)), WG)
        return along_rows(rel_rows, (C, C)) == cols

    def row_in(self, shape, rel_rows=None):
        """[C, n] in the WGMMA layout (rel_rows = vec(0, ROW) if preloaded)."""
        return along_rows(self.vec(0, ROW) if rel_rows is None else rel_rows, shape) == 0.0

    def in_last(self, shape, last_rows=None):
        """[C, n] in the WGMMA layout (last_rows = vec(2, ROW) if preloaded)."""
        return along_rows(self.vec(2, ROW) if last_rows is None else last_rows, shape) != 0.0

    def carry(self):
        """[C] in the COL layout (the same value in every entry; C = HALF columns)."""
        return self.vec(3, COL) != 0.0

    def carry_rows(self, shape, carry_rows=None):
        """carry as a [C, n] WGMMA-layout mask (the same value everywhere; carry_rows = vec(3, ROW))."""
        return along_rows(self.vec(3, ROW) if carry_rows is None else carry_rows, shape) != 0.0


def keep(x, seg, mask: str, *args):
    """x where seg.<mask>(*args) else 0 (a select) when seg is given; x itself when seg is None (the
    dense kernels trace exactly as without documents)."""
    return x if seg is None else jnp.where(getattr(seg, mask)(*args), x, 0.0)


def split_bf16(x, hi_s, lo_s):
    """x fp32 -> hi = bf16(x), lo = bf16(x - hi) into two operand buffers (split-bf16 operands)."""
    hi = x.astype(BF16)
    hi_s[...] = hi
    lo_s[...] = (x - hi.astype(F32)).astype(BF16)


def store_final(state, buf, dst):
    """A serial pass's last step: the fp32 state [BV, K] through the (free) SMEM buffer `buf` to `dst`."""
    buf[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst)
    plgpu.wait_smem_to_gmem(0)


def check_shapes(arrays, want, context):
    """ValueError naming every array of `arrays` ({name: array}) whose shape is not want[name]."""
    bad = {n: a.shape for n, a in arrays.items() if a.shape != want[n]}
    if bad:
        raise ValueError(f"shapes do not match {context}: {bad}; expected { {n: want[n] for n in bad} }")


def check_dtypes(arrays, dtype):
    """ValueError naming every array of `arrays` ({name: array}) whose dtype is not `dtype`."""
    bad = {n: str(a.dtype) for n, a in arrays.items() if a.dtype != dtype}
    if bad:
        raise ValueError(f"{sorted(bad)} must be {jnp.dtype(dtype).name}; got {bad}")


def check_qk(q, k):
    """q, k token-major [B, T, H, K] bf16 with T a multiple of CHUNK and K in HEAD_DIMS; returns (B, T, H, K)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K]; got {q.shape=}")
    B, T, H, K = q.shape
    if T % CHUNK:
        raise ValueError(f"q's T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS:
        raise ValueError(f"K = {K} must be in {HEAD_DIMS} (wgmma tiles of 64 columns)")
    check_dtypes(dict(q=q, k=k), BF16)
    return B, T, H, K


def interpret_params(interpret):
    """plgpu.kernel's `interpret` from ours: False -> compiled, True -> Mosaic GPU interpret mode
    (CPU) with one TMA vector clock (race-detector bookkeeping only: halves the interpreter's time per call),
    or an InterpretGPUParams as given (e.g. detect_races=True)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams(num_tma_threads_per_device=1) if interpret else None


def is_hopper(device=None) -> bool:
    """Whether `device` (default: JAX's first device) is a CUDA GPU of compute capability 9.x."""
    device = jax.devices()[0] if device is None else device
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
