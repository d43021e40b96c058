"""Pallas KDA (Kimi Delta Attention) chunk kernels behind a `jax.custom_vjp`.

Forward: `fwd.intra_fwd` (gate cumsum, anchored row-block score GEMMs, (I+L)^-1, W, U, Aqk; parallel
over (batch, head, chunk)) then the state pass: `fwd.state_fwd` (serial fp32 state pass; parallel
over (batch, head, V-block)), or, when that leaves the GPU under-filled, the exact sequence split
of `split.py` (per-segment transitions, a short scan over segments, then `fwd.state_fwd` per
segment in parallel). With the default parallel_output the serial pass writes V' and the per-chunk
states and `fwd.output_fwd` forms o in parallel over chunks (so forward-only calls write the states
too; on Hopper the fused pass below forms o itself and forward-only calls write no states). Backward: reuses what the
differentiated forward saved (chunk factors, A and M, per-chunk states; nothing is recomputed);
`bwd.state_bwd` (reverse serial pass, split the same way when the forward's is) then
`bwd.intra_bwd` (parallel; it also forms the products with the saved states and their gradients)
give dq, dk, dv, dg, dbeta and dh0. On an sm_90 GPU (and in interpret mode) the two serial state
passes run as Mosaic GPU kernels instead (hopper.py: TMA loads, wgmma; KernelOptions.hopper_state_fwd,
hopper_fused_output (the forward pass forms o too) and hopper_state_bwd; same math and layouts), and
so do kernel a of the two-kernel intra backward (hopper_bwd.py, hopper_intra_bwd) and, when asked,
kernel b (hopper_score_bwd.py, hopper_score_bwd; off by default: not faster than the Triton kernel b in
the op) and kernel a of the two-kernel intra forward (hopper_fwd.py, hopper_intra_fwd). The kernels read and write the user's token-major [B, T, H, .]
tensors directly (BlockSpecs). XLA work around them: zero padding / slicing when T is not a
multiple of 64 or K, V not a power of two, slicing the split's transition outputs, the fp32 cast of
g, and with segment_ids the per-chunk document offsets (common.document_offsets). With the default
xla_gate_cumsum + pallas_cumsum the chunk-local cumsum of g and the reverse cumsum of dG are two
more Pallas kernels (cumsum.chunk_cumsum) between them (in XLA with pallas_cumsum=False).

Saved for the backward, per (batch, head), for bf16 inputs at K = V = 128 and T tokens:
qg, kd, aqk bf16 (T x (128 + 128 + 64) x 2 bytes), w, u fp32 (T x 256 x 4; w bf16 where the Hopper
forward kernel writes it, KernelOptions.hopper_bf16_w), e^{G_last}, A and M
fp32 (T x 128 x 4), the per-chunk states h bf16 (T / 64 x 128 x 128 x 2), plus the inputs.

Packed documents (segment_ids): XLA turns the ids into per-chunk document offsets
(common.document_offsets, [B, T] int32); intra_fwd and intra_bwd read one [C] block of them per
program and apply 0/1 selects to the chunk factors and their gradients (common.Segments), so the
serial state passes, the sequence split and the output kernel run unchanged. Without segment_ids
the kernels take no extra input and are the same as before.

Kernel variants with the same math (ops.KernelOptions; on by default after the H200 A/Bs of
2026-12-01): the intra-chunk backward as two kernels (bwd.intra_bwd_split), the fla-style
forward (fwd.state_fwd_vp + fwd.output_fwd), bf16 operands for the forward's state dots and the
intra dots, the gate cumsums outside the intra kernels (xla_gate_cumsum) in a Pallas kernel
(pallas_cumsum), intra_fwd as two kernels (fwd.intra_fwd_split), the compact row-block score-tile
backward. Off: the backward's kernel a over V blocks of the saved states (tile_state_bwd; measured
slower). bf16 operands in the backward state pass (bf16_state_bwd_dots) are on since round 6.

Gates: with a declared lower_bound in [-5, 0) every 16x16 diagonal score tile is one anchored dot
(exp of at most 80 nats). With lower_bound=None (unbounded gates, e.g. Kimi Linear's
g = -exp(A_log) softplus(.)) the diagonal tiles are computed exactly instead, elementwise with every
exp argument <= 0 (common.own_block_scores in fwd.intra_fwd_split's kernel a, bwd._own_block_bwd in
the compact backward kernel b); all other kernels need no bound. That path exists only for the
default option set (UNBOUNDED_OPTIONS: the seven round-3 fields on, any values of BOUND_FREE_FIELDS:
UNBOUNDED_OPTION_SETS); `supported` refuses other option sets.

Lowering: a portable `pl.pallas_call` with BlockSpecs (every kernel but the two Hopper passes of
hopper.py, which are `plgpu.kernel`s lowered by Mosaic GPU); on GPU jax 0.11.2 lowers it through the
Triton backend (the default for pallas_call on CUDA; `common.INTRA_PARAMS` / `STATE_PARAMS` /
`CUMSUM_PARAMS` set num_warps and num_stages=1, `OUTPUT_PARAMS` num_warps); `interpret=True` runs the
same kernel bodies on CPU. Not run on TPU.

Source: Kimi Linear (arXiv 2510.26692) Eq. 1, chunk form as in fla `chunk_kda(safe_gate=True)`;
see ANCHORS.md section 1. This package never imports k3jax.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import bwd, common, cumsum, fwd, hopper, hopper_bwd, hopper_fwd, hopper_score_bwd, split

CHUNK_SIZE = 64
MIN_LOWER_BOUND = -5.0     # 16 tokens x 5 nats = 80 < log(fp32/bf16 max) = 88.7
MAX_HEAD_DIM = 128         # largest K, V the tests cover
# Largest K, V for compiled fp32 calls: fp32 at K = V = 32 passed the H200 tests (forward and
# backward); at K = V = 128 the backward failed to launch (shared memory 245760 > 232448 bytes,
# 2026-11-30); 64 was not run.
MAX_FP32_HEAD_DIM = 32
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Sequence split of the serial state passes (split.py). Automatic rule: split only when the serial
# pass has fewer than SPLIT_TARGET_PROGRAMS programs (B * H * V-blocks; ~2 per SM on an H200's 132),
# into the fewest segments (of a power-of-two number of chunks, at least SPLIT_MIN_CHUNKS) that
# reach it. The split costs ~3x the serial work, so it pays only on an under-filled GPU.
SPLIT_TARGET_PROGRAMS = 256
SPLIT_MIN_CHUNKS = 4
# The same rule when both serial passes run on Hopper (hopper.py; KernelOptions.hopper_state_fwd and
# hopper_state_bwd): their chunk step is short enough that one serial pass beat the split at 32 and
# 64 programs on the H200 (2026-12-01, round 10 of kda_pallas_notes.md: 1x65536x16 forward 6.12 ->
# 4.96 ms, forward+backward 28.05 -> 24.55; 2x16384x16 3.11 -> 2.31, 14.07 -> 11.71). Below 32
# programs the split is kept (not measured: with 8 programs one pass would run 4x the serial steps
# of the split's segments).
SPLIT_TARGET_PROGRAMS_HOPPER = 32


def split_chunks(n_chunks: int, sequence_split: int | None = None, n_programs: int | None = None,
                 target_programs: int = SPLIT_TARGET_PROGRAMS) -> int:
    """Segment length (in chunks) for the state passes, or 0 for one serial pass.

    sequence_split: None = automatic (see SPLIT_TARGET_PROGRAMS; needs n_programs, the serial
    pass's program count; target_programs replaces SPLIT_TARGET_PROGRAMS, e.g. by
    SPLIT_TARGET_PROGRAMS_HOPPER); 0 = off; L > 0 = segments of L chunks, used only when
    n_chunks % L == 0 and n_chunks >= 2 L.
    """
    if sequence_split is not None:
        L = int(sequence_split)
        return L if L > 0 and n_chunks % L == 0 and n_chunks >= 2 * L else 0
    if n_programs is None or n_programs >= target_programs:
        return 0
    needed = -(-target_programs // n_programs)
    valid = [L for L in (1 << e for e in range(n_chunks.bit_length() - 1, -1, -1))
             if SPLIT_MIN_CHUNKS <= L and n_chunks % L == 0 and n_chunks >= 2 * L]
    for L in valid:                       # largest first: the fewest segments that reach the target
        if n_chunks // L >= needed:
            return L
    return valid[-1] if valid else 0


def saved_state_dtype(dtype):
    """Storage dtype of the per-chunk states h and their gradients dh saved for the backward.

    bf16 inputs: bf16 (as fla's chunk_kda; halves the largest saved tensor, 2.1 GB -> 1.05 GB at
    8x4096x16, K = V = 128). Measured in interpret mode ((1, 1024, 2, 128) bf16, RMS ratio vs the fp32
    recurrence, with factor_dtypes below): dk 2.43e-3 -> 2.62e-3, dg 2.21e-3 -> 2.64e-3, dq, dv,
    dbeta, dh0 unchanged. The carried states (registers) stay fp32. fp32 inputs: fp32.
    """
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def factor_dtypes(dtype) -> tuple:
    """Storage dtypes of the saved chunk factors (qg, kd, w, u, aqk) for inputs of `dtype`.

    fp32 inputs: all fp32. bf16 inputs: qg, kd, aqk bf16 and w, u fp32. Measured in interpret mode
    (CPU, (1, 1024, 2, 128) bf16, RMS ratio vs the fp32 recurrence): all fp32 o 2.85e-3, ht 1.7e-5;
    this choice o 3.29e-3, ht 3.0e-4; all five bf16 o 3.70e-3, ht 1.8e-3 (tolerance 5e-3): w and u
    in bf16 cost the most accuracy for their bytes (with the TF32 state dots of that time; where
    every consumer of w takes it as a bf16 operand anyway, the Hopper forward kernel writes it in
    bf16: KernelOptions.hopper_bf16_w).
    """
    if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return (jnp.float32,) * 5
    return (dtype, dtype, jnp.float32, jnp.float32, dtype)



@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static choices between kernel variants with the same math (the round-3 levers of
    experiments/results/kda_pallas_notes.md). Defaults: the seven round-3 fields on, chosen by the
    H200 A/B run of 2026-12-01 (experiments/results/kda_ab_round3_h200.json; 8x4096x16x128 bf16,
    fwd / fwd+bwd: 2.70 / 13.16 ms all on vs 6.32 / 35.28 ms all off, errors vs the fp32 recurrence
    within fla's tolerances), pallas_cumsum (round 5), bf16_state_bwd_dots (round 6) and the three
    Hopper passes (hopper_state_fwd, hopper_fused_output, hopper_state_bwd: rounds 8, 11, 9),
    the Hopper kernel a of the intra backward (hopper_intra_bwd, round 13), of the intra
    forward (hopper_intra_fwd, round 17), its fused W / U (hopper_fused_wu, round 18) and bf16 W
    (hopper_bf16_w, round 20) on,
    tile_state_bwd off.
    ROUND2_OPTIONS (all off) are the round-2 kernels, kept for A/B runs and tests.

    split_intra_bwd: the intra-chunk backward as two kernels (bwd.intra_bwd_split) instead of one.
    parallel_output: the forward's serial pass only carries the state and writes V' and the
      per-chunk states (fwd.state_fwd_vp); o = Qg S + Aqk V' runs in parallel over chunks
      (fwd.output_fwd), as fla's chunk_kda forward. Forward-only calls then write the states too.
    bf16_state_dots: bf16 inputs only: the forward's state / output dots take bf16 operands (S, V'
      rounded to bf16 per dot, as fla) instead of TF32 fp32 operands; fp32 inputs ignore it.
    bf16_intra_dots: bf16 inputs only: the TF32 dots of intra_fwd (solve, W, U) and intra_bwd (state
      products, dX, dY, dA, off-diagonal score tiles) take bf16 operands (as fla); the bf16x3 dots
      stay; fp32 inputs ignore it.
    xla_gate_cumsum: the chunk-local cumsum of g (forward) and the reverse cumsum of dG (backward)
      run outside the intra kernels (in XLA, common.chunk_cumsum, or with pallas_cumsum in
      cumsum.chunk_cumsum; ~0.3 GB read + write each at 8x4096x16) instead of inside
      intra_fwd / intra_bwd, whose anchors then are ref loads (the round-3 profile measured the
      in-kernel cumsums at ~1.4 ms of intra_fwd and ~5 ms of intra_bwd).
    split_intra_fwd: intra_fwd as two kernels (fwd.intra_fwd_split): scores + (I + L)^-1 writing A,
      then W = A X, U = A Y reading A (fla's recompute_w_u), so that neither body holds the score
      values, the solve and the W / U operands at once. Without xla_gate_cumsum the second kernel
      runs its own chunk cumsum of g.
    compact_offdiag_bwd: the score-tile backward row block by row block on row slices of the refs
      ([16, n] x [n, K] dots, n <= 64) instead of 12 masked [64, 64] x [64, K] dots of which 3/4 of
      the rows are zero (bwd._intra_bwd_b_compact_kernel). It needs the score gradients in HBM, so
      it runs the two-kernel backward whatever split_intra_bwd says (implies it).
    tile_state_bwd (off: measured slower on the H200, op fwd+bwd 13.26 -> 15.04 ms at 8x4096x16x128,
      kernel a 6.95 -> 8.64 ms; round 4 of kda_pallas_notes.md): kernel a
      of the two-kernel backward forms its state products over V blocks of bwd.STATE_BLOCK_V = 64
      columns (bwd._state_products_tiled: [64, K] row slices of the saved state and its gradient,
      column slices of dO, dV', U, V, dv) instead of holding both whole [V, K] fp32 states; same
      sums with the contraction over V split into blocks (fp32 rounding only). Kernel a needs no
      gate bound, so it is also allowed with lower_bound=None (UNBOUNDED_OPTION_SETS). It exists
      only in the two-kernel backward, so it implies split_intra_bwd.
    pallas_cumsum (round 5 of kda_pallas_notes.md; default since 2026-12-01): the two cumsums that
      xla_gate_cumsum moves out of the intra kernels run as one Pallas kernel each
      (cumsum.chunk_cumsum: one read and one write of g / dG) instead of XLA's associative scan
      (0.32 ms at 8x4096x16 against fla's 0.13 ms cumsum kernel). Measured on the H200: op
      2.88 -> 2.39 ms forward, 13.42 -> 12.68 ms forward+backward at 8x4096x16x128, errors vs the
      fp32 recurrence within 2e-5 of the XLA cumsum's (dbeta 4.09e-3 -> 4.11e-3). Same sums up to fp32 rounding. Without
      xla_gate_cumsum there is no such cumsum and it is ignored.
    bf16_state_bwd_dots (round 6 of kda_pallas_notes.md; default since 2026-12-01):
      bf16 inputs only: the four dots of the backward's serial state pass (bwd.state_bwd: Aqk^T dO,
      Kd dS, dO^T Qg, dV'^T W) take bf16 operands (dS, dV' and the fp32-stored W rounded to bf16 per
      dot, as fla's chunk_gated_delta_rule_bwd_dhu) instead of fp32 operands at TF32, as
      bf16_state_dots does for the forward's pass; the sequence split's transitions keep exact
      precision. fp32 inputs ignore it. Measured on the H200 (one process, 2026-12-01): op
      forward+backward 12.54 -> 11.93 ms at 8x4096x16x128 and 29.63 -> 28.31 ms at 1x65536x16x128;
      errors vs the fp32 recurrence within 1e-5 of the fp32-operand pass's (dbeta 4.11e-3 -> 4.12e-3).
    hopper_state_fwd (round 8 of kda_pallas_notes.md): the forward's serial state pass
      (fwd.state_fwd_vp) as the Mosaic GPU kernel hopper.state_fwd (TMA loads two chunks deep,
      wgmma with bf16 operands; same math, layouts and operand rounding) where it applies: bf16
      inputs with parallel_output and bf16_state_dots, padded K in hopper.HEAD_DIMS, padded V a
      multiple of 64, and either compiled on a compute-capability-9.x GPU (hopper.is_hopper) or in
      interpret mode (which then runs it in Mosaic GPU interpret mode, so CPU tests cover what the
      H200 runs). Elsewhere (other GPUs, fp32, small heads) the Triton pass runs; it is the
      same function, so no call is refused for this option.
    hopper_fused_output (round 11 of kda_pallas_notes.md): where hopper_state_fwd applies (and o
      is bf16), the Hopper pass also forms o = Qg S + Aqk V' per chunk (hopper.state_output_fwd)
      instead of writing V' for fwd.output_fwd; forward-only calls then write no per-chunk states.
      Same operands and rounding (fp32 accumulation order aside).
    hopper_state_bwd (round 9 of kda_pallas_notes.md): the backward's serial state pass
      (bwd.state_bwd with bf16 operands) as the Mosaic GPU kernel hopper.state_bwd, under
      hopper_state_fwd's conditions with bf16_state_bwd_dots in place of bf16_state_dots and
      parallel_output (and a bf16 output gradient).
    hopper_intra_bwd (round 13 of kda_pallas_notes.md): kernel a of the two-kernel intra-chunk
      backward (bwd.intra_bwd_a: the state products, the W / U and (I + L)^-1 backward) as the
      Mosaic GPU kernel hopper_bwd.intra_bwd_a (wgmma with the same bf16 operands, the dL products
      split-bf16 as the Triton kernel's bf16x3 dots); kernel b is unchanged. Where it applies: bf16
      inputs with bf16_intra_dots and xla_gate_cumsum, the two-kernel backward (split_intra_bwd or
      compact_offdiag_bwd) without tile_state_bwd, no segment_ids, padded K and V in
      hopper.HEAD_DIMS, bf16 saved states, compiled on a compute-capability-9.x GPU or in
      interpret mode; elsewhere the Triton kernel a runs (same function, nothing refused).
      Measured on the H200 (one process, 2026-12-01, round 15): op forward+backward 11.41 -> 6.91 ms
      at 8x4096x16x128 and 22.35 -> 13.33 ms at 16x2048x32x128; errors vs the fp32 recurrence
      unchanged to three digits.
    hopper_score_bwd (off: correct on the H200 but no faster in the op than the Triton kernel b;
      round 14's version 6.00 vs 3.09 ms kernel rows at 8x4096x16x128, round 16's 2.72 vs 2.85 ms,
      op forward+backward 6.86 -> 6.74 ms at 8x4096x16 and 15.58 -> 15.63 at 1x65536x16, within the
      rows' spread; kda_pallas_notes.md): kernel b of the
      two-kernel intra-chunk backward (the anchored score-tile backward, bwd.intra_bwd_b) as the
      Mosaic GPU kernel hopper_score_bwd.intra_bwd_b (bwd._score_bwd's masked form as [64, 64]
      wgmma; split-bf16 diagonal tiles as the Triton kernel's bf16x3 dots). Where it applies: bf16
      inputs with bf16_intra_dots and xla_gate_cumsum, the two-kernel backward, bounded gates
      (lower_bound set; with lower_bound=None the Triton kernel's exact diagonal tiles run), padded
      K in hopper.HEAD_DIMS, compiled on a compute-capability-9.x GPU or in interpret mode; with
      either kernel a (segment_ids only reach kernel a). Elsewhere the Triton kernel b runs.
    hopper_intra_fwd (round 17 of kda_pallas_notes.md; default since 2026-12-01): kernel a of the
      two-kernel intra-chunk forward (the anchored scores and (I + beta M)^-1, fwd.intra_fwd_a) as
      the Mosaic GPU kernel hopper_fwd.intra_fwd_a (the same bf16-operand products as [64, K] x
      [K, 64] and [64, 64] x [64, 64] wgmma); the Triton kernel b (W, U) still reads its A. Where it
      applies: bf16 inputs with bf16_intra_dots, xla_gate_cumsum and split_intra_fwd, bounded
      gates, no segment_ids, padded K in hopper.HEAD_DIMS, compiled on a compute-capability-9.x GPU
      or in interpret mode; elsewhere the Triton kernel a runs. Measured on the H200 (one process,
      2026-12-01 18:59 UTC): op 1.88 -> 1.75 ms forward and 6.76 -> 6.58 ms forward+backward at
      8x4096x16x128; errors vs the fp32 recurrence within 1e-5 of the Triton kernel a's (the
      kernel's approximate exp, hopper.EXP_PARAMS; with the precise exp its outputs were
      bit-identical to the compiled Triton kernel's).
    hopper_fused_wu (round 18 of kda_pallas_notes.md; default since 2026-12-01): with
      hopper_intra_fwd where it applies (and V in hopper.HEAD_DIMS), W = A X and U = A Y are formed
      in the same Mosaic GPU kernel (hopper_fwd.intra_fwd) instead of the Triton kernel b: A is
      written only for the backward, k, G and beta are read once. Same products and rounding.
      Measured on the H200 (one process, 2026-12-01 21:53 UTC): op 1.78 -> 1.51 ms forward and
      6.61 -> 6.33 ms forward+backward at 8x4096x16x128; errors vs the fp32 recurrence identical
      to 3 digits.
    hopper_bf16_w (round 20 of kda_pallas_notes.md; default since 2026-12-01): where
      hopper_fused_wu runs, W is written in bf16 (the rounding its bf16-operand consumers apply:
      the Hopper state passes and backward kernel a then copy it by TMA straight into their wgmma
      operand buffers, without the fp32 load / round / store step, which sits on the serial passes'
      critical path; the Triton kernels that read W upcast it). Half W's bytes. Only with
      bf16_state_dots and bf16_state_bwd_dots (else W stays fp32). Numerics: the same where W is a
      bf16 operand (bit-identical outputs in the GPU tests); the sequence split's
      transitions (exact dots) see the rounded W. Measured on the H200 (one process, 2026-12-01
      22:34 UTC): op forward 4.26 -> 3.79 ms, forward+backward 14.60 -> 13.78 at 1x65536x16x128;
      6.28 -> 6.19 forward+backward at 8x4096x16x128.
    """

    split_intra_bwd: bool = True
    parallel_output: bool = True
    bf16_state_dots: bool = True
    bf16_intra_dots: bool = True
    xla_gate_cumsum: bool = True
    split_intra_fwd: bool = True
    compact_offdiag_bwd: bool = True
    tile_state_bwd: bool = False
    pallas_cumsum: bool = True
    bf16_state_bwd_dots: bool = True
    hopper_state_fwd: bool = True
    hopper_state_bwd: bool = True
    hopper_fused_output: bool = True
    hopper_intra_bwd: bool = True
    hopper_score_bwd: bool = False
    hopper_intra_fwd: bool = True
    hopper_fused_wu: bool = True
    hopper_bf16_w: bool = True


