"""ptxas's register and spill report for the Mosaic GPU KDA kernels (GPU only).

Mosaic GPU compiles a kernel to PTX and runs ptxas when XLA compiles the program that calls it;
with MOSAIC_GPU_DUMP_PTXAS=1 (set here before jax is imported) jaxlib prints ptxas's verbose
report to stderr: registers per thread, spill stores / loads in bytes, and notes such as C7514
(wgmma serialised). One warpgroup per CTA has at most 255 registers a thread, so spills and code
size decide much of these kernels' speed (kda_pallas_notes.md, round 15).

Each --kernels entry is a bench_kda_kernels kernel row name (the Mosaic GPU ones:
bench_kda_kernels.MOSAIC_KERNELS), optionally with ":" and "+"-joined private ablations, e.g.
intra_bwd_a_hopper:dL. Each is compiled and run once on bench_kda_kernels.profile_inputs at --shape.

Run (H200): python -m experiments.ptxas_report --kernels=intra_bwd_a_hopper,intra_bwd_b_hopper 2>&1 \
  | grep -E "===|spill|Used|C7514"
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

from absl import app, flags  # noqa: E402

flags.DEFINE_list("kernels", ["intra_bwd_a_hopper", "intra_bwd_b_hopper", "state_fwd_hopper"],
                  "bench_kda_kernels kernel rows, each optionally 'name:ablation+ablation'")
flags.DEFINE_string("shape", "1x1024x2x128", "BxTxHxK of the inputs (V = K); registers do not depend on it")
FLAGS = flags.FLAGS


def parse_spec(spec: str) -> tuple[str, tuple[str, ...]]:
    """'name' or 'name:a+b' -> (name, ("a", "b")); ValueError naming the spec for an unknown kernel
    or ablation."""
    from experiments import bench_kda_kernels as bk
    name, _, abl = spec.partition(":")
    ablate = tuple(a for a in abl.split("+") if a)
    if name not in bk.MOSAIC_KERNELS:
        raise ValueError(f"--kernels entry {spec!r}: {name!r} is not one of {bk.MOSAIC_KERNELS}")
    bad = [a for a in ablate if a not in bk.ABLATION_NAMES[name]]
    if bad:
        raise ValueError(f"--kernels entry {spec!r}: unknown ablations {bad}; "
                         f"{name} takes {bk.ABLATION_NAMES[name]}")
    return name, ablate


def main(argv):
    del argv
    import jax
    from experiments import bench_kda_kernels as bk
    specs = [parse_spec(s) for s in FLAGS.kernels]
    try:
        B, T, H, K = (int(x) for x in FLAGS.shape.split("x"))
    except ValueError:
        raise ValueError(f"--shape must be BxTxHxK, got {FLAGS.shape!r}") from None
    inputs = bk.profile_inputs(B, T, H, K)
    for name, ablate in specs:
        print(f"=== {name} {'+'.join(ablate) or 'none'}", flush=True)
        fn = bk.profile_fn(name, ablate, 0, K, False)
        jax.block_until_ready(jax.jit(fn)(*inputs[name]))
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    app.run(main)
