"""Per-kernel GPU timing of the Pallas KDA kernels (pallas_kernels.kda), plus the whole op.

For each shape B x T x H x K (V = K, bf16 q/k/v/beta, fp32 g; ANCHORS.md recipe: q ~ N(0,1),
k L2-normalised, v ~ N(0,1), g = -5 sigmoid(N(0,1)), beta = sigmoid(N(0,1)), lower_bound = -5), it
times, each jitted on its own on the outputs of the previous one (layouts as in
pallas_kernels/kda/ops.py):
  intra_fwd       chunk factors (intra_fwd_save: also A and M, as when differentiated)
  state_fwd       serial state pass, o and the saved states (state_fwd_nosave: forward-only variant)
  state_bwd       reverse state pass
  intra_bwd       intra-chunk gradients
and the whole op (`ops.kda_pallas`) forward and forward+backward (value_and_grad of sum(o * do) w.r.t.
q, k, v, g, beta), and, unless --nochunked, the XLA chunked op (k3jax.ops.kda_chunked) the same way
(issue 4's target: pallas >= 5x faster than it). Timing: each callable is compiled, called --warmup
times, then --iters calls are timed one by one with `block_until_ready`; the median (ms) is kept.
The inputs of one kernel are fixed across its calls (they are hundreds of MB, far larger than L2).

Rows are appended to --out (JSON) after every measurement, so a run cut by a time limit keeps what it
measured. Compiler parameters of the intra / serial kernels can be swept with --intra_warps /
--state_warps (Triton num_warps; num_stages stays 1), and the sequence split of the state passes
(split.py) with --splits (segment length in chunks; 0 = one serial pass). With a split, the kernels
transitions_fwd / scan_fwd (and transitions_bwd / scan_bwd) are timed too and state_fwd / state_bwd
run per segment.

Run (GPU): python -m experiments.bench_kda_kernels --shapes=8x4096x16x128,1x65536x16x128 \
             --out=$OUT/kda_kernels.json

Profiling by ablation (--ablate=none,scores,solve,...; first shape only; replaces the rows above):
one row per (kernel, ablation, num_warps) with the kernel time only (no errors: an ablated kernel
computes WRONG results, only its time means something). An ablation removes a named piece of the
kernel body (common.FWD_ABLATIONS / BWD_ABLATIONS / STATE_ABLATIONS; "a+b" removes both; "none" is
the kernel as shipped), so `ms(none) - ms(piece)` is what the piece costs in context. Kernels:
--ablate_kernels (intra_fwd, intra_fwd_save, intra_fwd_split, state_fwd, intra_bwd, ...; a name a
kernel does not know is skipped for it; intra_fwd_split and intra_bwd_split time both of
their pallas_calls, with the real options bf16_dots, gate_cumsum and, for intra_bwd_split,
compact and tile_state as "ablations"; intra_bwd_a and intra_bwd_b are the split backward's two
pallas_calls timed apart, each with the options the default op uses (bf16 dots, XLA gate cumsum,
compact kernel b): kernel a with its private ablations bwd.A_ABLATIONS (state_products, dXY, dA,
dL, exact_dots, compute) and the real option tile_state (state products over V blocks of
bwd.STATE_BLOCK_V = 64; tile_state32: blocks of 32), kernel b with none), each at every
--ablate_warps value. Inputs are random of the right shapes
and dtypes (the kernels' times do not depend on the values). All rows are lowered and compiled in
--compile_threads threads first, then timed one by one in order; --time_budget_s stops the run (the
JSON keeps the rows done).
  python -m experiments.bench_kda_kernels --shapes=8x4096x16x128 --ablate=none,compute,scores \
      --ablate_warps=8,4 --time_budget_s=130 --out=$OUT/kda_profile.json
A/B of option sets (--variants, same mode): the whole op per ops.KernelOptions spec ("base",
"base+tile_state", "base-pallas_cumsum", ...), fwd, fwd+bwd and errors; --state_stages (one value
per process) sets the serial kernels' num_stages, --variant_split their sequence split (round 5 of kda_pallas_notes.md):
  python -m experiments.bench_kda_kernels --shapes=8x4096x16x128 --variants=base,base+tile_state \
      --state_stages=2 --check_shape=1x1024x2x128 --out=$OUT/ab.json
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from pallas_kernels.kda import bwd, common, fwd, hopper, hopper_bwd, hopper_fwd, hopper_score_bwd, ops, split

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["8x4096x16x128", "1x65536x16x128"], "BxTxHxK shapes (V = K)")
flags.DEFINE_string("out", "/tmp/k3jax_bench_kda_kernels/kda_kernels.json", "JSON file, rewritten after "
                    "every measurement (committed results were written with --out=experiments/results/...)")
flags.DEFINE_integer("iters", 20, "timed calls per measurement (median reported)")
flags.DEFINE_integer("warmup", 2, "untimed calls after compilation")
flags.DEFINE_list("intra_warps", ["8"], "Triton num_warps values to try for intra_fwd/intra_bwd")
flags.DEFINE_list("state_warps", ["4"], "Triton num_warps values to try for the serial kernels")
flags.DEFINE_list("state_stages", ["1"], "Triton num_stages values to try for the serial kernels "
                  "(> 1 pipelines the next chunk's loads; 3 overflowed shared memory in round 1)")
flags.DEFINE_string("variant_split", "0", "sequence_split of the --variants ops: a segment length in chunks "
                    "(0: one serial pass) or 'auto' (the op's default rule, ops.split_chunks)")
flags.DEFINE_list("exact_bf16", ["bf16x3"], "precision of the error-sensitive dots for bf16 inputs "
                  "(common.EXACT_BF16): bf16x3 (default), tf32 (one TF32 pass), tf32x3")
flags.DEFINE_string("check_shape", "1x1024x2x128", "BxTxHxK of the accuracy check run for every "
                    "config (RMS ratios of o and the gradients vs the fp32 recurrence); '' = none")
flags.DEFINE_list("splits", ["auto", "0"], "sequence-split segment lengths in chunks to compare: "
                  "'auto' (ops.split_chunks' rule, what kda_pallas does by default), 0 = one serial "
                  "pass, L > 0 (falls back to 0 unless it divides T / 64 into >= 2 segments)")
flags.DEFINE_bool("chunked", True, "also time the XLA chunked op (k3jax.ops.kda_chunked)")
flags.DEFINE_integer("chunked_max_t", 16384, "skip the XLA chunked op above this T (its serial scan "
                     "over T / 64 chunks is slow to compile and run; shared/bench/jla_anchor.py skips "
                     "it there too)")
flags.DEFINE_bool("interpret", False, "Pallas interpret mode (a CPU smoke run of this script only)")
flags.DEFINE_list("ablate", [], "profiling mode: ablations to time ('none' = as shipped; 'a+b' = "
                  "both); empty = the normal rows")
flags.DEFINE_list("ablate_kernels", ["intra_fwd", "intra_bwd"], "kernels of the profiling mode: "
                  "intra_fwd, intra_fwd_save, intra_fwd_split, state_fwd, "
                  "state_fwd_vp, state_fwd_hopper, output_fwd, intra_bwd, intra_bwd_split, intra_bwd_a, "
                  "intra_bwd_b, intra_bwd_a_hopper, intra_bwd_b_hopper, intra_fwd_a, intra_fwd_a_hopper, "
                  "intra_fwd_hopper")
flags.DEFINE_list("ablate_warps", ["8", "4"], "Triton num_warps values of the profiling mode (each "
                  "row is timed at every value; 0 = each kernel's default, common.*_PARAMS)")
flags.DEFINE_list("variants", [], "profiling mode: ops.KernelOptions variants whose whole op is "
                  "timed (fwd, fwd+bwd at the first shape, sequence split --variant_split) and checked "
                  "(errors at --check_shape): 'base' (the defaults), 'round2' (all off), '+'-joined short "
                  "names (on over round2; VARIANT_FIELDS), or 'base' then '+name' / '-name' (on / off over "
                  "the defaults)")
flags.DEFINE_integer("compile_threads", 8, "profiling mode: threads compiling rows in parallel")
flags.DEFINE_float("time_budget_s", 0.0, "profiling mode: stop starting rows after this many "
                   "seconds since the start (0 = no limit)")

LOWER_BOUND = -5.0
CHUNK = ops.CHUNK_SIZE
EXACT = {"bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3, "tf32": lax.Precision.DEFAULT,
         "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}
_REFERENCE = {}
_CHECKED = {}


def rms_ratio(ref, out) -> float:
    """fla's error metric RMS(ref - out) / RMS(ref), in fp64."""
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((ref - out) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def check_errors(shape: str, seg_rule, interpret: bool) -> dict:
    """RMS ratios of o, dq, dk, dv, dg, dbeta of kda_pallas vs the fp32 recurrence (k3jax) on one
    bf16 input set (ANCHORS recipe, loss sum(o * do)) with the current precision settings; computed
    once per (shape, split, common.EXACT_BF16)."""
    from k3jax.ops.kda_reference import kda_recurrent
    B, T, H, K = (int(x) for x in shape.split("x"))
    q, k, v, g, beta, do = make_inputs(B, T, H, K, head_major=False)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")

    def run(f):
        def loss(*a):
            o = f(*a)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
        (_, o), gr = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
            q, k, v, g, beta)
        return (o,) + tuple(gr)

    if shape not in _REFERENCE:
        _REFERENCE[shape] = run(lambda *a: kda_recurrent(*(x.astype(jnp.float32) for x in a))[0])
    seg = ops.split_chunks(T // CHUNK, seg_rule, B * H * (K // min(K, 64)))
    key = (shape, seg, str(common.EXACT_BF16))        # numerics do not depend on num_warps/stages
    if key not in _CHECKED:
        out = run(lambda *a: ops.kda_pallas(*a, lower_bound=LOWER_BOUND, interpret=interpret,
                                            sequence_split=seg)[0])
        _CHECKED[key] = {"check_shape": shape, "check_split": seg,
                         **{n: rms_ratio(r, x) for n, r, x in zip(names, _REFERENCE[shape], out)}}
    return _CHECKED[key]


def median_ms(f, *args, iters: int, warmup: int) -> float:
    """Median wall time (ms) of `iters` synchronised calls of f(*args), after compile + warmup."""
    jax.block_until_ready(f(*args))
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def make_inputs(B, T, H, K, *, head_major: bool):
    """ANCHORS-recipe inputs: q, k, v, beta bf16; g fp32; do bf16. [B, T, H, .] or [B, H, T, .]."""
    shp = (B, H, T, K) if head_major else (B, T, H, K)
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], shp, jnp.bfloat16)
    k = jax.random.normal(ks[1], shp, jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], shp, jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], shp, jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], shp[:3], jnp.float32)).astype(jnp.bfloat16)
    do = jax.random.normal(ks[5], shp, jnp.bfloat16)
    return q, k, v, g, beta, do


