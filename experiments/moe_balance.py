"""MoE load-balancing comparison: the same small MoE LM trained with every balancing method.

  python -m experiments.moe_balance --steps=600 --seeds=0,1,2
  python -m experiments.moe_balance --methods=quantile_exact,aux_loss --steps=50 --seeds=0 \
      --workdir_root=/tmp/moe_balance_smoke --out=/tmp/moe_balance_smoke   # smoke (fresh dirs)
  # one H200, the whole table in one call (attention-only MoE LM, see configs/moe_balance_gpu.py):
  python -m experiments.moe_balance --config=experiments/configs/moe_balance_gpu.py --num_experts=32 \
      --top_k=4 --steps=300 --time_budget_s=380 --out=$OUT/results --workdir_root=/tmp/moe_balance_runs
  # two H200s in one call: one process per GPU on disjoint --methods (6 + 5), then one merged table:
  C="--config=experiments/configs/moe_balance_gpu.py --num_experts=32 --top_k=4 --steps=300 --seeds=0,1,2 \
     --time_budget_s=520"
  CUDA_VISIBLE_DEVICES=0 python -m experiments.moe_balance $C --out=$OUT/gpu0 --name=moe_balance_gpu0 \
      --methods=quantile_exact,quantile_histogram,quantile_histogram_2pass,quantile_exact_ema0.9,loss_free,none \
      --workdir_root=/tmp/mb0 --compilation_cache_dir=/tmp/jax_cache0 > $OUT/gpu0.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python -m experiments.moe_balance $C --out=$OUT/gpu1 --name=moe_balance_gpu1 \
      --methods=aux_loss,seq_aux_loss,quantile_threshold,capacity_1.0_aux,capacity_1.25_aux \
      --workdir_root=/tmp/mb1 --compilation_cache_dir=/tmp/jax_cache1 > $OUT/gpu1.log 2>&1 &
  wait
  python -m experiments.moe_balance --merge=$OUT/gpu0/moe_balance_gpu0.json,$OUT/gpu1/moe_balance_gpu1.json \
      --out=$OUT/results --name=moe_balance_h200x2
  # re-runs and missing seeds later: one --merge with --merge_later_wins (a later file's (method, seed)
  # replaces the earlier row; the .md lists what was replaced). The committed table,
  # experiments/results/moe_balance_h200.md, is such a merge of the files in moe_balance_h200_runs/.

Methods (ANCHORS.md §2): none, Switch aux loss, DeepSeek-V3 sequence-wise aux loss, DeepSeek
loss-free bias (its gamma = 1e-3, and 1e-2 as "loss_free_1e-2"), Quantile Balancing (exact and histogram quantile), the seed article's literal
same-step threshold diversion, and capacity factor 1.0 / 1.25 (with the Switch aux loss); plus three QB
diagnostics from experiments/results/qb_convergence.md: "quantile_histogram_2pass" (a second
histogram inside the quantile's bin, bins² resolution, against the 1000-bin stall at MaxVio 0.2-0.5),
"quantile_exact_ema0.9" (EMA 0.9 of the bias: its MaxVio_global separates batch-to-batch content
shift, which EMA averages out, from router drift, which EMA lags) and "quantile_exact_iter4" (four dual
steps per training step instead of one: the remedy qb_convergence.md measured against drift, 0.43 ->
0.24 on its synthetic router). `--methods` takes any subset, so
separate processes (one per GPU) can split the table and `--merge` joins their JSONs.

Per run it reads `<workdir>/metrics.jsonl` (written by `k3jax.train.trainer.train`) and reports:
final validation loss, MaxVio_batch (mean over MoE layers; its mean after warm-up and its curve),
MaxVio_global on the validation slice, CV of the load, dropped %, dead experts, diverted % (seed
method) and tokens/s. Writes `<out>/moe_balance_<date>.json`, `.md` (table: mean ± std over seeds) and
`.png` (MaxVio_batch vs step per method) with the device and versions. The three files are rewritten
after EVERY run, so a run cut short keeps the finished rows.

Runs go seed-major (seed 0 of every method, then seed 1, ...), so a cut keeps every method. Seeds 1, 2
of a method reuse seed 0's executables IN MEMORY, with no re-trace and no compile request: the jitted
train step (`nnx.jit`) keys its cache on the graph definition of (model, optimizer), which is equal
across seeds for the model but was not for the optimizer, whose static `tx` is a fresh optax object
(closures compare by identity) per `make_optimizer` call, so every run re-traced the step and only a
persistent-cache hit on a bit-identical HLO could save the compile (on CPU it did; the H200 run never
reached a seed 1). `k3jax.train.optimizer.make_optimizer` is now cached on the frozen `TrainConfig`, so
every run with the same TrainConfig gets the same optax object. Each row records compile requests, persistent-cache hits and backend compile seconds.
`--time_budget_s` stops starting new runs once the elapsed time plus the expected length of the next
run (the last run of that method minus its compile seconds, or the slowest first run so far) would
pass the budget.
"""
from __future__ import annotations

