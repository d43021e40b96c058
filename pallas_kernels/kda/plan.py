"""Which backend runs each stage of a `kda_pallas` call, and the kernels' tuning values.

Stages (docs/kda_kernels.md has the pipeline and what each saves):
  forward:  cumsum -> intra_fwd -> [sequence split] -> state_fwd (+ output)
  backward: [sequence split] -> state_bwd -> solve_bwd -> score_bwd -> cumsum (reverse)
Backends: "triton" (portable `pl.pallas_call` kernels, lowered by Triton on any CUDA GPU; interpret
mode on CPU) and "mosaic_gpu" (sm_90: TMA + wgmma; bf16 with padded K, V in {64, 128}; Mosaic GPU
interpret mode on CPU). Under "mosaic_gpu" the stages without a Mosaic GPU kernel for the call run
the Triton one:

| stage      | mosaic_gpu, dense, bounded | with segment_ids | unbounded gates |
|------------|----------------------------|------------------|-----------------|
| cumsum     | triton                     | triton           | triton          |
| intra_fwd  | mosaic_gpu                 | mosaic_gpu       | triton          |
| state_fwd  | mosaic_gpu (output fused)  | mosaic_gpu       | mosaic_gpu      |
| state_bwd  | mosaic_gpu                 | mosaic_gpu       | mosaic_gpu      |
| solve_bwd  | mosaic_gpu                 | mosaic_gpu       | mosaic_gpu      |
| score_bwd  | mosaic_gpu                 | mosaic_gpu       | triton          |

With segment_ids the Mosaic GPU intra kernels apply the document selects (Segments in
mosaic_gpu/common.py, as triton/common.py's).
"auto" is "mosaic_gpu" compiled on a compute-capability-9.x GPU for calls it covers, else "triton".
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels.kda.mosaic_gpu.common import HEAD_DIMS, is_hopper

BACKENDS = ("auto", "triton", "mosaic_gpu")
CHUNK_SIZE = 64
TILE = 16                  # diagonal tile: 16 tokens x 5 nats = 80 < log(bf16 / fp32 max) = 88.7
MIN_LOWER_BOUND = -5.0


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Tuning values of the kernels (no effect on the math beyond fp32 summation order).

    intra_warps: Triton warps of the intra-chunk kernels (several [64, 128] fp32 values live: 8
      halve the registers per thread); state_warps: of the serial passes, the sequence split and
      the cumsum; output_warps: of the Triton output kernel. block_v: V rows of the transposed
      state per program of the serial passes (min with the padded V; the Mosaic GPU passes need 64).
    split_target_programs: the sequence split runs only when the serial pass has fewer programs
      (B * H * V blocks; ~2 per SM of an H200's 132), into the fewest segments (a power-of-two
      number of chunks >= split_min_chunks) that reach it; it costs ~3x the serial work.
      split_target_programs_mgpu: the same when both serial passes are Mosaic GPU kernels (their
      chunk step is short: one serial pass beat the split at 32 and 64 programs on the H200).
    """

    intra_warps: int = 8
    state_warps: int = 4
    output_warps: int = 4
    block_v: int = 64
    split_target_programs: int = 256
    split_target_programs_mgpu: int = 32
    split_min_chunks: int = 4

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Tuning.{f.name} must be a positive int; got {value!r}")
        if self.block_v & (self.block_v - 1) or self.block_v < 16:
            raise ValueError(f"Tuning.block_v must be a power of two >= 16; got {self.block_v}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernels of one call: a backend per stage, the sequence split, the gate handling.

    intra_fwd, state_fwd, state_bwd, solve_bwd, score_bwd: "triton" or "mosaic_gpu" (cumsum is
    always "triton"); seg_chunks: segment length (chunks) of the sequence split, 0 = one serial
    pass; centre: s, the diagonal tiles' factors are scaled by 2^(+-s) (centre_exponent; 0 for
    unbounded gates); block_v: V rows per serial-pass program.
    """

    backend: str
    intra_fwd: str
    state_fwd: str
    state_bwd: str
    solve_bwd: str
    score_bwd: str
    seg_chunks: int
    unbounded: bool
    segmented: bool
    centre: int
    block_v: int
    tuning: Tuning

    def stages(self) -> dict[str, str]:
        """{stage: backend} in pipeline order."""
        return dict(cumsum="triton", intra_fwd=self.intra_fwd, state_fwd=self.state_fwd, state_bwd=self.state_bwd,
                    solve_bwd=self.solve_bwd, score_bwd=self.score_bwd)


def centre_exponent(lower_bound: float, tile: int = TILE) -> int:
    """s = round(tile |lower_bound| / (2 ln 2)) (58 at -5: 2^58 ~ e^40): the diagonal tile's factors
    are e^{G - anc} 2^s and e^{anc - G} 2^-s, both within e^{+-40} (uncentred: [e^-80, 1] and
    [1, e^80]). A power of two (exact; an additive shift of the exp argument would round it to
    ulp(40) ~ 4e-6) and a constant (the anchor stays causal). Uncentred, the backward forms
    (cotangent x e^-80), which backends without fp32 denormals (XLA:CPU, TPU) flush to zero for
    cotangents below ~1e-3, and (cotangent x e^80), which overflows above ~1e3; centred, a product
    of an entry x with a factor stays within |x| e^{+-40}: exact for |x| in ~[3e-21, 1e20] (x:
    cotangent, q, k entries)."""
    return round(0.5 * tile * abs(float(lower_bound)) / math.log(2.0))


def mosaic_gpu_covers(dtype, Kp: int, Vp: int) -> tuple[bool, str]:
    """Whether the Mosaic GPU stages take a call with inputs of `dtype` and padded head dims Kp, Vp."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return False, f"the Mosaic GPU kernels take bf16 inputs (wgmma operands); got {jnp.dtype(dtype).name}"
    if Kp not in HEAD_DIMS or Vp not in HEAD_DIMS:
        return False, (f"the Mosaic GPU kernels take K, V padded to {HEAD_DIMS} (wgmma tiles of 64 columns); "
                       f"got K -> {Kp}, V -> {Vp}")
    return True, ""