def time_kernels(B, T, H, K, iters, warmup, seg, interpret=False):
    """Median ms of each pallas_call (forward and backward) at one shape; dict kernel -> ms.

    seg: sequence-split segment length in chunks (0 = one serial pass), as ops.split_chunks returns.
    """
    sc = K ** -0.5
    q, k, v, g, beta, do = make_inputs(B, T, H, K, head_major=False)
    h0 = jnp.zeros((B, H, K, K), jnp.float32)
    prec, exact = common.mm_precision(q.dtype), common.exact_precision(q.dtype)
    sdt = ops.saved_state_dtype(q.dtype)
    kw_k = dict(chunk_size=CHUNK, block_v=min(K, 64), interpret=interpret)
    kw = dict(iters=iters, warmup=warmup)
    out = {}
    f1 = jax.jit(lambda *a: fwd.intra_fwd(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                          factor_dtype=ops.factor_dtypes(q.dtype)))
    fac = f1(q, k, v, g, beta)
    out["intra_fwd"] = median_ms(f1, q, k, v, g, beta, **kw)
    f1s = jax.jit(lambda *a: fwd.intra_fwd(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                           factor_dtype=ops.factor_dtypes(q.dtype), save_solve=True))
    *_, A, M = f1s(q, k, v, g, beta)
    out["intra_fwd_save"] = median_ms(f1s, q, k, v, g, beta, **kw)
    qg, kd, w, u, aqk, gl = fac
    starts, ends = h0, None
    if seg:
        ft = jax.jit(lambda kd, w, u, gl: split.transitions_fwd(kd, w, u, gl, seg_chunks=seg,
                                                                precision=exact, **kw_k))
        P, R = ft(kd, w, u, gl)
        out["transitions_fwd"] = median_ms(ft, kd, w, u, gl, **kw)
        fs = jax.jit(lambda x0, P, R: split.segment_scan(x0, P, R, reverse=False, block_v=min(K, 64),
                                                         interpret=interpret, precision=exact))
        starts, _ = fs(h0, P, R)
        out["scan_fwd"] = median_ms(fs, h0, P, R, **kw)
    f2 = jax.jit(lambda fac, h0: fwd.state_fwd(*fac, h0, out_dtype=jnp.bfloat16, precision=prec,
                                               state_dtype=sdt, **kw_k))
    f2n = jax.jit(lambda fac, h0: fwd.state_fwd(*fac, h0, out_dtype=jnp.bfloat16, precision=prec,
                                                save_states=False, **kw_k))
    o, h, ht = f2(fac, starts)
    out["state_fwd"] = median_ms(f2, fac, starts, **kw)
    out["state_fwd_nosave"] = median_ms(f2n, fac, starts, **kw)
    dht = ht if ht.ndim == 4 else ht[:, :, -1]
    ends = dht
    if seg:
        ftb = jax.jit(lambda qg, kd, w, aqk, gl, do: split.transitions_bwd(
            qg, kd, w, aqk, gl, do, seg_chunks=seg, precision=exact, **kw_k))
        Q, Z = ftb(qg, kd, w, aqk, gl, do)
        out["transitions_bwd"] = median_ms(ftb, qg, kd, w, aqk, gl, do, **kw)
        fsb = jax.jit(lambda x0, Q, Z: split.segment_scan(x0, Q, Z, reverse=True, block_v=min(K, 64),
                                                          interpret=interpret, precision=exact))
        ends, _ = fsb(dht, Q, Z)
        out["scan_bwd"] = median_ms(fsb, dht, Q, Z, **kw)
    f3 = jax.jit(lambda fac, do, dht: bwd.state_bwd(fac[0], fac[1], fac[2], fac[4], fac[5], do, dht,
                                                     precision=prec, state_dtype=sdt, **kw_k))
    du, dh, _ = f3(fac, do, ends)
    out["state_bwd"] = median_ms(f3, fac, do, ends, **kw)
    f4 = jax.jit(lambda *a: bwd.intra_bwd(*a, scale=sc, chunk_size=CHUNK, interpret=interpret))
    out["intra_bwd"] = median_ms(f4, q, k, v, g, beta, do, du, h, dh, w, u, A, M, **kw)
    split_f = out.get("transitions_fwd", 0.0) + out.get("scan_fwd", 0.0)
    split_b = out.get("transitions_bwd", 0.0) + out.get("scan_bwd", 0.0)
    out["kernels_fwd_sum"] = out["intra_fwd"] + split_f + out["state_fwd_nosave"]
    out["kernels_fwd_bwd_sum"] = (out["intra_fwd_save"] + split_f + out["state_fwd"] + split_b
                                  + out["state_bwd"] + out["intra_bwd"])
    return out