import datetime
import dataclasses
import json
import os
import platform
import time

import jax
import numpy as np
from absl import app, flags, logging

from experiments.harness import CompileCounter, enable_compilation_cache, grouped_matmul_in_use
import k3jax.train.trainer as trainer_lib
from experiments.configs.common import define_config_file
from experiments.qb_convergence import binomial_floor
from k3jax.train.config import RunConfig, run_config_from_dict
from k3jax.train.metrics import read_metrics

METHODS: dict[str, dict] = {
    "none": {"balancing": {"method": "none"}},
    "aux_loss": {"balancing": {"method": "aux_loss"}},
    "seq_aux_loss": {"balancing": {"method": "seq_aux_loss"}},
    "loss_free": {"balancing": {"method": "loss_free"}},
    "loss_free_1e-2": {"balancing": {"method": "loss_free", "gamma": 1e-2}},
    "quantile_exact": {"balancing": {"method": "quantile", "quantile_estimator": "exact"}},
    "quantile_histogram": {"balancing": {"method": "quantile", "quantile_estimator": "histogram"}},
    "quantile_histogram_2pass": {"balancing": {"method": "quantile", "quantile_estimator": "histogram",
                                               "histogram_passes": 2}},
    "quantile_exact_ema0.9": {"balancing": {"method": "quantile", "quantile_estimator": "exact", "ema": 0.9}},
    "quantile_exact_iter4": {"balancing": {"method": "quantile", "quantile_estimator": "exact",
                                           "quantile_iterations": 4}},
    "quantile_threshold": {"balancing": {"method": "quantile_threshold"}},
    "capacity_1.0_aux": {"balancing": {"method": "aux_loss"}, "capacity_factor": 1.0},
    "capacity_1.25_aux": {"balancing": {"method": "aux_loss"}, "capacity_factor": 1.25},
}
STATS = ("max_vio", "cv", "dropped_fraction", "dead_experts", "diverted_fraction", "entropy")


