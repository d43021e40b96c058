"""Residual schemes over depth: PreNorm vs Block / Full Attention Residuals vs the article-literal variant.

Issue 6's experiment (ANCHORS.md §3). Deep-narrow byte LMs on the default corpus ("python-stdlib"), one
run per (variant, depth, seed); every variant trained with seed s sees the SAME token stream (the seed
fixes both the parameter init and grain's shuffle, so variants differ only in the residual scheme).

  python -m experiments.depth_residuals     # the CPU sweep committed in results/ (16 and 6 layers, 150 steps)
  # the extra CPU sweeps (their tables are copied into results/depth_residuals.md, one page for the CPU study;
  # their JSONs are results/depth_residuals_L32.json, _prenorm_1p25x.json, _prenorm_1p5x.json):
  python -m experiments.depth_residuals --variants=prenorm,block_attnres --depths=32 \
      --workdir=runs/depth_residuals_L32 --out=/tmp/k3jax_depth_residuals/depth_residuals_L32
  python -m experiments.depth_residuals --variants=prenorm --steps=188 \
      --workdir=runs/depth_residuals_1p25x --out=/tmp/k3jax_depth_residuals/depth_residuals_prenorm_1p25x
  python -m experiments.depth_residuals --variants=prenorm --steps=225 \
      --workdir=runs/depth_residuals_1p5x --out=/tmp/k3jax_depth_residuals/depth_residuals_prenorm_1p5x
  python -m experiments.depth_residuals --depths=24 --d_model=512 --num_heads=8 --head_dim=64 --d_ff=1536 \
      --seq_len=1024 --batch_size=16 --steps=300 --dtype=bfloat16 --token_multipliers=1.25,1.5 --scan_layers \
      --remat=full --parallel=4 --split_seeds --timing_steps=40   # issue 27 on one H100: gpu_checks/depth_gpu.sh
  python -m experiments.depth_residuals --merge=a.json,b.json --out=...   # other seeds or variants, one table

PreNorm at `--token_multipliers` × the steps (same schedule shape, the same warmup) gives the loss-vs-tokens
curve from which each variant's compute-equivalent multiplier is read: per seed, the fit
val_loss = a + b·ln(m) through PreNorm's points, solved for the variant's val loss (beyond the largest
multiplier it is an extrapolation, marked so).

Per run it records the final validation loss (nats/token) and bits/byte, training tokens/s (first step,
which compiles, excluded), the validation curve, peak memory, and depth diagnostics of the trained model
(`LanguageModel.diagnostics` on the first validation batch: per-sublayer input RMS, cosine between
consecutive sublayer inputs, the sublayer x source depth-weight matrix of the AttnRes variants).

With `--parallel=N` up to N isolated workers share the device (each told to preallocate 0.9/N of its memory):
their tokens/s are shares of one device. `--timing_steps=K` then trains each variant alone for K steps, one
after another, and reports those tokens/s (the step-time overhead vs PreNorm); with
`--compilation_cache_dir` they load the sweep's compiled step instead of compiling it again.

Peak memory: each (variant, depth) runs in its own subprocess (`--isolate`, default) that trains its
seeds one after another, so one compile serves all seeds. On CPU we report that process's peak resident
set size (`ru_maxrss`, which includes the Python/JAX runtime and XLA compilation) and, as
`rss_baseline_mib`, the RSS after imports and corpus loading, before any model exists; the difference is
what the model, its optimizer state, activations and its compilation added. On GPU/TPU we report
`memory_stats()["peak_bytes_in_use"]` of device 0 (device memory only). Without `--isolate` the RSS
numbers are of the shared parent process (monotone, not per config).

Outputs: `<out>.json` (all raw numbers, date, machine, versions), `<out>.md` (table + the markdown of
`--notes_file`, by default `<out>_notes.md` when it exists, as the committed page's notes do) and
`<out>_{val_loss,cosine,hidden_rms,depth_weights}.png`. To add notes to a finished sweep without
retraining: `--report_from=<out>.json --notes_file=notes.md`.
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
    flags.DEFINE_list("depths", ["16", "6"], "Transformer layers per model (each = 2 sublayers); issue 27's "
                      "GPU sweep ran 24 and 32 (experiments/gpu_checks/depth_gpu.sh).")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (init + data order); same per variant.")
    flags.DEFINE_integer("d_model", 64, "Hidden size D.")
    flags.DEFINE_integer("num_heads", 4, "Attention heads.")
    flags.DEFINE_integer("head_dim", 16, "Per-head size.")
    flags.DEFINE_integer("d_ff", 192, "SwiGLU hidden size.")
    flags.DEFINE_integer("seq_len", 64, "Tokens per sequence T.")
    flags.DEFINE_integer("batch_size", 8, "Sequences per step B.")
    flags.DEFINE_integer("steps", 150, "Optimizer steps per run.", lower_bound=1)
    flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
    flags.DEFINE_integer("warmup_steps", 15, "Linear warmup steps.")
    flags.DEFINE_integer("eval_every", 25, "Validation cadence (steps); also at the end.")
    flags.DEFINE_integer("eval_batches", 4, "Batches in the fixed validation slice.")
    flags.DEFINE_integer(
        "residual_blocks", 8, "N for block_attnres (sublayer blocks) and article_block (layer blocks); capped at "
        "the number of units of the model.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_bool("scan_layers", False, "model.scan_layers (compile time independent of depth) for every "
                      "variant but article_block, which has no scanned form and stays unrolled. Without --remat it costs memory: at "
                      "32 layers, d 512 the step needed 20.7 GiB (prenorm; 11.1 unrolled), 30.1 (block_attnres), "
                      "> 65 (full_attnres) (results/depth_gpu_h100.md).")
    flags.DEFINE_enum("remat", "none", ["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"],
                      "model.remat of the scanned layers (needs --scan_layers; article_block, always unrolled, gets "
                      "none). With AttnRes, 'full' keeps two buffers, not one per layer "
                      "(results/scan_buffer_memory_cpu.md).")
    flags.DEFINE_string("workdir", "runs/depth_residuals", "Run folders and per-config raw results.")
    flags.DEFINE_string("out", "/tmp/k3jax_depth_residuals/depth_residuals", "Output prefix (.json/.md/_*.png); "
                        "the committed result is --out=experiments/results/depth_residuals.")
    flags.DEFINE_bool("isolate", True, "One subprocess per (variant, depth): per-config peak memory.")
    flags.DEFINE_bool("reuse", True, "Reuse a (variant, depth) result already in --workdir with the "
                      "same settings (resume an interrupted sweep).")
    flags.DEFINE_string("notes_file", "", "Markdown appended to the table as 'What happened' (default: "
                        "<out>_notes.md when it exists).")
    flags.DEFINE_string(
        "report_from", "", "Rewrite <out>.md and the plots from this existing results JSON (keeps its date, machine "
        "and raw numbers; adds --notes_file) instead of training.")
    flags.DEFINE_list("token_multipliers", [], "PreNorm also at these multiples of --steps (e.g. 1.25,1.5): "
                      "the loss-vs-tokens curve of the compute-equivalent multiplier.")
    flags.DEFINE_integer("parallel", 1, "Isolated workers run at once (they share the device).")
    flags.DEFINE_bool("split_seeds", False, "One worker per (variant, depth, seed) instead of per (variant, "
                      "depth): more compiles, more parallelism.")
    flags.DEFINE_integer("timing_steps", 0, "After the sweep, train each variant alone for this many steps "
                         "(seed 0) and report its tokens/s; 0 = no timing pass.", lower_bound=0)
    flags.DEFINE_string("compilation_cache_dir", "", "JAX persistent compilation cache shared by the workers.")
    flags.DEFINE_list("merge", [], "Result JSONs of sweeps with the same settings (e.g. other seeds): write one "
                      "table from their groups to --out instead of training.")
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
    scan_layers: bool = False   # model.scan_layers where the variant supports it (not article_block)
    remat: str = "none"         # model.remat of the scanned layers (only with scan_layers)


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
    from k3jax.models.config import SCAN_RESIDUALS, ModelConfig, ResidualConfig
    from k3jax.train.config import DataConfig, RunConfig, TrainConfig
    s = settings
    model = ModelConfig(d_model=s.d_model, num_layers=num_layers, num_heads=s.num_heads, head_dim=s.head_dim,
                        d_ff=s.d_ff, mixer_pattern="A", ffn="mlp", dtype=s.dtype,
                        scan_layers=s.scan_layers and variant in SCAN_RESIDUALS,
                        remat=s.remat if s.scan_layers and variant in SCAN_RESIDUALS else "none",
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


def scaled_settings(settings: Settings, token_multiplier: float) -> Settings:
    """`settings` with `token_multiplier` × the steps (warmup and eval cadence unchanged).

    Raises:
      ValueError: a multiplier <= 0.
    """
    if not token_multiplier > 0:
        raise ValueError(f"token_multiplier must be > 0, got {token_multiplier=}")
    return dataclasses.replace(settings, steps=max(1, round(settings.steps * token_multiplier)))


def group_key(group: dict) -> tuple:
    return group["variant"], group["num_layers"], group.get("token_multiplier", 1.0)


def _line_style(group: dict):
    """Solid for a variant's own row; PreNorm ×m rows share its colour, each multiplier its own dash."""
    m = group.get("token_multiplier", 1.0)
    return "-" if m == 1.0 else ("--", ":", "-.", (0, (3, 1, 1, 1)))[round(4 * m) % 4]


