"""Per-kernel GPU time of every KDA implementation at the given shapes, side by side: k3jax pallas (and
chunked), jax-linear-attention's Mosaic GPU KDA and fla's Triton chunk_kda.

Where bench_kda gives one time per implementation (per call and back to back), this says which
kernels take it, so the gap to a peer can be pinned to a stage (intra-chunk factors, solve, state pass, output, backward pieces).
Inputs: bench_kda.make_inputs (ANCHORS recipe: bf16 q/k/v/beta, fp32 g = -5 sigmoid(N(0,1)), k
L2-normalised), lower_bound = -5 declared to our ops; fla gets the same recipe in torch.

Method: each (implementation, mode) is jitted (bench_kda.jitted: "fwd", or "fwd+bwd" = value and
grads of sum(o * do)), compiled and warmed up, then --iters calls run under `jax.profiler.trace`, each
in a step annotation; the trace is parsed by profile_step.parse_trace (the GPU kernels on the device
planes' stream lines, per call). fla runs first, in a torch subprocess under torch.profiler (CUDA
activity; self device time per kernel name / --iters). Times are device kernel times in ms per call;
"busy" is the union of kernel intervals per call, "wall" the step window (JAX) or CUDA-event time
(fla) per call. Profilers add a little per kernel: compare kernels within one table, and walls with
bench_kda's medians.

Run (GPU, ~3 min with fla's autotuning):
  python -m experiments.profile_kda_peers --shapes=8x4096x16x128 --fla --out=$OUT/kda_peers_h200
Writes <out>.json (every kernel row) and <out>.md (the largest --top kernels per table).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags
import jax

from experiments import bench_kda, profile_step

FLAGS = flags.FLAGS
# bench_kda's flags are reused: --shapes, --implementations (pallas, chunked, jla; default here pallas,jla),
# --modes, --iters (profiled calls; default here 10), --warmup, --fla, --declared_lower_bound, --out
# (output prefix; default here /tmp/k3jax_profile_kda_peers/kda_peers), --from_json (one JSON: re-write
# the markdown only). Its other flags (--dtype, --chunk_size, ...) do not apply here: bf16, chunk 64.
flags.DEFINE_integer("top", 14, "kernels per table in the markdown")
FLAGS.set_default("implementations", ["pallas", "jla"])
FLAGS.set_default("iters", 10)
FLAGS.set_default("warmup", 3)
FLAGS.set_default("out", "/tmp/k3jax_profile_kda_peers/kda_peers")


FLA_PROFILE_SCRIPT = r"""
import json, sys, torch
from torch.profiler import profile, ProfilerActivity
import fla
from fla.ops.kda import chunk_kda
B, T, H, K = (int(x) for x in sys.argv[1].lower().split("x"))
iters, warmup, modes = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
""" + bench_kda.FLA_INPUTS + r"""do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
kw = dict(safe_gate=True, lower_bound=-5.0)
leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
def fwd():
    with torch.no_grad():
        chunk_kda(q, k, v, g, beta, **kw)
def fb():
    for t in leaves:              # fresh gradients each call (no accumulation into .grad)
        t.grad = None
    o, _ = chunk_kda(*leaves, **kw)
    o.backward(do)
versions = dict(fla=getattr(fla, "__version__", "?"), torch=torch.__version__,
                triton=__import__("triton").__version__)
for mode in modes:
    fn = fwd if mode == "fwd" else fb
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / iters
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and e.count:
            kernels.append(dict(kernel=e.key, ms=us / 1e3 / iters, calls=e.count / iters))
    kernels.sort(key=lambda r: -r["ms"])
    print("ROW" + json.dumps(dict(implementation="fla", mode=mode, wall_ms=wall, busy_ms=None,
                                  kernels=kernels, versions=versions)), flush=True)
"""


def profile_fla(shape: str) -> list[dict]:
    """fla's rows from a torch subprocess (run before JAX touches the GPU); [] when fla is missing."""
    proc = subprocess.run([sys.executable, "-c", FLA_PROFILE_SCRIPT, shape, str(FLAGS.iters), str(FLAGS.warmup),
                           ",".join(FLAGS.modes)], capture_output=True, text=True)
    rows = [json.loads(line[3:]) for line in proc.stdout.splitlines() if line.startswith("ROW")]
    if proc.returncode:
        print("fla failed:", proc.stderr[-800:], flush=True)
    return rows