def _define_flags():
    """Command-line flags, defined only when run as a script (importing this module from a test next to
    other experiment modules then defines no absl flags that could collide, e.g. --seeds, --out)."""
    global _CONFIG, _METHODS, _SEEDS, _STEPS, _EXPERTS, _TOP_K, _WARMUP, _ROOT, _OUT, _ORDER, _BUDGET, _MERGE, _NAME
    global _CACHE_DIR, _MERGE_LATER_WINS
    _CONFIG = define_config_file("config", "experiments/configs/k3_tiny.py", "Base run config.")
    _METHODS = flags.DEFINE_list("methods", list(METHODS), "Methods to run (keys of METHODS).")
    _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
    _STEPS = flags.DEFINE_integer("steps", 600, "Training steps per run.")
    _EXPERTS = flags.DEFINE_integer("num_experts", 16, "Routed experts E.")
    _TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token k.")
    _WARMUP = flags.DEFINE_float("warmup_frac", 0.25, "MaxVio_batch is averaged over steps after this fraction.")
    _ROOT = flags.DEFINE_string("workdir_root", "runs/moe_balance", "Run directories: <root>/<method>/seed<s>; "
                                "must not hold runs of this plan yet (the trainer would resume them).")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_moe_balance", "Where the JSON/markdown/plot go (the "
                                     "committed table: --out=experiments/results --name=moe_balance_h200).")
    _ORDER = flags.DEFINE_enum("order", "seed_major", ["seed_major", "method_major"],
                               "seed_major: seed 0 of every method first (a cut keeps every method).")
    _BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Stop starting runs that would end past this many "
                                 "seconds of wall clock since start (0 = no budget).")
    _MERGE = flags.DEFINE_list("merge", [], "Result JSONs of separate processes: write ONE merged json/md/png "
                               "to <out>/<name>.* and train nothing.")
    _MERGE_LATER_WINS = flags.DEFINE_bool("merge_later_wins", False, "With --merge: a (method, seed) in "
                                          "several files keeps the last file's row (a re-run) instead of raising.")
    _NAME = flags.DEFINE_string("name", "", "Output file stem under --out ('' = moe_balance_<date>).")
    _CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", "/tmp/k3jax_jax_cache",
                                     "JAX persistent compilation cache ('' = off).")


def run_order(methods: list[str], seeds: list[int], order: str) -> list[tuple[str, int]]:
    """(method, seed) pairs in run order: "seed_major" = every method's seed 0 first, "method_major"."""
    if order == "seed_major":
        return [(m, s) for s in seeds for m in methods]
    return [(m, s) for m in methods for s in seeds]


def used_workdirs(workdir_root: str, plan: list[tuple[str, int]]) -> list[str]:
    """The run directories ``<workdir_root>/<method>/seed<seed>`` of ``plan`` that exist and are not empty
    (``k3jax.train.trainer.train`` would resume from their checkpoints instead of training afresh)."""
    dirs = [os.path.join(workdir_root, method, f"seed{seed}") for method, seed in plan]
    return [d for d in dirs if os.path.isdir(d) and os.listdir(d)]


def expected_run_seconds(method: str, walls: dict[str, list[float]],
                         repeat_walls: dict[str, list[float]] | None = None) -> float:
    """Expected wall seconds of the next run of `method`: the last entry of `repeat_walls[method]`
    when given (a run's wall minus its backend compile seconds: later seeds reuse the executables),
    else its last run in `walls`, else the slowest run so far (a first run compiles), else 0."""
    if repeat_walls and repeat_walls.get(method):
        return repeat_walls[method][-1]
    if walls.get(method):
        return walls[method][-1]
    return max((w for ws in walls.values() for w in ws), default=0.0)


