"""MoE benchmarks on one GPU: the grouped GEMM (every k3jax backend, jla's GEMMs one by one, torch's)
and the MoE layer. Two studies, one page each:

  python -m experiments.bench_moe --out=$OUT/moe_gemm_h200                              # --study=backends
  python -m experiments.bench_moe --study=per_op --out=$OUT/grouped_gemm_ops_h200
  python -m experiments.bench_moe --study=per_op --ops=fwd+bwd --notilings --out=$OUT/grouped_gemm_full_groups_h200

GEMM shape (--gemm_shape, a name of harness.MOE_GEMM_SHAPES or MxKxNxE): lhs [M, K] x rhs [E, K, N], bf16
operands, fp32 accumulation; the anchor is M = 32768 routed rows (4096 tokens x top-8), K = 2048, N = 1024,
64 experts (ANCHORS.md). Groups: "balanced" = M/E rows each, "skewed" = Zipf(1.5) expert ids
(`group_sizes`; the largest of 64 groups holds 38.5% of the rows).

backends: the GEMM through `k3jax.ops.grouped_matmul.grouped_matmul` for every backend of --impls, fwd
  and fwd+bwd (d lhs and d rhs with a cotangent of the output dtype), with bf16 output (as torch) and with
  the fp32 output the MoE layer uses; errors RMS(x - xla)/RMS(xla). A backend that is not installed or
  not supported for the call gives a row with its reason. Then the MoE LAYER (--layer_shape, a name of
  harness.MOE_LAYER_SHAPES or TxDxFxExK, "none" to skip): `k3jax.nn.MoEFeedForward` (bf16 experts,
  softmax router, Quantile Balancing) fwd+bwd w.r.t. the input and every parameter; tokens/s and the
  expert FLOP rate (18 N k D F) as % of the dense bf16 matmul measured in the same run.
per_op: the three GEMMs one by one: fwd out [M, N] = lhs rhs[g] and d_lhs [M, K] = d_out rhs[g]^T by
  jla 0.1.0's public `ragged_dot(..., full_groups=True, config=)` for each named TileConfig that
  `supports` accepts (then EXTRA_CONFIGS; d_lhs on a copy of rhs^T made outside the timed call), d_rhs
  [E, K, N] = lhs_g^T d_out_g by jla's `transposed_ragged_dot`, and fwd+bwd through
  grouped_matmul(--per_op_impl) without and with full_groups=True; bf16 outputs.

torch._grouped_mm runs in a subprocess before JAX takes the GPU (same shapes, group sizes, dtypes): fwd,
d_lhs, d_rhs, fwd+bwd (fresh gradients) and fwd+bwd accumulate (gradients summed into .grad).
Timing (docs/benchmarks.md): JAX by `harness.time_call`: ms = per call, each waited for (median of
--iters), stream ms = back to back (--stream_calls calls a sync, median of --stream_reps); torch: the same
back-to-back method and triton's do_bench (median, L2 flushed). Rows are written to <out>.json / .md as
they are measured, so a cut run keeps what it has.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from experiments import harness

FLAGS = flags.FLAGS
STUDIES = ("backends", "per_op")
GROUPINGS = ("balanced", "skewed")
OPS = ("fwd", "d_lhs", "d_rhs", "fwd+bwd")
# jla 0.1.0's named tilings (public attributes of jla.ops.mosaic_gpu.ragged_dot), the default first.
JLA_CONFIG_NAMES = ("PERSISTENT", "PERSISTENT_WS", "ALIGNED", "WARP_SPECIALIZED", "BLOCK_ALIGNED")
# Unnamed jla TileConfigs (not GPU-tested by jla; timed last): half-height row tiles, wider / deeper tiles.
EXTRA_CONFIGS = (dict(schedule="persistent", block_m=64, block_n=128, steps=6),
                 dict(schedule="persistent", block_m=64, block_n=256, steps=4),
                 dict(schedule="persistent", block_k=128, steps=3))


def _define_flags():
    """The flags, defined only when run as a script (tests import this module next to other scripts)."""
    flags.DEFINE_enum("study", "backends", STUDIES, "What to measure (see the module docstring).")
    flags.DEFINE_string("out", "/tmp/k3jax_bench_moe/moe_gemm", "Output path prefix (.json, .md).")
    flags.DEFINE_string("gemm_shape", "anchor", f"One of {sorted(harness.MOE_GEMM_SHAPES)} or MxKxNxE.")
    flags.DEFINE_integer("iters", 30, "Timed per-call samples (median reported).")
    flags.DEFINE_integer("warmup", 3, "Untimed calls after the compiling one.")
    flags.DEFINE_integer("stream_calls", 10, "Back-to-back calls per timed group (0 = no back-to-back time).")
    flags.DEFINE_integer("stream_reps", 10, "Back-to-back groups (median reported).")
    flags.DEFINE_bool("torch", True, "Time torch._grouped_mm in a subprocess (needs torch + triton + CUDA).")
    flags.DEFINE_integer("torch_timeout_s", 300, "Wall-clock limit of the torch subprocess.")
    flags.DEFINE_list("impls", ["xla", "tokamax", "jla"], "backends: grouped_matmul backends to time.")
    flags.DEFINE_list("out_dtypes", ["bfloat16", "float32"], "backends: GEMM output (= cotangent) dtypes.")
    flags.DEFINE_string("layer_shape", "anchor", f"backends: MoE layer, one of {sorted(harness.MOE_LAYER_SHAPES)}, "
                        "TxDxFxExK (tokens, d_model, d_ff, experts, top_k) or none.")
    flags.DEFINE_list("layer_impls", ["default", "jla", "xla"],
                      "backends: the layer's grouped-matmul backends ('default' = implementation=None).")
    flags.DEFINE_integer("layer_iters", 10, "backends: timed layer calls.")
    flags.DEFINE_list("ops", list(OPS), "per_op: ops to time (torch times all).")
    flags.DEFINE_string("per_op_impl", "jla", "per_op: the grouped_matmul backend of the fwd+bwd rows.")
    flags.DEFINE_bool("tilings", True, "per_op: time jla's fwd / d_lhs / d_rhs kernels (needs jla).")
    flags.DEFINE_bool("extra_configs", True, "per_op: also time EXTRA_CONFIGS (unnamed jla tilings), last.")
    flags.DEFINE_float("budget_s", 100.0, "per_op: skip further JAX rows after this many seconds.")


def parse_shape(text: str, names: dict, fields: tuple[str, ...]) -> dict:
    """A name of `names` or the `fields` as 'AxBx...' positive integers -> dict; ValueError naming it."""
    if text in names:
        return dict(names[text])
    parts = text.lower().split("x")
    if len(parts) != len(fields) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be one of {sorted(names)} or {'x'.join(fields)} positive integers; got {text!r}")
    return dict(zip(fields, map(int, parts)))


def group_sizes(num_rows: int, num_groups: int, kind: str, seed: int = 0) -> np.ndarray:
    """Rows per group, summing to ``num_rows``, as int32 ``[num_groups]``.

    ``"balanced"``: ``num_rows // num_groups`` each (``num_rows`` must be a multiple of ``num_groups``).
    ``"skewed"``: ``np.bincount(rng.zipf(1.5, size=num_rows) % num_groups)`` with
    ``rng = np.random.default_rng(seed)`` (seed 0 at M=32768, 64 groups: the largest holds 12620 rows).

    Raises:
      ValueError: unknown ``kind``, ``num_groups < 1``, ``num_rows < 0``, or balanced rows that do not divide.
    """
    if num_groups < 1 or num_rows < 0:
        raise ValueError(f"need num_groups >= 1 and num_rows >= 0; got {num_groups=}, {num_rows=}")
    if kind == "balanced":
        if num_rows % num_groups:
            raise ValueError(f"balanced groups need num_rows % num_groups == 0; got {num_rows=}, {num_groups=}")
        return np.full(num_groups, num_rows // num_groups, np.int32)
    if kind == "skewed":
        rng = np.random.default_rng(seed)
        return np.bincount(rng.zipf(1.5, size=num_rows) % num_groups, minlength=num_groups).astype(np.int32)
    raise ValueError(f"kind must be one of {GROUPINGS}; got {kind=}")


def gemm_flops(op: str, m: int, k: int, n: int) -> int:
    """FLOPs of ``op`` on [M, K] x [E, K, N] with every row in a group: 2MKN a GEMM, 3x for fwd+bwd.

    Raises:
      ValueError: unknown ``op``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}; got {op=}")
    return (3 if op == "fwd+bwd" else 1) * 2 * m * k * n


