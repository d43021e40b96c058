"""Grouped-GEMM (MoE expert matmul) benchmark: every available JAX implementation side by side in one
process, plus `torch._grouped_mm` in a torch subprocess of the same call.

  python -m experiments.bench_moe --out=experiments/results/moe_gemm_h200

Shape (ANCHORS.md): routed rows M = 32768 (4096 tokens x top-8), K = 2048, N = 1024, 64 experts, bf16
operands, fp32 accumulation, bf16 output; "balanced" = M/E rows per expert, "skewed" = Zipf(1.5)
expert ids. Forward and forward+backward (d lhs and d rhs) medians of `--iters` runs after warm-up.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_OUT = flags.DEFINE_string("out", "experiments/results/moe_gemm", "Output path prefix (.json, .md).")
_ITERS = flags.DEFINE_integer("iters", 30, "Timed runs per measurement (median reported).")
_M = flags.DEFINE_integer("m", 32768, "Routed rows.")
_K = flags.DEFINE_integer("k", 2048, "Contraction size.")
_N = flags.DEFINE_integer("n", 1024, "Output columns.")
_E = flags.DEFINE_integer("experts", 64, "Experts (groups).")
_TORCH = flags.DEFINE_bool("torch", True, "Also time torch._grouped_mm in a subprocess (needs torch+CUDA).")

TORCH_SCRIPT = r"""
import json, sys, numpy as np, torch
from triton.testing import do_bench
M, K, N, G, iters = (int(x) for x in sys.argv[1:6])
groups = json.loads(sys.argv[6])
lhs = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
rhs = (torch.randn(G, K, N, device="cuda") * K ** -0.5).bfloat16()
dout = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
res = []
for name, gs in groups.items():
    offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
    a = lhs.clone().requires_grad_(True); b = rhs.clone().requires_grad_(True)
    def fb():
        torch._grouped_mm(a, b, offs=offs).backward(dout)
    fwd = do_bench(lambda: torch._grouped_mm(lhs, rhs, offs=offs), warmup=25, rep=100, return_mode="median")
    res.append(dict(impl="torch._grouped_mm", groups=name, fwd_ms=fwd,
                    fwdbwd_ms=do_bench(fb, warmup=25, rep=100, return_mode="median")))