def time_op(name, fn, B, T, H, K, iters, warmup):
    """Median ms of the whole op fn(q, k, v, g, beta) -> o, forward and forward+backward."""
    q, k, v, g, beta, do = make_inputs(B, T, H, K, head_major=False)

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) * do.astype(jnp.float32))

    kw = dict(iters=iters, warmup=warmup)
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return {f"{name}_fwd": median_ms(jax.jit(fn), q, k, v, g, beta, **kw),
            f"{name}_fwd_bwd": median_ms(fb, q, k, v, g, beta, **kw)}


# Kernel rows: the kernels' private ablations, plus "gate_cumsum" (a real option, not an ablation:
# the kernel reads the chunk cumsum G instead of g; the XLA cumsum is not in the kernel row).
# "compact" (intra_bwd_split only) is the real option compact_offdiag (kernel b row block by row
# block); the *_split kernels time both of their pallas_calls in one row. "tile_state"
# (intra_bwd_split, intra_bwd_a) is the real option state_block_v = bwd.STATE_BLOCK_V (kernel a's
# state products over V blocks; "tile_state32": blocks of 32, intra_bwd_a only). intra_bwd_a /
# intra_bwd_b: the two kernels of intra_bwd_split on their own, always with the default op's
# options (bf16_dots, gate_cumsum, compact_offdiag); kernel b has no ablation (row "none" only).
ABLATION_NAMES = {"intra_fwd": common.FWD_ABLATIONS + ("gate_cumsum",),
                  "intra_fwd_save": common.FWD_ABLATIONS + ("gate_cumsum",),
                  "intra_fwd_split": ("bf16_dots", "gate_cumsum"),
                  "state_fwd": common.STATE_ABLATIONS,
                  "intra_bwd": common.BWD_ABLATIONS + ("gate_cumsum",),
                  "intra_bwd_split": ("bf16_dots", "gate_cumsum", "compact", "tile_state"),
                  "intra_bwd_a": bwd.A_ABLATIONS + ("tile_state", "tile_state32"),
                  "intra_bwd_b": (),
                  "state_fwd_vp": ("bf16_dots",), "output_fwd": ("bf16_dots",),
                  "state_fwd_hopper": (), "intra_bwd_a_hopper": hopper_bwd.ABLATIONS,
                  "intra_bwd_b_hopper": (), "intra_fwd_a": (), "intra_fwd_a_hopper": (),
                  "intra_fwd_hopper": ()}
