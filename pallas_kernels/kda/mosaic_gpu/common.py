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


def segment_masks(rel):
    """The Mosaic GPU kernels' document input from rel [B, T] int32 (api.document_offsets): seg
    [4, B, T] fp32 (small integers, exact), per token i of a chunk: rel_i twice (read in the ROW and
    in the COL layout: two identical loads would be merged into one value, whose two layouts layout
    inference cannot satisfy); in_last_i (1 where rel_i = rel of the chunk's last token, else 0);
    carry (1 where that last rel is 0, else 0: the same for the chunk's 64 tokens). The masks of
    triton/common.Segments without in-kernel reductions."""
    B, T = rel.shape
    if T % CHUNK:
        raise ValueError(f"segments' T = {T} must be a multiple of {CHUNK}")
    rel = rel.astype(jnp.int32)
    last = jnp.repeat(rel[:, CHUNK - 1::CHUNK], CHUNK, axis=1)              # [B, T]
    return jnp.stack([rel, rel, rel == last, last == 0]).astype(F32)


class Segments:
    """Document masks of one chunk inside a Mosaic GPU kernel (packed sequences, segment_ids), as
    triton/common.Segments: same [C, C] (rel_i == rel_j: the score tiles M, Aqk and their
    gradients), row_in (rel_i == 0: Qg, X and their gradients), in_last (rel_i == rel_last: Kd, dKd)
    per row, carry (rel_last == 0: e^{G_last} and its gradient) per column. Built where used, each
    from a direct load of seg (segment_masks; a [C] vector in the ROW or COL layout of the WGMMA
    tile it masks: 2 resp. 16 registers a thread), so that no mask lives across the kernel."""

    def __init__(self, seg_ref, b, rows):
        self.ref, self.b, self.rows = seg_ref, b, rows

    def _vec(self, i, layout):
        return load(self.ref.at[i, self.b, self.rows], layout)

    def _rows(self, i, shape):           # seg[i] along the rows of a [C, n] WGMMA tile
        return plgpu.layout_cast(jnp.broadcast_to(self._vec(i, ROW)[:, None], shape), WG)

    def same(self):
        """[C, C] in the WGMMA layout."""
        C = CHUNK
        cols = plgpu.layout_cast(jnp.broadcast_to(self._vec(1, COL)[None, :], (C, C)), WG)
        return self._rows(0, (C, C)) == cols

    def row_in(self, shape):
        """[C, n] in the WGMMA layout."""
        return self._rows(0, shape) == 0.0

    def in_last(self, shape):
        """[C, n] in the WGMMA layout."""
        return self._rows(2, shape) != 0.0

    def carry(self):
        """[C] in the COL layout (the same value in every entry; C = HALF columns)."""
        return self._vec(3, COL) != 0.0


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