print("JSON" + json.dumps(res))
"""


def _median_ms(fn, *args, iters):
    import jax
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def _implementations():
    import jax
    import jax.numpy as jnp
    impls = {"xla ragged_dot": lambda a, b, gs: jax.lax.ragged_dot(a, b, gs, preferred_element_type=jnp.float32)}
    try:
        import tokamax
        for name in ("mosaic", "triton"):
            impls[f"tokamax {name}"] = (lambda a, b, gs, name=name: tokamax.ragged_dot(
                a, b, gs, preferred_element_type=jnp.float32, implementation=name))
    except Exception as e:  # noqa: BLE001 -- report and carry on with what imports
        print("tokamax unavailable:", repr(e)[:200], flush=True)
    try:
        from jla.ops.mosaic_gpu import ragged_dot as jrd
        impls["jla grouped_matmul"] = lambda a, b, gs: jrd.grouped_matmul(a, b, gs, impl="mosaic_gpu")
    except Exception as e:  # noqa: BLE001
        print("jax-linear-attention unavailable:", repr(e)[:200], flush=True)
    from k3jax.ops import dispatch
    for name in dispatch.GROUPED_MATMUL_IMPLEMENTATIONS:
        if name not in ("xla", "blocked"):
            impls[f"k3jax {name}"] = (lambda a, b, gs, name=name: dispatch.grouped_matmul(
                a, b, gs, implementation=name))
    return impls


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    m, k, n, e = _M.value, _K.value, _N.value, _E.value
    rng = np.random.default_rng(0)
    groups = {"balanced": np.full(e, m // e, np.int32),
              "skewed": np.bincount(rng.zipf(1.5, size=m) % e, minlength=e).astype(np.int32)}
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kx, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kw, (e, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    dout = jax.random.normal(kd, (m, n), jnp.float32)
    flops = 2 * m * k * n
    dense = _median_ms(jax.jit(lambda a, b: a @ b), lhs, rhs[0], iters=_ITERS.value)
    results = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "shape": dict(M=m, K=k, N=n, experts=e), "skew_max_over_mean": float(groups["skewed"].max() / groups["skewed"].mean()),
               "dense_matmul_ms": dense, "dense_tflops": flops / dense / 1e9, "rows": []}
    print(f"dense {m}x{k}x{n}: {dense:.3f} ms ({flops / dense / 1e9:.0f} TFLOP/s)", flush=True)
    ref = {}
    for gname, gs in groups.items():
        gs = jnp.asarray(gs)
        for name, fn in _implementations().items():
            try:
                out = jax.jit(fn)(lhs, rhs, gs).astype(jnp.float32)
                if gname not in ref:
                    ref[gname] = out
                err = float(jnp.linalg.norm(out - ref[gname]) / jnp.linalg.norm(ref[gname]))
                fwd = _median_ms(jax.jit(fn), lhs, rhs, gs, iters=_ITERS.value)
                grad = jax.jit(jax.grad(lambda a, b, fn=fn, gs=gs: jnp.vdot(fn(a, b, gs).astype(jnp.float32), dout),
                                        argnums=(0, 1)))
                fb = _median_ms(grad, lhs, rhs, iters=_ITERS.value)
                row = dict(impl=name, groups=gname, fwd_ms=fwd, fwdbwd_ms=fb, rel_err_vs_first=err,
                           fwd_tflops=flops / fwd / 1e9, fwdbwd_tflops=3 * flops / fb / 1e9)
            except Exception as ex:  # noqa: BLE001 -- one failing implementation must not hide the rest
                row = dict(impl=name, groups=gname, error=repr(ex)[:300])
            print(row, flush=True)
            results["rows"].append(row)
    if _TORCH.value:
        try:
            proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, str(m), str(k), str(n), str(e), str(_ITERS.value),
                                   json.dumps({g: v.tolist() for g, v in groups.items()})],
                                  capture_output=True, text=True, timeout=300)
            line = [x for x in proc.stdout.splitlines() if x.startswith("JSON")]
            rows = json.loads(line[0][4:]) if line else [dict(impl="torch._grouped_mm", error=proc.stderr[-300:])]
        except Exception as ex:  # noqa: BLE001
            rows = [dict(impl="torch._grouped_mm", error=repr(ex)[:300])]
        for row in rows:
            print(row, flush=True)
        results["rows"].extend(rows)
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value + ".json", "w") as f:
        json.dump(results, f, indent=1)
    torch_fb = {r["groups"]: r["fwdbwd_ms"] for r in results["rows"] if r["impl"] == "torch._grouped_mm" and "fwdbwd_ms" in r}
    lines = [f"# Grouped GEMM, {results['device']}, {results['date']}, jax {results['jax']}", "",
             f"M={m} K={k} N={n}, {e} experts, bf16 in / fp32 accumulate; skewed max/mean load "
             f"{results['skew_max_over_mean']:.1f}; dense matmul {dense:.3f} ms ({results['dense_tflops']:.0f} TFLOP/s). "
             "Medians; fwd+bwd = d lhs and d rhs.", "",
             "| implementation | groups | fwd ms | fwd+bwd ms | fwd+bwd / torch | rel. err |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r.get('groups', '')} | failed: {r['error'][:80]} | | | |")
            continue
        ratio = r["fwdbwd_ms"] / torch_fb[r["groups"]] if r["groups"] in torch_fb else float("nan")
        lines.append(f"| {r['impl']} | {r['groups']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {ratio:.2f} | "
                     f"{r.get('rel_err_vs_first', 0):.1e} |")
    with open(_OUT.value + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
