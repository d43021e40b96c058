"""CPU tests of experiments/bench_grouped_gemm_ops.py (issue #5): its pure-python parts, its failure
without the GPU wheel, and its JAX rows end to end with stand-ins for jla's kernels (XLA ragged ops)."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from experiments import bench_grouped_gemm_ops as B

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_render_markdown_ratios_skips_and_best_per_op():
    results = dict(
        shape=dict(M=256, K=128, N=128, experts=4), device="H200", date="d", versions={},
        group_stats={"skewed": dict(max=100, min=1, empty=2, max_fraction=0.5)},
        rows=[
            _row("fwd", "torch", "_grouped_mm", "skewed", 0.2, ms_do_bench=0.25),
            _row("d_lhs", "torch", "_grouped_mm", "skewed", 0.25),
            _row("fwd+bwd", "torch", "_grouped_mm", "skewed", 1.0),
            _row("fwd", "jla", "PERSISTENT", "skewed", 0.3, ms_blocking=0.5, err=1e-3, tflops=400.0),
            _row("fwd", "jla", "ALIGNED", "skewed", 0.26),
            _row("d_lhs", "jla", "PERSISTENT", "skewed", 0.5),
            _row("d_rhs", "jla", "transposed_ragged_dot", "skewed", 0.7),
            _row("d_rhs", "jla split", "max_rows=2048", "skewed", 0.4),
            dict(op="fwd", impl="jla", config="WARP_SPECIALIZED", groups="skewed", skipped="time budget 100 s spent"),
        ])
    md = B.render_markdown(results)
    assert "| fwd | jla | PERSISTENT | 0.300 | 1.50 | 400 | 0.500 |  | 1.0e-03 |" in md
    assert "| fwd | torch | _grouped_mm | 0.200 | 1.00 |  |  | 0.250 |  |" in md
    assert "| d_rhs | jla | transposed_ragged_dot | 0.700 |  |" in md  # no torch d_rhs: no ratio
    assert "| fwd | jla | WARP_SPECIALIZED | time budget 100 s spent |" in md
    assert "skewed: largest group 100 rows (50.0%), smallest 1, empty 2" in md
    # best: fwd ALIGNED 0.26 + d_lhs 0.5 + d_rhs split 0.4 = 1.16 = 1.16 x torch's 1.0
    assert "Best jla per op: fwd jla ALIGNED 0.260, d_lhs jla PERSISTENT 0.500, d_rhs jla split max_rows=2048 " \
           "0.400; sum 1.160 ms = 1.16 x torch fwd+bwd (1.000 ms)." in md
    assert "## balanced" not in md  # no rows, no table


@pytest.mark.skipif(importlib.util.find_spec("jla") is not None, reason="jla installed: nothing to refuse")
def test_script_fails_clearly_without_jla(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.bench_grouped_gemm_ops", f"--out={tmp_path}/o",
                          "--notorch"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode != 0 and "jax-linear-attention (jla) is not installed" in out.stderr
    res = json.load(open(tmp_path / "o.json"))
    assert res["group_stats"]["skewed"]["max"] == 12620 and res["rows"][-1]["impl"] == "jla"
    assert "largest group 12620 rows" in open(tmp_path / "o.md").read()


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
    from experiments import bench_grouped_gemm_ops as B
    B._define_flags()
    flags.FLAGS(["bench", "--out=" + sys.argv[1], "--m=256", "--k=128", "--n=128", "--experts=4",
                 "--iters=2", "--inner=2"])
    groups = {"balanced": B.group_sizes(256, 4, "balanced"), "skewed": jnp.array([200, 0, 50, 6])}
    results = dict(shape=dict(M=256, K=128, N=128, experts=4), rows=[])
    B._jax_rows(results, {k: jax.numpy.asarray(v) for k, v in groups.items()}, time.time())
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
        assert r["ms"] > 0 and r["ms_blocking"] > 0, r
        assert r["err"] < 1e-2, r  # bf16 outputs vs fp32 references
    assert json.load(open(tmp_path / "o.json"))["rows"] == rows
