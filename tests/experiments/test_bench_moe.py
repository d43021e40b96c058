"""CPU tests of experiments/bench_moe.py beyond the smoke run: group sizes, FLOPs, shapes, the two
markdown pages, and the per_op study's jla rows end to end with stand-ins for jla's kernels (XLA ragged ops)."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from experiments import bench_moe as B

from tests.repo import REPO


def test_group_sizes_balanced_and_the_anchor_skew():
    bal = B.group_sizes(32768, 64, "balanced")
    assert bal.dtype == np.int32 and bal.shape == (64,) and set(bal.tolist()) == {512}
    skew = B.group_sizes(32768, 64, "skewed")
    rng = np.random.default_rng(0)  # the formula of moe_anchor_*.py, written out
    np.testing.assert_array_equal(skew, np.bincount(rng.zipf(1.5, size=32768) % 64, minlength=64))
    assert skew.sum() == 32768 and skew.max() == 12620 and int(np.argmax(skew)) == 1
    assert not np.array_equal(B.group_sizes(32768, 64, "skewed", seed=1), skew)
    with pytest.raises(ValueError, match="kind"):
        B.group_sizes(64, 4, "zipf")
    with pytest.raises(ValueError, match="num_rows % num_groups"):
        B.group_sizes(65, 4, "balanced")
    with pytest.raises(ValueError, match="num_groups"):
        B.group_sizes(64, 0, "balanced")


def test_gemm_flops():
    assert B.gemm_flops("d_rhs", 4, 5, 6) == 240 and B.gemm_flops("fwd+bwd", 4, 5, 6) == 720
    with pytest.raises(ValueError, match="op"):
        B.gemm_flops("bwd", 4, 5, 6)


def _row(op, impl, config, groups, ms, **kw):
    return dict(op=op, impl=impl, config=config, groups=groups, ms=ms, **kw)


_ENV = dict(date="d", device="H200", backend="gpu", cpu_count=16, python="3.12", jax="0.11.2")
_STATS = {"skewed": dict(max=100, min=1, empty=2, max_fraction=0.5)}


def test_render_per_op_ratios_skips_and_best_per_op():
    results = dict(
        study="per_op", shape=dict(m=256, k=128, n=128, experts=4), env=_ENV, group_stats=_STATS,
        rows=[
            _row("fwd", "torch", "_grouped_mm", "skewed", 0.2, ms_do_bench=0.25),
            _row("d_lhs", "torch", "_grouped_mm", "skewed", 0.25),
            _row("fwd+bwd", "torch", "_grouped_mm", "skewed", 1.0),
            _row("fwd", "jla", "PERSISTENT", "skewed", 0.3, ms_per_call=0.5, err=1e-3, tflops=400.0),
            _row("fwd", "jla", "ALIGNED", "skewed", 0.26),
            _row("d_lhs", "jla", "PERSISTENT", "skewed", 0.5),
            _row("d_rhs", "jla", "transposed_ragged_dot", "skewed", 0.4),
            dict(op="fwd", impl="jla", config="WARP_SPECIALIZED", groups="skewed", skipped="time budget 100 s spent"),
            dict(op="", impl="jla", groups="", error="jla not importable: ImportError()"),
        ])
    md = B.render_per_op(results)
    assert md.startswith("# Grouped GEMM by op, H200\n\nd; H200 (gpu, 16 CPUs); python 3.12; jax 0.11.2\n")
    assert "| fwd | jla | PERSISTENT | 0.300 | 1.50 | 400 | 0.500 |  | 1.0e-03 |" in md
    assert "| fwd | torch | _grouped_mm | 0.200 | 1.00 |  |  | 0.250 |  |" in md
    assert "| d_rhs | jla | transposed_ragged_dot | 0.400 |  |" in md  # no torch d_rhs: no ratio
    assert "| fwd | jla | WARP_SPECIALIZED | time budget 100 s spent |" in md
    assert "skewed: largest group 100 rows (50.0%), smallest 1, empty 2" in md
    assert "Not measured:\n- jla: jla not importable: ImportError()" in md
    # best: fwd ALIGNED 0.26 + d_lhs 0.5 + d_rhs 0.4 = 1.16 = 1.16 x torch's 1.0
    assert "Best jla per op: fwd jla ALIGNED 0.260, d_lhs jla PERSISTENT 0.500, d_rhs jla transposed_ragged_dot " \
           "0.400; sum 1.160 ms = 1.16 x torch fwd+bwd (1.000 ms)." in md
    assert "## balanced" not in md  # no rows, no table


def test_render_backends_ratio_to_torch_errors_and_layer():
    results = dict(
        study="backends", shape=dict(m=256, k=128, n=128, experts=4), env=_ENV, group_stats=_STATS,
        dense_matmul_ms=0.5, dense_tflops=300.0, layer_shape=dict(tokens=8, d_model=4, d_ff=2, experts=2, top_k=1),
        rows=[dict(impl="torch", groups="skewed", op="fwd", ms=0.1, ms_do_bench=0.25),
              dict(impl="torch", groups="skewed", op="fwd+bwd", ms=0.9, ms_do_bench=1.0),
              dict(impl="k3jax jla", groups="skewed", out_dtype="bfloat16", fwd_ms=0.5, fwdbwd_ms=1.5,
                   fwdbwd_stream_ms=1.2, err_out=0.0, err_dlhs=1e-3, err_drhs=2e-3),
              dict(impl="k3jax tokamax", groups="skewed", out_dtype="bfloat16", error="needs an NVIDIA GPU")],
        layer=[dict(impl="default", resolved="jla", fwdbwd_ms=15.2, tokens_per_s=1.08e6, tflops=325.0, pct_dense=99.2),
               dict(impl="xla", error="boom")])
    md = B.render_backends(results)
    assert "| k3jax jla | skewed | bfloat16 | 0.500 | 1.500 | 1.200 | 1.50 | 0.0e+00 | 1.0e-03 | 2.0e-03 |" in md
    assert "| k3jax tokamax | skewed | bfloat16 | not run: needs an NVIDIA GPU |" in md
    assert "| torch._grouped_mm (do_bench) | skewed | bfloat16 | 0.250 | 1.000 | | 1.00 | | | |" in md
    assert "| default (jla) | 15.20 | 1.08e+06 | 325 | 99.2 |" in md and "| xla | failed: boom |" in md


def test_parse_shape_names_and_dims():
    from experiments import harness  # noqa: PLC0415
    fields = ("m", "k", "n", "experts")
    assert B.parse_shape("anchor", harness.MOE_GEMM_SHAPES, fields) == dict(m=32768, k=2048, n=1024, experts=64)
    assert B.parse_shape("256x128x64x4", harness.MOE_GEMM_SHAPES, fields) == dict(m=256, k=128, n=64, experts=4)
    for bad in ("256x128x64", "256x0x64x4", "big"):
        with pytest.raises(ValueError, match="shape"):
            B.parse_shape(bad, harness.MOE_GEMM_SHAPES, fields)


_DRIVER = textwrap.dedent("""
    import json, sys, time, types
    import jax, jax.numpy as jnp
    from k3jax.ops import grouped_matmul as G
    # Stand-ins for jla 0.1.0's kernels (the signatures the script calls), computed by XLA ragged ops.
    leaf = types.ModuleType("jla.ops.mosaic_gpu.ragged_dot")
    class Tile(types.SimpleNamespace):
        def divides(self, k, n):
            return True
    for name in ("PERSISTENT", "PERSISTENT_WS", "ALIGNED", "WARP_SPECIALIZED", "BLOCK_ALIGNED"):
        setattr(leaf, name, Tile(name=name))
    leaf.supports = lambda lhs, rhs, gs, config=None: getattr(config, "name", None) != "BLOCK_ALIGNED"
    def tile_config(**fields):  # jla's TileConfig refuses some tilings in __post_init__
        if fields.get("block_k") == 128:
            raise ValueError("unsupported")
        return Tile(**fields)
    leaf.TileConfig = tile_config
    leaf.ragged_dot = lambda lhs, rhs, gs, *, full_groups=False, config=None: jax.lax.ragged_dot(
        lhs, rhs, gs).astype(lhs.dtype)
    leaf.transposed_ragged_dot = lambda lhs, d_out, gs: jax.lax.ragged_dot_general(
        lhs, d_out, gs, G._RAGGED_CONTRACTING_DIMS, preferred_element_type=jnp.float32).astype(lhs.dtype)
    names = ["jla", "jla.ops", "jla.ops.mosaic_gpu"]
    mods = [types.ModuleType(n) for n in names]
    mods[0].ops, mods[1].mosaic_gpu, mods[2].ragged_dot = mods[1], mods[2], leaf
    sys.modules.update(zip(names + [leaf.__name__], mods + [leaf]))
    G._platform = lambda: ("gpu", "NVIDIA H200", "9.0")
    G._importable = lambda module: module == "jla"
    from absl import flags
    from experiments import bench_moe as B
    B._define_flags()
    flags.FLAGS(["bench", "--study=per_op", "--out=" + sys.argv[1], "--iters=2", "--warmup=0", "--stream_calls=2",
                 "--stream_reps=2"])
    groups = {"balanced": B.group_sizes(256, 4, "balanced"), "skewed": jnp.array([200, 0, 50, 6])}
    results = dict(study="per_op", shape=dict(m=256, k=128, n=128, experts=4), group_stats={}, rows=[])
    B._per_op_rows(results, {k: jax.numpy.asarray(v) for k, v in groups.items()}, time.time())
    print("RESULT" + json.dumps(results["rows"]))