def profile_jax(name: str, op, mode: str, args) -> dict:
    """One (implementation, mode): compile, warm up, --iters calls traced; kernels per call."""
    fn = bench_kda.jitted(op, mode)
    for _ in range(1 + FLAGS.warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for i in range(FLAGS.iters):
                with jax.profiler.StepTraceAnnotation(profile_step.STEP_NAME, step_num=i):
                    jax.block_until_ready(fn(*args))
        summary = profile_step.parse_trace(trace_dir)
    kernels = [dict(kernel=r["kernel"], ms=r["ms_per_step"], calls=r["count_per_step"]) for r in summary["ops"]]
    return dict(implementation=name, mode=mode, wall_ms=summary["step_wall_ms"], busy_ms=summary["device_busy_ms"],
                kernels=kernels)


def write_markdown(result: dict, path: str) -> None:
    env = result["environment"]
    lines = ["# KDA per-kernel GPU time (B×T×H×K, V = K; bf16, lower_bound = −5)", "",
             f"{result['date']}; {env.get('device', '?')}; "
             + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("device", "date"))
             + f"; {result['iters']} profiled calls each. Made by `experiments/profile_kda_peers.py`.", "",
             "ms per call; busy = union of kernel intervals, wall = step window (JAX) or CUDA events (fla).", ""]
    for r in result["rows"]:
        total = sum(k["ms"] for k in r["kernels"])
        busy = f"{r['busy_ms']:.3f}" if r.get("busy_ms") is not None else "—"
        lines += [f"## {r['shape']} {r['implementation']} {r['mode']}: wall {r['wall_ms']:.3f}, busy {busy}, "
                  f"kernels {total:.3f} ms ({len(r['kernels'])} distinct)", "",
                  "| kernel | ms | calls | share of kernel time |", "|---|---:|---:|---:|"]
        for k in r["kernels"][:FLAGS.top]:
            lines.append(f"| `{k['kernel'][:90]}` | {k['ms']:.3f} | {k['calls']:g} | {k['ms'] / total:.1%} |")
        rest = r["kernels"][FLAGS.top:]
        if rest:
            lines.append(f"| ({len(rest)} others) | {sum(k['ms'] for k in rest):.3f} | | |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def save(rows: list[dict]) -> None:
    """Write <out>.json and <out>.md with the rows so far (a run cut by a time limit keeps them)."""
    fla_versions = next((r["versions"] for r in rows if "versions" in r), {})
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  iters=FLAGS.iters, environment={**bench_kda.environment(), **fla_versions},
                  rows=[{k: v for k, v in r.items() if k != "versions"} for r in rows])
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, FLAGS.out + ".md")


def main(argv):
    del argv
    if not FLAGS.out:
        raise ValueError("--out must be a path prefix (the .json and .md are written there)")
    if FLAGS.from_json:
        if len(FLAGS.from_json) != 1:
            raise ValueError(f"--from_json takes one JSON of this script; got {FLAGS.from_json}")
        with open(FLAGS.from_json[0]) as f:
            result = json.load(f)
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        write_markdown(result, FLAGS.out + ".md")
        return
    bench_kda.check_flags()
    if FLAGS.iters < 1 or FLAGS.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0; got {FLAGS.iters}, {FLAGS.warmup}")
    rows = []
    if FLAGS.fla:            # every shape before JAX touches the GPU (save() would: it asks for the device)
        for shape in FLAGS.shapes:
            rows += [dict(r, shape=shape) for r in profile_fla(shape)]
    ops = bench_kda.implementations(64)
    for shape in FLAGS.shapes:
        B, T, H, K = (int(x) for x in shape.lower().split("x"))
        args = jax.block_until_ready(bench_kda.make_inputs(jax.random.key(0), B, T, H, K, jax.numpy.bfloat16))
        for name in FLAGS.implementations:
            if name not in ops:
                print(f"{name}: not available here, skipped", flush=True)
                continue
            for mode in FLAGS.modes:
                rows.append(dict(profile_jax(name, ops[name], mode, args), shape=shape))
                r = rows[-1]
                save(rows)
                print(f"{shape} {name} {mode}: wall {r['wall_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms", flush=True)
        del args
    save(rows)
    print("wrote", FLAGS.out + ".json", FLAGS.out + ".md", flush=True)


if __name__ == "__main__":
    app.run(main)
