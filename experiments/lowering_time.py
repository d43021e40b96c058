"""JAX's share of a training step's GPU compile, measured on any host (issue 26).

  PYTHONPATH=<jla's wheel unpacked> python -m experiments.lowering_time --shapes=k3_small,1b --depth_layers=32 \
      --out=experiments/results/lowering_cpu

bench_train's compile seconds are JAX's trace and lowering to StableHLO (the Pallas kernels' Triton IR
and Mosaic GPU modules included) plus XLA's backend compile. The first two are Python on the host and do
not depend on the device: this script traces and lowers bench_train's k3jax step for CUDA on the host it
runs on, as if on an H200. The kernels' device checks are faked for the duration of the call (private
JAX APIs: the kernel plan's Hopper check, the Pallas Triton target, cuDNN's version check; the ops'
`implementation=None` rule answers as on an H200: KDA and depth-attention kernels, cuDNN attention).
Attention and grouped matmuls lower as on the H200 where jla and tokamax import (put the wheels of
experiments/gpu_wheels.txt on PYTHONPATH); without them attention lowers as cuDNN's and grouped matmuls as
XLA's. XLA's backend compile needs the GPU: bench_train records it (`backend_compile_s`).

Per row (bench_train's like_for_like / k3_default at each of --shapes, layers unrolled or scanned as bench_train
runs them; the trainer's `train_step` on abstract parameters): trace seconds, lower seconds (median of --reps, caches cleared before each), the Mosaic GPU and
Triton custom calls in the lowered module, and its size. Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
    flags.DEFINE_list("shapes", ["k3_small"], "bench_train shapes: k3_small, 1b, tiny.")
    flags.DEFINE_list("rows", ["like_for_like", "k3_default"], "bench_train k3jax rows.")
    flags.DEFINE_enum("scan_layers", "default", ["default", "true", "false"],
                      "Scan the layers (remat full) or not; default: as bench_train at the shape.")
    flags.DEFINE_list("depth_layers", [], "Also the depth sweep's model (experiments/gpu_checks/depth_gpu.sh: "
                      "d 512, attention + SwiGLU, 16 x 1024 tokens, unrolled) at these layer counts, PreNorm, "
                      "Block AttnRes (8 blocks) and Full AttnRes.")
    flags.DEFINE_integer("reps", 1, "Trace + lower repetitions per row (median).", lower_bound=1)
    flags.DEFINE_string("out", "/tmp/k3jax_lowering_time/lowering", "Output prefix (.json/.md).")


@contextlib.contextmanager
def as_if_h200():
    """The ops' implementation=None rules and the kernels' device checks answer as on an H200 (sm_90)."""
    import jax  # noqa: PLC0415
    import jax._src.cudnn.fused_attention_stablehlo as cudnn_attention  # noqa: PLC0415  private API
    from jax._src.pallas.triton import gpu_info  # noqa: PLC0415  private API

    from pallas_kernels.kda import plan as kda_plan  # noqa: PLC0415

    class H200:
        platform, device_kind, compute_capability = "gpu", "NVIDIA H200", "9.0"

    info = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90)
    with contextlib.ExitStack() as stack:
        for target, name, value in [
            (jax, "default_backend", lambda: "gpu"), (jax, "devices", lambda *a: [H200()]),
            (gpu_info, "get_gpu_info", lambda: info), (kda_plan, "is_hopper", lambda device=None: True),
            (cudnn_attention, "check_cudnn_version", lambda: 91000),
            (cudnn_attention, "check_compute_capability", lambda capability: True)]:
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def lower_row(shape: str, row: str, *, scan_layers: bool | None, reps: int) -> dict:
    """Trace and lower bench_train's step of `row` at `shape` for CUDA; seconds and custom-call counts."""
    from experiments.bench_train import SHAPES, model_config  # noqa: PLC0415
    s = SHAPES[shape]
    scan = s.get("scan_layers", False) if scan_layers is None else scan_layers
    cfg = model_config(shape, row, scan_layers=scan, remat="full" if scan else "none")
    return {"shape": shape, "row": row, "scan_layers": scan,
            **lower_model(cfg, s["batch_size"], s["seq_len"], reps=reps)}


def lower_depth_row(variant: str, num_layers: int, *, reps: int) -> dict:
    """The same for the depth sweep's model at GPU scale (depth_gpu.sh's settings), unrolled."""
    from experiments.depth_residuals import Settings, run_config  # noqa: PLC0415
    settings = Settings(d_model=512, num_heads=8, head_dim=64, d_ff=1536, seq_len=1024, batch_size=16,
                        dtype="bfloat16")
    cfg = run_config(settings, variant, num_layers, 0, "/tmp/unused").model
    return {"shape": f"depth L{num_layers}", "row": variant, "scan_layers": False,
            **lower_model(cfg, settings.batch_size, settings.seq_len, reps=reps)}