# The round-2 kernels: fused intra_fwd / intra_bwd, the state pass writing o, TF32 fp32-operand dots,
# the gate cumsums inside the kernels (the defaults until 2026-12-01).
ROUND2_OPTIONS = KernelOptions(split_intra_bwd=False, parallel_output=False, bf16_state_dots=False,
                               bf16_intra_dots=False, xla_gate_cumsum=False, split_intra_fwd=False,
                               compact_offdiag_bwd=False, tile_state_bwd=False, pallas_cumsum=False,
                               bf16_state_bwd_dots=False, hopper_state_fwd=False, hopper_state_bwd=False,
                               hopper_fused_output=False, hopper_intra_bwd=False,
                               hopper_score_bwd=False, hopper_intra_fwd=False, hopper_fused_wu=False,
                               hopper_bf16_w=False)


# The base option set with the exact diagonal tiles for unbounded gates (lower_bound=None): they exist
# in fwd.intra_fwd_split's kernel a with the gate cumsum outside it and in the compact backward kernel
# b, and the tests cover them with the seven round-3 options on (the defaults of 2026-12-01); the
# BOUND_FREE_FIELDS below may take any value. Spelled out, not
# KernelOptions(), so that a later change of the defaults cannot widen what unbounded gates reach.
UNBOUNDED_OPTIONS = KernelOptions(split_intra_bwd=True, parallel_output=True, bf16_state_dots=True,
                                  bf16_intra_dots=True, xla_gate_cumsum=True, split_intra_fwd=True,
                                  compact_offdiag_bwd=True, tile_state_bwd=False, pallas_cumsum=True,
                                  bf16_state_bwd_dots=True, hopper_state_fwd=True, hopper_state_bwd=True,
                                  hopper_fused_output=True, hopper_intra_bwd=True,
                                  hopper_score_bwd=False, hopper_intra_fwd=True, hopper_fused_wu=True,
                                  hopper_bf16_w=True)