def group_label(group: dict) -> str:
    m = group.get("token_multiplier", 1.0)
    return group["variant"] if m == 1.0 else f"{group['variant']} ×{m:g} tokens"


def timing_run(settings: Settings, variant: str, num_layers: int, steps: int, workdir: str) -> dict:
    """Train `variant` for `steps` steps (seed 0, no eval before the end) and return its tokens/s (the trainer's:
    the compiling first step left out)."""
    from k3jax.train.trainer import train
    s = dataclasses.replace(settings, steps=steps, eval_every=steps, eval_batches=1, warmup_steps=1)
    cfg = run_config(s, variant, num_layers, 0, os.path.join(workdir, f"timing_{variant}_L{num_layers}"))
    shutil.rmtree(cfg.workdir, ignore_errors=True)
    summary = train(cfg, show_progress=False)
    return {"variant": variant, "num_layers": num_layers, "steps": steps, "tokens_per_s": summary["tokens_per_s"]}


def run_config_group(settings: Settings, variant: str, num_layers: int, seeds: list[int], workdir: str,
                     token_multiplier: float = 1.0, *, isolated: bool = True, parallel: int = 1) -> dict:
    """Train `variant` at `num_layers` for each seed (in this process) and return raw results; `settings`
    already carries the steps of `token_multiplier` (recorded in the result), `isolated` whether this process
    runs this group only (its peak memory is the group's), `parallel` how many such processes shared the device."""
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
        cfg = run_config(settings, variant, num_layers, seed,
                         os.path.join(workdir, f"{_group_stem(variant, num_layers, token_multiplier)}_s{seed}"))
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
            "token_multiplier": token_multiplier,
            "residual_blocks": residual_blocks_for(variant, num_layers, settings.residual_blocks),
            "settings": dataclasses.asdict(settings), "seeds": seeds, "runs": runs,
            "group_wall_seconds": time.time() - group_start,
            "rss_baseline_mib": rss_baseline, "rss_peak_mib": _rss_mib(),
            "device_peak_bytes": _device_peak_bytes(), "platform": jax.local_devices()[0].platform,
            "isolated": isolated, "workers_sharing_device": parallel}


