"""Whole training steps: k3jax (like-for-like with jla, and the K3 default) and jla's trainer (issue 26).

  python -m experiments.bench_train --shape=k3_small --rows=like_for_like,k3_default,jla \
      --out=$OUT/train_step_h200          # one H200; jla needs its wheel (experiments/gpu_wheels.txt)
  python -m experiments.bench_train --shape=tiny --rows=like_for_like,k3_default --steps=3 --warmup=1 \
      --out=/tmp/bench_train              # CPU smoke size

Rows (each in its own subprocess, so that compile time and the device's peak memory are its own):
  like_for_like: k3jax with jla's choices: PreNorm residuals, Switch aux loss (alpha 0.01);
  k3_default: k3jax's K3 recipe: Block AttnRes (4 blocks), exact Quantile Balancing;
  jla: `python -m jla.cli train --config <--jla_config> --set ...` (jla-0.1.0: synthetic Markov tokens,
    documents of 1000 tokens, remat full, scanned layers), its log lines parsed; skipped with a message
    when `jla` is not importable.
Both k3jax rows use `--scan_layers` / `--remat` (default: unrolled, no remat, k3jax's defaults and the
fastest on the H200 at K3-small; `--scan_layers --remat=full` is jla's choice), kda.implementation=None, bf16 compute.

A k3jax row builds the model and optimizer as `k3jax.train.trainer.train` does and runs the trainer's
step loop on synthetic data of the shape (Markov tokens over the vocabulary, documents of `doc_len`
tokens packed into each row with segment ids and positions): the host dispatches step n + 1 before it
reads step n's metrics and puts the next batch on the device one step ahead, as the trainer. Per row:
compile (wall seconds of the first step, XLA backend compile seconds), the median ms between the ends
of consecutive steps over `--steps` steps after `--warmup` (tokens/s from it; one more step runs untimed
after them, so that every timed end is read as the trainer reads it), the device's peak memory
(`memory_stats()["peak_bytes_in_use"]`, where the backend reports it) and the loss of the last timed step.
Profiles op by op are `experiments/profile_step.py`'s job (one config, a trace); this script compares
configs side by side, so it is its own entry point on the same harness.
The rows inherit the environment: the "1b" k3_default row peaks at 114 GiB with the fused depth kernels,
over the 104 GiB that XLA_PYTHON_CLIENT_MEM_FRACTION's default (0.75) leaves on an H200; run it with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (recorded in the page).
Writes <out>.json and <out>.md (date, device, versions).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPES = {
    # d_model 768, 8 layers "KKKA", KDA / attention 6 x 128, MoE 16 x 1024 top-2, 32 x 2048 tokens
    "k3_small": dict(model=dict(d_model=768, num_layers=8, num_heads=6, head_dim=128, d_ff=2176, mixer_pattern="KKKA",
                                moe=dict(num_experts=16, top_k=2, d_ff=1024), residual=dict(blocks=4)),
                     batch_size=32, seq_len=2048, doc_len=1000, jla_config="experiments/configs/jla_k3_small_shape.toml"),
    # issue 26's second shape: 1.63B parameters, 0.56B active (its example's 64 x 1024 experts are 10.1B
    # parameters, 150 GiB of fp32 weights and Adam moments: more than one H200), 16 x 4096 tokens
    "1b": dict(model=dict(d_model=2048, num_layers=24, num_heads=16, head_dim=128, d_ff=5632, mixer_pattern="KKKA",
                          moe=dict(num_experts=64, top_k=8, d_ff=128), residual=dict(blocks=4)),
               batch_size=16, seq_len=4096, doc_len=1000, jla_config="experiments/configs/jla_1b_shape.toml",
               scan_layers=True, remat="full"),  # unrolled without remat needs ~290 GiB
    "tiny": dict(model=dict(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64, mixer_pattern="KA",
                            moe=dict(num_experts=4, top_k=2, d_ff=32), residual=dict(blocks=2)),
                 batch_size=2, seq_len=64, doc_len=40),
}
ROWS = ("like_for_like", "k3_default", "jla")
VARIANTS = {"like_for_like": dict(residual=dict(kind="prenorm"), moe=dict(balancing=dict(method="aux_loss", alpha=0.01))),
            "k3_default": dict(residual=dict(kind="block_attnres"),
                               moe=dict(balancing=dict(method="quantile", quantile_estimator="exact")))}


def merged(a: dict, b: dict) -> dict:
    """`a` updated by `b`, nested dicts merged key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def model_config(shape: str, row: str, *, scan_layers: bool, remat: str):
    """The k3jax `ModelConfig` of a row at a named shape. Raises ValueError for unknown names."""
    from k3jax.models.config import model_config_from_dict  # noqa: PLC0415
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape=}")
    if row not in VARIANTS:
        raise ValueError(f"row must be one of {sorted(VARIANTS)}, got {row=}")
    base = dict(vocab_size=259, ffn="moe", attention=dict(rope=False),
                kda=dict(gate="bounded", lower_bound=-5.0, implementation=None), dtype="bfloat16",
                scan_layers=scan_layers, remat=remat if scan_layers else "none")
    return model_config_from_dict(merged(merged(base, SHAPES[shape]["model"]), VARIANTS[row]))


