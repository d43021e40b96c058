"""Causal attention with packed documents: every `k3jax.ops.attention` implementation side by side.

  python -m experiments.bench_attention --out=experiments/results/attention_h200

Per shape B x T x H x Dh (bf16) and documents per row (segment_ids of exponential document lengths,
mean T / docs, at least 64 tokens; docs=1 uses the plain causal mask): forward and forward+backward
(grad of sum(o * do)) back to back (`harness.time_call` stream time, median of groups), and each
implementation's error RMS ratio against the fp32 "xla" output and gradients. Writes <out>.json/.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.harness import (environment, environment_line, markdown_table, packed_segment_ids, rms_ratio,
                                 time_call, write_results)
from k3jax.ops import attention as A

_SHAPES = flags.DEFINE_list("shapes", ["32x2048x6x128", "8x4096x16x128"], "B x T x H x Dh shapes.")
_DOCS = flags.DEFINE_list("docs_per_row", ["1", "16"], "Documents per row (1 = no segment_ids).")
_IMPLS = flags.DEFINE_list("implementations", list(A.IMPLEMENTATIONS), "Implementations to time.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls after compiling.")
_REPS = flags.DEFINE_integer("stream_reps", 15, "Groups of back-to-back calls (median).")
_OUT = flags.DEFINE_string("out", "/tmp/k3jax_bench_attention/attention", "Output prefix (<out>.json, <out>.md).")


def _inputs(B, T, H, Dh, i):
    ks = jax.random.split(jax.random.key(i), 4)
    return tuple(jax.random.normal(kk, (B, T, H, Dh), jnp.bfloat16) for kk in ks)


def bench_shape(B, T, H, Dh, docs, implementations, *, iters, warmup, reps):
    seg = None if docs == 1 else packed_segment_ids(B, T, docs)
    q, k, v, do = _inputs(B, T, H, Dh, 0)
    ref_fn = lambda q, k, v: A.causal_attention(q, k, v, segment_ids=seg, implementation="xla")  # noqa: E731
    ref = jax.jit(lambda q, k, v, do: (ref_fn(q, k, v), *jax.vjp(ref_fn, q, k, v)[1](do)))(
        *(x.astype(jnp.float32) for x in (q, k, v, do)))
    rows = []
    for name in implementations:
        ok, why = A.supported(name, q, k, v, segment_ids=seg)
        if not ok:
            rows.append(dict(implementation=name, skipped=why))
            continue
        fwd = jax.jit(lambda q, k, v, do, name=name: A.causal_attention(q, k, v, segment_ids=seg, implementation=name))

        def fwd_bwd(q, k, v, do, name=name):
            f = lambda q, k, v: A.causal_attention(q, k, v, segment_ids=seg, implementation=name)  # noqa: E731
            o, vjp = jax.vjp(f, q, k, v)
            return (o, *vjp(do))

        fwd_bwd = jax.jit(fwd_bwd)
        make = lambda i: _inputs(B, T, H, Dh, i)  # noqa: E731
        try:
            outs = fwd_bwd(q, k, v, do)
            t_f = time_call(fwd, make, iters=iters, warmup=warmup, stream_calls=iters, stream_reps=reps)
            t_b = time_call(fwd_bwd, make, iters=iters, warmup=warmup, stream_calls=iters, stream_reps=reps)
        except Exception as e:  # noqa: BLE001 (a backend failing on this call is a row, not the end of the run)
            rows.append(dict(implementation=name, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        errors = {n: rms_ratio(a.astype(jnp.float32), b) for n, a, b in zip(("o", "dq", "dk", "dv"), outs, ref)}
        rows.append(dict(implementation=name, fwd_ms=t_f["stream_ms"], fwd_bwd_ms=t_b["stream_ms"],
                         compile_s=t_f["compile_s"] + t_b["compile_s"], errors=errors))
    return rows


def main(argv):
    del argv
    results = []
    for shape in _SHAPES.value:
        B, T, H, Dh = (int(x) for x in shape.split("x"))
        for docs in (int(d) for d in _DOCS.value):
            rows = bench_shape(B, T, H, Dh, docs, _IMPLS.value, iters=_ITERS.value, warmup=_WARMUP.value,
                               reps=_REPS.value)
            results.append(dict(shape=shape, docs_per_row=docs, rows=rows))
            for r in rows:
                print(shape, docs, r, flush=True)
    env = environment()
    lines = ["# Causal attention with packed documents", "", environment_line(env), "",
             "bf16, back-to-back ms per call (median of groups); error = RMS ratio vs fp32 XLA (o / dq / dk / dv).", ""]
    table = []
    for res in results:
        for r in res["rows"]:
            if "skipped" in r:
                table.append([res["shape"], res["docs_per_row"], r["implementation"], "-", "-", r["skipped"][:80]])
            else:
                e = r["errors"]
                table.append([res["shape"], res["docs_per_row"], r["implementation"], f"{r['fwd_ms']:.3f}",
                              f"{r['fwd_bwd_ms']:.3f}", " / ".join(f"{e[n]:.1e}" for n in ("o", "dq", "dk", "dv"))])
    lines += markdown_table(["B x T x H x Dh", "docs/row", "implementation", "fwd ms", "fwd+bwd ms", "error"], table)
    write_results(_OUT.value, dict(environment=env, results=results), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
