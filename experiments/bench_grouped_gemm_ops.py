"""The three GEMMs of a grouped matmul timed one by one on one GPU (issue #5): which one loses to
`torch._grouped_mm` when the group sizes are skewed?

  PYTHONPATH=/tmp/site:$PWD python -m experiments.bench_grouped_gemm_ops --out=$OUT/gemm_ops

For balanced (M/E rows per group) and skewed (Zipf(1.5) expert ids, ``np.bincount(rng.zipf(1.5, M) % E)``,
seed 0: one group holds ~38% of the rows) group sizes, at M=32768, K=2048, N=1024, 64 groups, bf16:

* ``fwd``   out [M, N] = ragged_dot(lhs [M, K], rhs [E, K, N]): jla 0.1.0's public
  ``ragged_dot(..., full_groups=True, config=)`` for every named ``TileConfig`` of jla that ``supports``
  accepts for the call (then, last, the unnamed ``EXTRA_CONFIGS``);
* ``d_lhs`` [M, K] = ragged_dot(d_out [M, N], rhs^T): the same call on a transposed copy of rhs made
  outside the timed function, every config;
* ``d_rhs`` [E, K, N] = lhs_g^T d_out_g per group: jla's ``transposed_ragged_dot`` (no config);
* ``fwd+bwd`` through ``k3jax.ops.grouped_matmul.grouped_matmul(implementation="jla")`` (bf16 output and
  cotangent), the number issue #5 judges, without and with ``full_groups=True`` (every row is in a
  group; skips the select that zeroes rows past the groups);
* torch._grouped_mm forward, d_lhs (``_grouped_mm(d_out, rhs^T, offs)``), d_rhs
  (``_grouped_mm(lhs^T, d_out, offs)``) and fwd+bwd (autograd) in a torch subprocess of the same call,
  same group sizes and dtypes; the direct d_lhs / d_rhs are checked against autograd's gradients.

Timing. JAX: ``ms`` = median over ``--iters`` samples of (``--inner`` back-to-back calls, then
``block_until_ready``) / ``--inner``, after warm-up: the host's dispatch overhead is hidden as in a
training step; ``ms_blocking`` = median of single calls each waited for (the method of bench_moe.py and
moe_gemm_h200.md, which adds the host round trip). torch: ``ms`` = the same batched method with
``torch.cuda.synchronize``; ``ms_do_bench`` = triton's ``do_bench`` median (CUDA events, L2 flushed
before each call; the method of moe_anchor_torch.py). Compare ``ms`` with ``ms``. Errors: RMS(x - xla) /
RMS(xla) against ``jax.lax.ragged_dot(_general)`` in fp32. Every row is written to ``<out>.json`` as soon
as it is measured and ``<out>.md`` at the end; configurations past ``--budget_s`` of wall time are
recorded as skipped (the whole run must stay under 120 s on an H200, compiles included).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
    """The command-line flags, defined only when run as a script (tests import this module next to other
    experiment scripts, whose absl flags share names such as --out)."""
    flags.DEFINE_string("out", "/tmp/gemm_ops", "Output path prefix (.json, .md).")
    flags.DEFINE_integer("iters", 30, "Timed samples per measurement (median reported).")
    flags.DEFINE_integer("inner", 10, "Back-to-back calls per timed sample.")
    flags.DEFINE_integer("m", 32768, "Routed rows.")
    flags.DEFINE_integer("k", 2048, "Contraction size of the forward GEMM.")
    flags.DEFINE_integer("n", 1024, "Output columns of the forward GEMM.")
    flags.DEFINE_integer("experts", 64, "Experts (groups).")
    flags.DEFINE_bool("torch", True, "Time torch._grouped_mm in a subprocess (needs torch + CUDA).")
    flags.DEFINE_integer("torch_timeout_s", 60, "Wall-clock limit of the torch subprocess.")
    flags.DEFINE_bool("extra_configs", True, "Also time EXTRA_CONFIGS (unnamed jla tilings), last.")
    flags.DEFINE_list("ops", ["fwd", "d_lhs", "d_rhs", "fwd+bwd"], "JAX ops to time (torch times all).")
    flags.DEFINE_float("budget_s", 100.0, "Skip further JAX measurements after this many seconds.")


GROUPINGS = ("balanced", "skewed")
VERSIONED = ("jax", "jaxlib", "jax-linear-attention", "torch", "triton")  # recorded with the results
OPS = ("fwd", "d_lhs", "d_rhs", "fwd+bwd")
# jla 0.1.0's named tilings (public attributes of jla.ops.mosaic_gpu.ragged_dot), in the order they are
# timed (the default, PERSISTENT, first); spelt out so JAX is imported only after torch ran.
JLA_CONFIG_NAMES = ("PERSISTENT", "PERSISTENT_WS", "ALIGNED", "WARP_SPECIALIZED", "BLOCK_ALIGNED")
# Unnamed jla TileConfigs (not GPU-tested by jla; timed after everything else with --extra_configs):
# half-height row tiles (less padding in the partial tiles of small groups), wider / deeper tiles.
EXTRA_CONFIGS = (dict(schedule="persistent", block_m=64, block_n=128, steps=6),
                 dict(schedule="persistent", block_m=64, block_n=256, steps=4),
                 dict(schedule="persistent", block_k=128, steps=3))


def group_sizes(num_rows: int, num_groups: int, kind: str, seed: int = 0) -> np.ndarray:
    """Rows per group, summing to ``num_rows``, as int32 ``[num_groups]``.

    ``"balanced"``: ``num_rows // num_groups`` each (``num_rows`` must be a multiple of ``num_groups``).
    ``"skewed"``: ``np.bincount(rng.zipf(1.5, size=num_rows) % num_groups)`` with
    ``rng = np.random.default_rng(seed)``, the skew of moe_anchor_*.py and bench_moe.py (seed 0 at
    M=32768, 64 groups: the largest group holds 12620 rows, 38.5%).

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
    """FLOPs of ``op`` for a grouped matmul [M, K] x [E, K, N] (every row in a group): 2MKN for each
    GEMM, 3 x that for fwd+bwd.

    Raises:
      ValueError: unknown ``op``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}; got {op=}")
    return (3 if op == "fwd+bwd" else 1) * 2 * m * k * n


def render_markdown(results: dict) -> str:
    """The markdown report of a results dict (``shape``, ``device``, ``date``, ``versions``,
    ``group_stats``, ``rows``): one table per grouping, one line per (op, implementation, config) with
    the batched time, its ratio to torch's batched time for the same op, the blocking and do_bench
    times and the error; then, per grouping, the best jla configuration of each op and their sum
    against torch's fwd+bwd."""
    s = results["shape"]
    lines = [f"# Grouped GEMM by op, {results.get('device', '?')}, {results.get('date', '?')}", "",
             f"Versions: {results.get('versions', {})}", "",
             f"M={s['M']} K={s['K']} N={s['N']}, {s['experts']} groups, bf16 operands, fp32 accumulation, bf16 "
             "outputs. ms = median of batched back-to-back calls (host overhead hidden); blocking = one call "
             "waited for at a time (JAX); do_bench = triton do_bench with L2 flush (torch). x torch = ms / "
             "torch's ms for the same op and groups. err = RMS(x - xla)/RMS(xla).", ""]
    for gname, stats in results.get("group_stats", {}).items():
        lines.append(f"- {gname}: largest group {stats['max']} rows ({100 * stats['max_fraction']:.1f}%), "
                     f"smallest {stats['min']}, empty {stats['empty']}")
    rows = results["rows"]
    failed = [r for r in rows if r.get("groups") not in GROUPINGS and r.get("error")]
    if failed:  # whole implementations that did not run (torch or jla missing, no GPU): say why
        lines += ["", "Not measured:"] + [
            f"- {r.get('impl', '?')}: {(r['error'].strip().splitlines() or [''])[-1][:200]}" for r in failed]
    torch_ms = {(r["groups"], r["op"]): r["ms"] for r in rows if r.get("impl") == "torch" and "ms" in r}
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    for gname in GROUPINGS:
        mine = [r for r in rows if r.get("groups") == gname]
        if not mine:
            continue
        lines += ["", f"## {gname}", "", "| op | implementation | config | ms | x torch | TFLOP/s | blocking ms "
                  "| do_bench ms | err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            head = f"| {r['op']} | {r['impl']} | {r.get('config', '')} |"
            if "ms" not in r:
                lines.append(f"{head} {r.get('error', r.get('skipped', 'not run'))[:120]} | | | | | |")
                continue
            t = torch_ms.get((gname, r["op"]))
            ratio = r["ms"] / t if t else None
            lines.append(f"{head} {r['ms']:.3f} | {fmt(ratio, '.2f')} | {fmt(r.get('tflops'), '.0f')} | "
                         f"{fmt(r.get('ms_blocking'), '.3f')} | {fmt(r.get('ms_do_bench'), '.3f')} | "
                         f"{fmt(r.get('err'), '.1e')} |")
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


def _write(results: dict, markdown: bool = False) -> None:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    if markdown:
        with open(FLAGS.out + ".md", "w") as f:
            f.write(render_markdown(results))




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

def batched(fn):
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
    def fwd_bwd_accumulate():  # moe_anchor_torch.py's method: gradients summed into .grad
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
            row["ms"] = batched(fn)
            row["ms_do_bench"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            a.grad = b.grad = None
        except Exception as e:
            row["error"] = repr(e)[:300]
        print("JSON" + json.dumps(row), flush=True)
"""


def _torch_rows(results: dict, groups: dict) -> None:
    args = [str(x) for x in (FLAGS.m, FLAGS.k, FLAGS.n, FLAGS.experts, FLAGS.iters, FLAGS.inner)]
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
            row["tflops"] = gemm_flops(op, FLAGS.m, FLAGS.k, FLAGS.n) / row["ms"] / 1e9
        print(row, flush=True)
        results["rows"].append(row)
    _write(results)


def _batched_ms(fn, *args, iters: int, inner: int, warmup: int = 3) -> float:
    """Median over ``iters`` samples of the per-call time of ``inner`` back-to-back calls (ms)."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner)
    return float(np.median(times)) * 1e3


def _jax_rows(results: dict, groups: dict, start: float) -> None:
    import jax
    import jax.numpy as jnp

    from experiments.harness import median_ms
    from k3jax.ops.grouped_matmul import grouped_matmul
    from jla.ops.mosaic_gpu import ragged_dot as jrd  # noqa: PLC0415 -- the GPU wheel, needed for every row

    m, k, n, e = FLAGS.m, FLAGS.k, FLAGS.n, FLAGS.experts
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kx, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kw, (e, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    dout = jax.random.normal(kd, (m, n), jnp.bfloat16)
    # d_rhs [E, K, N] = lhs^T d_out per group: the ragged dimension M is contracted
    RAGGED_CONTRACTING_DIMS = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    rhs_t = jnp.swapaxes(rhs, 1, 2)  # d_lhs's operand, transposed outside the timed calls
    f32 = jnp.float32

    def rel(x, ref):
        x = x.astype(f32)
        return float(jnp.sqrt(jnp.mean((x - ref) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(ref ** 2)), 1e-30))

    # Every candidate as (op, impl, config label, jitted fn, its array arguments but the group sizes):
    # one compile each (group sizes are a runtime argument); operands are arguments, never closed-over
    # constants.
    cands = []
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

    def fwd_bwd(a, b, d, gs, full_groups=False):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(
            a, b, gs, "jla", preferred_element_type=jnp.bfloat16, full_groups=full_groups), a, b)
        return out, vjp(d)
    cands.append(("fwd+bwd", "k3jax grouped_matmul jla", "default", jax.jit(fwd_bwd), (lhs, rhs, dout)))
    # every row is in a group here (as after token_dispatch.permute): the promise torch._grouped_mm relies on
    cands.append(("fwd+bwd", "k3jax grouped_matmul jla", "full_groups=True",
                  jax.jit(functools.partial(fwd_bwd, full_groups=True)), (lhs, rhs, dout)))
    if FLAGS.extra_configs:  # last: the time budget cuts these first
        for fields in EXTRA_CONFIGS:
            try:
                cfg = jrd.TileConfig(**fields)
            except ValueError:
                cfg = None
            cands += tile_rows(", ".join(f"{k}={v}" for k, v in fields.items()), cfg)

    ref_fwd = jax.jit(lambda a, b, gs: jax.lax.ragged_dot(a, b, gs, preferred_element_type=f32))
    ref_dlhs = jax.jit(lambda d, b, gs: jax.lax.ragged_dot(d, jnp.swapaxes(b, 1, 2), gs, preferred_element_type=f32))
    ref_drhs = jax.jit(lambda a, d, gs: jax.lax.ragged_dot_general(
        a, d, gs, RAGGED_CONTRACTING_DIMS, preferred_element_type=f32))
    cands = [c for c in cands if c[0] in FLAGS.ops]
    refs = {}
    for gname, gs_np in groups.items():
        gs = jnp.asarray(gs_np)
        refs[gname] = dict(fwd=ref_fwd(lhs, rhs, gs), d_lhs=ref_dlhs(dout, rhs, gs), d_rhs=ref_drhs(lhs, dout, gs))
    print(f"references done at {time.time() - start:.1f} s", flush=True)
    for op, impl, label, fn, args in cands:
        for gname, gs_np in groups.items():
            gs = jnp.asarray(gs_np)
            row = dict(impl=impl, config=label, groups=gname, op=op)
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
                        row.update(err_out=rel(out, ref["fwd"]), err_dlhs=rel(d_lhs, ref["d_lhs"]),
                                   err_drhs=rel(d_rhs, ref["d_rhs"]))
                        row["err"] = max(row["err_out"], row["err_dlhs"], row["err_drhs"])
                    else:
                        row["err"] = rel(out, refs[gname][op])  # every row is in a group: no tail
                    row["ms"] = _batched_ms(fn, *args, gs, iters=FLAGS.iters, inner=FLAGS.inner)
                    row["ms_blocking"] = median_ms(fn, *args, gs, iters=FLAGS.iters)
                    row["tflops"] = gemm_flops(op, m, k, n) / row["ms"] / 1e9
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
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    m, e = FLAGS.m, FLAGS.experts
    groups = {kind: group_sizes(m, e, kind) for kind in GROUPINGS}
    from experiments.harness import package_versions  # noqa: PLC0415 -- JAX is imported after torch ran
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "versions": package_versions(VERSIONED),
               "shape": dict(M=m, K=FLAGS.k, N=FLAGS.n, experts=e),
               "timing": dict(iters=FLAGS.iters, inner=FLAGS.inner),
               "group_sizes": {g: v.tolist() for g, v in groups.items()},
               "group_stats": {g: dict(max=int(v.max()), min=int(v.min()), empty=int((v == 0).sum()),
                                       max_fraction=float(v.max() / v.sum())) for g, v in groups.items()},
               "rows": []}
    if FLAGS.torch:  # first, before JAX takes the GPU
        _torch_rows(results, groups)
    import jax
    results["device"] = jax.devices()[0].device_kind
    try:
        import jla.ops.mosaic_gpu.ragged_dot  # noqa: F401,PLC0415 -- fail clearly when the wheel is missing
    except ImportError as ex:
        results["rows"].append(dict(impl="jla", groups="", op="", error=f"jla not importable: {ex!r}"))
        _write(results, markdown=True)
        raise SystemExit(f"bench_grouped_gemm_ops: jax-linear-attention (jla) is not installed: {ex}") from ex
    if jax.default_backend() != "gpu":
        results["rows"].append(dict(impl="jla", groups="", op="",
                                    error=f"needs an NVIDIA sm_90 GPU; got {jax.default_backend()=}"))
        _write(results, markdown=True)
        raise SystemExit(f"bench_grouped_gemm_ops: needs an NVIDIA sm_90 GPU; got {jax.default_backend()=}")
    _jax_rows(results, groups, start)
    results["wall_s"] = round(time.time() - start, 1)
    _write(results, markdown=True)
    print(render_markdown(results))
    print(f"wall {results['wall_s']} s", flush=True)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