def _group_stem(variant: str, num_layers: int, token_multiplier: float = 1.0) -> str:
    tag = "" if token_multiplier == 1.0 else "_x" + f"{token_multiplier:g}".replace(".", "p")
    return f"{variant}_L{num_layers}{tag}"


def _group_path(workdir: str, variant: str, num_layers: int, token_multiplier: float = 1.0,
                seeds: list[int] | None = None) -> str:
    tag = "" if seeds is None else "_s" + "-".join(str(s) for s in seeds)
    return os.path.join(workdir, f"result_{_group_stem(variant, num_layers, token_multiplier)}{tag}.json")


def _run_isolated(spec: dict, parallel: int, cache_dir: str) -> dict:
    env = dict(os.environ)
    if parallel > 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
    args = [sys.executable, "-m", "experiments.depth_residuals", f"--worker={json.dumps(spec)}", "--verbosity=-1"]
    if cache_dir:
        args.append(f"--compilation_cache_dir={cache_dir}")
    subprocess.run(args, check=True, env=env)
    with open(spec["out"]) as f:
        return json.load(f)


def _full_settings(settings: dict) -> dict:
    """`settings` of a result JSON with the fields it predates at their defaults (e.g. scan_layers)."""
    return dataclasses.asdict(Settings(**settings))


