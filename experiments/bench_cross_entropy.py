"""LM-head cross-entropy at a large vocabulary: the plain loss vs the chunked one (issue 28).

  python -m experiments.bench_cross_entropy                       # one H200: vocab 32768 and 131072
  python -m experiments.bench_cross_entropy --tiny                # CPU smoke size (writes under /tmp)

What is timed: forward + backward (d hidden, d head) of the summed cross-entropy of `hidden @ head`,
hidden [tokens, d_model] in --dtype (bf16), head [d_model, vocab] fp32 (the parameter; cast to the compute
dtype inside, as the model's head), random targets, every token counted. "plain" = the whole [tokens,
vocab] logits at once (`k3jax.ops.cross_entropy.cross_entropy`, the trainer's loss below 32768 ids);
"chunked" = `chunked_cross_entropy` with --chunk_sizes tokens per chunk ("auto" = the trainer's
`auto_chunk_size`: 4096 at 32k, 1024 at 128k; below 32768 ids, where the trainer uses the plain loss,
a quarter of the tokens). Default shape: 32 x 2048 tokens, d_model 768.

Per row (each in its own subprocess, so that the device's peak memory is the row's own): the per-call ms
(median of --iters fresh-input calls, each waited for) and the back-to-back ms (median over --stream_reps
groups of --stream_calls calls dispatched without waiting: device time), `harness.time_call`; the
compiled executable's temporary memory (`memory_analysis()`), the device's peak memory
(`memory_stats()["peak_bytes_in_use"]`, inputs included, where the backend reports it), the loss (equal
across rows of a vocabulary: same inputs), and the rate of the 6·N·D·V matmul FLOPs of a plain
forward+backward (the chunked loss also recomputes the logits, 8·N·D·V). A row that runs out of memory
is recorded with its error. Writes <out>.json and <out>.md after every row (date, device, versions).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

IMPLS = ("plain", "chunked")
TINY = dict(vocabs=[512, 2048], tokens=256, d_model=32, iters=2, warmup=0, stream_calls=2, stream_reps=1)


def run_row(impl: str, vocab: int, chunk: int, *, tokens: int, d_model: int, dtype: str, iters: int, warmup: int,
            stream_calls: int, stream_reps: int, seed: int = 0) -> dict:
    """Time one row in this process (module docstring). `chunk` is ignored for "plain"."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from experiments import harness  # noqa: PLC0415
    from k3jax.ops.cross_entropy import chunked_cross_entropy, cross_entropy  # noqa: PLC0415
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    compute = jnp.dtype(dtype)
    loss_fn = (cross_entropy if impl == "plain"
               else lambda *a, **k: chunked_cross_entropy(*a, chunk_size=chunk, **k))

    def loss(hidden, weight, targets, mask):
        nats, count = loss_fn(hidden, weight, targets, mask, dtype=compute)
        return nats / count

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    @jax.jit
    def make(key):
        kh, kw, kt = jax.random.split(key, 3)
        return (jax.random.normal(kh, (tokens, d_model), jnp.float32).astype(compute),
                jax.random.normal(kw, (d_model, vocab), jnp.float32) * d_model ** -0.5,
                jax.random.randint(kt, (tokens,), 0, vocab), jnp.ones((tokens,), bool))

    row = {"impl": impl, "vocab": vocab, "chunk_size": chunk if impl == "chunked" else None, "tokens": tokens,
           "d_model": d_model, "dtype": dtype, "logits_fp32_gib": tokens * vocab * 4 / 2**30}
    try:
        args0 = make(jax.random.key(seed))
        compiled = step.lower(*args0).compile()
        mem = compiled.memory_analysis()
        if mem is not None:
            row["compiled_temp_gib"] = mem.temp_size_in_bytes / 2**30
        value, _ = compiled(*args0)
        row["loss"] = float(value)
        timing = harness.time_call(compiled, lambda i: make(jax.random.key(seed + 1 + i)), iters=iters,
                                   warmup=warmup, stream_calls=stream_calls, stream_reps=stream_reps)
    except Exception as e:  # noqa: BLE001 (an out-of-memory row is a result, recorded as such)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return row
    row.update(timing)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    row["peak_memory_gib"] = None if peak is None else peak / 2**30
    ms = timing.get("stream_ms", timing["median_ms"])
    row["tflops"] = 6 * tokens * d_model * vocab / (ms * 1e-3) / 1e12
    return row


def render(result: dict) -> str:
    """The markdown page of a run."""
    from experiments.harness import environment_line, markdown_table  # noqa: PLC0415
    table = []
    for r in result["rows"]:
        name = r["impl"] + (f" (chunk {r['chunk_size']})" if r.get("chunk_size") else "")
        if "error" in r:
            table.append([r["vocab"], name, "error: " + r["error"], "", "", "", f"{r['logits_fp32_gib']:.2f}", "", ""])
            continue
        fmt = lambda x, f="{:.3g}": "n/a" if x is None else f.format(x)  # noqa: E731
        table.append([r["vocab"], name, fmt(r["median_ms"]), fmt(r.get("stream_ms")), fmt(r.get("compiled_temp_gib")),
                      fmt(r.get("peak_memory_gib")), fmt(r["logits_fp32_gib"]), f"{r['loss']:.4f}",
                      fmt(r.get("tflops"), "{:.1f}")])
    f = result["flags"]
    lines = [f"# LM-head cross-entropy, plain vs chunked ({result['env']['date']}, {result['env']['device']})", "",
             environment_line(result["env"]), "",
             f"`experiments/bench_cross_entropy.py`: forward + backward (d hidden, d head) of the summed cross-entropy "
             f"of hidden [{f['tokens']}, {f['d_model']}] {f['dtype']} @ head [{f['d_model']}, V] fp32; ms = median of "
             f"{f['iters']} calls each waited for; stream ms = back to back ({f['stream_calls']} calls a sync, median of "
             f"{f['stream_reps']}); temp = the compiled executable's temporary memory; peak = device peak (inputs "
             "included); logits = the size of the [tokens, V] fp32 logits; TFLOP/s = 6·N·D·V over the stream (or "
             "per-call) time.", ""]
    lines += markdown_table(["vocab", "impl", "ms", "stream ms", "temp GiB", "peak GiB", "fp32 logits GiB",
                             "loss value", "TFLOP/s"], table)
    return "\n".join(lines) + "\n"