# The fields that do not touch the gate arithmetic (kernel a over V blocks, the cumsum kernel, the
# backward state pass's dot precision, the Hopper state passes and kernel a; the Hopper kernel b and
# the Hopper forward kernel with its fused W / U and bf16 W, which are not used for unbounded gates
# whatever they say): unbounded gates run with
# UNBOUNDED_OPTIONS and any values of these (tested in interpret mode against UNBOUNDED_OPTIONS:
# test_tile_state_bwd_matches_whole_states, TestPallasCumsumOption, TestBf16StateBwdDots,
# test_kda_hopper.TestHopperStateOptions, test_kda_hopper_bwd.TestHopperIntraBwdOption).
BOUND_FREE_FIELDS = ("tile_state_bwd", "pallas_cumsum", "bf16_state_bwd_dots", "hopper_state_fwd",
                     "hopper_state_bwd", "hopper_fused_output", "hopper_intra_bwd", "hopper_score_bwd",
                     "hopper_intra_fwd", "hopper_fused_wu", "hopper_bf16_w")
UNBOUNDED_OPTION_SETS = tuple(dataclasses.replace(UNBOUNDED_OPTIONS, **dict(zip(BOUND_FREE_FIELDS, values)))
                              for values in itertools.product((False, True), repeat=len(BOUND_FREE_FIELDS)))