def merge_groups(groups: list[dict]) -> list[dict]:
    """Groups of the same (variant, depth, token multiplier) combined into one (their runs by seed), in
    first-seen order.

    Raises:
      ValueError: groups of one key with different settings, or a seed in two of them.
    """
    merged: dict[tuple, dict] = {}
    for g in groups:
        key = group_key(g)
        if key not in merged:
            merged[key] = json.loads(json.dumps(g))
            continue
        m = merged[key]
        if _full_settings(m["settings"]) != _full_settings(g["settings"]):
            raise ValueError(f"groups of {key} have different settings: {m['settings']} vs {g['settings']}")
        twice = {r["seed"] for r in m["runs"]} & {r["seed"] for r in g["runs"]}
        if twice:
            raise ValueError(f"seeds {sorted(twice)} of {key} are in more than one group")
        m["runs"] = sorted(m["runs"] + g["runs"], key=lambda r: r["seed"])
        m["seeds"] = [r["seed"] for r in m["runs"]]
        m["group_wall_seconds"] += g["group_wall_seconds"]
        for k in ("rss_peak_mib", "device_peak_bytes", "workers_sharing_device"):
            if g.get(k) is not None:
                m[k] = max(m.get(k) or 0, g[k])
        m["isolated"] = m.get("isolated", True) and g.get("isolated", True)
    return list(merged.values())


def _parse_list(name: str, values, kind, minimum=None) -> list:
    """A list flag's values as `kind`; ValueError naming --`name` for a value that does not parse or is below
    `minimum`."""
    out = []
    for v in values:
        try:
            x = kind(v)
        except ValueError:
            raise ValueError(f"--{name} takes {kind.__name__} values, got {v!r}") from None
        if minimum is not None and x < minimum:
            raise ValueError(f"--{name} values must be >= {minimum}, got {x}")
        out.append(x)
    return out


def merge_docs(docs: list[dict], names: list[str]) -> tuple[list[dict], list[dict], dict]:
    """Result JSONs of several sweeps as one: (groups, timing, sweep). Groups as `merge_groups`; the timing
    runs of every document, the first of each (variant, depth) kept; the sweep block of the first document with
    the union of variants, depths and seeds, the largest --parallel and the documents' names and machines.

    Raises:
      ValueError: a document that is not a sweep's result JSON (no `machine` / `groups` / `sweep`), documents
        from different device kinds (their `machine.devices`), or `merge_groups`'s.
    """
    for d, name in zip(docs, names):
        missing = [k for k in ("machine", "groups", "sweep") if not isinstance(d, dict) or k not in d]
        if missing or "devices" not in d["machine"]:
            raise ValueError(f"--merge takes this script's result JSONs; {name} has no {missing or ['machine.devices']}")
    kinds = {json.dumps(d["machine"]["devices"]) for d in docs}
    if len(kinds) > 1:
        raise ValueError(f"merge takes sweeps from one kind of machine, got devices {sorted(kinds)} in {names}")
    groups = merge_groups([g for d in docs for g in d["groups"]])
    timing, timed = [], set()
    for d in docs:
        for t in d.get("timing") or []:
            if (t["variant"], t["num_layers"]) not in timed:
                timed.add((t["variant"], t["num_layers"]))
                timing.append(t)
    sweeps = [d.get("sweep") or {} for d in docs]

    def union(key):
        return sorted({x for sw in sweeps for x in sw.get(key, [])}, key=str)
    sweep = {**sweeps[0], "variants": union("variants"), "depths": union("depths"), "seeds": union("seeds"),
             "parallel": max(sw.get("parallel", 1) for sw in sweeps), "merged_from": names,
             "merged_machines": [d["machine"] for d in docs]}
    return groups, timing, sweep


def _header_facts(groups: list[dict], rows: list[dict], sweep: dict) -> dict:
    """What the markdown header may say of all rows at once: seeds per cell, settings that differ between
    groups (beyond the PreNorm ×m rows' steps), whether every peak is one config's own process, and how many
    workers shared the device at most (per result; results that predate the field: the sweep's --parallel)."""
    counts = sorted({r["seeds"] for r in rows})
    seeds = (f"{counts[0]} seed{'s' if counts[0] != 1 else ''} per cell" if len(counts) == 1
             else f"{counts[0]}–{counts[-1]} seeds per cell")
    settings = [_full_settings(g["settings"]) for g in groups]
    differ = sorted(k for k in settings[0] if k != "steps" and len({json.dumps(x[k]) for x in settings}) > 1)
    workers = max(g.get("workers_sharing_device") or sweep.get("parallel", 1) for g in groups)
    return {"seeds": seeds, "differ": differ, "isolated": all(g.get("isolated", True) for g in groups),
            "workers": workers}