def _define_flags():
    """Command-line flags, defined only when run as a script (tests import experiment modules together)."""
    from absl import flags  # noqa: PLC0415
    flags.DEFINE_list("vocabs", ["32768", "131072"], "Vocabulary sizes.")
    flags.DEFINE_integer("tokens", 32 * 2048, "Tokens N (batch x sequence).")
    flags.DEFINE_integer("d_model", 768, "Hidden size D.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype of hidden and the head matmul.")
    flags.DEFINE_list("impls", list(IMPLS), f"Rows, of {IMPLS}.")
    flags.DEFINE_list("chunk_sizes", ["auto"], "chunked: tokens per chunk ('auto' = the trainer's auto_chunk_size).")
    flags.DEFINE_integer("iters", 10, "Timed per-call samples (median reported).")
    flags.DEFINE_integer("warmup", 2, "Untimed calls after the compiling one.")
    flags.DEFINE_integer("stream_calls", 5, "Back-to-back calls per timed group (0 = none).")
    flags.DEFINE_integer("stream_reps", 5, "Back-to-back groups (median reported).")
    flags.DEFINE_bool("tiny", False, f"CPU smoke size: {TINY} (overrides those flags).")
    flags.DEFINE_string("out", "", "Output prefix (<out>.json, .md); default /tmp/k3jax_bench_cross_entropy/"
                        "cross_entropy_<device> (--tiny: .../cross_entropy_tiny).")
    flags.DEFINE_string("one_row", "", "Internal: run the row impl:vocab:chunk here and print its JSON.")
    flags.DEFINE_float("row_timeout_s", 560.0, "Seconds a row's subprocess may take.")


def main(argv):
    del argv
    from absl import flags  # noqa: PLC0415
    f = flags.FLAGS
    shape = dict(vocabs=[int(v) for v in f.vocabs], tokens=f.tokens, d_model=f.d_model, iters=f.iters,
                 warmup=f.warmup, stream_calls=f.stream_calls, stream_reps=f.stream_reps)
    if f.tiny:
        shape.update(TINY)
    common = {k: shape[k] for k in ("tokens", "d_model", "iters", "warmup", "stream_calls", "stream_reps")}
    if f.one_row:
        impl, vocab, chunk = f.one_row.split(":")
        print("BENCH_ROW " + json.dumps(run_row(impl, int(vocab), int(chunk), dtype=f.dtype, **common)), flush=True)
        return
    from experiments.harness import environment, write_results  # noqa: PLC0415
    from k3jax.ops.cross_entropy import auto_chunk_size  # noqa: PLC0415
    unknown = [i for i in f.impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"--impls must be from {IMPLS}, got {unknown}")
    env = environment()
    out = f.out or ("/tmp/k3jax_bench_cross_entropy/cross_entropy_" + ("tiny" if f.tiny else
                    env["device"].lower().replace("nvidia ", "").replace(" ", "_")))
    plan = []
    for vocab in shape["vocabs"]:
        for impl in f.impls:
            if impl == "plain":
                plan.append(("plain", vocab, 0))
                continue
            for c in f.chunk_sizes:
                # auto: the trainer's chunk; below its threshold (the trainer's plain loss) a quarter of the tokens
                chunk = (auto_chunk_size(vocab) or max(1, min(4096, shape["tokens"] // 4))) if c == "auto" else int(c)
                plan.append(("chunked", vocab, min(chunk, shape["tokens"])))
    keep = [a for a in sys.argv[1:] if not a.startswith(("--one_row", "--out", "--impls", "--chunk_sizes", "--vocabs"))]
    rows = []
    for impl, vocab, chunk in plan:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "experiments.bench_cross_entropy",
                               f"--one_row={impl}:{vocab}:{chunk}", *keep],
                              capture_output=True, text=True, timeout=f.row_timeout_s)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_ROW ")), None)
        if line is None:  # the subprocess died (e.g. killed for memory): record it, go on
            rows.append({"impl": impl, "vocab": vocab, "chunk_size": chunk or None, "tokens": shape["tokens"],
                         "logits_fp32_gib": shape["tokens"] * vocab * 4 / 2**30,
                         "error": f"subprocess rc {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"})
        else:
            rows.append(json.loads(line[len("BENCH_ROW "):]))
        shown = {k: rows[-1].get(k) for k in ("median_ms", "stream_ms", "compiled_temp_gib", "peak_memory_gib", "loss",
                                              "error") if rows[-1].get(k) is not None}
        print(f"{impl} vocab {vocab} chunk {chunk}: {json.dumps(shown)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        result = {"env": env, "flags": {**common, "dtype": f.dtype, "vocabs": shape["vocabs"]}, "rows": rows}
        write_results(out, result, render(result))  # after every row: a later failure keeps the rest
    print(render(result))


if __name__ == "__main__":
    _define_flags()
    from absl import app
    app.run(main)