def supported(q, k, v, g, beta, *, lower_bound=None, segment_ids=None, use_qk_l2norm=False,
              chunk_size=CHUNK_SIZE, initial_state=None, interpret=False,
              options=None) -> tuple[bool, str]:
    """Whether `kda_pallas` covers this call (shapes, dtypes, options), and why not if it does not.

    Args: as `kda_pallas` (arrays or ShapeDtypeStructs; segment_ids [B, T] of an integer dtype;
      options a KernelOptions or None = KernelOptions()), plus the dispatch option use_qk_l2norm,
      which the kernel does not implement. Compiled (interpret=False) fp32 calls are covered only up
      to K, V <= MAX_FP32_HEAD_DIM (see there). lower_bound=None (unbounded gates) is covered only
      with options in UNBOUNDED_OPTION_SETS (the seven round-3 fields on, as by default, any values
      of BOUND_FREE_FIELDS).
    Returns: (True, "") or (False, reason).
    """
    if use_qk_l2norm:
        return False, "use_qk_l2norm=True is not supported by the Pallas KDA kernel"
    if lower_bound is None:
        opts = KernelOptions() if options is None else options
        if opts not in UNBOUNDED_OPTION_SETS:
            return False, ("lower_bound=None (unbounded gates) runs in the Pallas KDA kernel only with the "
                           "default options (the seven round-3 KernelOptions fields on, BOUND_FREE_FIELDS either "
                           f"way: UNBOUNDED_OPTION_SETS); got {options=}: "
                           "the exact diagonal tiles exist only in intra_fwd_split with xla_gate_cumsum and the "
                           "compact_offdiag_bwd backward")
    elif isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        return False, (f"lower_bound must be None or a Python number in [{MIN_LOWER_BOUND}, 0) (a static "
                       f"compile-time promise); got {type(lower_bound).__name__} {lower_bound!r}")
    elif not MIN_LOWER_BOUND <= float(lower_bound) < 0:
        return False, f"{lower_bound=} must lie in [{MIN_LOWER_BOUND}, 0) for the Pallas KDA kernel"
    if chunk_size != CHUNK_SIZE:
        return False, f"{chunk_size=} is not supported by the Pallas KDA kernel (only {CHUNK_SIZE})"
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        return False, f"expected q, k, g of one shape [B, T, H, K]; got {q.shape=} {k.shape=} {g.shape=}"
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        return False, f"expected v [B, T, H, V], beta [B, T, H]; got {v.shape=} {beta.shape=}"
    V = v.shape[-1]
    if min(B, T, H, K, V) == 0:
        return False, f"every dimension must be positive; got {q.shape=} {v.shape=}"
    if not jnp.issubdtype(beta.dtype, jnp.floating) or not jnp.issubdtype(g.dtype, jnp.floating):
        return False, f"g and beta must be floating point; got {g.dtype=} {beta.dtype=}"
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return False, f"head dims K={K}, V={V} above {MAX_HEAD_DIM} are not covered by the tests"
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        return False, f"q, k, v must share one dtype in (bfloat16, float32); got {dtypes}"
    if not interpret and jnp.dtype(q.dtype) == jnp.dtype(jnp.float32) and max(K, V) > MAX_FP32_HEAD_DIM:
        return False, (f"float32 inputs with K={K}, V={V} above {MAX_FP32_HEAD_DIM} are not supported compiled: "
                       "the backward exceeded the H200's shared memory at K = V = 128 (245760 > 232448 bytes, "
                       "2026-11-30); use bfloat16 inputs or interpret=True")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        return False, f"expected initial_state [B, H, K, V]; got {initial_state.shape=}"
    if segment_ids is not None and (tuple(segment_ids.shape) != (B, T)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        return False, (f"expected segment_ids [B, T] = {(B, T)} of an integer dtype; "
                       f"got {segment_ids.shape=} {segment_ids.dtype=}")
    return True, ""


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _state_pass(fac, h0, *, chunk_size, block_v, seg_chunks, out_dtype, interpret, save_states,
                state_dtype, dtype, options=KernelOptions()):
    """The forward's state pass and output: fwd.state_fwd over all chunks, or split into segments
    (split.py) when seg_chunks > 0; with options.parallel_output fwd.state_fwd_vp (or
    hopper.state_fwd, see use_hopper_state_fwd) + fwd.output_fwd, or with hopper_fused_output the
    Hopper pass with the output fused in (hopper.state_output_fwd; h only when save_states)."""
    kw = dict(chunk_size=chunk_size, block_v=block_v, interpret=interpret)
    bf16 = options.bf16_state_dots and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    prec = common.BF16_OPERANDS if bf16 else common.mm_precision(dtype)
    qg, kd, w, u, aqk, gl = fac
    starts, ht = h0, None
    if seg_chunks:
        P, R = split.transitions_fwd(kd, w, u, gl, seg_chunks=seg_chunks,
                                     precision=common.exact_precision(dtype), **kw)
        starts, ht = split.segment_scan(h0, P, R, reverse=False, block_v=block_v,
                                        interpret=interpret, precision=common.exact_precision(dtype))
    hopper_fwd = options.parallel_output and use_hopper_state_fwd(kd, w, u, block_v, bf16, state_dtype,
                                                                  interpret, options)
    if hopper_fwd and options.hopper_fused_output and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) \
            and qg.dtype == aqk.dtype == jnp.bfloat16:
        o, h, ht_pass = hopper.state_output_fwd(kd, w, u, gl, starts, qg, aqk, out_dtype=out_dtype,
                                                write_states=save_states, interpret=interpret)
    elif options.parallel_output:
        if hopper_fwd:
            vp, h, ht_pass = hopper.state_fwd(kd, w, u, gl, starts, interpret=interpret)
        else:
            vp, h, ht_pass = fwd.state_fwd_vp(kd, w, u, gl, starts, precision=prec,
                                              state_dtype=state_dtype, vp_dtype=u.dtype, **kw)
        o = fwd.output_fwd(qg, aqk, vp, h, chunk_size=chunk_size, out_dtype=out_dtype,
                           interpret=interpret, precision=prec)
    else:
        o, h, ht_pass = fwd.state_fwd(*fac, starts, out_dtype=out_dtype, precision=prec,
                                      save_states=save_states, state_dtype=state_dtype, **kw)
    return o, h, (ht if seg_chunks else ht_pass)


