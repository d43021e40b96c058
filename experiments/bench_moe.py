"""MoE benchmark on one GPU: the grouped GEMM through `k3jax.ops.grouped_matmul.grouped_matmul` (every
implementation it has, side by side in one process), `torch._grouped_mm` in a torch subprocess of the
same call, and the MoE LAYER forward+backward throughput.

  python -m experiments.bench_moe --out=$OUT/moe_gemm_h200

GEMM shape (ANCHORS.md): routed rows M = 32768 (4096 tokens x top-8), K = 2048, N = 1024, 64 experts,
bf16 operands, fp32 accumulation; "balanced" = M/E rows per expert, "skewed" = Zipf(1.5) expert ids.
Each implementation is timed with bf16 output and a bf16 cotangent (as `torch._grouped_mm`) and with
the fp32 output + fp32 cotangent the MoE layer uses; the error columns are RMS(out - xla)/RMS(xla) for
the output and for d lhs / d rhs. An implementation that is not installed or not supported for the call
gives a row with its reason.

Layer (`--layer_tokens` etc.): `k3jax.nn.MoEFeedForward` (bf16 experts, softmax router, Quantile
Balancing), forward+backward w.r.t. the input and every parameter; tokens/s and the achieved expert
FLOP rate (18 N k D F: three GEMMs, forward + two backward) as % of the measured dense bf16 matmul rate.

Timing: median of `--iters` runs after 3 warm-up calls, `block_until_ready` around each. Every row is
written to `<out>.json` / `<out>.md` as soon as it is measured, so a cut run keeps what it has.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from experiments.harness import VERSIONED, median_ms, package_versions


_OUT = flags.DEFINE_string("out", "/tmp/k3jax_bench_moe/moe_gemm", "Output path prefix (.json, .md); the "
                           "committed table is --out=experiments/results/moe_gemm_h200.")
_ITERS = flags.DEFINE_integer("iters", 30, "Timed runs per GEMM measurement (median reported).")
_M = flags.DEFINE_integer("m", 32768, "Routed rows.")
_K = flags.DEFINE_integer("k", 2048, "Contraction size.")
_N = flags.DEFINE_integer("n", 1024, "Output columns.")
_E = flags.DEFINE_integer("experts", 64, "Experts (groups).")
_IMPLS = flags.DEFINE_list("impls", ["xla", "tokamax", "jla"], "k3jax grouped_matmul implementations to time.")
_OUT_DTYPES = flags.DEFINE_list("out_dtypes", ["bfloat16", "float32"], "GEMM output (= cotangent) dtypes.")
_TORCH = flags.DEFINE_bool("torch", True, "Also time torch._grouped_mm in a subprocess (needs torch+CUDA).")
_LAYER_TOKENS = flags.DEFINE_integer("layer_tokens", 16384, "MoE layer: tokens per call (0 = skip the layer).")
_LAYER_D = flags.DEFINE_integer("layer_d_model", 2048, "MoE layer: d_model.")
_LAYER_F = flags.DEFINE_integer("layer_d_ff", 1024, "MoE layer: hidden width of one expert.")
_LAYER_E = flags.DEFINE_integer("layer_experts", 64, "MoE layer: routed experts.")
_LAYER_K = flags.DEFINE_integer("layer_top_k", 8, "MoE layer: experts per token.")
_LAYER_IMPLS = flags.DEFINE_list("layer_impls", ["default", "jla", "xla"],
                                 "MoE layer grouped-matmul implementations ('default' = implementation=None).")
_LAYER_ITERS = flags.DEFINE_integer("layer_iters", 10, "Timed runs per layer measurement.")

TORCH_SCRIPT = r"""
import json, sys, numpy as np, torch
from triton.testing import do_bench
M, K, N, G, iters = (int(x) for x in sys.argv[1:6])
groups = json.loads(sys.argv[6])
lhs = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
rhs = (torch.randn(G, K, N, device="cuda") * K ** -0.5).bfloat16()
dout = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
for name, gs in groups.items():
    offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
    a = lhs.clone().requires_grad_(True); b = rhs.clone().requires_grad_(True)
    def fb():
        torch._grouped_mm(a, b, offs=offs).backward(dout)
    fwd = do_bench(lambda: torch._grouped_mm(lhs, rhs, offs=offs), warmup=25, rep=100, return_mode="median")
    row = dict(impl="torch._grouped_mm", groups=name, out_dtype="bfloat16", fwd_ms=fwd,
               fwdbwd_ms=do_bench(fb, warmup=25, rep=100, return_mode="median"))
    print("JSON" + json.dumps(row), flush=True)
