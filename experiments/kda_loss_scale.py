"""KDA gradients at every loss scale: grad(c L) / c against the fp32 recurrence, near the gate bound.

The training loss reaching a KDA layer is of order 1 / (tokens per step), so its cotangents are
~1e-5, and channels that learn a fast decay sit near lower_bound = -5. This measures, for each
implementation (`kda(..., implementation=...)`; "pallas" in interpret mode off a GPU), fla's error
metric (RMS(ref - out) / RMS(ref)) of dq, dk, dv, dg, dbeta, dh0 at loss scales c with
L = c sum(o w) for a fixed order-1 cotangent w, bf16 inputs (q ~ N(0, 1), k L2-normalised,
v ~ N(0, 1), beta = sigmoid(N(0, 1))), B = 1, T = 128, H = 2, K = V = 32, lower_bound = -5 declared,
and four gate cases: the ANCHORS recipe -5 sigmoid(N(0, 1)); -5 sigmoid(N(2, 1)) (most channels near
the bound); one channel at -4.95 among -0.1 (that channel's dg reported too, "dg0"); every gate -5.
Writes <out>.json and <out>.md. The reference is the fp32 recurrence on the bf16-rounded inputs at c = 1.

Run (CPU): python -m experiments.kda_loss_scale --out=experiments/results/kda_loss_scale_cpu
"""
from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import environment, rms_ratio

flags.DEFINE_list("implementations", ["chunked", "pallas"], "kda implementations to measure")
flags.DEFINE_list("gates", ["recipe", "near_bound", "one_fast_channel", "at_bound"], "gate cases")
flags.DEFINE_list("scales", ["1", "1e-4", "1e-6", "1e3", "1e6"], "loss scales c")
flags.DEFINE_string("shape", "1x128x2x32", "BxTxHxK (V = K)")
flags.DEFINE_string("out", "/tmp/k3jax_kda_loss_scale/kda_loss_scale", "output path without extension ('' = none)")
FLAGS = flags.FLAGS
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(key, B, T, H, K, gate):
    ks = jax.random.split(key, 7)
    k = jax.random.normal(ks[1], (B, T, H, K))
    z = jax.random.normal(ks[4], (B, T, H, K))
    g = {"recipe": lambda: -5 * jax.nn.sigmoid(z), "near_bound": lambda: -5 * jax.nn.sigmoid(z + 2),
         "one_fast_channel": lambda: jnp.full(z.shape, -0.1).at[..., 0].set(-4.95),
         "at_bound": lambda: jnp.full(z.shape, -5.0)}[gate]()
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    x = dict(q=bf(jax.random.normal(ks[0], (B, T, H, K))), k=bf(k / jnp.linalg.norm(k, axis=-1, keepdims=True)),
             v=bf(jax.random.normal(ks[2], (B, T, H, K))), g=g, beta=bf(jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))),
             h0=jax.random.normal(ks[6], (B, H, K, K)))
    return x, jax.random.normal(ks[5], (B, T, H, K))


def grad_fn(implementation):
    from k3jax.ops.kda import kda
    kw = dict(interpret=True) if implementation == "pallas" and jax.default_backend() != "gpu" else {}
    lower_bound = None if implementation == "recurrent" else -5.0

    def loss(args, w, c):
        o, _ = kda(*args[:5], initial_state=args[5], output_final_state=True, lower_bound=lower_bound,
                   implementation=implementation, **kw)
        return jnp.sum(o.astype(jnp.float32) * (c * w))
    return jax.jit(lambda args, w, c: [x.astype(jnp.float32) / c for x in jax.grad(loss)(args, w, c)])


def main(argv):
    del argv
    B, T, H, K = (int(v) for v in FLAGS.shape.split("x"))
    oracle = grad_fn("recurrent")
    fns = {name: grad_fn(name) for name in FLAGS.implementations}
    rows = []
    for gate in FLAGS.gates:
        x, w = inputs(jax.random.PRNGKey(0), B, T, H, K, gate)
        names = ("q", "k", "v", "g", "beta", "h0")
        ref = oracle([x[n].astype(jnp.float32) for n in names], w, 1.0)
        for impl, fn in fns.items():
            for c in (float(s) for s in FLAGS.scales):
                got = fn([x[n] for n in names], w, c)
                errs = {n: rms_ratio(o, r) for n, r, o in zip(GRADS, ref, got)}
                if gate == "one_fast_channel":
                    errs["dg0"] = rms_ratio(got[3][..., 0], ref[3][..., 0])
                rows.append(dict(gate=gate, implementation=impl, scale=c, **errs))
                print(json.dumps(rows[-1]), flush=True)
    env = environment()
    lines = [f"| gates | implementation | c | {' | '.join(GRADS)} | dg0 |", "|---|---|---|" + "---|" * (len(GRADS) + 1)]
    for r in rows:
        lines.append(f"| {r['gate']} | {r['implementation']} | {r['scale']:g} | "
                     + " | ".join(f"{r[n]:.1e}" for n in GRADS) + f" | {r['dg0']:.1e} |" if "dg0" in r else
                     f"| {r['gate']} | {r['implementation']} | {r['scale']:g} | "
                     + " | ".join(f"{r[n]:.1e}" for n in GRADS) + " | |")
    md = "\n".join(lines) + "\n"
    print(md)
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out + ".json", "w") as f:
            json.dump(dict(environment=env, shape=FLAGS.shape, rows=rows), f, indent=1)
        with open(FLAGS.out + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    app.run(main)
