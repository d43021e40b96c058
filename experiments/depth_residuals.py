"""Residual schemes over depth: PreNorm vs Block / Full Attention Residuals vs the article-literal variant.

Issue 6's experiment (ANCHORS.md §3). Deep-narrow byte LMs on the default corpus ("python-stdlib"), one
run per (variant, depth, seed); every variant trained with seed s sees the SAME token stream (the seed
fixes both the parameter init and grain's shuffle, so variants differ only in the residual scheme).

  python -m experiments.depth_residuals     # the CPU sweep committed in results/ (16 and 6 layers, 150 steps)
  python -m experiments.depth_residuals --variants=prenorm,block_attnres --depths=32 \
      --workdir=runs/depth_residuals_L32 --out=experiments/results/depth_residuals_L32
  python -m experiments.depth_residuals --variants=prenorm --steps=188 \
      --workdir=runs/depth_residuals_1p25x --out=experiments/results/depth_residuals_prenorm_1p25x
  python -m experiments.depth_residuals --depths=32,12 --d_model=256 --num_heads=4 --head_dim=64 \
      --d_ff=768 --seq_len=1024 --batch_size=32 --steps=5000 --dtype=bfloat16   # GPU-sized (issue)

Per run it records the final validation loss (nats/token) and bits/byte, training tokens/s (first step,
which compiles, excluded), the validation curve, peak memory, and depth diagnostics of the trained model
(`LanguageModel.diagnostics` on the first validation batch: per-sublayer input RMS, cosine between
consecutive sublayer inputs, the sublayer x source depth-weight matrix of the AttnRes variants).

Peak memory: each (variant, depth) runs in its own subprocess (`--isolate`, default) that trains its
seeds one after another, so one compile serves all seeds. On CPU we report that process's peak resident
set size (`ru_maxrss`, which includes the Python/JAX runtime and XLA compilation) and, as
`rss_baseline_mib`, the RSS after imports and corpus loading, before any model exists; the difference is
what the model, its optimizer state, activations and its compilation added. On GPU/TPU we report
`memory_stats()["peak_bytes_in_use"]` of device 0 (device memory only). Without `--isolate` the RSS
numbers are of the shared parent process (monotone, not per config).

Outputs: `<out>.json` (all raw numbers, date, machine, versions), `<out>.md` (table + the markdown of
`--notes_file` if given) and `<out>_{val_loss,cosine,hidden_rms,depth_weights}.png`. To add notes to a
finished sweep without retraining: `--report_from=<out>.json --notes_file=notes.md`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

from absl import app, flags

VARIANTS = ("prenorm", "block_attnres", "full_attnres", "article_block")

FLAGS = flags.FLAGS


def _define_flags():
    """The command-line flags, defined only when run as a script: the tests import this module next to
    other experiment scripts whose absl flags share names (--variants, --out, --seeds)."""
    flags.DEFINE_list("variants", list(VARIANTS), f"Residual schemes, from {VARIANTS}.")
    flags.DEFINE_list("depths", ["16", "6"], "Transformer layers per model (each = 2 sublayers); the "
                      "issue's full setting is 32,12 (see the module docstring).")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (init + data order); same per variant.")
    flags.DEFINE_integer("d_model", 64, "Hidden size D.")
    flags.DEFINE_integer("num_heads", 4, "Attention heads.")
    flags.DEFINE_integer("head_dim", 16, "Per-head size.")
    flags.DEFINE_integer("d_ff", 192, "SwiGLU hidden size.")
    flags.DEFINE_integer("seq_len", 64, "Tokens per sequence T.")
    flags.DEFINE_integer("batch_size", 8, "Sequences per step B.")
    flags.DEFINE_integer("steps", 150, "Optimizer steps per run.")
    flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
    flags.DEFINE_integer("warmup_steps", 15, "Linear warmup steps.")
    flags.DEFINE_integer("eval_every", 25, "Validation cadence (steps); also at the end.")
    flags.DEFINE_integer("eval_batches", 4, "Batches in the fixed validation slice.")
    flags.DEFINE_integer(
        "residual_blocks", 8, "N for block_attnres (sublayer blocks) and article_block (layer blocks); capped at "
        "the number of units of the model.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_string("workdir", "runs/depth_residuals", "Run folders and per-config raw results.")
    flags.DEFINE_string("out", "/tmp/k3jax_depth_residuals/depth_residuals", "Output prefix (.json/.md/_*.png); "
                        "the committed result is --out=experiments/results/depth_residuals.")
    flags.DEFINE_bool("isolate", True, "One subprocess per (variant, depth): per-config peak memory.")
    flags.DEFINE_bool("reuse", True, "Reuse a (variant, depth) result already in --workdir with the "
                      "same settings (resume an interrupted sweep).")
    flags.DEFINE_string("notes_file", "", "Markdown appended to the table as 'What happened'.")
    flags.DEFINE_string(
        "report_from", "", "Rewrite <out>.md and the plots from this existing results JSON (keeps its date, machine "
        "and raw numbers; adds --notes_file) instead of training.")
    flags.DEFINE_string("worker", "", "Internal: JSON {settings, variant, depth, out} run by a subprocess.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that defines the sweep except which variants/depths/seeds (all shared by every run)."""

    d_model: int = 64
    num_heads: int = 4
    head_dim: int = 16
    d_ff: int = 192
    seq_len: int = 64
    batch_size: int = 8
    steps: int = 150
    learning_rate: float = 3e-3
    warmup_steps: int = 15
    eval_every: int = 25
    eval_batches: int = 4
    residual_blocks: int = 8
    dtype: str = "float32"
    source: str = "python-stdlib"