def run_sweep(settings: Settings, variants, depths, seeds, *, workdir: str, isolate: bool = True,
              reuse: bool = True, token_multipliers=(), parallel: int = 1, split_seeds: bool = False,
              cache_dir: str = "") -> list[dict]:
    """Run every (variant, depth) over `seeds`, and PreNorm at each of `token_multipliers` × the steps;
    returns one raw-result dict per (variant, depth, multiplier). With `isolate`, up to `parallel` worker
    processes at once, one per (variant, depth, multiplier) or, with `split_seeds`, per seed as well.

    Raises:
      ValueError: an unknown variant, an empty variants/depths/seeds list, a multiplier <= 0, or
        parallel / split_seeds without isolate.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be from {VARIANTS}, got {unknown}")
    if not variants or not depths or not seeds:
        raise ValueError(f"variants, depths and seeds must be non-empty, got {variants=}, {depths=}, {seeds=}")
    if not isolate and (parallel > 1 or split_seeds):
        raise ValueError("parallel > 1 and split_seeds need isolate (one process per worker)")
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel=}")
    multipliers = [float(m) for m in token_multipliers]
    for m in multipliers:
        scaled_settings(settings, m)  # validates
    os.makedirs(workdir, exist_ok=True)
    jobs = []  # (variant, depth, multiplier, seeds)
    for num_layers in depths:
        for variant, m in [(v, 1.0) for v in variants] + [("prenorm", m) for m in multipliers if m != 1.0]:
            for chunk in ([[s] for s in seeds] if split_seeds else [list(seeds)]):
                jobs.append((variant, num_layers, m, chunk))

    def run_job(job):
        variant, num_layers, m, chunk = job
        s = scaled_settings(settings, m)
        path = _group_path(workdir, variant, num_layers, m, chunk if split_seeds else None)
        if reuse and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            if _full_settings(old["settings"]) == dataclasses.asdict(s) and old["seeds"] == chunk:
                print(f"reusing {path}", flush=True)
                return old
        if isolate:
            spec = {"settings": dataclasses.asdict(s), "variant": variant, "num_layers": num_layers,
                    "token_multiplier": m, "seeds": chunk, "workdir": workdir, "out": path, "parallel": parallel}
            return _run_isolated(spec, parallel, cache_dir)
        group = run_config_group(s, variant, num_layers, chunk, workdir, m, isolated=False)
        with open(path, "w") as f:
            json.dump(group, f)
        return group

    if parallel > 1:
        import concurrent.futures  # noqa: PLC0415
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            groups = list(pool.map(run_job, jobs))
    else:
        groups = [run_job(job) for job in jobs]
    return merge_groups(groups)


def run_timing(settings: Settings, variants, depths, steps: int, *, workdir: str, cache_dir: str = "") -> list[dict]:
    """Each (variant, depth) trained alone for `steps` steps, one process after another (`timing_run`)."""
    out = []
    for num_layers in depths:
        for variant in variants:
            path = os.path.join(workdir, f"timing_{variant}_L{num_layers}.json")
            spec = {"settings": dataclasses.asdict(settings), "variant": variant, "num_layers": num_layers,
                    "timing_steps": steps, "workdir": workdir, "out": path}
            out.append(_run_isolated(spec, 1, cache_dir))
            print(f"timing {variant} L={num_layers}: {out[-1]['tokens_per_s']:,.0f} tok/s alone", flush=True)
    return out


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


def compute_equivalent(groups: list[dict], num_layers: int, seed: int, val_loss: float) -> tuple[float, bool]:
    """The PreNorm token multiplier that reaches `val_loss` at `num_layers`, from the fit
    val_loss = a + b·ln(m) through PreNorm's runs of `seed` at every multiplier it ran (least squares).
    Returns (multiplier, extrapolated: outside the multipliers PreNorm ran); nan when PreNorm ran at fewer
    than two multipliers for the seed or its loss does not fall with tokens."""
    points = [(g.get("token_multiplier", 1.0), r["val_loss"]) for g in groups
              if g["variant"] == "prenorm" and g["num_layers"] == num_layers for r in g["runs"] if r["seed"] == seed]
    if len({m for m, _ in points}) < 2:
        return float("nan"), False
    xs = [math.log(m) for m, _ in points]
    ys = [y for _, y in points]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    if not b < 0:
        return float("nan"), False
    m = math.exp((val_loss - (y_mean - b * x_mean)) / b)
    ms = [mm for mm, _ in points]
    return m, not min(ms) <= m <= max(ms)


def summary_rows(groups: list[dict], timing: list[dict] | None = None) -> list[dict]:
    """One row per (variant, depth, token multiplier): mean/std over seeds; the paired difference to
    prenorm's val loss at the same depth and seed (same tokens) when prenorm was run; the compute-equivalent
    PreNorm multiplier (`compute_equivalent`, per seed, then mean/std) when PreNorm ran at several
    multipliers; tokens/s alone and the step-time overhead vs PreNorm from `timing`."""
    baseline = {(g["num_layers"], r["seed"]): r["val_loss"] for g in groups
                if g["variant"] == "prenorm" and g.get("token_multiplier", 1.0) == 1.0 for r in g["runs"]}
    solo = {(t["variant"], t["num_layers"]): t["tokens_per_s"] for t in timing or []}
    rows = []
    for g in groups:
        runs = g["runs"]
        m = g.get("token_multiplier", 1.0)
        row = {"variant": g["variant"], "label": group_label(g), "token_multiplier": m,
               "num_layers": g["num_layers"], "residual_blocks": g["residual_blocks"],
               "seeds": len(runs), "num_params": runs[0]["num_params"]}
        for key in ("val_loss", "val_bpb", "tokens_per_s", "wall_seconds"):
            row[key], row[key + "_std"] = _mean_std([r[key] for r in runs])
        diffs = [r["val_loss"] - baseline[(g["num_layers"], r["seed"])] for r in runs
                 if (g["num_layers"], r["seed"]) in baseline]
        row["delta_vs_prenorm"], row["delta_vs_prenorm_std"] = _mean_std(diffs) if diffs else (float("nan"),) * 2
        eq = [compute_equivalent(groups, g["num_layers"], r["seed"], r["val_loss"]) for r in runs]
        eq = [e for e in eq if not math.isnan(e[0])] if g["variant"] != "prenorm" and m == 1.0 else []
        row["compute_equivalent"], row["compute_equivalent_std"] = (
            _mean_std([e[0] for e in eq]) if eq else (float("nan"),) * 2)
        row["compute_equivalent_extrapolated"] = any(e[1] for e in eq)
        row["solo_tokens_per_s"] = solo.get((g["variant"], g["num_layers"])) if m == 1.0 else None
        base_tps = solo.get(("prenorm", g["num_layers"]))
        row["step_time_overhead"] = (base_tps / row["solo_tokens_per_s"] - 1.0
                                     if row["solo_tokens_per_s"] and base_tps else None)
        row["peak_memory_mib"] = _peak_mib(g)
        row["rss_baseline_mib"] = g["rss_baseline_mib"]
        row["memory_kind"] = "device peak_bytes_in_use" if g.get("device_peak_bytes") else "process peak RSS"
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The sweep's table; the compute-equivalent and alone-timing columns only when some row has them."""
    with_eq = any(not math.isnan(r.get("compute_equivalent", float("nan"))) for r in rows)
    with_solo = any(r.get("solo_tokens_per_s") for r in rows)
    head = ["variant", "layers (sublayers)", "N", "params", "val loss (nats)", "Δ vs prenorm (paired)", "bits/byte",
            "tokens/s", "peak memory (MiB)"]
    head += ["PreNorm-compute equivalent"] * with_eq + ["tokens/s alone", "step-time overhead"] * with_solo
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = r.get("label", r["variant"])
        delta = ("—" if label == "prenorm" or math.isnan(r["delta_vs_prenorm"])
                 else f"{r['delta_vs_prenorm']:+.4f} ± {r['delta_vs_prenorm_std']:.4f}")
        cells = [label, f"{r['num_layers']} ({2 * r['num_layers']})", str(r["residual_blocks"]), f"{r['num_params']:,}",
                 f"{r['val_loss']:.4f} ± {r['val_loss_std']:.4f}", delta, f"{r['val_bpb']:.4f} ± {r['val_bpb_std']:.4f}",
                 f"{r['tokens_per_s']:,.0f} ± {r['tokens_per_s_std']:,.0f}",
                 f"{r['peak_memory_mib']:,.0f} (base {r['rss_baseline_mib']:,.0f})"]
        if with_eq:
            eq = r.get("compute_equivalent", float("nan"))
            where = " (extrapolated: worse than PreNorm)" if eq < 1 else " (extrapolated past the largest multiplier)"
            cells.append("—" if math.isnan(eq) else f"{eq:.2f}× ± {r['compute_equivalent_std']:.2f}"
                         + (where if r["compute_equivalent_extrapolated"] else ""))
        if with_solo:
            over = r.get("step_time_overhead")
            cells += [f"{r['solo_tokens_per_s']:,.0f}" if r.get("solo_tokens_per_s") else "—",
                      "—" if over is None or label == "prenorm" else f"{100 * over:+.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
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
            ax.plot(steps, losses.mean(0), color=colors[g["variant"]], label=group_label(g), marker="o", ms=3,
                    linestyle=_line_style(g))
            ax.fill_between(steps, losses.min(0), losses.max(0), color=colors[g["variant"]], alpha=0.2)
        ax.set(title=f"{depth} layers", xlabel="step", ylabel="val loss (nats/token)")
        ax.legend()
    paths.append(_save(fig, out + "_val_loss.png"))

    for key, title, ylabel, log in (("cosine", "cosine(input_l, input_{l+1}) by depth", "cosine", False),
                                     ("hidden_rms", "RMS of each sublayer's input by depth", "RMS", True)):
        fig, axes = panels(title + "\n(trained, first validation batch, mean over seeds)")
        for ax, depth in zip(axes, depths):
            for g in (g for g in groups if g["num_layers"] == depth):
                values = np.array([r["diagnostics"][key] for r in g["runs"]]).mean(0)
                ax.plot(np.arange(len(values)), values, color=colors[g["variant"]], label=group_label(g),
                        linestyle=_line_style(g))
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
        fig.suptitle("learned depth weights\n(mean over tokens of the first validation batch)")
        paths.append(_save(fig, out + "_depth_weights.png"))
    return paths


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(groups: list[dict], out: str, *, notes: str = "", sweep: dict | None = None,
                  machine: dict | None = None, timing: list[dict] | None = None) -> dict:
    """Write `<out>.json`, `<out>.md` and the plots; return the JSON document. `machine` (default: this
    machine now) is given when re-rendering an earlier sweep's results."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    rows = summary_rows(groups, timing)
    doc = {"experiment": "depth_residuals (issues 6, 27)", "machine": machine or machine_info(), "sweep": sweep or {},
           "rows": rows, "groups": groups, "timing": timing or []}
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    plots = make_plots(groups, out)
    s = groups[0]["settings"]
    m = doc["machine"]
    facts = _header_facts(groups, rows, sweep or {})
    md = [f"# Depth residual schemes (issues 6, 27): {m['date_utc']}", "",
          f"Machine: {m['platform']}, {m['cpu_count']} CPUs, devices {m['devices']}; jax {m['versions']['jax']}, "
          f"flax {m['versions']['flax']}. Raw numbers: `{os.path.basename(out)}.json`.", "",
          f"Setting: byte LM on `{s['source']}`, attention mixers + SwiGLU, d_model {s['d_model']}, "
          f"{s['num_heads']} heads × {s['head_dim']}, d_ff {s['d_ff']}, T = {s['seq_len']}, B = {s['batch_size']}, "
          f"{s['steps']} AdamW steps (× the multiplier for PreNorm ×m rows; peak lr {s['learning_rate']}, {s['warmup_steps']} warmup, cosine), "
          f"{s['dtype']}{'; layers scanned (model.scan_layers; article_block unrolled)' if s.get('scan_layers') else ''}"
          f"{'; remat ' + s['remat'] if s.get('remat', 'none') != 'none' else ''}; "
          f"validation = first {s['eval_batches']} batch{'es' if s['eval_batches'] != 1 else ''} of the validation split; "
          f"{facts['seeds']}, seed s gives every variant the same init RNG and the same token "
          "order. Mean ± sample std over seeds; Δ = paired (same seed) val-loss difference to prenorm. "
          "N = blocks (block_attnres: sublayer blocks; article_block: layer blocks; full_attnres: one per sublayer). "
          + (f"**Settings differ between rows** in {', '.join(facts['differ'])} (each group's settings: the "
             "JSON). " if facts["differ"] else "")
          + f"Peak memory: {rows[0]['memory_kind']} "
          + ("of the config's own process (with split seeds, the largest of its processes; " if facts["isolated"] else
             "of the one process that ran the configs in turn (a running maximum, not each config's own; ")
          + "base = RSS before any model; CPU RSS includes the runtime and XLA compilation)."
          + (f" Up to {facts['workers']} workers shared the device: tokens/s is each run's share; 'tokens/s "
             f"alone' is each variant trained alone for {timing[0]['steps'] if timing else '?'} steps (seed 0)."
             if facts["workers"] > 1 else "")
          + (" PreNorm-compute equivalent: the PreNorm token multiplier reaching the variant's val loss, per seed "
             "from the fit a + b·ln(m) through PreNorm's multipliers, mean ± std." if any(
                 g.get("token_multiplier", 1.0) != 1.0 for g in groups) else ""), "",
          markdown_table(rows), ""]
    if notes:
        md += ["## What happened", "", notes.strip(), ""]
    md += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + [""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(md))
    return doc


def main(argv):
    del argv
    if FLAGS.compilation_cache_dir:
        from experiments.harness import enable_compilation_cache  # noqa: PLC0415
        enable_compilation_cache(FLAGS.compilation_cache_dir)
    if FLAGS.worker:
        spec = json.loads(FLAGS.worker)
        if "timing_steps" in spec:
            group = timing_run(Settings(**spec["settings"]), spec["variant"], spec["num_layers"],
                               spec["timing_steps"], spec["workdir"])
        else:
            group = run_config_group(Settings(**spec["settings"]), spec["variant"], spec["num_layers"],
                                     spec["seeds"], spec["workdir"], spec.get("token_multiplier", 1.0),
                                     parallel=spec.get("parallel", 1))
        with open(spec["out"] + ".tmp", "w") as f:    # atomic: a killed worker leaves no partial result
            json.dump(group, f)
        os.replace(spec["out"] + ".tmp", spec["out"])
        return
    notes = ""
    notes_file = FLAGS.notes_file or (FLAGS.out + "_notes.md" if os.path.exists(FLAGS.out + "_notes.md") else "")
    if notes_file:                   # the committed page's notes live beside it: a re-run keeps them
        with open(notes_file) as f:
            notes = f.read()
    if FLAGS.report_from:
        with open(FLAGS.report_from) as f:
            old = json.load(f)
        write_outputs(old["groups"], FLAGS.out, notes=notes, sweep=old["sweep"], machine=old["machine"],
                      timing=old.get("timing"))
        print(markdown_table(summary_rows(old["groups"], old.get("timing"))))
        return
    if FLAGS.merge:
        docs = []
        for path in FLAGS.merge:
            with open(path) as f:
                docs.append(json.load(f))
        groups, timing, sweep = merge_docs(docs, [os.path.basename(p) for p in FLAGS.merge])
        doc = write_outputs(groups, FLAGS.out, notes=notes, machine=docs[0]["machine"], timing=timing, sweep=sweep)
        print(markdown_table(doc["rows"]))
        return
    settings = Settings(d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, head_dim=FLAGS.head_dim,
                        d_ff=FLAGS.d_ff, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                        learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                        eval_every=FLAGS.eval_every, eval_batches=FLAGS.eval_batches,
                        residual_blocks=FLAGS.residual_blocks, dtype=FLAGS.dtype, scan_layers=FLAGS.scan_layers,
                        remat=FLAGS.remat)
    if FLAGS.remat != "none" and not FLAGS.scan_layers:
        raise ValueError(f"--remat={FLAGS.remat} needs --scan_layers (it applies to the scanned layers)")
    depths = _parse_list("depths", FLAGS.depths, int, minimum=1)
    seeds = _parse_list("seeds", FLAGS.seeds, int, minimum=0)
    multipliers = _parse_list("token_multipliers", FLAGS.token_multipliers, float)  # > 0: run_sweep's check
    start = time.time()
    groups = run_sweep(settings, FLAGS.variants, depths, seeds, workdir=FLAGS.workdir, isolate=FLAGS.isolate,
                       reuse=FLAGS.reuse, token_multipliers=multipliers, parallel=FLAGS.parallel,
                       split_seeds=FLAGS.split_seeds, cache_dir=FLAGS.compilation_cache_dir)
    sweep_wall = time.time() - start
    timing = (run_timing(settings, FLAGS.variants, depths, FLAGS.timing_steps, workdir=FLAGS.workdir,
                         cache_dir=FLAGS.compilation_cache_dir) if FLAGS.timing_steps else [])
    doc = write_outputs(groups, FLAGS.out, notes=notes, timing=timing,
                        sweep={"variants": FLAGS.variants, "depths": depths, "seeds": seeds,
                               "token_multipliers": multipliers,
                               "isolate": FLAGS.isolate, "parallel": FLAGS.parallel, "split_seeds": FLAGS.split_seeds,
                               "timing_steps": FLAGS.timing_steps, "sweep_wall_seconds": sweep_wall})
    print(markdown_table(doc["rows"]))


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)  # keep orbax's per-save INFO lines out of the log
    app.run(main)
