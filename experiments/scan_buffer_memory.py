"""The scanned AttnRes stack with two buffers and a slot per period kept for the backward, against the checkpointed scan.

  python -m experiments.scan_buffer_memory --out=experiments/results/scan_buffer_memory_cpu
  python -m experiments.scan_buffer_memory --tiny --out=/tmp/sbm        # smoke

`model.scan_layers` with AttnRes and `remat="full"` runs `k3jax.ops.residuals.scan_source_buffer`: the
forward keeps the first and final source buffers and one slot per period, and the backward rebuilds each
period's buffer from them. The reference is what the model ran before and what the tests hold it to,
`jax.lax.scan(jax.checkpoint(body))`, which saves the whole `[N + 1, B, T, D]` buffer at every period.

Per row (variant, scan): the compiled train step's temporary memory (`memory_analysis()` of the trainer's
step, compiled for this host's backend) at the depth sweep's GPU shape (experiments/gpu_checks/depth_gpu.sh:
32 layers, d 512, 8 heads, 16 x 1024 tokens, bf16), and the median step time and loss of --steps steps at a
smaller shape (--time_*: d 64, 4 heads, 8 x 64 tokens, fp32, as the CPU depth study; on a GPU, pass the
memory shape and bfloat16). PreNorm (no buffer) is the reference row. Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import statistics
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
SCANS = ("checkpointed", "kept_buffers")  # kept_buffers: the library's scan_source_buffer
SCANNED = ("prenorm", "block_attnres", "full_attnres")  # the variants the model scans


def _define_flags():
    flags.DEFINE_list("variants", ["prenorm", "block_attnres", "full_attnres"],
                      "depth_residuals' variants; prenorm (no buffer) is the reference, checkpointed only.")
    flags.DEFINE_list("scans", list(SCANS), f"Scans of the AttnRes rows, from {SCANS}.")
    flags.DEFINE_integer("layers", 32, "Transformer layers.")
    flags.DEFINE_integer("steps", 15, "Timed steps per row (after the compiling first step).")
    flags.DEFINE_integer("time_d_model", 64, "d_model of the timed rows.")
    flags.DEFINE_integer("time_num_heads", 4, "Attention heads of the timed rows (head_dim = d_model / heads).")
    flags.DEFINE_integer("time_batch", 8, "Sequences per step of the timed rows.")
    flags.DEFINE_integer("time_seq_len", 64, "Tokens per sequence of the timed rows.")
    flags.DEFINE_enum("time_dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the timed rows.")
    flags.DEFINE_bool("memory", True, "Compile each row at the memory shape for its temp memory "
                      "(--nomemory: times only).")
    flags.DEFINE_bool("tiny", False, "Smoke sizes: 2 layers, d 32, 2 x 32 tokens, 2 steps.")
    flags.DEFINE_string("out", "/tmp/k3jax_scan_buffer_memory/scan_buffer_memory", "Output prefix (.json/.md).")
    flags.register_validator("scans", lambda v: bool(v) and set(v) <= set(SCANS),
                             message=f"--scans must name some of {SCANS}")
    flags.register_validator("variants", lambda v: bool(v) and set(v) <= set(SCANNED),
                             message=f"--variants must name some of {SCANNED} (article_block has no scanned form)")


def _model_config(variant: str, layers: int, d_model: int, num_heads: int, batch: int, seq_len: int, dtype: str):
    from experiments.depth_residuals import Settings, run_config  # noqa: PLC0415
    settings = Settings(d_model=d_model, num_heads=num_heads, head_dim=d_model // num_heads, d_ff=3 * d_model,
                        seq_len=seq_len, batch_size=batch, dtype=dtype, scan_layers=True, remat="full")
    return run_config(settings, variant, layers, 0, "/tmp/unused").model


def _checkpointed(body, buffer, xs, first_slot):
    """The reference: the carry (the whole buffer) saved at every period."""
    import jax  # noqa: PLC0415
    del first_slot
    return jax.lax.scan(jax.checkpoint(body, prevent_cse=False), buffer, xs)


def _with_scan(scan: str):
    """Context: the model's scanned AttnRes stack runs `scan` ("kept_buffers" = the library's own)."""
    import contextlib  # noqa: PLC0415
    from unittest import mock  # noqa: PLC0415

    from k3jax.ops import residuals  # noqa: PLC0415
    if scan == "kept_buffers":
        return contextlib.nullcontext()
    return mock.patch.object(residuals, "scan_source_buffer", _checkpointed)


def _batch(batch: int, seq_len: int):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, 259)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((batch, seq_len), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len)),
            "loss_mask": jnp.ones((batch, seq_len), bool)}


def compiled_temp_gib(cfg, batch: int, seq_len: int, scan: str) -> float:
    """Temporary memory of the compiled train step on abstract parameters (GiB)."""
    import jax  # noqa: PLC0415

    from experiments.lowering_time import abstract_train_step  # noqa: PLC0415
    step, state, abstract_batch = abstract_train_step(cfg, batch, seq_len)
    jax.clear_caches()  # the other scan's trace must not be reused
    with _with_scan(scan):
        compiled = jax.jit(step).lower(state, abstract_batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


def timed_steps(cfg, batch: int, seq_len: int, scan: str, steps: int) -> dict:
    """Median wall time of `steps` train steps after the compiling first one, and the last loss."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.config import TrainConfig  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    from k3jax.train.step import bind_train_step  # noqa: PLC0415
    jax.clear_caches()  # bind_train_step's jit keys on the graph: the other scan's executable must not be reused
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    step = bind_train_step(model, nnx.Optimizer(model, make_optimizer(TrainConfig()), wrt=nnx.Param))
    data = _batch(batch, seq_len)
    with _with_scan(scan):
        start = time.perf_counter()
        metrics = jax.device_get(step(data))
        first = time.perf_counter() - start
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            metrics = jax.device_get(step(data))
            times.append(time.perf_counter() - start)
    return {"first_step_s": first, "median_step_ms": 1e3 * statistics.median(times), "loss": float(metrics["loss"])}