# The Mosaic GPU kernels (hopper*.py): no Triton num_warps; intra_bwd_a_hopper / intra_bwd_b_hopper
# take intra_bwd_a's / intra_bwd_b's inputs, intra_fwd_a_hopper intra_fwd_a's, intra_fwd_hopper
# intra_fwd_split's with G (the backward kernel a's "input_copies" and "dL" ablations: its TMA copies
# of W, U, dU, A, G, q, k, v, M skipped, its exact dL products skipped).
MOSAIC_KERNELS = ("state_fwd_hopper", "intra_bwd_a_hopper", "intra_bwd_b_hopper", "intra_fwd_a_hopper",
                  "intra_fwd_hopper")
# --variants: "base" = ops.KernelOptions() (the defaults: the seven round-3 options, pallas_cumsum,
# bf16_state_bwd_dots and the hopper options but hopper_score_bwd on since
# 2026-12-01), "round2" = ops.ROUND2_OPTIONS (every option off), '+'-joined short names of
# the options to turn ON over round 2 ("a+b" sets both), or "base" then "+a" / "-b": turned ON / OFF
# over the defaults (e.g. "base+tile_state", "base-pallas_cumsum"). Result JSONs before 2026-12-01
# 03:00 UTC (kda_ab_round3_h200.json included) wrote "base" for the then-default all-off kernels,
# i.e. today's "round2"; those of round 5 (kda_ab_round5_h200/, commit 5a812f7) for the defaults
# without pallas_cumsum.
VARIANT_FIELDS = {"split_bwd": "split_intra_bwd", "par_out": "parallel_output",
                  "bf16_state": "bf16_state_dots", "bf16_intra": "bf16_intra_dots",
                  "xla_cumsum": "xla_gate_cumsum", "split_fwd": "split_intra_fwd",
                  "compact_bwd": "compact_offdiag_bwd", "tile_state": "tile_state_bwd",
                  "pallas_cumsum": "pallas_cumsum", "bf16_state_bwd": "bf16_state_bwd_dots",
                  "hopper_state": "hopper_state_fwd", "hopper_state_bwd": "hopper_state_bwd",
                  "hopper_fused": "hopper_fused_output", "hopper_intra": "hopper_intra_bwd",
                  "hopper_score": "hopper_score_bwd", "hopper_fwd": "hopper_intra_fwd",
                  "hopper_wu": "hopper_fused_wu", "bf16_w": "hopper_bf16_w"}