def run_config(base: dict, method: str, seed: int, *, num_experts: int, top_k: int, steps: int,
               workdir_root: str) -> RunConfig:
    """The RunConfig of one (method, seed) run: `base` (a plain config dict) with the MoE FFN of E =
    `num_experts`, top-`top_k`, the method's settings (`METHODS[method]`), `steps` steps with one eval
    and one checkpoint at the end, and workdir `<workdir_root>/<method>/seed<seed>`.

    Raises:
      ValueError: unknown `method`, or a field the config classes reject.
    """
    if method not in METHODS:
        raise ValueError(f"method: unknown {method!r}; choose from {sorted(METHODS)}")
    d = json.loads(json.dumps(base))  # deep copy of plain data
    d["model"]["ffn"] = "moe"
    # model.moe: E, k and the method's settings; its balancing replaces the base config's (whole).
    d["model"].setdefault("moe", {}).update(num_experts=num_experts, top_k=top_k, **METHODS[method])
    d["train"].update(steps=steps, eval_every=steps, checkpoint_every=steps, log_every=max(1, min(10, steps // 20)),
                      sample_tokens=0)
    d["train"]["warmup_steps"] = min(d["train"].get("warmup_steps", 0), max(steps // 10, 1))
    d["seed"] = seed
    d["workdir"] = os.path.join(workdir_root, method, f"seed{seed}")
    return run_config_from_dict(d)


def sampling_floor(base: dict, num_experts: int, top_k: int) -> dict:
    """MaxVio_batch of a perfect bias at the run's batch: every (token, slot) of the ``batch_size x
    seq_len`` tokens of a training step lands on each expert with probability 1/E, independently
    (``qb_convergence.binomial_floor``). A balancer cannot beat this floor at that batch size."""
    tokens = int(base["data"]["batch_size"]) * int(base["data"]["seq_len"])
    return {"tokens_per_batch": tokens, "max_vio": binomial_floor(tokens, num_experts, top_k)}


def _layer_mean(row: dict, stat: str) -> float | None:
    values = [v for k, v in row.items() if k.startswith("moe/") and k.endswith("/" + stat)]
    return float(np.mean(values)) if values else None


def _summarise(workdir: str, summary: dict) -> dict:
    rows = read_metrics(workdir)
    train_rows = [r for r in rows if _layer_mean(r, "max_vio") is not None]
    steps = np.array([r["step"] for r in train_rows])
    after = steps > _WARMUP.value * _STEPS.value
    out = {"curve_steps": steps.tolist(), "max_vio_curve": [_layer_mean(r, "max_vio") for r in train_rows],
           "curves": {stat: [_layer_mean(r, stat) for r in train_rows] for stat in STATS}}
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


_SAME_IN_MERGE = ("steps", "num_experts", "top_k", "warmup_frac", "jax")


_MISSING = object()


def _field_defaults() -> dict[str, object]:
    """Dotted base-config key -> the dataclass default of that field (data.*, model.*, train.*)."""
    from k3jax.models.config import ModelConfig
    from k3jax.train.config import DataConfig, TrainConfig
    out = {}

    def flatten(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for section, cls in (("data", DataConfig), ("model", ModelConfig), ("train", TrainConfig)):
        flatten(section, dataclasses.asdict(cls()))  # nested sub-configs: model.moe.balancing.method, ...
    return out


def _config_differences(a, b, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """Dotted keys where two (nested) base-config dicts differ. A key missing on one side counts,
    unless the other side holds that field's dataclass default (a field added to the config after
    the older file was written, e.g. model.moe.balancing.quantile_iterations = 1: the same run)."""
    defaults = _field_defaults() if defaults is None else defaults
    if a is _MISSING or b is _MISSING:
        present = b if a is _MISSING else a
        if isinstance(present, dict):  # a whole section missing on one side: compare its fields
            return [d for key, value in present.items() for d in _config_differences(
                *((_MISSING, value) if a is _MISSING else (value, _MISSING)), f"{prefix}.{key}", defaults)]
        same = prefix in defaults and _jsonable(defaults[prefix]) == present
        return [] if same else [prefix]
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [] if a == b else [prefix or "base_config"]
    out = []
    for key in dict.fromkeys([*a, *b]):
        out += _config_differences(a.get(key, _MISSING), b.get(key, _MISSING),
                                   f"{prefix}.{key}" if prefix else str(key), defaults)
    return out


def _jsonable(x):
    """x as it reads back from a result JSON (tuples become lists)."""
    return json.loads(json.dumps(x, default=str))


def _process_line(p: dict) -> str:
    return (f"{p.get('file', '?')}: {p.get('device', '?')}, CUDA_VISIBLE_DEVICES={p.get('cuda_visible_devices')}, "
            f"pid {p.get('pid', '?')}, methods {','.join(p.get('methods', []))}, "
            f"{p.get('elapsed_s', float('nan')):.0f} s elapsed, grouped matmul {p.get('grouped_matmul', '?')}")


def merge_results(paths: list[str], later_wins: bool = False) -> tuple[dict[str, list[dict]], dict]:
    """One (results, meta) from result JSONs written by separate processes of this script.

    Rows are concatenated per method (methods in first-seen order, each method's rows sorted by seed);
    meta is the first file's, with `device` = the distinct devices joined by " + ", `seeds` = the union,
    `skipped` = the union minus the (method, seed) pairs some file ran, `elapsed_s` = the longest
    process, `processes` = one entry per file (file, device, CUDA_VISIBLE_DEVICES, pid, methods,
    elapsed, grouped matmul) and `merged_from` = `paths`. With `later_wins`, a (method, seed) run by
    several files keeps the LAST file's row (a re-run, e.g. after a fix) and `meta["replaced"]` lists
    [method, seed, the file whose row won].

    Raises:
      ValueError: fewer than 2 paths; a file without "meta"/"results"; files that disagree on
        steps, num_experts, top_k, warmup_frac, jax version or the base run config (--config and its
        overrides: the model, data and training the methods are compared on); a (method, seed) present
        in two files (unless `later_wins`).
    """
    if len(paths) < 2:
        raise ValueError(f"merge needs at least 2 result files; got {paths=}")
    loaded = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict) or "meta" not in d or "results" not in d:
            raise ValueError(f"{path=}: not a moe_balance result file (needs 'meta' and 'results')")
        loaded.append((path, d["meta"], d["results"]))
    first_path, first_meta, _ = loaded[0]
    for path, m, _ in loaded[1:]:
        for key in _SAME_IN_MERGE:
            if m.get(key) != first_meta.get(key):
                raise ValueError(f"{path=}: {key}={m.get(key)!r} differs from {first_path}'s {first_meta.get(key)!r}")
        diff = _config_differences(m.get("base_config"), first_meta.get("base_config"))
        if diff:
            raise ValueError(f"{path=}: base_config differs from {first_path}'s at {', '.join(diff[:8])}"
                             f"{' ...' if len(diff) > 8 else ''} (runs of different --config cannot share a table)")
    results: dict[str, list[dict]] = {}
    ran: set[tuple[str, int]] = set()
    processes, skipped, devices = [], [], []
    replaced = []
    for path, m, res in loaded:
        for method, runs in res.items():
            for r in runs:
                if (method, r["seed"]) in ran:
                    if not later_wins:
                        raise ValueError(f"{path=}: {method} seed {r['seed']} is also in another file")
                    results[method] = [x for x in results[method] if x["seed"] != r["seed"]]
                    replaced.append([method, r["seed"], path])
                ran.add((method, r["seed"]))
                results.setdefault(method, []).append(r)
        skipped += [tuple(x) for x in m.get("skipped", [])]
        if m["device"] not in devices:
            devices.append(m["device"])
        processes += [dict(p, file=p.get("file", path)) for p in m["processes"]] if "processes" in m else [
            {"file": path, "device": m["device"], "cuda_visible_devices": m.get("cuda_visible_devices"),
             "pid": m.get("pid"), "methods": m.get("methods", list(res)), "elapsed_s": m.get("elapsed_s", float("nan")),
             "grouped_matmul": m.get("grouped_matmul")}]
    for runs in results.values():
        runs.sort(key=lambda r: r["seed"])
    meta = dict(first_meta)
    meta.update(device=" + ".join(devices), processes=processes, merged_from=list(paths),
                seeds=sorted({s for _, m, _ in loaded for s in m["seeds"]}, key=int),
                skipped=[list(x) for x in dict.fromkeys(skipped) if (x[0], x[1]) not in ran],
                elapsed_s=max(m.get("elapsed_s", 0.0) for _, m, _ in loaded),
                grouped_matmul=" + ".join(dict.fromkeys(str(m.get("grouped_matmul")) for _, m, _ in loaded)))
    if replaced:
        meta["replaced"] = replaced
    return results, meta


def write_results(results: dict[str, list[dict]], meta: dict, stem: str) -> None:
    """Write `<stem>.json` ({"meta", "results"}), `.md` (table: mean ± std over seeds; with
    `meta["processes"]`, one header line per process) and `.png` (MaxVio_batch vs step per method)."""
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    where = meta["device"]
    if meta.get("processes"):  # each process saw its own device(s): say how many and which
        visible = " / ".join(dict.fromkeys(str(p.get("cuda_visible_devices")) for p in meta["processes"]))
        where = f"{len(meta['processes'])} processes on {where}, CUDA_VISIBLE_DEVICES {visible}"
    lines = [f"# MoE balancing comparison ({meta['date']}, {where}, jax {meta.get('jax', jax.__version__)})", "",
             f"E = {meta['num_experts']}, top-{meta['top_k']}, {meta['steps']} steps, seeds requested "
             f"{','.join(meta['seeds'])} (the seeds column counts those that ran); MaxVio_batch / CV / drop / dead / diverted averaged over MoE layers "
             f"and over logged steps after {meta['warmup_frac']:.0%} of training; MaxVio_global on the "
             "validation slice at the end. Compile s = backend compile seconds of the method's runs (seeds "
             f"after the first reuse its executables in memory). MoE grouped matmul: {meta.get('grouped_matmul', '?')}.", "",
             "| method | seeds | val loss (nats) | MaxVio_batch | MaxVio_global | CV | drop % | dead experts "
             "| diverted % | tokens/s | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    if meta.get("processes"):
        lines[2:2] = [f"Merged from {len(meta['processes'])} processes (rows concatenated; elapsed = the longest):", "",
                      *[f"- {_process_line(p)}" for p in meta["processes"]], ""]
    if meta.get("replaced"):  # --merge_later_wins: which earlier rows a re-run replaced
        lines[2:2] = ["Rows replaced by a later file (--merge_later_wins): " + "; ".join(
            f"{m} seed {sd} by {os.path.basename(f)}" for m, sd, f in meta["replaced"]) + ".", ""]
    for method, runs in results.items():
        col = lambda k: [r[k] for r in runs]  # noqa: E731
        lines.append(
            f"| {method} | {len(runs)} | {_fmt(col('val_loss'), digits=4)} | {_fmt(col('max_vio_after_warmup'))} | "
            f"{_fmt(col('max_vio_global'))} | {_fmt(col('cv_after_warmup'))} | "
            f"{_fmt(col('dropped_fraction_after_warmup'), 100, 2)} | "
            f"{_fmt(col('dead_experts_after_warmup'), digits=2)} | "
            f"{_fmt(col('diverted_fraction_after_warmup'), 100, 2)} | {_fmt(col('tokens_per_s'), digits=0)} | "
            f"{' / '.join(f'{r["compile"]["backend_compile_s"]:.1f}' for r in runs)} |")
    floor = meta.get("sampling_floor")
    if floor:
        lines += ["", f"Sampling floor of MaxVio_batch (a perfect bias, iid routing at the run's "
                  f"{floor['tokens_per_batch']} tokens per batch, qb_convergence's method): {floor['max_vio']:.3f}."]
    if meta.get("skipped"):
        lines += ["", f"Not run (time budget {meta['time_budget_s']:.0f} s): "
                  + ", ".join(f"{m} seed {s}" for m, s in meta["skipped"])]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")

    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, runs in results.items():
        curves = np.array([r["max_vio_curve"] for r in runs], np.float64)
        ax.plot(runs[0]["curve_steps"], curves.mean(0), label=f"{method} ({len(runs)} seeds)")
    if floor:
        ax.axhline(floor["max_vio"], color="k", ls="--", lw=1,
                   label=f"sampling floor of a perfect bias ({floor['max_vio']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio_batch (mean over MoE layers and seeds)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"MoE balancing, E={meta['num_experts']} top-{meta['top_k']} ({where})", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    t_start = time.time()
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    if _MERGE.value:
        results, meta = merge_results(list(_MERGE.value), later_wins=_MERGE_LATER_WINS.value)
        os.makedirs(_OUT.value, exist_ok=True)
        stem = os.path.join(_OUT.value, _NAME.value or f"moe_balance_{meta['date']}")
        if any(os.path.abspath(stem + ".json") == os.path.abspath(p) for p in _MERGE.value):
            raise ValueError(f"--out/--name: {stem}.json is one of the --merge inputs; choose another --name")
        write_results(results, meta, stem)
        with open(stem + ".md") as f:
            print(f.read())
        print(f"wrote {stem}.json/.md/.png")
        return
    unknown = sorted(set(_METHODS.value) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    if _CACHE_DIR.value:
        enable_compilation_cache(_CACHE_DIR.value)
    counter = CompileCounter()
    base = _CONFIG.value.to_dict()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    device = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.node()})"
    meta = {"date": stamp, "device": device, "jax": jax.__version__, "steps": _STEPS.value,
            "num_experts": _EXPERTS.value, "top_k": _TOP_K.value, "seeds": _SEEDS.value,
            "warmup_frac": _WARMUP.value, "order": _ORDER.value, "time_budget_s": _BUDGET.value,
            "compilation_cache_dir": _CACHE_DIR.value, "grouped_matmul": grouped_matmul_in_use(),
            "skipped": [], "methods": list(_METHODS.value), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "base_config": base,
            "sampling_floor": sampling_floor(base, _EXPERTS.value, _TOP_K.value)}
    plan = run_order(list(_METHODS.value), [int(s) for s in _SEEDS.value], _ORDER.value)
    used = used_workdirs(_ROOT.value, plan)
    if used:  # the trainer would RESUME those runs (from another --steps/--config) and report stale metrics
        raise ValueError(f"--workdir_root={_ROOT.value!r} already holds runs ({', '.join(used[:3])}"
                         f"{' ...' if len(used) > 3 else ''}); pass a fresh --workdir_root or remove them")
    os.makedirs(_OUT.value, exist_ok=True)
    stem = os.path.join(_OUT.value, _NAME.value or f"moe_balance_{stamp}")
    results: dict[str, list[dict]] = {}
    walls: dict[str, list[float]] = {}
    repeat_walls: dict[str, list[float]] = {}
    for method, seed in plan:
        elapsed = time.time() - t_start
        expected = expected_run_seconds(method, walls, repeat_walls)
        if _BUDGET.value and elapsed + expected > _BUDGET.value:
            meta["skipped"].append((method, seed))
            print(f"skip {method} seed {seed}: {elapsed:.0f} s elapsed + {expected:.0f} s expected > budget "
                  f"{_BUDGET.value:.0f} s", flush=True)
            continue
        cfg = run_config(base, method, seed, num_experts=_EXPERTS.value, top_k=_TOP_K.value, steps=_STEPS.value,
                         workdir_root=_ROOT.value)
        counter.reset()
        t_run = time.time()
        summary = trainer_lib.train(cfg, show_progress=False)
        wall = time.time() - t_run
        walls.setdefault(method, []).append(wall)
        res = _summarise(cfg.workdir, summary)
        res.update(seed=seed, wall_s=wall, compile=counter.reset())
        repeat_walls.setdefault(method, []).append(wall - res["compile"]["backend_compile_s"])
        results.setdefault(method, []).append(res)
        meta["elapsed_s"] = time.time() - t_start
        write_results(results, meta, stem)
        print(f"{method} seed {seed}: val loss {res['val_loss']:.4f}, MaxVio_batch "
              f"{res['max_vio_after_warmup']:.3f}, MaxVio_global {res['max_vio_global']}, {wall:.1f} s "
              f"(compile {res['compile']['backend_compile_s']:.1f} s, cache hits {res['compile']['cache_hits']}"
              f"/{res['compile']['compile_requests']}); {meta['elapsed_s']:.0f} s elapsed", flush=True)
    meta["elapsed_s"] = time.time() - t_start
    write_results(results, meta, stem)
    with open(stem + ".md") as f:
        print(f.read())
    print(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