def markov_batches(num_batches: int, batch_size: int, seq_len: int, doc_len: int, vocab: int, seed: int = 0):
    """Synthetic packed batches: each row a Markov chain over `vocab` tokens (every token has 4 likely
    successors, probability 0.9, else uniform), cut into documents of `doc_len` tokens (segment ids from
    1, positions restarting at 0; a target across a document boundary is masked out)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, (vocab, 4))
    t = np.arange(seq_len)
    segment_ids = np.broadcast_to((t // doc_len + 1).astype(np.int32), (batch_size, seq_len))
    positions = np.broadcast_to((t % doc_len).astype(np.int32), (batch_size, seq_len))
    loss_mask = np.broadcast_to((t % doc_len) != doc_len - 1, (batch_size, seq_len))
    out = []
    for _ in range(num_batches):
        tokens = np.empty((batch_size, seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, vocab, batch_size)
        follow = rng.random((batch_size, seq_len)) < 0.9
        pick = rng.integers(0, 4, (batch_size, seq_len))
        uniform = rng.integers(0, vocab, (batch_size, seq_len))
        for i in range(seq_len):
            tokens[:, i + 1] = np.where(follow[:, i], successors[tokens[:, i], pick[:, i]], uniform[:, i])
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids,
                    "positions": positions, "loss_mask": loss_mask})
    return out


def run_k3jax(shape: str, row: str, *, steps: int, warmup: int, scan_layers: bool, remat: str) -> dict:
    """Time one k3jax row in this process (module docstring)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from experiments.harness import CompileCounter  # noqa: PLC0415
    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.config import TrainConfig  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    from k3jax.train.step import bind_train_step  # noqa: PLC0415
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {steps=}, {warmup=}")
    s = SHAPES[shape]
    cfg = model_config(shape, row, scan_layers=scan_layers, remat=remat)
    total = 1 + warmup + steps
    counter = CompileCounter()
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=total + 1, warmup_steps=max(total // 10, 1))),
                              wrt=nnx.Param)
    host = markov_batches(min(total, 8), s["batch_size"], s["seq_len"], s["doc_len"], cfg.vocab_size)
    step = bind_train_step(model, optimizer)  # as the trainer: no graph traversal per call
    counter.reset()
    t0 = time.perf_counter()
    first = jax.device_get(step(jax.device_put(host[0])))
    compile_s = time.perf_counter() - t0
    compile_stats = counter.reset()
    ends, losses, pending = [], [float(first["ce"])], None
    batch = jax.device_put(host[1 % len(host)])
    # One step more than timed: every timed step's end is read right after the next step's dispatch (the
    # last read, with nothing dispatched behind it, came ~0.8 s early on the H200 at 1b and is not timed).
    for n in range(1, total + 1):
        metrics = step(batch)
        if n < total:
            batch = jax.device_put(host[(n + 1) % len(host)])  # on the device before it is needed
        if pending is not None:
            losses.append(float(jax.device_get(pending)["ce"]))
            ends.append(time.perf_counter())
        pending = metrics
    losses.append(float(jax.device_get(pending)["ce"]))
    step_ms = np.diff(ends[warmup - 1:] if warmup else [t0 + compile_s, *ends]) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    tokens = s["batch_size"] * s["seq_len"]
    median = float(np.median(step_ms))
    return {"row": row, "shape": shape, "system": "k3jax", "config": dataclasses.asdict(cfg),
            "tokens_per_step": tokens, "steps_timed": int(step_ms.size), "step_ms_median": median,
            "step_ms": step_ms.tolist(), "tokens_per_s": tokens / median * 1e3, "compile_s": compile_s,
            "backend_compile_s": compile_stats.get("backend_compile_s", 0.0),
            "compile_phases_s": compile_stats["phases_s"],
            "peak_memory_gib": None if peak is None else peak / 2**30,
            "final_loss": losses[-2],  # the last timed step's (the untimed one after it is not counted)
            "steps_run": total + 1, "losses": losses}


