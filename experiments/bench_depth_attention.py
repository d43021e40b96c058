"""Block AttnRes depth mixes of a whole stack, "xla" vs "pallas" (k3jax.ops.residuals), forward+backward.

  python -m experiments.bench_depth_attention --out=experiments/results/depth_attention_h200
  python -m experiments.bench_depth_attention --shapes=tiny --iters=2 --reps=2   # CPU smoke (xla only)

A shape is the depth structure of one of bench_train's models, with every sublayer replaced by a
stand-in f_l(h) = c_l ⊙ h with a per-channel scale c_l [D] (one elementwise op, the same for both
implementations; per channel, so that the sources are not collinear and the softmax over them depends on
the pseudo-queries), so the time is that of the L + 1 depth mixes and the source bookkeeping:
  k3_small: 8 layers, 4 blocks of sublayers, 32 x 2048 tokens, d_model 768, unrolled (each mix reads a
    Python list of sources: `attnres_forward`, what the unrolled model runs);
  1b: 24 layers, 4 blocks, 16 x 4096 tokens, d_model 2048, scanned over the 6 repeats of a 4-layer
    period with remat "full" and a carried [5, B, T, D] source buffer (`depth_attention_carry`, what the
    scanned model runs).
Per implementation: back-to-back ms of jit(value_and_grad) (median of groups, `harness.time_call`), the
compile seconds, the loss beside the fp32 truth's (Σ hidden · ct with a random ct: a sum of B·T·D terms
of both signs that cancel, so bf16 noise in the hidden states can move it by tens of %), and the RMS
ratio of each gradient (embedding, pseudo-queries, key-norm scales, stand-in scales) against the fp32
truth (XLA on an fp32 embedding). bf16 sources, fp32 parameters. Writes <out>.json/.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.harness import environment, environment_line, markdown_table, rms_ratio, time_call, write_results
from k3jax.ops import residuals as R

SHAPES = {"k3_small": dict(layers=8, blocks=4, B=32, T=2048, D=768, scanned=False),
          "1b": dict(layers=24, blocks=4, B=16, T=4096, D=2048, scanned=True, period=4),
          "tiny": dict(layers=4, blocks=3, B=2, T=64, D=48, scanned=True, period=2)}
_SHAPES = flags.DEFINE_list("shapes", ["k3_small", "1b"], f"Shapes: {sorted(SHAPES)}.")
_IMPLS = flags.DEFINE_list("implementations", None, "Implementations (default: xla, and pallas on a GPU).")
_ITERS = flags.DEFINE_integer("iters", 10, "Calls per group.")
_REPS = flags.DEFINE_integer("reps", 10, "Groups of back-to-back calls (median).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also time the op alone (3 of 5 buffer slots valid) under a few "
                           "pallas_kernels.depth_attention.Tuning values at each shape's tokens and d_model.")
_OUT = flags.DEFINE_string("out", "/tmp/k3jax_bench_depth_attention/depth_attention", "Output prefix (<out>.json, <out>.md).")


def stack_loss(shape: dict, implementation: str):
    """loss(embedding, queries [L+1, D], scales [L+1, D], c [L, D], ct [B, T, D]) of the stand-in stack."""
    layout = R.block_layout(shape["layers"], shape["blocks"])
    L = layout.num_sublayers

    def unrolled(emb, queries, scales, c, ct):
        fns = [lambda h, l=l: (c[l] * h.astype(jnp.float32)).astype(h.dtype) for l in range(L)]
        out = R.attnres_forward(emb, fns, layout, queries, scales, implementation=implementation)
        return jnp.sum(out.hidden.astype(jnp.float32) * ct)

    def scanned(emb, queries, scales, c, ct):
        per = 2 * shape["period"]
        groups = L // per
        scan_in = layout.scan_inputs()
        xs = dict(q=queries[:-1].reshape(groups, per, -1), s=scales[:-1].reshape(groups, per, -1),
                  c=c.reshape(groups, per, -1), slot=jnp.asarray(scan_in["slot"]).reshape(groups, per),
                  n=jnp.asarray(scan_in["num_valid"]).reshape(groups, per))

        @jax.checkpoint
        def body(carry, x):
            for i in range(per):
                h, _, carry = R.depth_attention_carry(carry, x["q"][i], x["s"][i], num_valid=x["n"][i],
                                                      implementation=implementation)
                out = (x["c"][i] * h.astype(jnp.float32)).astype(carry.dtype)
                updated = jax.lax.dynamic_index_in_dim(carry, x["slot"][i], 0, keepdims=False) + out
                carry = jax.lax.dynamic_update_index_in_dim(carry, updated, x["slot"][i], 0)
            return carry, None

        buf = jnp.zeros((layout.max_sources, *emb.shape), emb.dtype).at[0].set(emb)
        buf, _ = jax.lax.scan(body, buf, xs)
        hidden = R.depth_attention(buf, queries[-1], scales[-1], implementation=implementation)
        return jnp.sum(hidden.astype(jnp.float32) * ct)

    return scanned if shape["scanned"] else unrolled


def make_inputs(shape: dict, i: int):
    L = 2 * shape["layers"]
    B, T, D = shape["B"], shape["T"], shape["D"]
    ks = jax.random.split(jax.random.key(i), 5)
    return (jax.random.normal(ks[0], (B, T, D), jnp.bfloat16),
            0.3 * jax.random.normal(ks[1], (L + 1, D), jnp.float32) / np.sqrt(D) * 8,
            1 + 0.1 * jax.random.normal(ks[2], (L + 1, D), jnp.float32),
            1 + 0.5 * jax.random.normal(ks[3], (L, D), jnp.float32),
            jax.random.normal(ks[4], (B, T, D), jnp.float32) / (B * T))


def bench(name: str, implementations, *, iters: int, reps: int) -> list[dict]:
    shape = SHAPES[name]
    rows, ref = [], None
    for impl in implementations:
        fn = jax.jit(jax.value_and_grad(stack_loss(shape, impl), argnums=(0, 1, 2, 3)))
        try:
            timing = time_call(fn, lambda i: make_inputs(shape, i), iters=1, warmup=1, stream_calls=iters,
                               stream_reps=reps)
            loss, grads = fn(*make_inputs(shape, 0))
        except Exception as e:  # noqa: BLE001 (a failing implementation is a row, not the end of the run)
            rows.append(dict(shape=name, implementation=impl, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        row = dict(shape=name, implementation=impl, fwd_bwd_ms=timing["stream_ms"], compile_s=timing["compile_s"],
                   loss=float(loss))
        if ref is None:  # the fp32 truth: XLA on an fp32 embedding
            args = make_inputs(shape, 0)
            ref = jax.jit(jax.value_and_grad(stack_loss(shape, "xla"), argnums=(0, 1, 2, 3)))(
                args[0].astype(jnp.float32), *args[1:])
        row["loss_fp32"] = float(ref[0])
        row["grad_rms_ratio"] = [rms_ratio(a, b) for a, b in zip(grads, ref[1])]
        rows.append(row)
        print(row, flush=True)
    return rows


TUNINGS = {"default": {}, "fwd8k": dict(fwd_elems=8192), "fwd16k_w8": dict(fwd_elems=16384, num_warps=8),
           "bwd2k": dict(bwd_elems=2048), "bwd8k_w8": dict(bwd_elems=8192, num_warps=8),
           "w8": dict(num_warps=8), "progs4k": dict(bwd_programs=4096)}


def sweep(name: str, *, iters: int, reps: int) -> list[dict]:
    """fwd and fwd+bwd ms of the op alone on a [5, B·T, D] bf16 buffer with num_valid = 3 (traced)."""
    from pallas_kernels.depth_attention import Tuning, depth_attention_pallas  # noqa: PLC0415
    shape = SHAPES[name]
    n_tok, d = shape["B"] * shape["T"], shape["D"]

    def make(i):
        ks = jax.random.split(jax.random.key(i), 3)
        return (jax.random.normal(ks[0], (5, n_tok, d), jnp.bfloat16), jax.random.normal(ks[1], (d,), jnp.float32),
                jax.random.normal(ks[2], (n_tok, d), jnp.bfloat16))
    rows = []
    for label, kw in TUNINGS.items():
        tuning = Tuning(**kw)
        fwd = jax.jit(lambda b, q, ct, t=tuning: depth_attention_pallas(b, q, num_valid=jnp.int32(3), tuning=t)[0])

        def loss(b, q, ct, t=tuning):
            out, _, b = depth_attention_pallas(b, q, num_valid=jnp.int32(3), pass_through=True, tuning=t)
            return jnp.sum((out * ct).astype(jnp.float32)) + jnp.sum(b[4].astype(jnp.float32))
        fb = jax.jit(jax.grad(loss, argnums=(0, 1)))
        try:
            t_f = time_call(fwd, make, iters=1, warmup=1, stream_calls=iters, stream_reps=reps)
            t_b = time_call(fb, make, iters=1, warmup=1, stream_calls=iters, stream_reps=reps)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(shape=name, tuning=label, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        # [N, D] bf16 units: forward reads 3 sources, writes 1 (4); backward reads 2 x 3 sources and g (7) and
        # reads + writes 3 slots of the buffer's cotangent (6), which XLA first writes whole (5): 22 at 4.8 TB/s
        gb = n_tok * d * 2 / 1e9
        rows.append(dict(shape=name, tuning=label, fwd_ms=t_f["stream_ms"], fwd_bwd_ms=t_b["stream_ms"],
                         fwd_gbs=4 * gb / (t_f["stream_ms"] / 1e3), floor_fwd_bwd_ms=22 * gb / 4.8e3 * 1e3))
        print(rows[-1], flush=True)
    return rows


def main(argv):
    del argv
    impls = _IMPLS.value or (["xla", "pallas"] if jax.default_backend() == "gpu" else ["xla"])
    rows = [r for s in _SHAPES.value for r in bench(s, impls, iters=_ITERS.value, reps=_REPS.value)]
    sweeps = [r for s in _SHAPES.value for r in sweep(s, iters=_ITERS.value, reps=_REPS.value)] if _SWEEP.value else []
    env = environment()
    table = markdown_table(["shape", "implementation", "fwd+bwd ms", "vs xla", "compile s",
                            "loss (fp32 truth)", "grad RMS ratio vs fp32 (emb, w, γ, c)"],
                           [[r["shape"], r["implementation"], r.get("fwd_bwd_ms", r.get("skipped")),
                             "" if "fwd_bwd_ms" not in r else
                             f"{next(x['fwd_bwd_ms'] for x in rows if x['shape'] == r['shape'] and 'fwd_bwd_ms' in x) / r['fwd_bwd_ms']:.2f}x",
                             r.get("compile_s", ""),
                             f"{r['loss']:.5g} ({r['loss_fp32']:.5g})" if "loss_fp32" in r else "", ", ".join(f"{e:.2g}" for e in r.get("grad_rms_ratio", []))]
                            for r in rows])
    lines = [f"# Block AttnRes depth mixes of a whole stack, fwd+bwd\n", environment_line(env), "",
             "`python -m experiments.bench_depth_attention` (stand-in sublayers; see the script's docstring).",
             "", *table, ""]
    if sweeps:
        lines += ["## The op alone, Pallas tuning values ([5, B·T, D] bf16 buffer, 3 slots valid)", "",
                  *markdown_table(["shape", "tuning", "fwd ms", "fwd GB/s", "fwd+bwd ms", "fwd+bwd floor ms"],
                                  [[r["shape"], r["tuning"], r.get("fwd_ms", r.get("skipped")), r.get("fwd_gbs", ""),
                                    r.get("fwd_bwd_ms", ""), r.get("floor_fwd_bwd_ms", "")] for r in sweeps]), ""]
    md = "\n".join(lines)
    write_results(_OUT.value, dict(environment=env, rows=rows, sweep=sweeps), md)
    print(md)


if __name__ == "__main__":
    app.run(main)
