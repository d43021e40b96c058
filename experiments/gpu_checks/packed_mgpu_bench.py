"""Packed documents (segment_ids) in the Pallas KDA op on a Hopper GPU (issue 25): forward + backward
time of kda_pallas under "mosaic_gpu" (the Mosaic GPU intra stages take the documents), dense (no
segment_ids, the floor) and backend="triton" (every stage Triton).

Inputs: harness.make_kda_inputs (bf16, lower_bound -5); documents of random lengths 1 + geometric
(mean --mean-doc tokens). Times: harness.time_call, back-to-back device-bound ms of a jitted
value-and-grad (all five input gradients).

  python -m experiments.gpu_checks.packed_mgpu_bench --out $OUT/kda_packed_ab_h100
(its 2026-12-03 H200 run: experiments/results/kda_packed_h200.json in git at 4435444; the table with
the peers is bench_kda --docs_per_row, experiments/results/kda_packed.md.)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.kda as pk
from experiments import harness

VARIANTS = {  # name: (backend, segmented)
    "mosaic_gpu packed": ("mosaic_gpu", True),
    "mosaic_gpu dense": ("mosaic_gpu", False),
    "triton packed": ("triton", True),
}


def packed_ids(B, T, mean_doc, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        t, i = 0, 0
        while t < T:
            n = 1 + int(rng.geometric(1.0 / mean_doc))
            seg[b, t:t + n] = i
            t, i = t + n, i + 1
    return jnp.asarray(seg)


def step_fn(backend, seg, interpret=False):
    def loss(q, k, v, g, beta, do):
        o, _ = pk.kda_pallas(q, k, v, g, beta, lower_bound=-5.0, segment_ids=seg, backend=backend,
                             interpret=interpret)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="32x2048x6x128,8x4096x16x128", help="BxTxHxK, comma separated")
    p.add_argument("--mean-doc", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--stream-calls", type=int, default=20)
    p.add_argument("--stream-reps", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--interpret", action="store_true", help="interpret mode (a CPU smoke run, K = 64)")
    a = p.parse_args(argv)
    rows, data = [], dict(environment=harness.environment(), mean_doc=a.mean_doc, results=[])
    for shape in a.shapes.split(","):
        B, T, H, K = harness.parse_kda_shape(shape)
        seg = packed_ids(B, T, a.mean_doc)
        docs = int(jnp.sum(seg[:, 1:] != seg[:, :-1])) + B
        for name, (backend, segmented) in VARIANTS.items():
            fn = step_fn(backend, seg if segmented else None, a.interpret)
            make = lambda i: harness.make_kda_inputs(jax.random.PRNGKey(i), B, T, H, K, jnp.bfloat16)  # noqa: E731
            t = harness.time_call(fn, make, iters=a.iters, warmup=2, stream_calls=a.stream_calls,
                                  stream_reps=a.stream_reps)
            rows.append([shape, name, t["stream_ms"], t["median_ms"]])
            data["results"].append(dict(shape=shape, variant=name, documents=docs, **t))
            print(shape, name, f"{t['stream_ms']:.3f} ms back to back, {t['median_ms']:.3f} ms per call", flush=True)
    md = "\n".join([f"# Packed documents in the Pallas KDA op (issue 25)", "", harness.environment_line(data["environment"]),
                    "", f"fwd + bwd (5 input gradients), bf16, lower_bound -5, documents mean {a.mean_doc} tokens.", ""]
                   + harness.markdown_table(["shape", "variant", "back-to-back ms", "per-call ms"], rows)) + "\n"
    print(md)
    if a.out:
        harness.write_results(a.out, data, md)


if __name__ == "__main__":
    main()