def residual_blocks_for(variant: str, num_layers: int, requested: int) -> int:
    """N actually used: `requested` capped at the units the variant's blocks count (sublayers for
    block_attnres, layers for article_block); 2L for full_attnres, 1 for prenorm (unused there)."""
    if variant == "block_attnres":
        return min(requested, 2 * num_layers)
    if variant == "article_block":
        return min(requested, num_layers)
    if variant == "full_attnres":
        return 2 * num_layers
    return 1


def run_config(settings: Settings, variant: str, num_layers: int, seed: int, workdir: str):
    """The `RunConfig` of one run (no sample at the end; one checkpoint, at the end)."""
    from k3jax.models.config import ModelConfig, ResidualConfig
    from k3jax.train.config import DataConfig, RunConfig, TrainConfig
    s = settings
    model = ModelConfig(d_model=s.d_model, num_layers=num_layers, num_heads=s.num_heads, head_dim=s.head_dim,
                        d_ff=s.d_ff, mixer_pattern="A", ffn="mlp", dtype=s.dtype,
                        residual=ResidualConfig(kind=variant, block_unit="sublayers", blocks=max(
                            1, residual_blocks_for(variant, num_layers, s.residual_blocks))))
    data = DataConfig(source=s.source, seq_len=s.seq_len, batch_size=s.batch_size)
    train = TrainConfig(steps=s.steps, learning_rate=s.learning_rate, warmup_steps=min(s.warmup_steps, s.steps),
                        eval_every=s.eval_every, eval_batches=s.eval_batches, log_every=min(10, s.steps),
                        checkpoint_every=s.steps, keep_checkpoints=1, sample_tokens=0)
    return RunConfig(model=model, data=data, train=train, workdir=workdir, seed=seed)


