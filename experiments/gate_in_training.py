"""The KDA gate in training (issue 27, part 3): K3-small with the bounded gate vs Kimi Linear's softplus gate.

  python -m experiments.gate_in_training --out=$OUT/gate_in_training_h200 --workdir_root=/tmp/gate_runs \
      --time_budget_s=240                     # one H200: K3-small (configs/k3_small_gpu.py), both gates
  python -m experiments.gate_in_training --tiny --steps=4 --out=/tmp/git --workdir_root=/tmp/git_runs  # CPU
  # one process per gate at a fixed step count (equal tokens), side by side on one GPU, then one table:
  python -m experiments.gate_in_training --gates=bounded --steps=500 --out=$OUT/b --workdir_root=/tmp/g &
  python -m experiments.gate_in_training --gates=softplus --steps=500 --out=$OUT/s --workdir_root=/tmp/g; wait
  python -m experiments.gate_in_training --merge=$OUT/b.json,$OUT/s.json --out=$OUT/gate_in_training_h200

Per gate, in one process, the same config except `model.kda.gate` (data order, schedule and seed equal):
 1. train with `k3jax.train.trainer.train` (`--time_budget_s` of training after the compiling first
    step; the softplus run stops at the step the bounded run reached, so both see the same tokens);
    "bounded" runs the kernels of the declared lower bound, "softplus" the op's unbounded path (the
    `kda.implementation=None` choice for an undeclared bound);
 2. report validation loss, bits/byte, tokens/s and the step reached;
 3. reload the trained model and run it eagerly on `--span_batches` validation batches, recording the
    log-decay g [B, T, H, K] of every KDA layer where the layer computes it (`kda_gate`), and report per
    tile length C in `--tiles` the span of each (row, tile, head): max over the K channels of -Σ g over
    the tile's C tokens, in nats. That is the largest exponent of the forced single-GEMM diagonal tile's
    operand k·exp(a - G) with the anchor a at the tile start (`gate_stability.tile_stats`); the tile
    overflows bf16/fp32 when the span exceeds ln(float32 max) = 88.72. The table gives the fraction of
    overflowing tiles and the span's quantiles per gate (the bounded gate's span is at most C·|lower_bound|).
`--evaluate_only` skips 1 and takes the step and tokens/s from each run's metrics.jsonl (the span pass of
the full K3-small model runs eagerly, ~2 min on an H100: a device call's time limit can cut it off).
Writes <out>.json and <out>.md (date, device, versions). Processes that share one GPU share its time: their
tokens/s are then not step-time numbers (the table says how many processes shared the device).
"""
from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import numpy as np
from absl import app, flags
from ml_collections import config_flags

OVERFLOW_NATS = float(np.log(np.finfo(np.float32).max))  # bf16 has fp32's exponent range
GATES = ("bounded", "softplus")


def tile_spans(g, tile: int) -> np.ndarray:
    """Spans [B, T // tile, H] (nats) of `g [B, T, H, K]` (log-decays <= 0): max over K of -Σ g over each
    `tile`-token tile; trailing tokens that do not fill a tile are left out.

    Raises:
      ValueError: g not 4-D, or `tile` not a positive int.
    """
    g = np.asarray(g, np.float64)
    if g.ndim != 4:
        raise ValueError(f"g must be [B, T, H, K], got {g.shape=}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile=}")
    B, T, H, K = g.shape
    n = T // tile
    return (-g[:, :n * tile].reshape(B, n, tile, H, K).sum(axis=2)).max(axis=-1)


@contextlib.contextmanager
def recording_gates():
    """Within the block, every `KimiDeltaAttention` layer's g (the output of `kda_gate`) is appended to
    the yielded list as a host array. Run the model eagerly (not under jit or scan)."""
    import k3jax.nn.kda as kda_module  # noqa: PLC0415
    recorded, original = [], kda_module.kda_gate

    def record(*args, **kwargs):
        g = original(*args, **kwargs)
        recorded.append(np.asarray(g))
        return g

    with mock.patch.object(kda_module, "kda_gate", record):
        yield recorded