def abstract_train_step(cfg, B: int, T: int):
    """The trainer's step of a `ModelConfig` as a pure function on abstract values: (step, state, batch), with
    `step(state, batch) -> (metrics, new state)`, the parameters and optimizer state of `nnx.eval_shape` and a
    `[B, T]` batch of ShapeDtypeStructs. Ready for `jax.jit(step).trace / lower(state, batch)`."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.config import TrainConfig  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    from k3jax.train.step import train_step  # noqa: PLC0415

    def build():
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(TrainConfig()), wrt=nnx.Param)
    graphdef, state = nnx.split(nnx.eval_shape(build))
    batch = {"inputs": jax.ShapeDtypeStruct((B, T), "int32"), "targets": jax.ShapeDtypeStruct((B, T), "int32"),
             "segment_ids": jax.ShapeDtypeStruct((B, T), "int32"), "positions": jax.ShapeDtypeStruct((B, T), "int32"),
             "loss_mask": jax.ShapeDtypeStruct((B, T), "bool")}

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        return train_step(model, optimizer, batch), nnx.state((model, optimizer))
    return step, state, batch


def lower_model(cfg, B: int, T: int, *, reps: int) -> dict:
    """Trace and lower the trainer's step of a `ModelConfig` for CUDA (median seconds, custom calls)."""
    import jax  # noqa: PLC0415

    step, state, batch = abstract_train_step(cfg, B, T)
    trace_s, lower_s = [], []
    for _ in range(reps):
        jax.clear_caches()
        with as_if_h200():
            t0 = time.perf_counter()
            traced = jax.jit(step).trace(state, batch)
            t1 = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            t2 = time.perf_counter()
        trace_s.append(t1 - t0)
        lower_s.append(t2 - t1)
    return {"trace_s": statistics.median(trace_s),
            "lower_s": statistics.median(lower_s), "trace_s_all": trace_s, "lower_s_all": lower_s,
            "mosaic_gpu_calls": text.count("custom_call @mosaic_gpu"),
            "triton_calls": text.count("__gpu$xla.gpu.triton"), "module_mb": len(text) / 1e6}


def main(argv):
    del argv
    import subprocess  # noqa: PLC0415

    from experiments.bench_train import SHAPES, VARIANTS  # noqa: PLC0415
    from experiments.harness import environment, environment_line, markdown_table, write_results  # noqa: PLC0415
    for name, given, known in (("shapes", FLAGS.shapes, SHAPES), ("rows", FLAGS.rows, VARIANTS)):
        unknown = [x for x in given if x not in known]
        if not given or unknown:
            raise ValueError(f"--{name} must be a non-empty list from {sorted(known)}; got {given}")
    scan = {"default": None, "true": True, "false": False}[FLAGS.scan_layers]
    rows = []
    for shape in FLAGS.shapes:
        for row in FLAGS.rows:
            rows.append(lower_row(shape, row, scan_layers=scan, reps=FLAGS.reps))
            print({k: v for k, v in rows[-1].items() if not k.endswith("_all")}, flush=True)
    for num_layers in (int(x) for x in FLAGS.depth_layers):
        for variant in ("prenorm", "block_attnres", "full_attnres"):
            rows.append(lower_depth_row(variant, num_layers, reps=FLAGS.reps))
            print({k: v for k, v in rows[-1].items() if not k.endswith("_all")}, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = environment(commit=commit)
    md = ["# JAX trace + lowering of the train step for an H200", "", environment_line(env), "",
          f"`python -m experiments.lowering_time --shapes={','.join(FLAGS.shapes)} --rows={','.join(FLAGS.rows)} "
          + (f"--depth_layers={','.join(FLAGS.depth_layers)} " if FLAGS.depth_layers else "")
          + f"--reps={FLAGS.reps}` at {commit or '?'}: seconds on this host (median of {FLAGS.reps}); XLA's backend "
          "compile is not included (bench_train's backend_compile_s).", ""]
    md += markdown_table(["shape", "row", "layers", "trace s", "lower s", "Mosaic GPU lowerings", "Triton lowerings",
                          "module MB"],
                         [[r["shape"], r["row"], "scanned" if r["scan_layers"] else "unrolled", f"{r['trace_s']:.1f}",
                           f"{r['lower_s']:.1f}", r["mosaic_gpu_calls"], r["triton_calls"], f"{r['module_mb']:.1f}"]
                          for r in rows])
    flag_values = {"shapes": FLAGS.shapes, "rows": FLAGS.rows, "scan_layers": FLAGS.scan_layers,
                   "depth_layers": FLAGS.depth_layers, "reps": FLAGS.reps}
    write_results(FLAGS.out, {"environment": env, "flags": flag_values, "rows": rows},
                  "\n".join(md) + "\n")
    print(f"wrote {FLAGS.out}.json and {FLAGS.out}.md")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