# Kernel-a V blocks of the profiling names "tile_state" and "tile_state32" (state_block_v).
TILE_STATE_BLOCKS = {"tile_state": bwd.STATE_BLOCK_V, "tile_state32": 32}


def variant_options(spec: str) -> ops.KernelOptions:
    """ops.KernelOptions of a --variants spec: "base" (ops.KernelOptions()), "round2"
    (ops.ROUND2_OPTIONS), field short names joined by '+' (each turned on over ops.ROUND2_OPTIONS),
    or "base" followed by "+name" (turned on) and "-name" (turned off) over ops.KernelOptions(),
    e.g. "base-pallas_cumsum" or "base+tile_state-pallas_cumsum".
    Raises: ValueError naming the spec for an unknown or empty name."""
    if spec == "base":
        return ops.KernelOptions()
    if spec == "round2":
        return ops.ROUND2_OPTIONS
    start, rest = ((ops.KernelOptions(), spec[len("base"):]) if spec.startswith(("base+", "base-"))
                   else (ops.ROUND2_OPTIONS, "+" + spec))
    signed = re.findall(r"([+-])([^+-]*)", rest)
    bad = [n for _, n in signed if n not in VARIANT_FIELDS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad} in {spec=}; expected 'base', 'round2', '+'-joined "
                         f"names from {tuple(VARIANT_FIELDS)} or 'base' then '+name' / '-name'")
    return dataclasses.replace(start, **{VARIANT_FIELDS[n]: sign == "+" for sign, n in signed})


def profile_inputs(B, T, H, K):
    """Random device inputs of every profiled kernel at one shape (K = V; bf16 as the op stores)."""
    C = CHUNK
    NT = T // C
    q, k, v, g, beta, do = make_inputs(B, T, H, K, head_major=False)
    ks = jax.random.split(jax.random.PRNGKey(1), 11)
    nrm = lambda i, shp, dt, s=1.0: (s * jax.random.normal(ks[i], shp, jnp.float32)).astype(dt)
    fdt = ops.factor_dtypes(q.dtype)
    sdt = ops.saved_state_dtype(q.dtype)
    fac = (nrm(0, (B, H, T, K), fdt[0]), nrm(1, (B, H, T, K), fdt[1]), nrm(2, (B, H, T, K), fdt[2]),
           nrm(3, (B, H, T, K), fdt[3]), nrm(4, (B, H, T, C), fdt[4], 0.1),
           jnp.exp(nrm(5, (B, H, NT, K), jnp.float32, 0.1) - 1.0))
    h0 = jnp.zeros((B, H, K, K), jnp.float32)
    du = nrm(6, (B, H, T, K), jnp.float32)
    h, dh = nrm(7, (B, H, NT, K, K), sdt), nrm(8, (B, H, NT, K, K), sdt)
    A, M = nrm(9, (B, H, T, C), jnp.float32, 0.1), nrm(10, (B, H, T, C), jnp.float32, 0.1)
    qg, kd, w, u, aqk, gl = fac
    bwd_in = (q, k, v, g, beta, do, du, h, dh, w, u, A, M)
    # Kernel a / b on their own read the chunk cumsum G (the default op's XLA gate cumsum); kernel
    # b's other inputs are kernel a's fp32 outputs (head-major).
    kb = jax.random.split(jax.random.PRNGKey(2), 6)
    f32 = lambda i, shp, s=1.0: s * jax.random.normal(kb[i], shp, jnp.float32)
    G = common.chunk_cumsum(g, C)
    bwd_b_in = (q, k, G, f32(0, (B, H, T, K)), f32(1, (B, H, T, K)), f32(2, (B, H, T, K)),
                f32(3, (B, H, NT, K)), f32(4, (B, H, T, C), 0.1), f32(5, (B, H, T, C), 0.1))
    return {"intra_bwd_a": (q, k, v, G, beta, do, du, h, dh, w, u, A, M), "intra_bwd_b": bwd_b_in,
            "intra_fwd": (q, k, v, g, beta), "intra_fwd_save": (q, k, v, g, beta),
            "intra_fwd_split": (q, k, v, g, beta),
            "state_fwd": (fac, h0), "state_fwd_vp": (kd, w, u, gl, h0),
            "state_fwd_hopper": (kd, w, u, gl, h0),
            "intra_bwd_a_hopper": (q, k, v, G, beta, do, du, h, dh, w, u, A, M),
            "intra_bwd_b_hopper": bwd_b_in,
            "intra_fwd_a": (q, k, G, beta), "intra_fwd_a_hopper": (q, k, G, beta),
            "intra_fwd_hopper": (q, k, v, G, beta),
            "output_fwd": (qg, aqk, u, h), "intra_bwd": bwd_in, "intra_bwd_split": bwd_in}