def span_stats(spans: list[np.ndarray]) -> dict:
    """Fraction of tiles over OVERFLOW_NATS and span quantiles, over every layer, row, tile and head."""
    flat = np.concatenate([s.ravel() for s in spans])
    q = np.quantile(flat, [0.5, 0.99, 0.999])
    return {"tiles": int(flat.size), "overflow_fraction": float(np.mean(flat > OVERFLOW_NATS)),
            "p50": float(q[0]), "p99": float(q[1]), "p99.9": float(q[2]), "max": float(flat.max()),
            "overflow_fraction_per_layer": [float(np.mean(s > OVERFLOW_NATS)) for s in spans]}


def evaluate_run(cfg, tiles: list[int], span_batches: int) -> dict:
    """Reload `cfg.workdir`'s newest checkpoint: validation loss on the trainer's validation slice and its
    gates' tile spans on the first `span_batches` validation batches (module docstring).

    Raises:
      ValueError: `cfg.model.scan_layers` (the gates are read eagerly, layer by layer).
    """
    import jax.numpy as jnp  # noqa: PLC0415
    from k3jax.data.corpus import load_corpus  # noqa: PLC0415
    from k3jax.data.pipeline import eval_batches  # noqa: PLC0415
    from k3jax.train.trainer import evaluate, load_trained_model, loss_chunk_size, run_tokenizer  # noqa: PLC0415
    if cfg.model.scan_layers:
        raise ValueError("model.scan_layers: the gates are read eagerly layer by layer; use unrolled layers")
    tokenizer = run_tokenizer(cfg)
    model, step = load_trained_model(cfg, tokenizer=tokenizer)
    val = load_corpus(cfg.data.source, "validation", cache_dir=cfg.data.cache_dir or None, tokenizer=tokenizer)
    if val.num_tokens <= cfg.data.seq_len:  # as the trainer: tiny corpora evaluate on the train stream
        val = load_corpus(cfg.data.source, "train", cache_dir=cfg.data.cache_dir or None, tokenizer=tokenizer)
    batches = list(eval_batches(val.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                                max_batches=max(cfg.train.eval_batches, span_batches), eos_id=tokenizer.eos_id))
    result = {"checkpoint_step": step, **evaluate(model, batches[:cfg.train.eval_batches],
                                                  loss_chunk_size=loss_chunk_size(cfg))}
    result.pop("val_bytes_per_token", None)
    spans = {c: [] for c in tiles}
    for batch in batches[:span_batches]:
        with recording_gates() as gs:
            model(jnp.asarray(batch["inputs"]), segment_ids=jnp.asarray(batch["segment_ids"]),
                  positions=jnp.asarray(batch["positions"]), train=False)
        for c in tiles:
            spans[c] += [tile_spans(g, c) for g in gs]
    result["val_batches"] = len(batches[:cfg.train.eval_batches])
    result["val_tokens_evaluated"] = int(sum(b["inputs"].size for b in batches[:cfg.train.eval_batches]))
    result["span_batches"] = len(batches[:span_batches])
    result["kda_layers"] = len(spans[tiles[0]]) // max(min(span_batches, len(batches)), 1)
    result["spans"] = {str(c): span_stats(s) for c, s in spans.items()}
    return result


def finished_run_summary(cfg) -> dict:
    """{"step", "tokens_per_s", "train_tokens", "val_tokens"} of the finished run in `cfg.workdir`
    (`--evaluate_only`, e.g. after a run whose span measurement was cut off): step and tokens/s from its
    metrics.jsonl's last training record, corpus sizes from its run_header.json.

    Raises:
      ValueError: no metrics.jsonl or run_header.json in the workdir; a header written for another model,
        data or step count than `cfg`; no training record; a last record before `cfg.train.steps`.
    """
    from k3jax.train.config import run_config_from_dict  # noqa: PLC0415
    from k3jax.train.metrics import read_metrics  # noqa: PLC0415
    workdir = cfg.workdir
    for name in ("metrics.jsonl", "run_header.json"):
        if not os.path.isfile(os.path.join(workdir, name)):
            raise ValueError(f"--evaluate_only: no finished run in {workdir} (no {name})")
    with open(os.path.join(workdir, "run_header.json")) as f:
        header = json.load(f)
    ran = run_config_from_dict(header["config"])
    for section in ("model", "data"):
        if getattr(ran, section) != getattr(cfg, section):
            raise ValueError(f"--evaluate_only: {workdir} was trained with another {section} config than these flags")
    if ran.train.steps != cfg.train.steps:
        raise ValueError(f"--evaluate_only: {workdir} was run for {ran.train.steps} steps, the flags say "
                         f"{cfg.train.steps} (pass the run's --steps)")
    records = [r for r in read_metrics(workdir) if "tokens_per_s" in r]
    if not records:
        raise ValueError(f"--evaluate_only: {workdir}/metrics.jsonl has no training record")
    if int(records[-1]["step"]) != cfg.train.steps:
        raise ValueError(f"--evaluate_only: {workdir} stopped at step {records[-1]['step']} of {cfg.train.steps} "
                         "(not finished; rerun it to resume)")
    return {"step": int(records[-1]["step"]), "tokens_per_s": float(records[-1]["tokens_per_s"]),
            "train_tokens": int(header["train_tokens"]), "val_tokens": int(header["val_tokens"])}