def _rss_mib() -> float:
    """Peak resident set size of this process so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _device_peak_bytes() -> int | None:
    import jax
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run_config_group(settings: Settings, variant: str, num_layers: int, seeds: list[int], workdir: str) -> dict:
    """Train `variant` at `num_layers` for each seed (in this process) and return raw results."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from k3jax.data.corpus import load_corpus
    from k3jax.data.pipeline import eval_batches
    from k3jax.train.metrics import read_metrics
    from k3jax.train.trainer import load_trained_model, train

    val_corpus = load_corpus(settings.source, "validation")
    if val_corpus.num_tokens <= settings.seq_len:
        val_corpus = load_corpus(settings.source, "train")
    diag_batch = eval_batches(val_corpus.tokens, batch_size=settings.batch_size, seq_len=settings.seq_len,
                              max_batches=1)[0]
    diag_batch = {k: jnp.asarray(v) for k, v in diag_batch.items()}
    rss_baseline = _rss_mib()

    @nnx.jit
    def diagnostics(model, inputs, segment_ids, positions):
        return model.diagnostics(inputs, segment_ids=segment_ids, positions=positions)

    runs = []
    group_start = time.time()
    for seed in seeds:
        cfg = run_config(settings, variant, num_layers, seed, os.path.join(workdir, f"{variant}_L{num_layers}_s{seed}"))
        shutil.rmtree(cfg.workdir, ignore_errors=True)  # a fresh run, never a resume
        t0 = time.time()
        summary = train(cfg, show_progress=False)
        wall = time.time() - t0
        model, _ = load_trained_model(cfg)
        diag = jax.device_get(diagnostics(model, diag_batch["inputs"], diag_batch["segment_ids"],
                                          diag_batch["positions"]))
        metrics = read_metrics(cfg.workdir)
        curve = [{"step": m["step"], "val_loss": m["val_loss"], "val_bpb": m["val_bpb"]}
                 for m in metrics if "val_loss" in m]
        train_ce = [{"step": m["step"], "ce": m["ce"]} for m in metrics if "ce" in m]
        run = {"seed": seed, "val_loss": summary["val_loss"], "val_bpb": summary["val_bpb"],
               "tokens_per_s": summary["tokens_per_s"], "wall_seconds": wall, "num_params": summary["num_params"],
               "unigram_entropy_bits": summary["unigram_entropy_bits"], "val_curve": curve, "train_ce": train_ce,
               "diagnostics": {k: np.asarray(v).tolist() for k, v in diag.items()}}
        if variant == "article_block":
            run["alphas"] = [float(s.alpha[...]) for s in model.block_scales]
        runs.append(run)
        print(f"{variant} L={num_layers} seed={seed}: val {run['val_loss']:.4f} nats, {run['val_bpb']:.4f} bits/byte, "
              f"{run['tokens_per_s']:,.0f} tok/s, {wall:.0f} s", flush=True)
    return {"variant": variant, "num_layers": num_layers, "num_sublayers": 2 * num_layers,
            "residual_blocks": residual_blocks_for(variant, num_layers, settings.residual_blocks),
            "settings": dataclasses.asdict(settings), "seeds": seeds, "runs": runs,
            "group_wall_seconds": time.time() - group_start,
            "rss_baseline_mib": rss_baseline, "rss_peak_mib": _rss_mib(),
            "device_peak_bytes": _device_peak_bytes(), "platform": jax.local_devices()[0].platform}


def _group_path(workdir: str, variant: str, num_layers: int) -> str:
    return os.path.join(workdir, f"result_{variant}_L{num_layers}.json")


def _run_isolated(settings: Settings, variant: str, num_layers: int, seeds: list[int], workdir: str) -> dict:
    path = _group_path(workdir, variant, num_layers)
    spec = json.dumps({"settings": dataclasses.asdict(settings), "variant": variant, "num_layers": num_layers,
                       "seeds": seeds, "workdir": workdir, "out": path})
    subprocess.run([sys.executable, "-m", "experiments.depth_residuals", f"--worker={spec}", "--verbosity=-1"],
                   check=True)
    with open(path) as f:
        return json.load(f)