def _hopper_applies(K, V, kd_dtype, w_dtype, block_v, bf16_dots, state_dtype, interpret) -> bool:
    """The conditions shared by both Hopper state passes (KernelOptions.hopper_state_fwd / _bwd), on
    the padded head dims K, V and the dtypes of the saved factors Kd, W (fp32, or bf16 with
    hopper_bf16_w) and states."""
    return (bf16_dots and K in hopper.HEAD_DIMS and block_v == hopper.BLOCK_V
            and V % hopper.BLOCK_V == 0 and jnp.dtype(kd_dtype) == jnp.dtype(jnp.bfloat16)
            and jnp.dtype(w_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
            and jnp.dtype(state_dtype) == jnp.dtype(jnp.bfloat16)
            and (bool(interpret) or hopper.is_hopper()))


def hopper_serial_passes(dtype, Kp: int, Vp: int, block_v: int, interpret, options) -> bool:
    """Whether BOTH serial state passes of a kda_pallas call with inputs of `dtype` and padded head
    dims Kp, Vp run on Hopper (then the automatic sequence split uses SPLIT_TARGET_PROGRAMS_HOPPER).
    The same conditions as use_hopper_state_fwd and _state_bwd_pass, from the static call data."""
    static = (Kp, Vp, *factor_dtypes(dtype)[1:3], block_v)                   # K, V, Kd and W dtypes
    return (options.parallel_output and options.hopper_state_fwd and options.hopper_state_bwd
            and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
            and _hopper_applies(*static, options.bf16_state_dots, saved_state_dtype(dtype), interpret)
            and _hopper_applies(*static, options.bf16_state_bwd_dots, saved_state_dtype(dtype), interpret))


def use_hopper_state_fwd(kd, w, u, block_v, bf16_dots, state_dtype, interpret, options) -> bool:
    """Whether the forward state pass runs hopper.state_fwd (KernelOptions.hopper_state_fwd)."""
    return (options.hopper_state_fwd and u.dtype == jnp.float32
            and _hopper_applies(kd.shape[-1], u.shape[-1], kd.dtype, w.dtype, block_v, bf16_dots, state_dtype,
                                interpret))


def _state_bwd_pass(qg, kd, w, aqk, gl, do, dht, *, bf16_dots, precision, state_dtype, chunk_size,
                    block_v, interpret, options):
    """The backward's serial state pass: hopper.state_bwd (KernelOptions.hopper_state_bwd, where it
    applies) or bwd.state_bwd; same outputs (du, dh, dh0)."""
    if (options.hopper_state_bwd and jnp.dtype(do.dtype) == jnp.dtype(jnp.bfloat16)
            and qg.dtype == aqk.dtype == kd.dtype
            and _hopper_applies(kd.shape[-1], do.shape[-1], kd.dtype, w.dtype, block_v, bf16_dots, state_dtype,
                                interpret)):
        return hopper.state_bwd(qg, kd, w, aqk, gl, do, dht, interpret=interpret)
    return bwd.state_bwd(qg, kd, w, aqk, gl, do, dht, precision=precision, state_dtype=state_dtype,
                         chunk_size=chunk_size, block_v=block_v, interpret=interpret)


def _hopper_split_bwd(q, interpret, options) -> bool:
    """The conditions shared by both Hopper kernels of the two-kernel intra backward: that backward
    (split_intra_bwd, compact_offdiag_bwd or tile_state_bwd implies it) with bf16 operands and the
    gate cumsum outside, bf16 queries q (padded token-major) with K in hopper.HEAD_DIMS, compiled on
    Hopper or in interpret mode."""
    return (options.bf16_intra_dots and options.xla_gate_cumsum
            and (options.split_intra_bwd or options.compact_offdiag_bwd or options.tile_state_bwd)
            and q.shape[-1] in hopper.HEAD_DIMS and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16)
            and (bool(interpret) or hopper.is_hopper()))