def merge_results(docs: list[dict]) -> dict:
    """One result from per-gate results of the same base config (e.g. one process per gate).

    Raises:
      ValueError: fewer than two documents, configs that differ, a gate in two documents, or runs that did
        not reach the same step (unequal tokens).
    """
    if len(docs) < 2:
        raise ValueError(f"--merge needs at least two result JSONs, got {len(docs)}")
    runs = {}
    for d in docs:
        if d["base_config"] != docs[0]["base_config"]:
            raise ValueError("--merge: the results' base configs differ")
        for gate, r in d["runs"].items():
            if gate in runs:
                raise ValueError(f"--merge: gate {gate!r} is in more than one result")
            runs[gate] = r
    steps = {r["step"] for r in runs.values()}
    if len(steps) != 1:
        raise ValueError(f"--merge: the runs reached different steps {sorted(steps)} (unequal tokens)")
    return {**docs[0], "runs": {g: runs[g] for g in GATES if g in runs}, "processes_sharing_device": len(docs),
            "merged_envs": [d["env"] for d in docs]}


def render(result: dict) -> str:
    from experiments.harness import environment_line, markdown_table  # noqa: PLC0415
    lines = ["# The KDA gate in training: bounded vs softplus (issue 27 part 3)", "",
             environment_line(result["env"]), "",
             f"Config `{result['config_file']}`{' (--tiny)' if result['tiny'] else ''}; the same run per gate but "
             "`model.kda.gate`. Span = max over channels of -Σ g over a tile (nats); a forced single bf16 GEMM "
             f"tile overflows above {OVERFLOW_NATS:.2f}.", ""]
    if result.get("processes_sharing_device", 1) > 1:
        lines += [f"The runs were {result['processes_sharing_device']} processes (merged); where they shared one "
                  "device at once, tokens/s is each run's share of it, not a step-time comparison.", ""]
    rows = []
    for gate, r in result["runs"].items():
        for c, s in r["spans"].items():
            rows.append([gate, r["step"], f"{r['val_loss']:.4f}", f"{r['val_bpb']:.4f}", f"{r['tokens_per_s']:,.0f}",
                         c, f"{s['overflow_fraction']:.2e}", f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}"])
    sizes = {(r["val_batches"], r["val_tokens_evaluated"], r["span_batches"])
             for r in result["runs"].values() if "val_batches" in r}
    for vb, vt, sb in sorted(sizes):
        lines += [f"Val loss on {vb} validation batch(es) ({vt:,} tokens); spans on {sb} batch(es).", ""]
    lines += markdown_table(["gate", "steps", "val loss", "val bpb", "tokens/s", "tile C", "overflowing tiles",
                             "span p50", "span p99", "span max"], rows)
    return "\n".join(lines) + "\n"


def _define_flags():
    global _CONFIG, _STEPS, _BUDGET, _ROOT, _OUT, _TILES, _SPAN_BATCHES, _TINY, _GATES, _MERGE, _EVALUATE_ONLY
    from experiments.configs.common import define_config_file  # noqa: PLC0415
    _CONFIG = define_config_file("config", "experiments/configs/k3_small_gpu.py", "Run config (both gates).")
    _STEPS = flags.DEFINE_integer("steps", 0, "Training steps (0 = the config's train.steps).")
    _BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Training seconds per run after its first step (0 = none).")
    _ROOT = flags.DEFINE_string("workdir_root", "runs/gate_in_training", "Run folders <root>/<gate>; must be fresh.")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_gate_in_training/gate_in_training", "Output prefix (.json, .md).")
    _TILES = flags.DEFINE_list("tiles", ["16", "64"], "Tile lengths C of the span measurement.")
    _SPAN_BATCHES = flags.DEFINE_integer("span_batches", 2, "Validation batches whose gates are measured.")
    _TINY = flags.DEFINE_bool("tiny", False, "A CPU smoke size (d 32, 2 layers KA, 2 x 64 tokens).")
    _GATES = flags.DEFINE_list("gates", list(GATES), f"Gates to run, from {GATES}; one per process with --steps.")
    _MERGE = flags.DEFINE_list("merge", [], "Result JSONs (one per gate) to merge into --out instead of training.")
    _EVALUATE_ONLY = flags.DEFINE_bool("evaluate_only", False, "Do not train: evaluate each gate's finished run in "
                                       "--workdir_root (step and tokens/s from its metrics.jsonl), same flags.")


def main(argv):
    del argv
    from experiments.harness import environment, write_results  # noqa: PLC0415
    from k3jax.train.config import run_config_from_dict  # noqa: PLC0415
    from k3jax.train.trainer import train  # noqa: PLC0415
    if _MERGE.value:
        docs = []
        for path in _MERGE.value:
            with open(path) as f:
                docs.append(json.load(f))
        result = merge_results(docs)
        text = render(result)
        write_results(_OUT.value, result, text)
        print(text)
        return
    gates = list(_GATES.value)
    if not gates or any(g not in GATES for g in gates) or len(set(gates)) != len(gates):
        raise ValueError(f"--gates must be distinct names from {GATES}, got {gates}")
    base = _CONFIG.value.to_dict()
    if _TINY.value:
        base["model"].update(d_model=32, num_layers=2, mixer_pattern="KA", num_heads=2, head_dim=16, d_ff=64)
        base["model"]["moe"].update(num_experts=4, d_ff=32)
        base["model"]["residual"].update(blocks=2)
        base["data"].update(seq_len=64, batch_size=2)
        base["train"].update(eval_batches=1)
    if _STEPS.value:
        base["train"].update(steps=_STEPS.value, eval_every=_STEPS.value, checkpoint_every=_STEPS.value,
                             warmup_steps=min(base["train"]["warmup_steps"], max(_STEPS.value // 10, 1)))
    tiles = [int(c) for c in _TILES.value]
    runs, reached = {}, None
    cfgs = {}
    for gate in gates:
        d = json.loads(json.dumps(base))
        d["model"]["kda"]["gate"] = gate
        d["workdir"] = os.path.join(_ROOT.value, gate)
        cfgs[gate] = run_config_from_dict(d)
    finished = {g: finished_run_summary(c) for g, c in cfgs.items()} if _EVALUATE_ONLY.value else {}
    for gate, cfg in cfgs.items():
        if _EVALUATE_ONLY.value:
            summary = finished[gate]
        else:
            if os.path.isdir(cfg.workdir) and os.listdir(cfg.workdir):
                raise ValueError(f"--workdir_root: {cfg.workdir} is not empty (the trainer would resume it)")
            stop = reached if reached is not None and reached < cfg.train.steps else None  # equal tokens
            summary = train(cfg, show_progress=False, stop_at_step=stop, time_budget_s=_BUDGET.value or None)
        reached = reached or int(summary["step"])
        runs[gate] = {"step": int(summary["step"]), "tokens_per_s": summary["tokens_per_s"],
                      **{k: summary[k] for k in ("train_tokens", "val_tokens") if k in summary},
                      **evaluate_run(cfg, tiles, _SPAN_BATCHES.value)}
        if runs[gate]["checkpoint_step"] != runs[gate]["step"]:
            raise ValueError(f"{cfg.workdir}: the newest checkpoint is step {runs[gate]['checkpoint_step']}, "
                             f"the run reached {runs[gate]['step']}")
    result = {"env": environment(), "config_file": config_flags.get_config_filename(flags.FLAGS["config"]), "tiny": _TINY.value,
              "base_config": base, "runs": runs}
    text = render(result)
    write_results(_OUT.value, result, text)
    print(text)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