def run_sweep(settings: Settings, variants, depths, seeds, *, workdir: str, isolate: bool = True,
              reuse: bool = True) -> list[dict]:
    """Run every (variant, depth) over `seeds`; returns one raw-result dict per (variant, depth).

    Raises:
      ValueError: an unknown variant, or an empty variants/depths/seeds list.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be from {VARIANTS}, got {unknown}")
    if not variants or not depths or not seeds:
        raise ValueError(f"variants, depths and seeds must be non-empty, got {variants=}, {depths=}, {seeds=}")
    os.makedirs(workdir, exist_ok=True)
    groups = []
    for num_layers in depths:
        for variant in variants:
            path = _group_path(workdir, variant, num_layers)
            if reuse and os.path.exists(path):
                with open(path) as f:
                    old = json.load(f)
                if old["settings"] == dataclasses.asdict(settings) and old["seeds"] == list(seeds):
                    print(f"reusing {path}", flush=True)
                    groups.append(old)
                    continue
            if isolate:
                group = _run_isolated(settings, variant, num_layers, list(seeds), workdir)
            else:
                group = run_config_group(settings, variant, num_layers, list(seeds), workdir)
                with open(path, "w") as f:
                    json.dump(group, f)
            groups.append(group)
    return groups


# ---------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------
def _mean_std(values) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def _peak_mib(group: dict) -> float:
    if group.get("device_peak_bytes"):
        return group["device_peak_bytes"] / 2**20
    return group["rss_peak_mib"]


def summary_rows(groups: list[dict]) -> list[dict]:
    """One row per (variant, depth): mean/std over seeds, and the paired difference to prenorm's
    val loss at the same depth and seed (same tokens) when prenorm was run."""
    baseline = {(g["num_layers"], r["seed"]): r["val_loss"] for g in groups if g["variant"] == "prenorm"
                for r in g["runs"]}
    rows = []
    for g in groups:
        runs = g["runs"]
        row = {"variant": g["variant"], "num_layers": g["num_layers"], "residual_blocks": g["residual_blocks"],
               "seeds": len(runs), "num_params": runs[0]["num_params"]}
        for key in ("val_loss", "val_bpb", "tokens_per_s", "wall_seconds"):
            row[key], row[key + "_std"] = _mean_std([r[key] for r in runs])
        diffs = [r["val_loss"] - baseline[(g["num_layers"], r["seed"])] for r in runs
                 if (g["num_layers"], r["seed"]) in baseline]
        row["delta_vs_prenorm"], row["delta_vs_prenorm_std"] = _mean_std(diffs) if diffs else (float("nan"),) * 2
        row["peak_memory_mib"] = _peak_mib(g)
        row["rss_baseline_mib"] = g["rss_baseline_mib"]
        row["memory_kind"] = "device peak_bytes_in_use" if g.get("device_peak_bytes") else "process peak RSS"
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | layers (sublayers) | N | params | val loss (nats) | Δ vs prenorm (paired) | "
             "bits/byte | tokens/s | peak memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = ("—" if r["variant"] == "prenorm" or math.isnan(r["delta_vs_prenorm"])
                 else f"{r['delta_vs_prenorm']:+.4f} ± {r['delta_vs_prenorm_std']:.4f}")
        lines.append(
            f"| {r['variant']} | {r['num_layers']} ({2 * r['num_layers']}) | {r['residual_blocks']} | "
            f"{r['num_params']:,} | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} | {delta} | "
            f"{r['val_bpb']:.4f} ± {r['val_bpb_std']:.4f} | {r['tokens_per_s']:,.0f} ± {r['tokens_per_s_std']:,.0f} | "
            f"{r['peak_memory_mib']:,.0f} (base {r['rss_baseline_mib']:,.0f}) |")
    return "\n".join(lines)


def machine_info() -> dict:
    import flax
    import jax
    import optax
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "devices": [str(d) for d in jax.devices()],
            "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
                         "optax": optax.__version__}}


# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------
def make_plots(groups: list[dict], out: str) -> list[str]:
    """Validation loss vs step, cosine-by-depth, hidden-RMS-by-depth (mean over seeds, one panel per
    depth) and the depth-weight heatmaps of the AttnRes variants (seed 0 / first seed). Returns paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    depths = sorted({g["num_layers"] for g in groups}, reverse=True)
    colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
    paths = []

    def panels(title):
        fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4.2), squeeze=False)
        fig.suptitle(title)
        return fig, axes[0]

    fig, axes = panels("validation loss vs step (mean over seeds; band = min..max)")
    for ax, depth in zip(axes, depths):
        for g in (g for g in groups if g["num_layers"] == depth):
            steps = [p["step"] for p in g["runs"][0]["val_curve"]]
            losses = np.array([[p["val_loss"] for p in r["val_curve"]] for r in g["runs"]])
            ax.plot(steps, losses.mean(0), color=colors[g["variant"]], label=g["variant"], marker="o", ms=3)
            ax.fill_between(steps, losses.min(0), losses.max(0), color=colors[g["variant"]], alpha=0.2)
        ax.set(title=f"{depth} layers", xlabel="step", ylabel="val loss (nats/token)")
        ax.legend()
    paths.append(_save(fig, out + "_val_loss.png"))

    for key, title, ylabel, log in (("cosine", "cosine(input_l, input_{l+1}) by depth", "cosine", False),
                                     ("hidden_rms", "RMS of each sublayer's input by depth", "RMS", True)):
        fig, axes = panels(title + " (trained, first validation batch, mean over seeds)")
        for ax, depth in zip(axes, depths):
            for g in (g for g in groups if g["num_layers"] == depth):
                values = np.array([r["diagnostics"][key] for r in g["runs"]]).mean(0)
                ax.plot(np.arange(len(values)), values, color=colors[g["variant"]], label=g["variant"])
            ax.set(title=f"{depth} layers", xlabel="sublayer l", ylabel=ylabel)
            if log:
                ax.set_yscale("log")
            ax.legend()
        paths.append(_save(fig, f"{out}_{key}.png"))

    attn = [g for g in groups if "depth_weights" in g["runs"][0]["diagnostics"]]
    if attn:
        attn.sort(key=lambda g: (-g["num_layers"], g["variant"]))
        fig, axes = plt.subplots(1, len(attn), figsize=(5 * len(attn), 5), squeeze=False)
        for ax, g in zip(axes[0], attn):
            w = np.array(g["runs"][0]["diagnostics"]["depth_weights"])
            masked = np.ma.masked_where(w == 0.0, w)  # zero padding beyond each row's sources
            im = ax.imshow(masked, aspect="auto", cmap="viridis", interpolation="nearest")
            ax.set(title=f"{g['variant']}, {g['num_layers']} layers (seed {g['runs'][0]['seed']})",
                   xlabel="source (b_0 = embedding, ..., partial sum)", ylabel="sublayer (last row = final mix)")
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.suptitle("learned depth weights (mean over tokens of the first validation batch)")
        paths.append(_save(fig, out + "_depth_weights.png"))
    return paths


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(groups: list[dict], out: str, *, notes: str = "", sweep: dict | None = None,
                  machine: dict | None = None) -> dict:
    """Write `<out>.json`, `<out>.md` and the plots; return the JSON document. `machine` (default: this
    machine now) is given when re-rendering an earlier sweep's results."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    rows = summary_rows(groups)
    doc = {"experiment": "depth_residuals (issue 6)", "machine": machine or machine_info(), "sweep": sweep or {},
           "rows": rows, "groups": groups}
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    plots = make_plots(groups, out)
    s = groups[0]["settings"]
    m = doc["machine"]
    md = [f"# Depth residual schemes (issue 6): {m['date_utc']}", "",
          f"Machine: {m['platform']}, {m['cpu_count']} CPUs, devices {m['devices']}; jax {m['versions']['jax']}, "
          f"flax {m['versions']['flax']}. Raw numbers: `{os.path.basename(out)}.json`.", "",
          f"Setting: byte LM on `{s['source']}`, attention mixers + SwiGLU, d_model {s['d_model']}, "
          f"{s['num_heads']} heads × {s['head_dim']}, d_ff {s['d_ff']}, T = {s['seq_len']}, B = {s['batch_size']}, "
          f"{s['steps']} AdamW steps (peak lr {s['learning_rate']}, {s['warmup_steps']} warmup, cosine), "
          f"{s['dtype']}; validation = first {s['eval_batches']} batches of the validation split; "
          f"{rows[0]['seeds']} seeds per cell, seed s gives every variant the same init RNG and the same token "
          "order. Mean ± sample std over seeds; Δ = paired (same seed) val-loss difference to prenorm. "
          "N = blocks (block_attnres: sublayer blocks; article_block: layer blocks; full_attnres: N = L). "
          f"Peak memory: {rows[0]['memory_kind']} of the config's own process (base = RSS before any model; "
          "CPU RSS includes the runtime and XLA compilation).", "",
          markdown_table(rows), ""]
    if notes:
        md += ["## What happened", "", notes.strip(), ""]
    md += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + [""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(md))
    return doc


def main(argv):
    del argv
    if FLAGS.worker:
        spec = json.loads(FLAGS.worker)
        group = run_config_group(Settings(**spec["settings"]), spec["variant"], spec["num_layers"], spec["seeds"],
                                 spec["workdir"])
        with open(spec["out"], "w") as f:
            json.dump(group, f)
        return
    notes = ""
    if FLAGS.notes_file:
        with open(FLAGS.notes_file) as f:
            notes = f.read()
    if FLAGS.report_from:
        with open(FLAGS.report_from) as f:
            old = json.load(f)
        write_outputs(old["groups"], FLAGS.out, notes=notes, sweep=old["sweep"], machine=old["machine"])
        print(markdown_table(summary_rows(old["groups"])))
        return
    settings = Settings(d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, head_dim=FLAGS.head_dim,
                        d_ff=FLAGS.d_ff, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                        learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                        eval_every=FLAGS.eval_every, eval_batches=FLAGS.eval_batches,
                        residual_blocks=FLAGS.residual_blocks, dtype=FLAGS.dtype)
    depths = [int(d) for d in FLAGS.depths]
    seeds = [int(s) for s in FLAGS.seeds]
    start = time.time()
    groups = run_sweep(settings, FLAGS.variants, depths, seeds, workdir=FLAGS.workdir, isolate=FLAGS.isolate,
                       reuse=FLAGS.reuse)
    write_outputs(groups, FLAGS.out, notes=notes,
                  sweep={"variants": FLAGS.variants, "depths": depths, "seeds": seeds,
                         "isolate": FLAGS.isolate, "sweep_wall_seconds": time.time() - start})
    print(markdown_table(summary_rows(groups)))


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)  # keep orbax's per-save INFO lines out of the log
    app.run(main)