_JLA_STEP = re.compile(r"step (\d+)/\d+ \| loss ([\d.naninf]+) .*?\| ([\d,]+) tok/s .*?\| ([\d.]+) ms/step")
_JLA_COMPILE = re.compile(r"compiled train step in ([\d.]+)s \(device memory ([\d.na]+) GiB\)")


def parse_jla_log(text: str, *, warmup: int) -> dict:
    """ms/step (median over jla's log windows after the first `warmup` steps), tokens/s, compile seconds,
    compiled device memory and the last logged loss from `jla train`'s log lines."""
    rows = [(int(a), float(b), float(c.replace(",", "")), float(d)) for a, b, c, d in _JLA_STEP.findall(text)]
    timed = [r for r in rows if r[0] > warmup] or rows
    compiled = _JLA_COMPILE.findall(text)
    return {"logged_steps": [r[0] for r in rows],
            "step_ms_median": float(np.median([r[3] for r in timed])) if timed else None,
            "tokens_per_s": float(np.median([r[2] for r in timed])) if timed else None,
            "final_loss": rows[-1][1] if rows else None,
            "compile_s": float(compiled[-1][0]) if compiled else None,
            "compiled_memory_gib": float(compiled[-1][1]) if compiled else None}


def run_jla(config: str, *, steps: int, warmup: int, timeout_s: float) -> dict:
    """jla's trainer through its CLI on `config` for warmup + steps steps; skipped when jla is missing."""
    import importlib.util  # noqa: PLC0415
    if importlib.util.find_spec("jla") is None:
        return {"row": "jla", "system": "jla", "skipped": "jla is not importable (install jax-linear-attention==0.1.0 "
                "from experiments/gpu_wheels.txt)"}
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "jla.cli", "train", "--config", config, "--set",
               f"train.max_steps={warmup + steps}", "--set", f'train.output_dir="{out_dir}"']
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    return {"row": "jla", "system": "jla", "command": " ".join(cmd), "returncode": proc.returncode, "wall_s": wall,
            **parse_jla_log(text, warmup=warmup), "log_tail": text[-3000:]}


def _compile_cell(row: dict) -> str:
    """First-step seconds; for k3jax rows also "(trace + lower, XLA)": jax's trace and lowering (the Pallas
    kernels' included) and XLA's backend compile; the rest of the first step is its run, kernels' runtime
    initialisation included."""
    if row.get("compile_s") is None:
        return "n/a"
    phases = row.get("compile_phases_s")
    if not phases:
        return f"{row['compile_s']:.1f}"
    jax_s = phases.get("jaxpr_trace_duration", 0.0) + phases.get("jaxpr_to_mlir_module_duration", 0.0)
    return f"{row['compile_s']:.1f} ({jax_s:.1f}, {phases.get('backend_compile_duration', 0.0):.1f})"


def render(result: dict) -> str:
    """The markdown page of a run."""
    from experiments.harness import environment_line, markdown_table  # noqa: PLC0415
    rows = result["rows"]
    jla = next((r for r in rows if r["row"] == "jla" and r.get("tokens_per_s")), None)
    base = jla["tokens_per_s"] if jla else None
    table = []
    for r in rows:
        if r.get("skipped"):
            table.append([r["row"], "skipped: " + r["skipped"], "", "", "", "", "", ""])
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and r.get("tokens_per_s") else "n/a"
        mem = r.get("peak_memory_gib", r.get("compiled_memory_gib"))
        table.append([r["row"], f"{r['step_ms_median']:.1f}" if r.get("step_ms_median") else "n/a",
                      f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "n/a", ratio,
                      _compile_cell(r),
                      f"{mem:.1f}" if mem is not None else "n/a",
                      f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "n/a",
                      r.get("steps_timed", len(r.get("logged_steps", [])))])
    f = result["flags"]
    lines = [f"# Whole training step, k3jax vs jla ({result['env']['date']}, {result['env']['device']})", "",
             environment_line(result["env"]), "",
             f"`experiments/bench_train.py --shape={f['shape']}`: {f['warmup']} warm-up steps then {f['steps']} timed; "
             f"k3jax scan_layers={f['scan_layers']}, remat={f['remat']}; "
             f"XLA_PYTHON_CLIENT_MEM_FRACTION={f.get('xla_python_client_mem_fraction') or 'unset (0.75)'}. ms/step = median between the ends of "
             "consecutive steps (host one step ahead, as the trainers); compile = first step's wall seconds (k3jax: jax's "
             "trace + lowering, XLA's backend compile); memory = "
             "device peak (k3jax) / jla's compiled-step estimate; loss = cross-entropy of the last step (nats).", ""]
    lines += markdown_table(["row", "ms/step", "tokens/s", "vs jla", "compile s", "memory GiB", "loss", "steps"], table)
    return "\n".join(lines) + "\n"


