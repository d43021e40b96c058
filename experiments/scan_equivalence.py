"""Scanned vs unrolled layers over a whole training run: does the loss after N steps stay within seed noise?

  python -m experiments.scan_equivalence --out=experiments/results/scan_equivalence_cpu
  python -m experiments.scan_equivalence --tiny --out=/tmp/scan_equivalence       # smoke (~2 min on CPU)

Issue 26's last target: the model with `model.scan_layers=True` (one `lax.scan` over the repeats of the
mixer pattern, remat "full", as bench_train's 1b rows run) trains to the same loss as the unrolled stack.
The unit tests hold one step to fp32 rounding; here the two layouts train side by side for `--steps`
steps from the same seed (same initial parameters, same batches), so their only difference is the order
of floating-point operations, compounded over the run. The noise it is compared with is the spread of
the same run over seeds.

Model: `experiments/configs/k3_tiny.py` (the `make train` hybrid: "KKKA" KDA / attention, MoE, bf16 here)
with 8 layers, so that the scan has two repeats to run, for bench_train's two rows: like_for_like (PreNorm,
Switch aux loss 0.01) and k3_default (Block AttnRes, exact Quantile Balancing: the scan carries the AttnRes
source buffer). Per run: the validation loss after the last step (the trainer's eval, the same validation
batches for every run) and the mean training loss of the last `--tail` logged steps. Per row: each layout's
mean and standard deviation over seeds, the paired differences (scanned − unrolled, same seed), their mean
± its standard error, and the verdict "within noise": the mean paired difference is smaller in size than
the seed noise, the standard deviation over seeds pooled over both layouts (a systematic gap from
scanning would exceed the spread that the seed alone causes; with 3 seeds one layout's own spread can
come out several times too small by chance). Single paired differences can exceed it: the two layouts'
trajectories part after a few steps, so each pair differs about as much as two runs with different
rounding noise.
Writes <out>.json / <out>.md.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile

from absl import app, flags

from experiments.harness import environment, environment_line, markdown_table, write_results

LAYOUTS = {"unrolled": dict(scan_layers=False, remat="none"), "scanned": dict(scan_layers=True, remat="full")}
_ROWS = flags.DEFINE_list("rows", ["like_for_like", "k3_default"], "bench_train rows to train.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (initial parameters and data order).")
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps per run.")
_LAYERS = flags.DEFINE_integer("num_layers", 8, "Layers (a multiple of the 4-layer pattern).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step (256 tokens each).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype.")
_TAIL = flags.DEFINE_integer("tail", 5, "Logged steps averaged into the final training loss.")
_TINY = flags.DEFINE_bool("tiny", False, "Smoke run: 2 seeds, 6 steps, batch 2, sequences of 64.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for the runs (default: a temporary one).")
_OUT = flags.DEFINE_string("out", "/tmp/k3jax_scan_equivalence/scan_equivalence", "Output prefix (<out>.json, <out>.md).")
_FROM_JSON = flags.DEFINE_list("from_json", [], "Re-summarise the runs of these earlier <out>.json files (no "
                                "training; same shape and dtype): seeds run in separate calls merge this way.")


def run_config(row: str, layout: str, seed: int, *, steps: int, num_layers: int, batch_size: int, seq_len: int,
               dtype: str, workdir: str):
    """The RunConfig of one run: k3_tiny with the row's residual scheme and balancing and the layout."""
    from experiments.bench_train import VARIANTS, merged  # noqa: PLC0415
    from experiments.configs import k3_tiny  # noqa: PLC0415
    from k3jax.train.config import run_config_from_dict  # noqa: PLC0415
    if row not in VARIANTS:
        raise ValueError(f"row must be one of {sorted(VARIANTS)}, got {row=}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout=}")
    base = k3_tiny.get_config().to_dict()
    model = merged(merged(base["model"], VARIANTS[row]),
                   dict(num_layers=num_layers, dtype=dtype, **LAYOUTS[layout]))
    train = dict(base["train"], steps=steps, warmup_steps=max(1, steps // 10), eval_every=steps,
                 checkpoint_every=steps, log_every=1, sample_tokens=0)
    data = dict(base["data"], batch_size=batch_size, seq_len=seq_len)
    return run_config_from_dict(dict(model=model, data=data, train=train, seed=seed,
                                     workdir=os.path.join(workdir, f"{row}_{layout}_seed{seed}")))


def final_losses(workdir: str, tail: int) -> dict:
    """(validation loss at the last eval, mean training loss of the last `tail` logged steps) of a run."""
    from k3jax.train.metrics import read_metrics  # noqa: PLC0415
    rows = read_metrics(workdir)
    train = [r["loss"] for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    if not train or not val:
        raise ValueError(f"{workdir}: no training or validation loss logged")
    return dict(val_loss=val[-1], train_loss=statistics.fmean(train[-tail:]))


def summarize(runs: list[dict]) -> list[dict]:
    """Per row and metric: each layout's mean / std over seeds, the paired differences, their mean and its
    standard error, and the verdict (module docstring)."""
    out = []
    for row in dict.fromkeys(r["row"] for r in runs):
        for metric in ("val_loss", "train_loss"):
            by = {lay: {r["seed"]: r[metric] for r in runs if r["row"] == row and r["layout"] == lay}
                  for lay in LAYOUTS}
            seeds = sorted(set(by["unrolled"]) & set(by["scanned"]))
            if len(seeds) < 2:
                raise ValueError(f"row {row}: need >= 2 seeds with both layouts, got {seeds}")
            diffs = [by["scanned"][s] - by["unrolled"][s] for s in seeds]
            noise = ((statistics.variance(by["unrolled"][s] for s in seeds)
                      + statistics.variance(by["scanned"][s] for s in seeds)) / 2) ** 0.5
            mean_diff = statistics.fmean(diffs)
            out.append(dict(row=row, metric=metric, seeds=seeds, seed_noise=noise,
                            unrolled_mean=statistics.fmean(by["unrolled"][s] for s in seeds),
                            unrolled_std=statistics.stdev(by["unrolled"][s] for s in seeds),
                            scanned_mean=statistics.fmean(by["scanned"][s] for s in seeds),
                            scanned_std=statistics.stdev(by["scanned"][s] for s in seeds),
                            paired_diffs=diffs, mean_diff=mean_diff,
                            mean_diff_se=statistics.stdev(diffs) / len(diffs) ** 0.5,
                            within_noise=abs(mean_diff) < noise))
    return out


def render(result: dict) -> str:
    """The markdown page of a result (`environment`, `shape`, `dtype`, `seeds`, `tiny`, `rows`)."""
    shape = result["shape"]
    lines = ["# Scanned vs unrolled layers over a training run (issue 26)", "",
             environment_line(result["environment"]), "",
             f"`python -m experiments.scan_equivalence{' --tiny' if result['tiny'] else ''}`: k3_tiny with "
             f"{shape['num_layers']} layers, {result['dtype']}, {shape['batch_size']} x {shape['seq_len']} tokens per "
             f"step, {shape['steps']} steps, seeds {result['seeds']}; scanned = `scan_layers=True, remat=\"full\"`. "
             f"diff = scanned − unrolled at the same seed (nats); seed noise = the standard deviation over seeds, "
             f"pooled over both layouts; within noise = |mean diff| < seed noise.", "",
             *markdown_table(["row", "loss", "seeds", "unrolled mean ± std", "scanned mean ± std", "paired diffs",
                              "mean diff ± s.e.", "seed noise", "within noise"],
                             [[r["row"], r["metric"], len(r["seeds"]),
                               f"{r['unrolled_mean']:.4f} ± {r['unrolled_std']:.4f}",
                               f"{r['scanned_mean']:.4f} ± {r['scanned_std']:.4f}",
                               ", ".join(f"{d:+.4f}" for d in r["paired_diffs"]),
                               f"{r['mean_diff']:+.4f} ± {r['mean_diff_se']:.4f}", f"{r['seed_noise']:.4f}",
                               "yes" if r["within_noise"] else "**no**"]
                              for r in result["rows"]]), ""]
    return "\n".join(lines)


def main(argv):
    del argv
    if _FROM_JSON.value:  # re-summarise the runs of earlier results (the first one's environment and shape)
        results = []
        for path in _FROM_JSON.value:
            with open(path) as f:
                results.append(json.load(f))
        result = results[0]
        if any((r["shape"], r["dtype"]) != (result["shape"], result["dtype"]) for r in results):
            raise ValueError(f"--from_json results differ in shape or dtype: {_FROM_JSON.value}")
        result["runs"] = [run for r in results for run in r["runs"]]
        result["rows"] = summarize(result["runs"])
        result["seeds"] = sorted({r["seed"] for r in result["runs"]})
        result.setdefault("tiny", result["shape"]["steps"] < 10)
    else:
        result = run_all()
    md = render(result)
    write_results(_OUT.value, result, md)
    print(md)


def run_all() -> dict:
    """Train every (row, seed, layout) of the flags in this process; the result dict `render` reads."""
    from k3jax.train.trainer import train  # noqa: PLC0415
    tiny = _TINY.value
    seeds = [0, 1] if tiny else [int(s) for s in _SEEDS.value]
    shape = dict(steps=6, num_layers=_LAYERS.value, batch_size=2, seq_len=64) if tiny else dict(
        steps=_STEPS.value, num_layers=_LAYERS.value, batch_size=_BATCH.value, seq_len=256)
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="scan_equivalence_")
    runs = []
    for row in _ROWS.value:
        for seed in seeds:
            for layout in LAYOUTS:
                cfg = run_config(row, layout, seed, dtype=_DTYPE.value, workdir=workdir, **shape)
                summary = train(cfg, show_progress=False)
                runs.append(dict(row=row, layout=layout, seed=seed, wall_s=summary["wall_seconds"],
                                 **final_losses(cfg.workdir, _TAIL.value)))
                print(runs[-1], flush=True)
    return dict(environment=environment(), shape=shape, dtype=_DTYPE.value, seeds=seeds, tiny=tiny, runs=runs,
                rows=summarize(runs))


if __name__ == "__main__":
    app.run(main)
