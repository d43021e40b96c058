"""K3-small vs a plain transformer of the same size on one GPU: tokens/s, MFU, validation loss (issue 8).

  python -m experiments.k3_small_gpu --out=$OUT/results --workdir_root=/tmp/k3_small_runs
  # CPU smoke run at a tiny size (do not commit its output):
  python -m experiments.k3_small_gpu --out=/tmp/k3s --workdir_root=/tmp/k3s_runs --steps=6 \
      --matmul_size=256 --tiny

Steps, in one process (the three output files are rewritten after each):
 1. the device's dense bf16 matmul rate: median over `--matmul_reps` timed [n, n] x [n, n] GEMMs
    (n = `--matmul_size`, fp32 accumulation, bf16 output) after one warm-up, 2·n³ FLOPs each;
 2. K3-small (`--k3_config`, default configs/k3_small_gpu.py) for `--steps` steps, or until
    `--k3_time_budget_s` seconds of training wall clock after its first step (compilation excluded: the
    budget of `k3jax.train.trainer.train`; the learning-rate schedule still spans `--steps`; the
    checkpoint at the stop is evaluated);
 3. the transformer (`--baseline_config`) for exactly the steps K3-small reached (same tokens, same data
    order, same learning-rate schedule), with its own budget `--baseline_time_budget_s`;
 4. per model: tokens/s after compilation (the trainer times every step but the first), model FLOPs per
    token (`k3jax.models.flops.model_flops_per_token`), MFU = FLOPs/token x tokens/s / measured GEMM rate,
    validation loss (nats/token and bits/byte) at the last step both models reached, and the curves.
Writes `<out>/<name>.json`, `.md` and `_loss.png` (validation bits/byte and training loss vs tokens).
JAX's persistent compilation cache is on (`--compilation_cache_dir`); wall, compile and step seconds
are recorded per model.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time

import jax
import numpy as np
from absl import app, flags, logging

from experiments.harness import CompileCounter, enable_compilation_cache, grouped_matmul_in_use, measure_matmul_rate
from experiments.configs.common import define_config_file
from k3jax.data.corpus import load_corpus
from k3jax.data.pipeline import eval_batches
from k3jax.models.flops import matmul_params_per_token, model_flops_per_token
from k3jax.train.config import RunConfig, run_config_from_dict
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import _versions, evaluate, load_trained_model, train

_K3 = define_config_file("k3_config", "experiments/configs/k3_small_gpu.py", "K3-small run config.")
_BASE = define_config_file("baseline_config", "experiments/configs/transformer_small_gpu.py",
                                        "Transformer baseline run config.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of both models (overrides train.steps).")
_K3_BUDGET = flags.DEFINE_float("k3_time_budget_s", 220.0, "Wall-clock seconds K3-small may train after its "
                                "first (compiling) step (0 = none).")
_BASE_BUDGET = flags.DEFINE_float("baseline_time_budget_s", 150.0, "Wall-clock seconds the baseline may train "
                                  "after its first step (0 = none).")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", 8192, "n of the n x n x n bf16 GEMMs that measure the rate.")
_MATMUL_REPS = flags.DEFINE_integer("matmul_reps", 10, "Timed GEMMs (median reported).")
_TINY = flags.DEFINE_bool("tiny", False, "CPU smoke size: d_model 64, 4 layers, 4 experts, 2 x 128 tokens.")
_OUT = flags.DEFINE_string("out", "/tmp/k3jax_k3_small_gpu", "Where the JSON/markdown/plot go (with --tiny and no "
                           "--out: /tmp/k3_small_tiny, so a smoke run never overwrites the committed results).")
_NAME = flags.DEFINE_string("name", "k3_small_h200", "Output file stem.")
_ROOT = flags.DEFINE_string("workdir_root", "/tmp/k3_small_runs", "Run directories: <root>/<model>.")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", "/tmp/k3jax_jax_cache",
                                 "JAX persistent compilation cache ('' = off).")

TINY_MODEL = dict(d_model=64, num_layers=4, num_heads=2, head_dim=32, d_ff=96, dtype="float32")
TINY_MOE = dict(num_experts=4, d_ff=64)
TINY_DATA = dict(seq_len=128, batch_size=2)


def _run_config(config, name: str) -> RunConfig:
    d = config.to_dict()
    d["train"]["steps"] = _STEPS.value
    d["train"]["checkpoint_every"] = _STEPS.value
    d["train"]["eval_every"] = min(d["train"]["eval_every"], _STEPS.value)
    d["train"]["warmup_steps"] = min(d["train"]["warmup_steps"], max(_STEPS.value // 10, 1))
    if _TINY.value:
        d["model"].update(TINY_MODEL)
        d["model"]["moe"].update(TINY_MOE)
        d["model"]["residual"]["blocks"] = 2
        d["data"].update(TINY_DATA)
        d["train"]["eval_batches"] = 2
    d["workdir"] = os.path.join(_ROOT.value, name)
    return run_config_from_dict(d)


def _final_eval(cfg: RunConfig) -> dict:
    """Validation loss of the workdir's latest checkpoint on the trainer's fixed validation slice."""
    val = load_corpus(cfg.data.source, "validation", cache_dir=cfg.data.cache_dir or None)
    if val.num_tokens <= cfg.data.seq_len:
        val = load_corpus(cfg.data.source, "train", cache_dir=cfg.data.cache_dir or None)
    batches = eval_batches(val.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                           max_batches=cfg.train.eval_batches)
    model, step = load_trained_model(cfg)
    return {"step": step, **evaluate(model, batches)}


def _train_model(name: str, cfg: RunConfig, budget: float, counter: CompileCounter,
                 stop_at_step: int | None = None) -> dict:
    counter.reset()
    t0 = time.time()
    summary = train(cfg, show_progress=False, stop_at_step=stop_at_step, time_budget_s=budget or None)
    wall = time.time() - t0
    compile_stats = counter.reset()
    rows = read_metrics(cfg.workdir)
    val = {int(r["step"]): {"val_loss": r["val_loss"], "val_bpb": r["val_bpb"]} for r in rows if "val_loss" in r}
    step = int(summary["step"])
    if step not in val:  # stopped between evaluations: evaluate the checkpoint written at the stop
        ev = _final_eval(cfg)
        val[step] = {"val_loss": ev["val_loss"], "val_bpb": ev["val_bpb"]}
    flops = model_flops_per_token(cfg.model, cfg.data.seq_len)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    return {
        "name": name,
        "config": dataclasses.asdict(cfg.model) | {"seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size},
        "num_params": summary["num_params"], "matmul_params_per_token": matmul_params_per_token(cfg.model),
        "flops_per_token": flops, "steps": step, "tokens": step * tokens_per_step, "tokens_per_step": tokens_per_step,
        "tokens_per_s": summary["tokens_per_s"], "wall_s": wall, "compile": compile_stats,
        "stopped_early": bool(summary.get("stopped_by_signal")),
        "val": {str(k): v for k, v in sorted(val.items())},
        "train_curve": [(int(r["step"]) * tokens_per_step, r["ce"]) for r in rows if "ce" in r],
    }


def _summary_table(result: dict) -> list[str]:
    rate = result["matmul"]["flops_per_s"]
    models = result["models"]
    common = None
    if len(models) == 2:
        steps = set.intersection(*(set(m["val"]) for m in models.values()))
        common = max(steps, key=int) if steps else None
    lines = [f"# K3-small vs transformer ({result['date']}, {result['device']})", "",
             f"jax {result['versions']['jax']}, flax {result['versions']['flax']}. Dense bf16 GEMM "
             f"{result['matmul']['n']}³: {rate / 1e12:.1f} TFLOP/s (median of {result['matmul']['reps']}); MFU is "
             "against that rate. FLOPs/token = 6·N_active + sequence terms (k3jax/models/flops.py, PaLM App. B). "
             f"MoE grouped matmul: {result['grouped_matmul']}.",
             "", "| model | params total | matmul params active/token | GFLOPs/token | steps | tokens | tokens/s "
             "| MFU | val bits/byte (final) | val loss nats (final) | compile s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models.values():
        last = m["val"][str(m["steps"])]
        mfu = m["flops_per_token"]["total"] * m["tokens_per_s"] / rate
        active = m["matmul_params_per_token"]["total"]
        lines.append(f"| {m['name']} | {m['num_params'] / 1e6:.1f} M | {active / 1e6:.1f} M "
                     f"| {m['flops_per_token']['total'] / 1e9:.3f} | {m['steps']} | {m['tokens'] / 1e6:.2f} M "
                     f"| {m['tokens_per_s']:,.0f} | {mfu:.1%} | {last['val_bpb']:.4f} | {last['val_loss']:.4f} "
                     f"| {m['compile']['backend_compile_s']:.1f} | {m['wall_s']:.0f} |")
    if common is not None:
        tokens = int(common) * next(iter(models.values()))["tokens_per_step"]
        values = "; ".join(f"{m['name']} {m['val'][common]['val_bpb']:.4f} bits/byte" for m in models.values())
        lines += ["", f"At equal tokens (step {common}, {tokens / 1e6:.2f} M tokens): {values}"]
    return lines


def _write(result: dict, stem: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    if "models" not in result or not result["models"]:
        return
    with open(stem + ".md", "w") as f:
        f.write("\n".join(_summary_table(result)) + "\n")
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in result["models"].values():
        tokens, ce = zip(*m["train_curve"]) if m["train_curve"] else ((), ())
        line, = ax.plot(np.array(tokens) / 1e6, np.array(ce) / math.log(2.0), alpha=0.5,
                        label=f"{m['name']} train (nats/token / ln 2)")
        vs = sorted((int(s), v["val_bpb"]) for s, v in m["val"].items())
        ax.plot([s * m["tokens_per_step"] / 1e6 for s, _ in vs], [v for _, v in vs], "o-", color=line.get_color(),
                label=f"{m['name']} validation bits/byte")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"K3-small vs transformer ({result['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + "_loss.png", dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    t_start = time.time()
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    if _CACHE_DIR.value:
        enable_compilation_cache(_CACHE_DIR.value)
    counter = CompileCounter()
    out = "/tmp/k3_small_tiny" if _TINY.value and not flags.FLAGS["out"].present else _OUT.value
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, _NAME.value)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.node()})",
              "versions": _versions(), "flags": {"steps": _STEPS.value, "k3_time_budget_s": _K3_BUDGET.value,
                                                 "baseline_time_budget_s": _BASE_BUDGET.value, "tiny": _TINY.value},
              "grouped_matmul": grouped_matmul_in_use(), "models": {}}
    result["matmul"] = measure_matmul_rate(_MATMUL_SIZE.value, _MATMUL_REPS.value)
    print(f"bf16 GEMM {_MATMUL_SIZE.value}^3: {result['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    _write(result, stem)

    k3_cfg = _run_config(_K3.value, "k3_small")
    result["models"]["k3_small"] = _train_model("k3_small", k3_cfg, _K3_BUDGET.value, counter)
    _write(result, stem)
    k3_steps = result["models"]["k3_small"]["steps"]
    base_cfg = _run_config(_BASE.value, "transformer")
    result["models"]["transformer"] = _train_model("transformer", base_cfg, _BASE_BUDGET.value, counter,
                                                   stop_at_step=k3_steps if k3_steps < _STEPS.value else None)
    result["elapsed_s"] = time.time() - t_start
    for m in result["models"].values():
        m["mfu"] = m["flops_per_token"]["total"] * m["tokens_per_s"] / result["matmul"]["flops_per_s"]
    _write(result, stem)
    print("\n".join(_summary_table(result)))
    print(f"wrote {stem}.json/.md/_loss.png in {result['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    app.run(main)