def use_hopper_intra_bwd(q, v, do, h, du, w, u, rel, interpret, options) -> bool:
    """Whether kernel a of the intra-chunk backward runs hopper_bwd.intra_bwd_a
    (KernelOptions.hopper_intra_bwd); q, v, do are the padded token-major inputs, h, du, w, u the
    saved states, dV' and W, U, rel the document offsets (None without segment_ids)."""
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    return (options.hopper_intra_bwd and not options.tile_state_bwd and _hopper_split_bwd(q, interpret, options)
            and rel is None and v.shape[-1] in hopper.HEAD_DIMS
            and all(jnp.dtype(x.dtype) == bf16 for x in (v, do, h))
            and all(jnp.dtype(x.dtype) == f32 for x in (du, u)) and jnp.dtype(w.dtype) in (f32, bf16))


def use_hopper_score_bwd(q, unbounded, interpret, options) -> bool:
    """Whether kernel b of the intra-chunk backward runs hopper_score_bwd.intra_bwd_b
    (KernelOptions.hopper_score_bwd); q: the padded token-major queries."""
    return options.hopper_score_bwd and not unbounded and _hopper_split_bwd(q, interpret, options)


def use_hopper_intra_fwd(q, unbounded, rel, interpret, options) -> bool:
    """Whether kernel a of the intra-chunk forward runs hopper_fwd.intra_fwd_a
    (KernelOptions.hopper_intra_fwd); q: the padded token-major queries, rel the document offsets
    (None without segment_ids)."""
    return (options.hopper_intra_fwd and options.split_intra_fwd and options.bf16_intra_dots
            and options.xla_gate_cumsum and not unbounded and rel is None
            and q.shape[-1] in hopper.HEAD_DIMS and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16)
            and (bool(interpret) or hopper.is_hopper()))


def _intra_fwd(q, k, v, g, beta, rel, *, scale, chunk_size, interpret, options, unbounded, save_solve):
    """The intra-chunk forward: fwd.intra_fwd (one or two Triton kernels), or with
    use_hopper_intra_fwd the Mosaic GPU kernel a and the Triton kernel b, or with hopper_fused_wu
    too (and V in hopper.HEAD_DIMS) the one Mosaic GPU kernel hopper_fwd.intra_fwd; same outputs
    (qg, kd, w, u, aqk, gl, and A, M with save_solve)."""
    fd = factor_dtypes(q.dtype)
    if not use_hopper_intra_fwd(q, unbounded, rel, interpret, options):
        return fwd.intra_fwd(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, interpret=interpret,
                             factor_dtype=fd, save_solve=save_solve, bf16_dots=options.bf16_intra_dots,
                             gate_cumsum=options.xla_gate_cumsum, segments=rel,
                             split=options.split_intra_fwd, unbounded=unbounded)
    if options.hopper_fused_wu and v.shape[-1] in hopper.HEAD_DIMS:
        # bf16 W only where both state passes round W to bf16 anyway (their bf16-operand dots)
        bf16_w = options.hopper_bf16_w and options.bf16_state_dots and options.bf16_state_bwd_dots
        return hopper_fwd.intra_fwd(q, k, v, g, beta, scale=scale, save_solve=save_solve, bf16_w=bf16_w,
                                    interpret=interpret)
    qg, kd, aqk, gl, A, *M = hopper_fwd.intra_fwd_a(q, k, g, beta, scale=scale, save_solve=save_solve,
                                                    interpret=interpret)
    w, u = fwd.intra_fwd_b(k, v, g, beta, A, chunk_size=chunk_size, interpret=interpret, factor_dtype=fd,
                           bf16_dots=True, gate_cumsum=True)
    return (qg, kd, w, u, aqk, gl) + ((A, M[0]) if save_solve else ())