def profile_fn(kernel: str, ablate: tuple, num_warps: int, K: int, interpret: bool):
    """The jittable callable of one profiled kernel with the private _ablate / _params options."""
    sc = K ** -0.5
    bf = jnp.bfloat16
    fdt = ops.factor_dtypes(bf)
    params = (common.pltriton.CompilerParams(num_warps=num_warps, num_stages=1) if num_warps
              else None)               # 0: the kernel's default (common.*_PARAMS)
    prec = common.BF16_OPERANDS if "bf16_dots" in ablate else common.mm_precision(bf)
    gc = "gate_cumsum" in ablate
    ablate = tuple(a for a in ablate if a != "gate_cumsum")
    if kernel in ("intra_fwd", "intra_fwd_save"):
        return lambda *a: fwd.intra_fwd(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                        factor_dtype=fdt, save_solve=kernel == "intra_fwd_save",
                                        gate_cumsum=gc, _ablate=ablate, _params=params)
    if kernel == "intra_fwd_split":
        return lambda *a: fwd.intra_fwd_split(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                              factor_dtype=fdt,
                                              bf16_dots="bf16_dots" in ablate, gate_cumsum=gc,
                                              _params=params)
    if kernel == "state_fwd":
        return lambda fac, h0: fwd.state_fwd(
            *fac, h0, chunk_size=CHUNK, block_v=min(K, 64), interpret=interpret,
            out_dtype=bf, precision=common.mm_precision(bf),
            state_dtype=ops.saved_state_dtype(bf), _ablate=ablate, _params=params)
    if kernel == "state_fwd_vp":
        return lambda *a: fwd.state_fwd_vp(*a, chunk_size=CHUNK, block_v=min(K, 64),
                                           interpret=interpret, precision=prec,
                                           state_dtype=ops.saved_state_dtype(bf),
                                           vp_dtype=fdt[3], _params=params)
    if kernel == "state_fwd_hopper":          # Mosaic GPU (hopper.py; no warps / ablations)
        return lambda *a: hopper.state_fwd(*a, interpret=interpret)
    if kernel == "intra_bwd_a_hopper":        # Mosaic GPU (hopper_bwd.py; no warps)
        return lambda *a: hopper_bwd.intra_bwd_a(*a, scale=sc, interpret=interpret, _ablate=ablate)
    if kernel == "intra_bwd_b_hopper":        # Mosaic GPU (hopper_score_bwd.py; no warps / ablations)
        return lambda *a: hopper_score_bwd.intra_bwd_b(*a, scale=sc, interpret=interpret)
    if kernel == "intra_fwd_a":               # the default op's Triton kernel a of the forward
        return lambda *a: fwd.intra_fwd_a(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                          factor_dtype=fdt, bf16_dots=True, gate_cumsum=True,
                                          _params=params)
    if kernel == "intra_fwd_a_hopper":        # Mosaic GPU (hopper_fwd.py; no warps / ablations)
        return lambda *a: hopper_fwd.intra_fwd_a(*a, scale=sc, interpret=interpret)
    if kernel == "intra_fwd_hopper":          # Mosaic GPU, kernel a with W / U fused (intra_fwd_split's outputs)
        return lambda *a: hopper_fwd.intra_fwd(*a, scale=sc, interpret=interpret)
    if kernel == "output_fwd":
        return lambda *a: fwd.output_fwd(*a, chunk_size=CHUNK, out_dtype=bf, interpret=interpret,
                                         precision=prec, _params=params)
    if kernel == "intra_bwd":
        return lambda *a: bwd.intra_bwd(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                        gate_cumsum=gc, _ablate=ablate, _params=params)
    tile = [TILE_STATE_BLOCKS[a] for a in ablate if a in TILE_STATE_BLOCKS]
    state_block_v = tile[0] if tile else None
    if kernel == "intra_bwd_split":
        return lambda *a: bwd.intra_bwd_split(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                              bf16_dots="bf16_dots" in ablate, gate_cumsum=gc,
                                              compact_offdiag="compact" in ablate,
                                              state_block_v=state_block_v, _params=params)
    if kernel == "intra_bwd_a":               # the default op's kernel a (bf16 dots, G from XLA)
        priv = tuple(a for a in ablate if a not in TILE_STATE_BLOCKS)
        return lambda *a: bwd.intra_bwd_a(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                          bf16_dots=True, gate_cumsum=True,
                                          state_block_v=state_block_v, _ablate=priv,
                                          _params=params)
    if kernel == "intra_bwd_b":               # the default op's kernel b (compact, bf16 dots)
        return lambda *a: bwd.intra_bwd_b(*a, scale=sc, chunk_size=CHUNK, interpret=interpret,
                                          bf16_dots=True, gate_cumsum=True, compact_offdiag=True,
                                          _params=params)
    raise ValueError(f"{kernel=} is not a profiled kernel; expected one of {tuple(ABLATION_NAMES)}")