def main(argv):
    del argv
    import subprocess  # noqa: PLC0415

    from experiments.harness import environment, environment_line, markdown_table, write_results  # noqa: PLC0415
    layers, steps = (2, 2) if FLAGS.tiny else (FLAGS.layers, FLAGS.steps)
    tiny = dict(d_model=32, num_heads=2, batch=2, seq_len=32, dtype="float32")
    mem_shape = tiny if FLAGS.tiny else dict(d_model=512, num_heads=8, batch=16, seq_len=1024, dtype="bfloat16")
    time_shape = tiny if FLAGS.tiny else dict(d_model=FLAGS.time_d_model, num_heads=FLAGS.time_num_heads,
                                              batch=FLAGS.time_batch, seq_len=FLAGS.time_seq_len, dtype=FLAGS.time_dtype)
    rows = []
    for variant in FLAGS.variants:
        for scan in (FLAGS.scans if variant != "prenorm" else SCANS[:1]):
            mem_cfg = _model_config(variant, layers, **mem_shape)
            row = {"variant": variant, "scan": scan, "layers": layers,
                   "temp_gib": (compiled_temp_gib(mem_cfg, mem_shape["batch"], mem_shape["seq_len"], scan)
                                if FLAGS.memory else None),
                   **timed_steps(_model_config(variant, layers, **time_shape), time_shape["batch"],
                                 time_shape["seq_len"], scan, steps)}
            rows.append(row)
            print(row, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = environment(commit=commit)
    md = ["# Scanned AttnRes: two buffers and a slot per period for the backward vs the checkpointed scan", "", environment_line(env), "",
          f"`python -m experiments.scan_buffer_memory {' '.join(sys.argv[1:])}` at {commit or '?'}, "
          f"{layers} layers, scanned, remat full. "
          + (f"Temp memory: the compiled train step's (`memory_analysis`, this host's backend) at d "
             f"{mem_shape['d_model']} ({mem_shape['num_heads']} heads), {mem_shape['batch']} x "
             f"{mem_shape['seq_len']} tokens, {mem_shape['dtype']}. " if FLAGS.memory else
             "Temp memory: not measured (--nomemory). ")
          + f"Step time: median of {steps} steps after the first "
          f"at d {time_shape['d_model']} ({time_shape['num_heads']} heads), {time_shape['batch']} x "
          f"{time_shape['seq_len']} tokens, {time_shape['dtype']}.", ""]
    md += markdown_table(["variant", "scan", "temp GiB", "median step ms", "first step s", "loss"],
                         [[r["variant"], r["scan"], "—" if r["temp_gib"] is None else f"{r['temp_gib']:.3g}",
                           f"{r['median_step_ms']:.1f}", f"{r['first_step_s']:.1f}", f"{r['loss']:.4f}"] for r in rows])
    write_results(FLAGS.out, {"environment": env, "flags": {"variants": FLAGS.variants, "scans": FLAGS.scans,
                                                           "memory": FLAGS.memory, "layers": layers, "steps": steps,
                                                           "memory_shape": mem_shape, "time_shape": time_shape},
                              "rows": rows},
                  "\n".join(md) + "\n")
    print(f"wrote {FLAGS.out}.json and {FLAGS.out}.md")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
