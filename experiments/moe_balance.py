"""MoE load-balancing comparison: the same small MoE LM trained with every balancing method.

  python -m experiments.moe_balance --steps=600 --seeds=0,1,2
  python -m experiments.moe_balance --methods=quantile_exact,aux_loss --steps=50 --seeds=0   # smoke

Methods (ANCHORS.md §2): none, Switch aux loss, DeepSeek-V3 sequence-wise aux loss, DeepSeek
loss-free bias, Quantile Balancing (exact and histogram quantile), the seed article's literal
same-step threshold diversion, and capacity factor 1.0 / 1.25 (with the Switch aux loss).

Per run it reads `<workdir>/metrics.jsonl` (written by `k3jax.train.trainer.train`) and reports:
final validation loss, MaxVio_batch (mean over MoE layers; its mean after warm-up and its curve),
MaxVio_global on the validation slice, CV of the load, dropped %, dead experts, diverted % (seed
method) and tokens/s. Writes `<out>/moe_balance_<date>.json`, `.md` (table: mean ± std over seeds) and
`.png` (MaxVio_batch vs step per method) with the device and versions.
"""
from __future__ import annotations

import datetime
import json
import os
import platform

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from k3jax.train.config import run_config_from_dict
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import train

METHODS: dict[str, dict] = {
    "none": {"moe_balancing": "none"},
    "aux_loss": {"moe_balancing": "aux_loss"},
    "seq_aux_loss": {"moe_balancing": "seq_aux_loss"},
    "loss_free": {"moe_balancing": "loss_free"},
    "quantile_exact": {"moe_balancing": "quantile", "moe_quantile_estimator": "exact"},
    "quantile_histogram": {"moe_balancing": "quantile", "moe_quantile_estimator": "histogram"},
    "quantile_threshold": {"moe_balancing": "quantile_threshold"},
    "capacity_1.0_aux": {"moe_balancing": "aux_loss", "moe_capacity_factor": 1.0},
    "capacity_1.25_aux": {"moe_balancing": "aux_loss", "moe_capacity_factor": 1.25},
}
STATS = ("max_vio", "cv", "dropped_fraction", "dead_experts", "diverted_fraction", "entropy")

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/k3_tiny.py", "Base run config.")
_METHODS = flags.DEFINE_list("methods", list(METHODS), "Methods to run (keys of METHODS).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_STEPS = flags.DEFINE_integer("steps", 600, "Training steps per run.")
_EXPERTS = flags.DEFINE_integer("num_experts", 16, "Routed experts E.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token k.")
_WARMUP = flags.DEFINE_float("warmup_frac", 0.25, "MaxVio_batch is averaged over steps after this fraction.")
_ROOT = flags.DEFINE_string("workdir_root", "runs/moe_balance", "Run directories: <root>/<method>/seed<s>.")
_OUT = flags.DEFINE_string("out", "experiments/results", "Where the JSON/markdown/plot go.")


def _run_config(base: dict, method: str, seed: int) -> dict:
    d = json.loads(json.dumps(base))  # deep copy of plain data
    d["model"].update(ffn="moe", moe_num_experts=_EXPERTS.value, moe_top_k=_TOP_K.value, **METHODS[method])
    steps = _STEPS.value
    d["train"].update(steps=steps, eval_every=steps, checkpoint_every=steps, log_every=max(1, min(10, steps // 20)),
                      sample_tokens=0)
    d["train"]["warmup_steps"] = min(d["train"].get("warmup_steps", 0), max(steps // 10, 1))
    d["seed"] = seed
    d["workdir"] = os.path.join(_ROOT.value, method, f"seed{seed}")
    return d


def _layer_mean(row: dict, stat: str) -> float | None:
    values = [v for k, v in row.items() if k.startswith("moe/") and k.endswith("/" + stat)]
    return float(np.mean(values)) if values else None


def _summarise(workdir: str, summary: dict) -> dict:
    rows = read_metrics(workdir)
    train_rows = [r for r in rows if _layer_mean(r, "max_vio") is not None]
    steps = np.array([r["step"] for r in train_rows])
    after = steps > _WARMUP.value * _STEPS.value
    out = {"curve_steps": steps.tolist(), "max_vio_curve": [_layer_mean(r, "max_vio") for r in train_rows]}
    for stat in STATS:
        vals = np.array([_layer_mean(r, stat) for r in train_rows], dtype=np.float64)
        out[stat + "_after_warmup"] = float(vals[after].mean()) if after.any() else float("nan")
    out.update(val_loss=summary.get("val_loss"), val_bpb=summary.get("val_bpb"),
               max_vio_global=summary.get("val_max_vio_global"), tokens_per_s=summary.get("tokens_per_s"))
    return out


def _fmt(values, scale=1.0, digits=3):
    v = np.array([x for x in values if x is not None], np.float64) * scale
    if v.size == 0:
        return "—"
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}" if v.size > 1 else f"{v.mean():.{digits}f}"


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    unknown = sorted(set(_METHODS.value) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    base = _CONFIG.value.to_dict()
    results: dict[str, list[dict]] = {}
    for method in _METHODS.value:
        for seed in (int(s) for s in _SEEDS.value):
            cfg = run_config_from_dict(_run_config(base, method, seed))
            summary = train(cfg, show_progress=False)
            res = _summarise(cfg.workdir, summary)
            res["seed"] = seed
            results.setdefault(method, []).append(res)
            print(f"{method} seed {seed}: val loss {res['val_loss']:.4f}, MaxVio_batch "
                  f"{res['max_vio_after_warmup']:.3f}, MaxVio_global {res['max_vio_global']}", flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    device = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.node()})"
    meta = {"date": stamp, "device": device, "jax": jax.__version__, "steps": _STEPS.value,
            "num_experts": _EXPERTS.value, "top_k": _TOP_K.value, "seeds": _SEEDS.value,
            "warmup_frac": _WARMUP.value, "base_config": base}
    os.makedirs(_OUT.value, exist_ok=True)
    stem = os.path.join(_OUT.value, f"moe_balance_{stamp}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)

    lines = [f"# MoE balancing comparison ({stamp}, {device}, jax {jax.__version__})", "",
             f"E = {_EXPERTS.value}, top-{_TOP_K.value}, {_STEPS.value} steps, seeds {','.join(_SEEDS.value)}; "
             f"MaxVio_batch / CV / drop / dead / diverted averaged over MoE layers and over logged steps after "
             f"{_WARMUP.value:.0%} of training; MaxVio_global on the validation slice at the end.", "",
             "| method | val loss (nats) | MaxVio_batch | MaxVio_global | CV | drop % | dead experts | diverted % "
             "| tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, runs in results.items():
        col = lambda k: [r[k] for r in runs]  # noqa: E731
        lines.append(
            f"| {method} | {_fmt(col('val_loss'), digits=4)} | {_fmt(col('max_vio_after_warmup'))} | "
            f"{_fmt(col('max_vio_global'))} | {_fmt(col('cv_after_warmup'))} | "
            f"{_fmt(col('dropped_fraction_after_warmup'), 100, 2)} | "
            f"{_fmt(col('dead_experts_after_warmup'), digits=2)} | "
            f"{_fmt(col('diverted_fraction_after_warmup'), 100, 2)} | {_fmt(col('tokens_per_s'), digits=0)} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, runs in results.items():
        curves = np.array([r["max_vio_curve"] for r in runs], np.float64)
        ax.plot(runs[0]["curve_steps"], curves.mean(0), label=method)
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio_batch (mean over MoE layers and seeds)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"MoE balancing, E={_EXPERTS.value} top-{_TOP_K.value} ({device})")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    app.run(main)