def _op_loss(fn, do):
    def loss(*a):
        o = fn(*a)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
    return loss


def profile(res, save, t_start):
    """The --ablate / --variants mode: one row per (kernel, ablation, num_warps), kernel time only,
    then per --variants spec the whole op's fwd and fwd+bwd time and (with --check_shape) its
    errors vs the fp32 recurrence.

    Phase 1 lowers and compiles every row in --compile_threads threads (until 75% of
    --time_budget_s); phase 2 runs the compiled rows one by one in order, with no compile running
    (so the host threads do not disturb the timing).
    """
    B, T, H, K = (int(x) for x in FLAGS.shapes[0].split("x"))
    if len(FLAGS.state_stages) != 1:
        raise ValueError(f"--state_stages takes one value in the --ablate / --variants mode; "
                         f"got {FLAGS.state_stages}")
    stages = int(FLAGS.state_stages[0])
    common.STATE_PARAMS = common.pltriton.CompilerParams(num_warps=common.STATE_PARAMS.num_warps,
                                                         num_stages=stages)
    if FLAGS.variant_split != "auto" and not FLAGS.variant_split.isdigit():
        raise ValueError(f"--variant_split must be 'auto' or a segment length >= 0; "
                         f"got {FLAGS.variant_split!r}")
    variant_split = None if FLAGS.variant_split == "auto" else int(FLAGS.variant_split)
    res.update(state_stages=stages, variant_split=FLAGS.variant_split)
    inputs = profile_inputs(B, T, H, K)
    res["mode"] = "profile (kernel rows: times only; ablated results are wrong)"
    jobs = []                                # (row, build() -> (compiled, args), kind)

    def kernel_build(row, ablate):
        fn = profile_fn(row["kernel"], ablate, row["num_warps"], K, FLAGS.interpret)
        return lambda: (jax.jit(fn).lower(*inputs[row["kernel"]]).compile(), inputs[row["kernel"]])

    for kernel in FLAGS.ablate_kernels:
        for spec in FLAGS.ablate:
            ablate = () if spec == "none" else tuple(spec.split("+"))
            if any(a not in ABLATION_NAMES[kernel] for a in ablate):
                continue
            for nw in (FLAGS.ablate_warps if kernel not in MOSAIC_KERNELS else ["0"]):   # no num_warps
                row = {"shape": FLAGS.shapes[0], "kernel": kernel, "ablate": spec,
                       "num_warps": int(nw)}
                jobs.append((row, kernel_build(row, ablate), "time"))
    op_in = make_inputs(B, T, H, K, head_major=False)
    chk = ref_job = None
    if FLAGS.variants and FLAGS.check_shape:
        from k3jax.ops.kda_reference import kda_recurrent
        cB, cT, cH, cK = (int(x) for x in FLAGS.check_shape.split("x"))
        chk = make_inputs(cB, cT, cH, cK, head_major=False)
        ref_loss = _op_loss(lambda *a: kda_recurrent(*(x.astype(jnp.float32) for x in a))[0], chk[5])
        ref_fn = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    for spec in FLAGS.variants:
        opts = variant_options(spec)

        def op(*a, opts=opts):
            return ops.kda_pallas(*a, lower_bound=LOWER_BOUND, interpret=FLAGS.interpret,
                                  sequence_split=variant_split, options=opts)[0]
        loss = _op_loss(op, op_in[5])
        vg = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
        for kernel, fn in (("op_fwd", op), ("op_fwd_bwd", vg)):
            row = {"shape": FLAGS.shapes[0], "kernel": kernel, "variant": spec, "state_stages": stages,
                   "variant_split": FLAGS.variant_split}
            jobs.append((row, lambda fn=fn: (jax.jit(fn).lower(*op_in[:5]).compile(), op_in[:5]),
                         "time"))
        if chk is not None:
            row = {"shape": FLAGS.check_shape, "kernel": "errors", "variant": spec}
            cvg = jax.value_and_grad(_op_loss(op, chk[5]), argnums=(0, 1, 2, 3, 4), has_aux=True)
            jobs.append((row, lambda f=cvg: (jax.jit(f).lower(*chk[:5]).compile(), chk[:5]),
                         "errors"))

    def timed(build):
        t0 = time.perf_counter()
        out = build()
        return out, time.perf_counter() - t0

    pool = concurrent.futures.ThreadPoolExecutor(max(1, FLAGS.compile_threads))
    if chk is not None:
        ref_job = pool.submit(lambda: jax.jit(ref_fn).lower(*chk[:5]).compile())
    futures = [pool.submit(timed, build) for _, build, _ in jobs]
    deadline = 0.75 * FLAGS.time_budget_s if FLAGS.time_budget_s else None
    remaining = None if deadline is None else max(1.0, deadline - (time.perf_counter() - t_start))
    concurrent.futures.wait(futures, timeout=remaining)
    res["compile_phase_s"] = time.perf_counter() - t_start
    reference = None
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    for (row, _, kind), fut in zip(jobs, futures):
        if FLAGS.time_budget_s and time.perf_counter() - t_start > FLAGS.time_budget_s:
            res["cut"] = f"time budget {FLAGS.time_budget_s} s reached before this row: {row}"
            break
        res["rows"].append(row)
        try:
            if not fut.done():
                raise TimeoutError("not compiled within 75% of --time_budget_s")
            (exe, args), row["compile_s"] = fut.result()
            if kind == "time":
                row["ms"] = median_ms(exe, *args, iters=FLAGS.iters, warmup=FLAGS.warmup)
            else:
                if reference is None:
                    (_, o_r), g_r = ref_job.result()(*args)
                    reference = (o_r,) + tuple(g_r)
                (_, o), gr = exe(*args)
                row.update({n: rms_ratio(r, x) for n, r, x in zip(names, reference, (o,) + tuple(gr))})
        except Exception as e:  # noqa: BLE001 -- keep the other rows; record why this one failed
            row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
        save()
        print(json.dumps(row), flush=True)
    pool.shutdown(wait=False, cancel_futures=True)
    save()