""")


def test_jax_rows_end_to_end_with_stand_in_kernels(tmp_path):
    """Every (op, config, grouping) row comes back timed and with a small error against the XLA
    reference (the stand-ins are XLA itself, so a wrong operand or transpose in the script would show)."""
    out = subprocess.run([sys.executable, "-c", _DRIVER, str(tmp_path / "o")], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))[6:])
    extras = [", ".join(f"{k}={v}" for k, v in fields.items()) for fields in B.EXTRA_CONFIGS]
    assert [(r["op"], r["config"]) for r in rows[::2]] == [
        *((op, c) for c in B.JLA_CONFIG_NAMES for op in ("fwd", "d_lhs")),
        ("d_rhs", "transposed_ragged_dot"), ("fwd+bwd", "default"), ("fwd+bwd", "full_groups=True"),
        *((op, c) for c in extras for op in ("fwd", "d_lhs"))]
    assert [r["groups"] for r in rows] == ["balanced", "skewed"] * (len(rows) // 2)
    for r in rows:
        if r["config"] in ("BLOCK_ALIGNED", extras[2]):
            assert r["skipped"] == ("jla supports() rejects it for K=128, N=128" if r["config"] == "BLOCK_ALIGNED"
                                    else "jla TileConfig refuses it")
            continue
        assert r["ms"] > 0 and r["ms_per_call"] > 0, r
        assert r["err"] < 1e-2, r  # bf16 outputs vs fp32 references
    assert json.load(open(tmp_path / "o.json"))["rows"] == rows


_BACKENDS_DRIVER = textwrap.dedent("""
    import json, sys
    from absl import flags
    from experiments import bench_moe as B
    B._define_flags()
    flags.FLAGS(["bench", "--out=" + sys.argv[1], "--impls=xla,blocked,jla", "--out_dtypes=bfloat16,float32",
                 "--iters=1", "--warmup=0", "--stream_calls=2", "--stream_reps=1"])
    results = dict(study="backends", shape=dict(m=64, k=16, n=8, experts=4), group_stats={}, rows=[], layer=[])
    B._backend_rows(results, {"skewed": B.group_sizes(64, 4, "skewed")})
    print("RESULT" + json.dumps(results["rows"]))
""")


def test_backend_rows_time_every_backend_and_give_reasons():
    """On CPU: xla and blocked are timed with errors against xla (blocked's within bf16 rounding), jla
    gives its refusal as the row's error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", _BACKENDS_DRIVER, tmp + "/o"], cwd=REPO, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))[6:])
    assert [(r["impl"], r["out_dtype"]) for r in rows] == [
        (f"k3jax {i}", d) for d in ("bfloat16", "float32") for i in ("xla", "blocked", "jla")]
    for r in rows:
        if r["impl"] == "k3jax jla":
            assert "needs an NVIDIA GPU" in r["error"]
            continue
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwdbwd_stream_ms"] > 0, r
        assert max(r["err_out"], r["err_dlhs"], r["err_drhs"]) < 1e-2, r
