"""Host time per train-step call: `nnx.jit`'s `train_step(model, optimizer, batch)` vs `bind_train_step`.

  python -m experiments.bench_dispatch --shape=1b --out=/tmp/dispatch   # any backend; CPU is enough

The model has the layer structure of a `bench_train` shape (layers, mixer pattern, experts, residual
kind, scan_layers) at tiny widths (d_model 32, 2 heads x 16, batch 2 x 64), so the device work per step
is small and the time of the call returning is the host's: the graph traversal that `nnx.jit` does on
every call (flatten, then merge back, the model and the optimizer) against the bound step's cached one.
Per row: the median over `--calls` back-to-back calls (after 2 untimed) of the time until the call
returns, and of the whole call + device_get. Writes <out>.json and <out>.md (date, device, versions).
"""
from __future__ import annotations

import time

import numpy as np


def measure(shape: str, row: str, scan_layers: bool, calls: int) -> dict:
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from experiments import bench_train as bt  # noqa: PLC0415
    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.config import TrainConfig  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    from k3jax.train.step import bind_train_step, train_step  # noqa: PLC0415
    m = bt.SHAPES[shape]["model"]
    bt.SHAPES["_probe"] = dict(model={**m, "d_model": 32, "num_heads": 2, "head_dim": 16, "d_ff": 64,
                                      "moe": {**m["moe"], "d_ff": 16}}, batch_size=2, seq_len=64, doc_len=40)
    cfg = bt.model_config("_probe", row, scan_layers=scan_layers, remat="full" if scan_layers else "none")
    batch = jax.device_put(bt.markov_batches(1, 2, 64, 40, cfg.vocab_size)[0])
    out = {"shape": shape, "row": row, "scan_layers": scan_layers, "num_layers": cfg.num_layers}
    for name in ("plain", "bound"):
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=10, warmup_steps=1)), wrt=nnx.Param)
        out["variables"] = len(jax.tree.leaves(nnx.state((model, opt))))
        step = bind_train_step(model, opt) if name == "bound" else (lambda b, m=model, o=opt: train_step(m, o, b))
        for _ in range(2):
            jax.device_get(step(batch))
        returned, total = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            metrics = step(batch)
            t1 = time.perf_counter()
            jax.device_get(metrics)
            returned.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        out[f"{name}_call_ms"] = 1e3 * float(np.median(returned))
        out[f"{name}_total_ms"] = 1e3 * float(np.median(total))
    return out


def main(argv):
    del argv
    from experiments.harness import environment, markdown_table, write_results  # noqa: PLC0415
    unknown = set(_LAYOUTS.value) - {"unrolled", "scanned"}
    if unknown:
        raise ValueError(f"--layouts must be from unrolled, scanned; got {sorted(unknown)}")
    rows = [measure(_SHAPE.value, row, layout == "scanned", _CALLS.value) for row in _ROWS.value
            for layout in _LAYOUTS.value if not (layout == "scanned" and _SHAPE.value == "tiny")]
    env = environment()
    table = [[r["row"], "scanned" if r["scan_layers"] else "unrolled", r["variables"], f"{r['plain_call_ms']:.1f}",
              f"{r['bound_call_ms']:.1f}", f"{r['plain_call_ms'] / r['bound_call_ms']:.1f}x",
              f"{r['plain_total_ms']:.1f}", f"{r['bound_total_ms']:.1f}"] for r in rows]
    md = [f"# Host time per train-step call, layer structure of `{_SHAPE.value}` ({env['date']}, {env['device']})", "",
          "`experiments/bench_dispatch.py`: tiny widths, so the call is the host's work; median of "
          f"{_CALLS.value} calls; ms.", ""]
    md += markdown_table(["row", "layers", "variables", "nnx.jit call", "bound call", "ratio", "nnx.jit + get",
                          "bound + get"], table)
    write_results(_OUT.value, {"env": env, "rows": rows}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    from absl import app, flags
    _SHAPE = flags.DEFINE_enum("shape", "k3_small", ["k3_small", "1b", "tiny"], "bench_train shape (its layers).")
    _ROWS = flags.DEFINE_list("rows", ["k3_default", "like_for_like"], "bench_train rows.")
    _LAYOUTS = flags.DEFINE_list("layouts", ["unrolled", "scanned"], "unrolled and / or scanned layers.")
    _CALLS = flags.DEFINE_integer("calls", 10, "Timed calls per row.")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_bench_dispatch/dispatch", "Output prefix (<out>.json, .md).")
    app.run(main)