def main(argv):
    del argv
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "dtype": "bfloat16", "lower_bound": LOWER_BOUND, "chunk_size": CHUNK, "rows": []}

    def save():
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as fh:
            json.dump(res, fh, indent=1)

    if FLAGS.ablate or FLAGS.variants:
        profile(res, save, time.perf_counter())
        os._exit(0)                          # do not wait for compiles cancelled by the budget

    for s in FLAGS.shapes:
        B, T, H, K = (int(x) for x in s.split("x"))
        n_prog = B * H * (K // min(K, 64))
        configs = []
        for iw in FLAGS.intra_warps:
            for sw in FLAGS.state_warps:
                for st in FLAGS.state_stages:
                    for ex in FLAGS.exact_bf16:
                        for sp in FLAGS.splits:
                            rule = None if sp == "auto" else int(sp)
                            seg = ops.split_chunks(T // CHUNK, rule, n_prog)
                            cfg = (int(iw), int(sw), int(st), ex, seg)
                            if cfg not in [c[:5] for c in configs]:
                                configs.append(cfg + (rule,))
        for iw, sw, st, ex, seg, rule in configs:
            common.INTRA_PARAMS = common.pltriton.CompilerParams(num_warps=iw, num_stages=1)
            common.STATE_PARAMS = common.pltriton.CompilerParams(num_warps=sw, num_stages=st)
            common.EXACT_BF16 = EXACT[ex]
            row = {"shape": s, "intra_warps": iw, "state_warps": sw, "state_stages": st,
                   "exact_bf16": ex, "sequence_split": seg}
            res["rows"].append(row)
            try:
                row.update(time_kernels(B, T, H, K, FLAGS.iters, FLAGS.warmup, seg, FLAGS.interpret))
                save()
                print(json.dumps(row), flush=True)
                pallas = functools.partial(ops.kda_pallas, lower_bound=LOWER_BOUND,
                                           interpret=FLAGS.interpret, sequence_split=seg)
                row.update(time_op("pallas", lambda *a: pallas(*a)[0], B, T, H, K,
                                   FLAGS.iters, FLAGS.warmup))
                save()
                if FLAGS.check_shape:
                    row["errors"] = check_errors(FLAGS.check_shape, rule, FLAGS.interpret)
            except Exception as e:  # noqa: BLE001 -- keep the other rows; record why this one failed
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            save()
            print(json.dumps(row), flush=True)
        if FLAGS.chunked and T <= FLAGS.chunked_max_t:
            from k3jax.ops.kda_chunked import kda_chunked
            row = {"shape": s, "implementation": "chunked_xla"}
            res["rows"].append(row)
            row.update(time_op("chunked", lambda *a: kda_chunked(*a, lower_bound=LOWER_BOUND)[0],
                               B, T, H, K, FLAGS.iters, FLAGS.warmup))
            save()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    app.run(main)