def resolve_backend(backend: str, dtype, Kp: int, Vp: int, interpret: bool) -> str:
    """"triton" or "mosaic_gpu" for a requested backend; ValueError when an explicit "mosaic_gpu"
    cannot run the call (or `backend` is not in BACKENDS)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend=}")
    if backend == "triton":
        return backend
    ok, why = mosaic_gpu_covers(dtype, Kp, Vp)
    if backend == "auto":
        return "mosaic_gpu" if ok and not interpret and is_hopper() else "triton"
    if not ok:
        raise ValueError(f"{backend=} cannot run this call: {why}")
    if not interpret and not is_hopper():
        raise ValueError(f"{backend=} compiles for a compute-capability-9.x GPU (sm_90); this device is not one: "
                         "use backend='triton', or interpret=True on CPU")
    return backend


def split_chunks(n_chunks: int, sequence_split: int | None, n_programs: int, target_programs: int,
                 min_chunks: int) -> int:
    """Segment length (in chunks) of the sequence split, or 0 for one serial pass.

    sequence_split: None = automatic (split only below target_programs programs, into the fewest
    segments of a power-of-two number of chunks >= min_chunks that reach it); 0 = off; L > 0 =
    segments of L chunks, used only when n_chunks % L == 0 and n_chunks >= 2 L.
    """
    if sequence_split is not None:
        L = int(sequence_split)
        return L if L > 0 and n_chunks % L == 0 and n_chunks >= 2 * L else 0
    if n_programs >= target_programs:
        return 0
    needed = -(-target_programs // n_programs)
    valid = [L for L in (1 << e for e in range(n_chunks.bit_length() - 1, -1, -1))
             if min_chunks <= L and n_chunks % L == 0 and n_chunks >= 2 * L]
    for L in valid:                       # largest first: the fewest segments that reach the target
        if n_chunks // L >= needed:
            return L
    return valid[-1] if valid else 0


def make_plan(dtype, B: int, H: int, Tp: int, Kp: int, Vp: int, *, lower_bound, segmented: bool, backend: str = "auto",
              interpret: bool = False, sequence_split: int | None = None, tuning: Tuning | None = None) -> Plan:
    """The Plan of a call on padded shapes (Tp a multiple of 64; Kp, Vp powers of two >= 16).

    Raises: ValueError from resolve_backend, or for a tuning that is not a Tuning.
    """
    tuning = Tuning() if tuning is None else tuning
    if not isinstance(tuning, Tuning):
        raise ValueError(f"tuning must be a plan.Tuning or None; got {type(tuning).__name__}")
    resolved = resolve_backend(backend, dtype, Kp, Vp, interpret)
    unbounded = lower_bound is None
    mgpu = resolved == "mosaic_gpu"
    block_v = min(Vp, tuning.block_v if not mgpu else 64)
    target = tuning.split_target_programs_mgpu if mgpu else tuning.split_target_programs
    seg = split_chunks(Tp // CHUNK_SIZE, sequence_split, B * H * (Vp // block_v), target, tuning.split_min_chunks)
    return Plan(backend=resolved,
                intra_fwd="mosaic_gpu" if mgpu and not unbounded else "triton",
                state_fwd=resolved, state_bwd=resolved, solve_bwd=resolved,
                score_bwd="mosaic_gpu" if mgpu and not unbounded else "triton",
                seg_chunks=seg, unbounded=unbounded, segmented=segmented,
                centre=0 if unbounded else centre_exponent(lower_bound), block_v=block_v, tuning=tuning)