def _intra_bwd(q, k, v, g, beta, do, du, h, dh, w, u, A, M, rel, *, scale, chunk_size, interpret, options,
               unbounded):
    """The intra-chunk backward: the Triton kernels (bwd.intra_bwd, one or two kernels), with kernel a
    (KernelOptions.hopper_intra_bwd) and / or kernel b (hopper_score_bwd) on Hopper where they
    apply; same outputs (dq, dk, dv, dg, dbeta)."""
    hopper_a = use_hopper_intra_bwd(q, v, do, h, du, w, u, rel, interpret, options)
    hopper_b = use_hopper_score_bwd(q, unbounded, interpret, options)
    if not (hopper_a or hopper_b):
        return bwd.intra_bwd(
            q, k, v, g, beta, do, du, h, dh, w, u, A, M, scale=scale, chunk_size=chunk_size,
            interpret=interpret, split=options.split_intra_bwd, bf16_dots=options.bf16_intra_dots,
            gate_cumsum=options.xla_gate_cumsum, segments=rel, compact_offdiag=options.compact_offdiag_bwd,
            unbounded=unbounded, state_block_v=(bwd.STATE_BLOCK_V if options.tile_state_bwd else None))
    if hopper_a:
        dv, dbeta, *parts = hopper_bwd.intra_bwd_a(q, k, v, g, beta, do, du, h, dh, w, u, A, M, scale=scale,
                                                   interpret=interpret)
    else:                                 # gate_cumsum: kernel a writes no G
        dv, dbeta, *parts = bwd.intra_bwd_a(
            q, k, v, g, beta, do, du, h, dh, w, u, A, M, scale=scale, chunk_size=chunk_size, interpret=interpret,
            bf16_dots=True, gate_cumsum=True, segments=rel,
            state_block_v=bwd.STATE_BLOCK_V if options.tile_state_bwd else None)
    if hopper_b:
        dq, dk, dg = hopper_score_bwd.intra_bwd_b(q, k, g, *parts, scale=scale, interpret=interpret)
    else:
        dq, dk, dg = bwd.intra_bwd_b(q, k, g, *parts, scale=scale, chunk_size=chunk_size, interpret=interpret,
                                     bf16_dots=True, gate_cumsum=True,
                                     compact_offdiag=options.compact_offdiag_bwd, unbounded=unbounded)
    return dq, dk, dv, dg, dbeta


def _gate_cumsum(x, chunk_size, options, interpret, reverse=False):
    """The chunk-local (reverse) cumsum that options.xla_gate_cumsum moves out of the intra kernels:
    XLA's (common.chunk_cumsum) or, with options.pallas_cumsum, the Pallas kernel's."""
    if options.pallas_cumsum:
        return cumsum.chunk_cumsum(x, chunk_size, reverse=reverse, interpret=interpret)
    return common.chunk_cumsum(x, chunk_size, reverse=reverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13))
def _core(q, k, v, g, beta, h0, rel, scale, chunk_size, block_v, seg_chunks, interpret, options,
          unbounded):
    """Padded token-major core: q, k, g [B,Tp,H,Kp]; v [B,Tp,H,Vp]; beta [B,Tp,H]; h0 [B,H,Vp,Kp];
    rel None or [B, Tp] int32 document offsets (common.document_offsets; no gradient).
    unbounded: no lower_bound (exact diagonal tiles; options in UNBOUNDED_OPTION_SETS).

    Forward-only calls land here (not in _core_fwd): the per-chunk states are not written (unless
    options.parallel_output sends them to fwd.output_fwd; the fused Hopper pass,
    hopper.state_output_fwd, does not write them).
    """
    if options.xla_gate_cumsum:
        g = _gate_cumsum(g, chunk_size, options, interpret)
    fac = _intra_fwd(q, k, v, g, beta, rel, scale=scale, chunk_size=chunk_size, interpret=interpret,
                     options=options, unbounded=unbounded, save_solve=False)
    o, _, ht = _state_pass(fac, h0, chunk_size=chunk_size, block_v=block_v, seg_chunks=seg_chunks,
                           out_dtype=v.dtype, interpret=interpret, save_states=False,
                           state_dtype=saved_state_dtype(q.dtype), dtype=q.dtype, options=options)
    return o, ht


def _core_fwd(q, k, v, g, beta, h0, rel, scale, chunk_size, block_v, seg_chunks, interpret, options,
              unbounded):
    # The chunk factors and the solve (A, M) are SAVED, not recomputed in the backward: 2 x 16 KiB
    # fp32 per chunk and head against ~20 GEMMs of the recompute (kda_pallas_notes.md).
    # With options.xla_gate_cumsum the saved g is its chunk-local cumsum G.
    if options.xla_gate_cumsum:
        g = _gate_cumsum(g, chunk_size, options, interpret)
    *fac, A, M = _intra_fwd(q, k, v, g, beta, rel, scale=scale, chunk_size=chunk_size, interpret=interpret,
                            options=options, unbounded=unbounded, save_solve=True)
    o, h, ht = _state_pass(fac, h0, chunk_size=chunk_size, block_v=block_v, seg_chunks=seg_chunks,
                           out_dtype=v.dtype, interpret=interpret, save_states=True,
                           state_dtype=saved_state_dtype(q.dtype), dtype=q.dtype, options=options)
    return (o, ht), (q, k, v, g, beta, h0, rel, h, tuple(fac), A, M)