"""


def _rel(a, b):
    import jax.numpy as jnp
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(b**2)), 1e-30))


def _write(results):
    """Rewrite <out>.json and <out>.md from everything measured so far."""
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value + ".json", "w") as f:
        json.dump(results, f, indent=1)
    torch_fb = {r["groups"]: r["fwdbwd_ms"] for r in results["rows"]
                if r["impl"] == "torch._grouped_mm" and "fwdbwd_ms" in r}
    s = results["shape"]
    lines = [f"# MoE grouped GEMM and layer, {results['device']}, {results['date']}",
             "", f"Versions: {results['versions']}", "",
             f"GEMM M={s['M']} K={s['K']} N={s['N']}, {s['experts']} experts, bf16 operands / fp32 accumulation; "
             f"skewed max/mean load {results['skew_max_over_mean']:.1f}; dense bf16 matmul "
             f"{results['dense_matmul_ms']:.3f} ms ({results['dense_tflops']:.3g} TFLOP/s). Medians; fwd+bwd = d lhs "
             "and d rhs with a cotangent of the output dtype. Errors: RMS(x - xla)/RMS(xla).", "",
             "| implementation | groups | out/cotangent | fwd ms | fwd+bwd ms | fwd+bwd / torch | err out | err d lhs | err d rhs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        head = f"| {r['impl']} | {r.get('groups', '')} | {r.get('out_dtype', '')} |"
        if "error" in r:
            lines.append(f"{head} not run: {r['error'][:100]} | | | | | |")
            continue
        ratio = f"{r['fwdbwd_ms'] / torch_fb[r['groups']]:.2f}" if r.get("groups") in torch_fb else "—"
        errs = " | ".join(f"{r[k]:.1e}" if k in r else "" for k in ("err_out", "err_dlhs", "err_drhs"))
        lines.append(f"{head} {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {ratio} | {errs} |")
    if results["layer"]:
        lay = results["layer_shape"]
        lines += ["", f"MoE layer forward+backward: {lay['tokens']} tokens, d_model {lay['d_model']}, expert d_ff "
                  f"{lay['d_ff']}, {lay['experts']} experts, top-{lay['top_k']}, softmax router, quantile balancing, "
                  "bf16 experts. Expert FLOPs = 18 N k D F.", "",
                  "| grouped matmul | fwd+bwd ms | tokens/s | expert TFLOP/s | % of dense bf16 matmul |", "|---|---|---|---|---|"]
        for r in results["layer"]:
            if "error" in r:
                lines.append(f"| {r['impl']} | failed: {r['error'][:100]} | | | |")
            else:
                lines.append(f"| {r['impl']} ({r['resolved']}) | {r['fwdbwd_ms']:.2f} | {r['tokens_per_s']:.3g} | "
                             f"{r['tflops']:.3g} | {r['pct_dense']:.1f} |")
    with open(_OUT.value + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")




def _gemm_rows(results, lhs, rhs, groups):
    import jax
    import jax.numpy as jnp
    from k3jax.ops import grouped_matmul as gmm
    m, n = lhs.shape[0], rhs.shape[2]
    flops = 2 * m * lhs.shape[1] * n
    for gname, gs_np in groups.items():
        gs = jnp.asarray(gs_np)
        for out_name in _OUT_DTYPES.value:
            out_dtype = jnp.dtype(out_name)
            dout = jax.random.normal(jax.random.key(2), (m, n), jnp.float32).astype(out_dtype)
            ref = None
            for impl in _IMPLS.value:
                row = dict(impl=f"k3jax {impl}", groups=gname, out_dtype=out_name)
                try:
                    ok, reason = gmm.supported(impl, lhs, rhs, gs, out_dtype)
                    if not ok:
                        raise ValueError(reason)

                    def fn(a, b, impl=impl, gs=gs, out_dtype=out_dtype):
                        return gmm.grouped_matmul(a, b, gs, impl, preferred_element_type=out_dtype)

                    def fwd_bwd(a, b, fn=fn, dout=dout):
                        out, vjp = jax.vjp(fn, a, b)
                        return out, vjp(dout)

                    fwd_bwd = jax.jit(fwd_bwd)
                    out, (d_lhs, d_rhs) = fwd_bwd(lhs, rhs)
                    if ref is None and impl == "xla":
                        ref = (out, d_lhs, d_rhs)
                    if ref is not None:
                        row.update(err_out=_rel(out, ref[0]), err_dlhs=_rel(d_lhs, ref[1]), err_drhs=_rel(d_rhs, ref[2]))
                    row["fwd_ms"] = median_ms(jax.jit(fn), lhs, rhs, iters=_ITERS.value)
                    row["fwdbwd_ms"] = median_ms(fwd_bwd, lhs, rhs, iters=_ITERS.value)
                    row.update(fwd_tflops=flops / row["fwd_ms"] / 1e9, fwdbwd_tflops=3 * flops / row["fwdbwd_ms"] / 1e9)
                except Exception as ex:  # noqa: BLE001 -- one failing implementation must not hide the rest
                    row["error"] = repr(ex)[:400]
                print(row, flush=True)
                results["rows"].append(row)
                _write(results)


def _torch_rows(results, groups):
    m, k, n, e = _M.value, _K.value, _N.value, _E.value
    try:
        proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, str(m), str(k), str(n), str(e), str(_ITERS.value),
                               json.dumps({g: v.tolist() for g, v in groups.items()})],
                              capture_output=True, text=True, timeout=300)
        rows = [json.loads(x[4:]) for x in proc.stdout.splitlines() if x.startswith("JSON")]
        if not rows:
            rows = [dict(impl="torch._grouped_mm", error=proc.stderr[-300:])]
    except Exception as ex:  # noqa: BLE001
        rows = [dict(impl="torch._grouped_mm", error=repr(ex)[:300])]
    for row in rows:
        print(row, flush=True)
        results["rows"].append(row)
    _write(results)


def _layer_rows(results):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from k3jax.nn.moe import MoEFeedForward
    from k3jax.ops import grouped_matmul as gmm
    from k3jax.ops.balancing import QuantileBalancing
    tokens, d, f, e, k = (x.value for x in (_LAYER_TOKENS, _LAYER_D, _LAYER_F, _LAYER_E, _LAYER_K))
    results["layer_shape"] = dict(tokens=tokens, d_model=d, d_ff=f, experts=e, top_k=k)
    x = jax.random.normal(jax.random.key(3), (1, tokens, d), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(4), (1, tokens, d), jnp.bfloat16)
    flops = 18 * tokens * k * d * f
    rows_m = tokens * k
    for impl in _LAYER_IMPLS.value:
        name = None if impl == "default" else impl
        probe = (jax.ShapeDtypeStruct((rows_m, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16),
                 jax.ShapeDtypeStruct((e,), jnp.int32))
        resolved = gmm.default_implementation(*probe) if name is None else name
        row = dict(impl=impl, resolved=resolved)
        try:
            layer = MoEFeedForward(d, f, e, k, balancing=QuantileBalancing(),
                                   dispatch_implementation=name, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

            def loss(params, x):
                y, aux = nnx.merge(graphdef, params, rest)(x)
                return jnp.vdot(y.astype(jnp.float32), cot.astype(jnp.float32)) + aux["loss"]

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            ms = median_ms(step, params, x, iters=_LAYER_ITERS.value)
            row.update(fwdbwd_ms=ms, tokens_per_s=tokens / ms * 1e3, tflops=flops / ms / 1e9,
                       pct_dense=100 * flops / ms / 1e9 / results["dense_tflops"])
        except Exception as ex:  # noqa: BLE001
            row["error"] = repr(ex)[:400]
        print(row, flush=True)
        results["layer"].append(row)
        _write(results)


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    m, k, n, e = _M.value, _K.value, _N.value, _E.value
    rng = np.random.default_rng(0)
    groups = {"balanced": np.full(e, m // e, np.int32),
              "skewed": np.bincount(rng.zipf(1.5, size=m) % e, minlength=e).astype(np.int32)}
    kx, kw = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(kx, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kw, (e, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    flops = 2 * m * k * n
    dense = median_ms(jax.jit(lambda a, b: a @ b), lhs, rhs[0], iters=_ITERS.value)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": jax.devices()[0].device_kind,
               "versions": package_versions(VERSIONED), "shape": dict(M=m, K=k, N=n, experts=e),
               "skew_max_over_mean": float(groups["skewed"].max() / groups["skewed"].mean()),
               "dense_matmul_ms": dense, "dense_tflops": flops / dense / 1e9, "rows": [], "layer": []}
    print(f"dense {m}x{k}x{n}: {dense:.3f} ms ({flops / dense / 1e9:.3g} TFLOP/s)", flush=True)
    _write(results)
    _gemm_rows(results, lhs, rhs, groups)
    if _TORCH.value:
        _torch_rows(results, groups)
    if _LAYER_TOKENS.value:
        _layer_rows(results)
    print(open(_OUT.value + ".md").read())


if __name__ == "__main__":
    app.run(main)