def _fmt(x, f):
    return "" if x is None else format(x, f)


def _header(results: dict, title: str) -> list[str]:
    s = results["shape"]
    env = results.get("env", {})
    return [f"# {title}, {env.get('device', '?')}", "", harness.environment_line(env), "",
            f"GEMM M={s['m']} K={s['k']} N={s['n']}, {s['experts']} groups, bf16 operands, fp32 accumulation. "
            "ms = per call, each waited for (median); stream ms = back-to-back calls (median); do_bench = triton "
            "do_bench, L2 flushed (torch). err = RMS(x - xla)/RMS(xla).", ""] + [
        f"- {g}: largest group {st['max']} rows ({100 * st['max_fraction']:.1f}%), smallest {st['min']}, "
        f"empty {st['empty']}" for g, st in results["group_stats"].items()]


def render_backends(results: dict) -> str:
    """Markdown of a backends study: one line per (backend, groups, dtype) with fwd and fwd+bwd times and
    fwd+bwd / torch's do_bench fwd+bwd; then the MoE layer table."""
    torch_fb = {r["groups"]: r["ms_do_bench"] for r in results["rows"]
                if r["impl"] == "torch" and r.get("op") == "fwd+bwd" and "ms_do_bench" in r}
    torch_f = {r["groups"]: r["ms_do_bench"] for r in results["rows"]
               if r["impl"] == "torch" and r.get("op") == "fwd" and "ms_do_bench" in r}
    lines = _header(results, "MoE grouped GEMM and layer") + ["", (
        "| implementation | groups | out/cotangent | fwd ms | fwd+bwd ms | fwd+bwd stream ms | fwd+bwd / torch "
        "| err out | err d lhs | err d rhs |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if r["impl"] == "torch":
            continue
        head = f"| {r['impl']} | {r['groups']} | {r['out_dtype']} |"
        if "error" in r:
            lines.append(f"{head} not run: {r['error'][:100]} | | | | | | |")
            continue
        ratio = _fmt(r["fwdbwd_ms"] / torch_fb[r["groups"]], ".2f") if r["groups"] in torch_fb else ""
        errs = " | ".join(_fmt(r.get(k), ".1e") for k in ("err_out", "err_dlhs", "err_drhs"))
        lines.append(f"{head} {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {_fmt(r.get('fwdbwd_stream_ms'), '.3f')} | "
                     f"{ratio} | {errs} |")
    for g in torch_fb:
        lines.append(f"| torch._grouped_mm (do_bench) | {g} | bfloat16 | {_fmt(torch_f.get(g), '.3f')} | "
                     f"{torch_fb[g]:.3f} | | 1.00 | | | |")
    lay = results.get("layer_shape")
    if lay:
        lines += ["", f"MoE layer fwd+bwd: {lay['tokens']} tokens, d_model {lay['d_model']}, expert d_ff "
                  f"{lay['d_ff']}, {lay['experts']} experts, top-{lay['top_k']}, softmax router, quantile balancing, "
                  f"bf16 experts; expert FLOPs = 18 N k D F; dense bf16 matmul [M, K] x [K, N] "
                  f"{results['dense_matmul_ms']:.3f} ms = {results['dense_tflops']:.3g} TFLOP/s.",
                  "", "| grouped matmul | fwd+bwd ms | tokens/s | expert TFLOP/s | % of dense bf16 matmul |",
                  "|---|---|---|---|---|"]
        for r in results["layer"]:
            if "error" in r:
                lines.append(f"| {r['impl']} | failed: {r['error'][:100]} | | | |")
            else:
                lines.append(f"| {r['impl']} ({r['resolved']}) | {r['fwdbwd_ms']:.2f} | {r['tokens_per_s']:.3g} | "
                             f"{r['tflops']:.3g} | {r['pct_dense']:.1f} |")
    return "\n".join(lines) + "\n"


def render_per_op(results: dict) -> str:
    """Markdown of a per_op study: one table per grouping, one line per (op, implementation, config) with
    the back-to-back time, its ratio to torch's for the same op, TFLOP/s, per-call and do_bench times and
    the error; then the best jla configuration of each op and their sum against torch's fwd+bwd."""
    rows = results["rows"]
    lines = _header(results, "Grouped GEMM by op") + [""]
    failed = [r for r in rows if r.get("groups") not in GROUPINGS and r.get("error")]
    if failed:  # whole implementations that did not run (torch or jla missing, no GPU): say why
        lines += ["Not measured:"] + [
            f"- {r.get('impl', '?')}: {(r['error'].strip().splitlines() or [''])[-1][:200]}" for r in failed]
    torch_ms = {(r["groups"], r["op"]): r["ms"] for r in rows if r.get("impl") == "torch" and "ms" in r}
    for gname in GROUPINGS:
        mine = [r for r in rows if r.get("groups") == gname]
        if not mine:
            continue
        lines += ["", f"## {gname}", "", "| op | implementation | config | ms | x torch | TFLOP/s | per-call ms "
                  "| do_bench ms | err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            head = f"| {r['op']} | {r['impl']} | {r.get('config', '')} |"
            if "ms" not in r:
                lines.append(f"{head} {r.get('error', r.get('skipped', 'not run'))[:120]} | | | | | |")
                continue
            t = torch_ms.get((gname, r["op"]))
            lines.append(f"{head} {r['ms']:.3f} | {_fmt(r['ms'] / t if t else None, '.2f')} | "
                         f"{_fmt(r.get('tflops'), '.0f')} | {_fmt(r.get('ms_per_call'), '.3f')} | "
                         f"{_fmt(r.get('ms_do_bench'), '.3f')} | {_fmt(r.get('err'), '.1e')} |")
        best = {}
        for op in ("fwd", "d_lhs", "d_rhs"):
            cands = [r for r in mine if r["op"] == op and r["impl"].startswith("jla") and "ms" in r]
            if cands:
                best[op] = min(cands, key=lambda r: r["ms"])
        if len(best) == 3:
            total = sum(b["ms"] for b in best.values())
            t = torch_ms.get((gname, "fwd+bwd"))
            picks = ", ".join(f"{op} {b['impl']} {b.get('config', '')} {b['ms']:.3f}" for op, b in best.items())
            lines += ["", f"Best jla per op: {picks}; sum {total:.3f} ms"
                      + (f" = {total / t:.2f} x torch fwd+bwd ({t:.3f} ms)." if t else ".")]
    return "\n".join(lines) + "\n"


def _write(results: dict) -> None:
    render = render_per_op if results["study"] == "per_op" else render_backends
    harness.write_results(FLAGS.out, results, render(results))


TORCH_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, torch
from triton.testing import do_bench
M, K, N, G, iters, inner = (int(x) for x in sys.argv[1:7])
groups = json.loads(sys.argv[7])
torch.manual_seed(0)
lhs = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
rhs = (torch.randn(G, K, N, device="cuda") * K ** -0.5).bfloat16()
dout = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

def stream(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts) * 1e3

def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

for name, gs in groups.items():
    offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
    a = lhs.clone().requires_grad_(True); b = rhs.clone().requires_grad_(True)
    def fwd_bwd():  # fresh gradients each call, as jax.vjp returns them
        a.grad = b.grad = None
        torch._grouped_mm(a, b, offs=offs).backward(dout)
    def fwd_bwd_accumulate():  # gradients summed into .grad
        torch._grouped_mm(a, b, offs=offs).backward(dout)
    ops = {"fwd": lambda: torch._grouped_mm(lhs, rhs, offs=offs),
           "d_lhs": lambda: torch._grouped_mm(dout, rhs.transpose(-2, -1), offs=offs),
           "d_rhs": lambda: torch._grouped_mm(lhs.transpose(-2, -1), dout, offs=offs),
           "fwd+bwd": fwd_bwd, "fwd+bwd accumulate": fwd_bwd_accumulate}
    check = {}
    try:
        a.grad = b.grad = None
        torch._grouped_mm(a, b, offs=offs).backward(dout)
        check = {"d_lhs": a.grad.clone(), "d_rhs": b.grad.clone()}
        a.grad = b.grad = None
    except Exception as e:
        print("JSON" + json.dumps(dict(impl="torch", groups=name, op="autograd", error=repr(e)[:300])), flush=True)
    for op, fn in ops.items():
        row = dict(impl="torch", config="_grouped_mm", groups=name, op=op)
        try:
            if op in check:
                row["err_vs_autograd"] = rel(fn(), check[op])
            row["ms"] = stream(fn)
            row["ms_do_bench"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            a.grad = b.grad = None
        except Exception as e:
            row["error"] = repr(e)[:300]
        print("JSON" + json.dumps(row), flush=True)
"""


def _torch_rows(results: dict, groups: dict) -> None:
    s = results["shape"]
    args = [str(x) for x in (s["m"], s["k"], s["n"], s["experts"], FLAGS.stream_reps, max(FLAGS.stream_calls, 1))]
    try:
        proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, *args,
                               json.dumps({g: v.tolist() for g, v in groups.items()})],
                              capture_output=True, text=True, timeout=FLAGS.torch_timeout_s)
        rows = [json.loads(x[4:]) for x in proc.stdout.splitlines() if x.startswith("JSON")]
        if not rows:
            rows = [dict(impl="torch", groups="", op="", error=(proc.stderr or proc.stdout)[-300:])]
    except Exception as ex:  # noqa: BLE001 -- torch missing or hung must not stop the JAX rows
        rows = [dict(impl="torch", groups="", op="", error=repr(ex)[:300])]
    for row in rows:
        if "ms" in row:
            op = "fwd+bwd" if row["op"].startswith("fwd+bwd") else row["op"]
            row["tflops"] = gemm_flops(op, s["m"], s["k"], s["n"]) / row["ms"] / 1e9
        print(row, flush=True)
        results["rows"].append(row)
    _write(results)


def _time(fn, *args, iters=None) -> dict:
    """harness.time_call on fixed arguments: per-call median ms and (when asked) back-to-back ms."""
    return harness.time_call(fn, lambda i: args, iters=iters or FLAGS.iters, warmup=FLAGS.warmup,
                             stream_calls=FLAGS.stream_calls, stream_reps=FLAGS.stream_reps)


def _operands(shape):
    import jax
    import jax.numpy as jnp
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    m, k, n, e = shape["m"], shape["k"], shape["n"], shape["experts"]
    lhs = jax.random.normal(kx, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kw, (e, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    return lhs, rhs, jax.random.normal(kd, (m, n), jnp.float32)


def _backend_rows(results: dict, groups: dict) -> None:
    import jax
    import jax.numpy as jnp

    from k3jax.ops import grouped_matmul as gmm
    lhs, rhs, dout32 = _operands(results["shape"])
    flops = gemm_flops("fwd", lhs.shape[0], lhs.shape[1], rhs.shape[2])
    dense = _time(jax.jit(lambda a, b: a @ b), lhs, rhs[0])["median_ms"]  # the MFU denominator of the layer
    results.update(dense_matmul_ms=dense, dense_tflops=flops / dense / 1e9)
    for gname, gs_np in groups.items():
        gs = jnp.asarray(gs_np)
        for out_name in FLAGS.out_dtypes:
            out_dtype = jnp.dtype(out_name)
            dout = dout32.astype(out_dtype)
            ref = None
            for impl in FLAGS.impls:
                row = dict(impl=f"k3jax {impl}", groups=gname, out_dtype=out_name)
                try:
                    ok, reason = gmm.supported(impl, lhs, rhs, gs, out_dtype)
                    if not ok:
                        raise ValueError(reason)
                    fn = functools.partial(gmm.grouped_matmul, group_sizes=gs, implementation=impl,
                                           preferred_element_type=out_dtype)

                    def fwd_bwd(a, b, fn=fn, dout=dout):
                        out, vjp = jax.vjp(lambda a, b: fn(a, b), a, b)
                        return out, vjp(dout)

                    fwd_bwd = jax.jit(fwd_bwd)
                    out, (d_lhs, d_rhs) = fwd_bwd(lhs, rhs)
                    if ref is None and impl == "xla":
                        ref = (out, d_lhs, d_rhs)
                    if ref is not None:
                        row.update(err_out=harness.rms_ratio(out, ref[0]), err_dlhs=harness.rms_ratio(d_lhs, ref[1]),
                                   err_drhs=harness.rms_ratio(d_rhs, ref[2]))
                    row["fwd_ms"] = _time(jax.jit(lambda a, b, fn=fn: fn(a, b)), lhs, rhs)["median_ms"]
                    t = _time(fwd_bwd, lhs, rhs)
                    row.update(fwdbwd_ms=t["median_ms"], fwdbwd_stream_ms=t.get("stream_ms"),
                               fwd_tflops=flops / row["fwd_ms"] / 1e9, fwdbwd_tflops=3 * flops / t["median_ms"] / 1e9)
                except Exception as ex:  # noqa: BLE001 -- one failing backend must not hide the rest
                    row["error"] = repr(ex)[:400]
                print(row, flush=True)
                results["rows"].append(row)
                _write(results)


def _layer_rows(results: dict, lay: dict) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.nn.moe import MoEFeedForward
    from k3jax.ops import grouped_matmul as gmm
    from k3jax.ops.balancing import QuantileBalancing
    tokens, d, f, e, k = (lay[x] for x in ("tokens", "d_model", "d_ff", "experts", "top_k"))
    results["layer_shape"] = lay
    x = jax.random.normal(jax.random.key(3), (1, tokens, d), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(4), (1, tokens, d), jnp.bfloat16)
    flops = 18 * tokens * k * d * f
    probe = (jax.ShapeDtypeStruct((tokens * k, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16),
             jax.ShapeDtypeStruct((e,), jnp.int32))
    for impl in FLAGS.layer_impls:
        name = None if impl == "default" else impl
        row = dict(impl=impl, resolved=gmm.default_implementation(*probe) if name is None else name)
        try:
            layer = MoEFeedForward(d, f, e, k, balancing=QuantileBalancing(), dispatch_implementation=name,
                                   dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

            def loss(params, x):
                y, aux = nnx.merge(graphdef, params, rest)(x)
                return jnp.vdot(y.astype(jnp.float32), cot.astype(jnp.float32)) + aux["loss"]

            ms = _time(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x,
                       iters=FLAGS.layer_iters)["median_ms"]
            row.update(fwdbwd_ms=ms, tokens_per_s=tokens / ms * 1e3, tflops=flops / ms / 1e9,
                       pct_dense=100 * flops / ms / 1e9 / results["dense_tflops"])
        except Exception as ex:  # noqa: BLE001
            row["error"] = repr(ex)[:400]
        print(row, flush=True)
        results["layer"].append(row)
        _write(results)


def _per_op_rows(results: dict, groups: dict, start: float) -> None:
    import jax
    import jax.numpy as jnp

    from k3jax.ops.grouped_matmul import grouped_matmul
    s = results["shape"]
    m, k, n, e = s["m"], s["k"], s["n"], s["experts"]
    lhs, rhs, dout = _operands(s)
    dout = dout.astype(jnp.bfloat16)
    f32 = jnp.float32
    cands, extra = [], []  # (op, impl, config, jitted fn or why it is skipped, its arguments but the sizes)
    if FLAGS.tilings:
        try:
            from jla.ops.mosaic_gpu import ragged_dot as jrd  # noqa: PLC0415 -- the GPU wheel
        except ImportError as ex:
            results["rows"].append(dict(impl="jla", groups="", op="", error=f"jla not importable: {ex!r}"))
        else:
            rhs_t = jnp.swapaxes(rhs, 1, 2)
            probe = jnp.zeros((e,), jnp.int32)

            def tile_rows(label, cfg):
                if cfg is None or not jrd.supports(lhs, rhs, probe, cfg):
                    why = "jla TileConfig refuses it" if cfg is None else f"jla supports() rejects it for K={k}, N={n}"
                    return [("fwd", "jla", label, why, ()), ("d_lhs", "jla", label, why, ())]
                gemm = jax.jit(lambda a, b, gs: jrd.ragged_dot(a, b, gs, full_groups=True, config=cfg))
                return [("fwd", "jla", label, gemm, (lhs, rhs)), ("d_lhs", "jla", label, gemm, (dout, rhs_t))]

            for name in JLA_CONFIG_NAMES:
                cands += tile_rows(name, getattr(jrd, name))
            cands.append(("d_rhs", "jla", "transposed_ragged_dot", jax.jit(jrd.transposed_ragged_dot), (lhs, dout)))
            for fields in EXTRA_CONFIGS if FLAGS.extra_configs else ():
                try:
                    cfg = jrd.TileConfig(**fields)
                except ValueError:
                    cfg = None
                extra += tile_rows(", ".join(f"{a}={v}" for a, v in fields.items()), cfg)

    def fwd_bwd(a, b, d, gs, full_groups=False):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, FLAGS.per_op_impl, preferred_element_type=jnp.bfloat16,
                                                       full_groups=full_groups), a, b)
        return out, vjp(d)

    label = f"k3jax grouped_matmul {FLAGS.per_op_impl}"
    cands.append(("fwd+bwd", label, "default", jax.jit(fwd_bwd), (lhs, rhs, dout)))
    # every row is in a group (as after token_dispatch.permute): the promise torch._grouped_mm relies on
    cands.append(("fwd+bwd", label, "full_groups=True", jax.jit(functools.partial(fwd_bwd, full_groups=True)),
                  (lhs, rhs, dout)))
    cands = [c for c in cands + extra if c[0] in FLAGS.ops]  # extra last: the time budget cuts these first

    dims = jax.lax.RaggedDotDimensionNumbers(  # d_rhs: lhs^T d_out per group, the ragged M contracted
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    ref_fwd = jax.jit(lambda a, b, gs: jax.lax.ragged_dot(a, b, gs, preferred_element_type=f32))
    ref_dlhs = jax.jit(lambda d, b, gs: jax.lax.ragged_dot(d, jnp.swapaxes(b, 1, 2), gs, preferred_element_type=f32))
    ref_drhs = jax.jit(lambda a, d, gs: jax.lax.ragged_dot_general(a, d, gs, dims, preferred_element_type=f32))
    refs = {g: dict(fwd=ref_fwd(lhs, rhs, gs), d_lhs=ref_dlhs(dout, rhs, gs), d_rhs=ref_drhs(lhs, dout, gs))
            for g, gs in ((g, jnp.asarray(v)) for g, v in groups.items())}
    for op, impl, config, fn, args in cands:
        for gname, gs_np in groups.items():
            gs = jnp.asarray(gs_np)
            row = dict(impl=impl, config=config, groups=gname, op=op)
            if isinstance(fn, str):
                row["skipped"] = fn
            elif time.time() - start > FLAGS.budget_s:
                row["skipped"] = f"time budget {FLAGS.budget_s:.0f} s spent"
            else:
                try:
                    out = fn(*args, gs)
                    if op == "fwd+bwd":
                        out, (d_lhs, d_rhs) = out
                        ref = refs[gname]
                        row.update(err_out=harness.rms_ratio(out, ref["fwd"]),
                                   err_dlhs=harness.rms_ratio(d_lhs, ref["d_lhs"]),
                                   err_drhs=harness.rms_ratio(d_rhs, ref["d_rhs"]))
                        row["err"] = max(row["err_out"], row["err_dlhs"], row["err_drhs"])
                    else:
                        row["err"] = harness.rms_ratio(out, refs[gname][op])  # every row in a group: no tail
                    t = _time(fn, *args, gs)
                    row.update(ms=t.get("stream_ms", t["median_ms"]), ms_per_call=t["median_ms"],
                               tflops=gemm_flops(op, m, k, n) / t.get("stream_ms", t["median_ms"]) / 1e9)
                except Exception as ex:  # noqa: BLE001 -- one failing config must not hide the rest
                    row["error"] = repr(ex)[:400]
            row["t_s"] = round(time.time() - start, 1)
            print(row, flush=True)
            results["rows"].append(row)
            _write(results)


def main(argv):
    del argv
    start = time.time()
    unknown = sorted(set(FLAGS.ops) - set(OPS))
    if unknown:  # a typo would silently drop an op from a GPU run
        raise ValueError(f"--ops: unknown {unknown}; choose from {list(OPS)}")
    shape = parse_shape(FLAGS.gemm_shape, harness.MOE_GEMM_SHAPES, ("m", "k", "n", "experts"))
    lay = None if FLAGS.layer_shape == "none" else parse_shape(
        FLAGS.layer_shape, harness.MOE_LAYER_SHAPES, ("tokens", "d_model", "d_ff", "experts", "top_k"))
    groups = {kind: group_sizes(shape["m"], shape["experts"], kind) for kind in GROUPINGS}
    results = {"study": FLAGS.study, "shape": shape,
               "timing": dict(iters=FLAGS.iters, warmup=FLAGS.warmup, stream_calls=FLAGS.stream_calls,
                              stream_reps=FLAGS.stream_reps),
               "group_sizes": {g: v.tolist() for g, v in groups.items()},
               "group_stats": {g: dict(max=int(v.max()), min=int(v.min()), empty=int((v == 0).sum()),
                                       max_fraction=float(v.max() / v.sum())) for g, v in groups.items()},
               "rows": [], "layer": []}
    if FLAGS.torch:  # first, before JAX takes the GPU
        _torch_rows(results, groups)
    results["env"] = harness.environment()
    if FLAGS.study == "per_op":
        _per_op_rows(results, groups, start)
    else:
        _backend_rows(results, groups)
        if lay is not None:
            _layer_rows(results, lay)
    results["wall_s"] = round(time.time() - start, 1)
    _write(results)
    print(open(FLAGS.out + ".md").read())


if __name__ == "__main__":
    _define_flags()
    app.run(main)