def _core_bwd(scale, chunk_size, block_v, seg_chunks, interpret, options, unbounded, res, cts):
    q, k, v, g, beta, h0, rel, h, (qg, kd, w, u, aqk, gl), A, M = res
    do, dht = cts
    kw = dict(chunk_size=chunk_size, block_v=block_v, interpret=interpret)
    bf16 = options.bf16_state_bwd_dots and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16)
    state_prec = common.BF16_OPERANDS if bf16 else common.mm_precision(q.dtype)
    pass_kw = dict(bf16_dots=bf16, precision=state_prec, state_dtype=h.dtype, options=options, **kw)
    if seg_chunks:
        Q, Z = split.transitions_bwd(qg, kd, w, aqk, gl, do, seg_chunks=seg_chunks,
                                     precision=common.exact_precision(q.dtype), **kw)
        ends, _ = split.segment_scan(dht, Q, Z, reverse=True, block_v=block_v, interpret=interpret,
                                     precision=common.exact_precision(q.dtype))
        du, dh, dh0 = _state_bwd_pass(qg, kd, w, aqk, gl, do, ends, **pass_kw)
        dh0 = dh0[:, :, 0]
    else:
        du, dh, dh0 = _state_bwd_pass(qg, kd, w, aqk, gl, do, dht, **pass_kw)
    dq, dk, dv, dg, dbeta = _intra_bwd(q, k, v, g, beta, do, du, h, dh, w, u, A, M, rel, scale=scale,
                                       chunk_size=chunk_size, interpret=interpret, options=options,
                                       unbounded=unbounded)
    if options.xla_gate_cumsum:
        dg = _gate_cumsum(dg, chunk_size, options, interpret, reverse=True)
    return (dq, dk, dv, dg.astype(g.dtype), dbeta.astype(beta.dtype), dh0.astype(h0.dtype), None)


_core.defvjp(_core_fwd, _core_bwd)


def kda_pallas(q, k, v, g, beta, *, lower_bound: float | None, scale: float | None = None,
               initial_state=None, output_final_state: bool = False, segment_ids=None,
               chunk_size: int = CHUNK_SIZE, interpret: bool = False,
               sequence_split: int | None = None, options: KernelOptions | None = None):
    """Chunked KDA with Pallas kernels, differentiable (custom_vjp; backward also in Pallas).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (one dtype: bf16 or fp32; dots take bf16 operands with
        fp32 accumulation for bf16 inputs); g: [B, T, H, K] log-decay in nats with
        lower_bound <= g <= 0 (a caller PROMISE; not checked at run time; g <= 0 is promised also
        without a bound); beta: [B, T, H].
      lower_bound: declared gate bound in [-5, 0); it is what makes every 16x16 diagonal tile one
        dense dot (exp of at most 16 * 5 = 80 nats). None: unbounded gates (any g <= 0, e.g. Kimi
        Linear's softplus gate): the diagonal tiles run the exact elementwise form (every exp
        argument <= 0; CUDA-core work instead of one tensor-core dot per tile); only with the
        option sets of UNBOUNDED_OPTION_SETS (the defaults are one).
      scale: query scale, None = K ** -0.5.
      initial_state: [B, H, K, V] (fp32) state before token 0, or None (zeros). With segment_ids it
        applies to each row's first document only.
      output_final_state: also return the fp32 final state [B, H, K, V] (with segment_ids: the
        state after the last token, i.e. of each row's last document).
      segment_ids: None or [B, T] integer document ids of packed sequences: the state restarts
        from zero at every token whose id differs from the previous token's (as k3jax's
        kda_recurrent / kda_chunked; no padding id: pad tokens form or join a document). In the
        kernels this is a set of 0/1 selects on the chunk factors (common.Segments); the serial
        state passes are unchanged.
      chunk_size: 64 (the only supported value).
      interpret: run the kernels in Pallas interpret mode (CPU).
      sequence_split: segment length in chunks for the exact sequence split of the serial state
        passes (split.py; see split_chunks): None = automatic (only when the serial pass would run
        fewer than SPLIT_TARGET_PROGRAMS programs, B * H * (Vp // min(Vp, 64)) with Vp the padded V,
        or fewer than SPLIT_TARGET_PROGRAMS_HOPPER when both passes run on Hopper
        (hopper_serial_passes), and the sequence has at least 2 * SPLIT_MIN_CHUNKS chunks), 0 = one
        serial pass.
      options: KernelOptions (kernel variants with the same math); None = KernelOptions().

    Returns: (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None).

    Raises: ValueError naming the reason when `supported(...)` is False (e.g. lower_bound=None with
      options outside UNBOUNDED_OPTION_SETS), or options not a KernelOptions.

    Source: Kimi Linear (arXiv 2510.26692) Eq. 1; fla `chunk_kda(..., safe_gate=True, lower_bound)`;
    unbounded gates: the exact pairwise diagonal tiles of k3jax's kda_chunked (no lower_bound).
    """
    if options is None:
        options = KernelOptions()
    if not isinstance(options, KernelOptions):
        raise ValueError(f"options must be a KernelOptions or None; got {type(options).__name__}")
    ok, why = supported(q, k, v, g, beta, lower_bound=lower_bound, chunk_size=chunk_size, interpret=interpret,
                        initial_state=initial_state, segment_ids=segment_ids, options=options)
    if not ok:
        raise ValueError(why)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    C = chunk_size
    Tp = -(-T // C) * C
    Kp, Vp = _pow2(K), _pow2(V)
    block_v = min(Vp, 64)

    def prep(x, n=None):        # zero padding of T (and K / V) is inert; a no-op when aligned
        pad = [(0, 0), (0, Tp - T), (0, 0)] + ([] if n is None else [(0, n - x.shape[-1])])
        return jnp.pad(x, pad) if any(p[1] for p in pad) else x

    qp, kp = prep(q, Kp), prep(k, Kp)
    vp = prep(v, Vp)
    gp = prep(g.astype(jnp.float32), Kp)
    bp = prep(beta)
    if initial_state is None:
        h0 = jnp.zeros((B, H, Vp, Kp), jnp.float32)
    else:
        h0 = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)
        h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Vp - V), (0, Kp - K)))
    rel = None if segment_ids is None else common.document_offsets(segment_ids, C, Tp)
    hopper_passes = hopper_serial_passes(q.dtype, Kp, Vp, block_v, interpret, options)
    seg = split_chunks(Tp // C, sequence_split, n_programs=B * H * (Vp // block_v),
                       target_programs=SPLIT_TARGET_PROGRAMS_HOPPER if hopper_passes else SPLIT_TARGET_PROGRAMS)
    o, ht = _core(qp, kp, vp, gp, bp, h0, rel, float(scale), C, block_v, seg, bool(interpret), options,
                  lower_bound is None)
    o = o[:, :T, :, :V] if (Tp, Vp) != (T, V) else o
    final = jnp.swapaxes(ht[:, :, :V, :K], -1, -2) if output_final_state else None
    return o, final