def _define_flags():
    """Command-line flags, defined only when run as a script (tests import experiment modules together)."""
    global _SHAPE, _ROWS, _STEPS, _WARMUP, _SCAN, _REMAT, _OUT, _JLA_CONFIG, _ONE_ROW, _TIMEOUT
    from absl import flags  # noqa: PLC0415
    _SHAPE = flags.DEFINE_enum("shape", "k3_small", sorted(SHAPES), "Named shape.")
    _ROWS = flags.DEFINE_list("rows", list(ROWS), f"Rows to run, of {ROWS}.")
    _STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per row (after --warmup).")
    _WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps after the compiling first step.")
    _SCAN = flags.DEFINE_bool("scan_layers", None, "k3jax rows: model.scan_layers (default: the shape's, else False).")
    _REMAT = flags.DEFINE_enum("remat", None, ["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"],
                               "k3jax rows: model.remat (with --scan_layers; default: the shape's, else none).")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_bench_train/train_step", "Output prefix (<out>.json, .md).")
    _JLA_CONFIG = flags.DEFINE_string("jla_config", "", "jla TOML at the shape (default: the shape's own).")
    _ONE_ROW = flags.DEFINE_string("one_row", "", "Internal: run this k3jax row here and print its JSON.")
    _TIMEOUT = flags.DEFINE_float("row_timeout_s", 560.0, "Seconds a row's subprocess may take.")


def main(argv):
    from experiments.harness import environment, write_results  # noqa: PLC0415
    del argv
    shape = SHAPES[_SHAPE.value]
    scan = shape.get("scan_layers", False) if _SCAN.value is None else _SCAN.value
    remat = shape.get("remat", "none") if _REMAT.value is None else _REMAT.value
    common = dict(steps=_STEPS.value, warmup=_WARMUP.value, scan_layers=scan, remat=remat)
    if _ONE_ROW.value:
        print("BENCH_ROW " + json.dumps(run_k3jax(_SHAPE.value, _ONE_ROW.value, **common)), flush=True)
        return
    unknown = [r for r in _ROWS.value if r not in ROWS]
    if unknown:
        raise ValueError(f"--rows must be from {ROWS}, got {unknown}")
    rows = []
    for row in _ROWS.value:
        t0 = time.perf_counter()
        if row == "jla":
            config = _JLA_CONFIG.value or SHAPES[_SHAPE.value].get("jla_config")
            if not config:
                rows.append({"row": "jla", "skipped": f"no jla config for shape {_SHAPE.value!r}"})
            else:
                rows.append(run_jla(config, steps=_STEPS.value, warmup=_WARMUP.value, timeout_s=_TIMEOUT.value))
        else:
            argv = [a for a in sys.argv[1:] if not a.startswith(("--rows", "--one_row", "--out"))]
            try:
                proc = subprocess.run([sys.executable, "-m", "experiments.bench_train", f"--one_row={row}", *argv],
                                      capture_output=True, text=True, timeout=_TIMEOUT.value)
            except subprocess.TimeoutExpired as e:  # a row, not the end of the run; keep what it printed
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                rows.append({"row": row, "skipped": f"timed out after {_TIMEOUT.value:.0f} s",
                             "stderr_tail": err[-2000:]})
                print(err[-2000:], flush=True)
            else:
                line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_ROW ")), None)
                if line is None:
                    raise RuntimeError(f"row {row} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
                rows.append(json.loads(line[len("BENCH_ROW "):]))
        print(f"{row}: {json.dumps({k: v for k, v in rows[-1].items() if k in ('step_ms_median', 'tokens_per_s', 'compile_s', 'peak_memory_gib', 'final_loss', 'skipped')})} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        result = {"env": environment(), "rows": rows,
                  "flags": {"shape": _SHAPE.value, **common,
                            "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}}
        write_results(_OUT.value, result, render(result))  # after every row: a later timeout keeps the rest
    print(render(result))


if __name__ == "__main__":
    _define_flags()
    from absl import app
    app.run(main)
