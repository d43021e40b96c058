"""The "jla" adapter's static choices (k3jax.ops.dispatch.JlaPlan, issue #5) on CPU: virtual-group
splitting of d_rhs and the per-GEMM tilings, with XLA ragged ops standing in for jla's kernels."""
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import dispatch as D

_H200 = ("gpu", "NVIDIA H200", "9.0")


def test_split_group_sizes_hand_example():
    sizes, owner = D.split_group_sizes(jnp.array([10, 0, 3, 7], jnp.int32), 4, 20)
    # V = 4 + 20 // 4 = 9: group 0 -> 4, 4, 2; group 1 -> none; group 2 -> 3; group 3 -> 4, 3; 3 unused
    np.testing.assert_array_equal(sizes, [4, 4, 2, 3, 4, 3, 0, 0, 0])
    np.testing.assert_array_equal(owner, [0, 0, 0, 2, 3, 3, 3, 3, 3])
    assert sizes.dtype == owner.dtype == jnp.int32


@pytest.mark.parametrize("max_rows", [1, 7, 64, 1000])
def test_split_group_sizes_partitions_every_group(max_rows):
    """Random sizes with empty groups and tail rows: per group the pieces sum to its size, all but the
    last are full, rows stay in order (owner non-decreasing), and V = G + M // max_rows suffices."""
    rng = np.random.default_rng(max_rows)
    num_rows = 300
    for _ in range(5):
        sizes = rng.multinomial(int(rng.integers(0, num_rows + 1)), rng.dirichlet(np.full(6, 0.3)))
        sizes[rng.integers(0, 6)] = 0
        v, owner = jax.jit(D.split_group_sizes, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), max_rows,
                                                                        num_rows)
        v, owner = np.asarray(v), np.asarray(owner)
        assert v.shape == owner.shape == (6 + num_rows // max_rows,)
        assert np.all(np.diff(owner) >= 0) and np.all((v >= 0) & (v <= max_rows))
        for g in range(6):
            mine = v[owner == g]
            mine = mine[mine > 0]
            assert mine.sum() == sizes[g] and len(mine) == -(-sizes[g] // max_rows)
            assert np.all(mine[:-1] == max_rows)
        # the non-empty pieces come first, in group order
        nonzero = np.flatnonzero(v)
        assert nonzero.size == 0 or nonzero[-1] == nonzero.size - 1


def test_split_group_sizes_rejects_bad_input():
    with pytest.raises(ValueError, match="max_rows"):
        D.split_group_sizes(jnp.array([1, 2]), 0, 3)
    with pytest.raises(ValueError, match="group_sizes"):
        D.split_group_sizes(jnp.array([1.0, 2.0]), 2, 3)
    with pytest.raises(ValueError, match="group_sizes"):
        D.split_group_sizes(jnp.ones((2, 2), jnp.int32), 2, 3)


def test_jla_plan_validation():
    assert D.JLA_PLAN == D.JlaPlan(**{f.name: getattr(D.JLA_PLAN, f.name)
                                      for f in D.dataclasses.fields(D.JlaPlan)})
    with pytest.raises(ValueError, match="d_rhs_split_rows"):
        D.JlaPlan(d_rhs_split_rows=0)
    with pytest.raises(ValueError, match="forward_config"):
        D.JlaPlan(forward_config="")
    with pytest.raises(ValueError, match="d_lhs_config"):
        D.JlaPlan(d_lhs_config=3)
    with pytest.raises(ValueError, match="forward_config"):
        D.JlaPlan(forward_config="PERSISTANT")          # a misspelt name is refused, not silently replaced
    with pytest.raises(ValueError, match="d_rhs_split_rows"):
        D.JlaPlan(d_rhs_split_rows=True)
    assert D.JlaPlan(d_rhs_split_rows=np.int64(4)).d_rhs_split_rows == 4


def test_grouped_matmul_input_validation():
    lhs, rhs = jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
    sizes = jnp.array([3, 5], jnp.int32)
    for kwargs, word in [(dict(full_groups="yes"), "full_groups"), (dict(full_groups=None), "full_groups"),
                         (dict(preferred_element_type=jnp.int8), "preferred_element_type")]:
        with pytest.raises(ValueError, match=word):
            D.grouped_matmul(lhs, rhs, sizes, implementation="xla", **kwargs)
    for args, word in [((lhs, rhs.astype(jnp.bfloat16), sizes), "dtype"), ((lhs, rhs, [3, 5]), "group_sizes"),
                       ((lhs, rhs, jnp.array([-1, 5], jnp.int32)), "group_sizes"),
                       ((lhs, rhs, jnp.array([5, 5], jnp.int32)), "group_sizes")]:
        with pytest.raises(ValueError, match=word):
            D.grouped_matmul(*args, implementation="xla")
    with pytest.raises(ValueError, match="full_groups"):
        D.grouped_matmul(lhs, rhs, jnp.array([3, 4], jnp.int32), implementation="xla", full_groups=True)
    # traced sizes cannot be checked: the promise is the caller's
    out = jax.jit(lambda s: D.grouped_matmul(lhs, rhs, s, implementation="xla", full_groups=True))(sizes)
    np.testing.assert_allclose(out, 4.0)


class _Tile:
    """Stand-in for jla's TileConfig: divides(k, n) as jla's (block_k | k and tile_n | n)."""

    def __init__(self, name, block_k, tile_n):
        self.name, self.block_k, self.tile_n = name, block_k, tile_n

    def divides(self, k, n):
        return k % self.block_k == 0 and n % self.tile_n == 0


def _fake_jla(monkeypatch):
    """jla.ops.mosaic_gpu.ragged_dot stand-ins computed by XLA (bf16 outputs, as jla's), recording the
    tiling each GEMM got and the group count of every d_rhs call."""
    calls = []
    leaf = types.ModuleType("jla.ops.mosaic_gpu.ragged_dot")
    leaf.PERSISTENT = _Tile("PERSISTENT", 64, 128)
    leaf.PERSISTENT_WS = _Tile("PERSISTENT_WS", 64, 256)  # as jla's: 256-wide tiles; N=256 but not K=128
    leaf.supports = lambda lhs, rhs, gs: True
    leaf._config_for = lambda config, k, n: leaf.PERSISTENT if config is None else config

    def ragged_dot(lhs, rhs, gs, full_groups=False, config=None):
        calls.append(("fwd", None if config is None else config.name))
        out = jax.lax.ragged_dot(lhs, rhs, gs).astype(lhs.dtype)
        if full_groups:  # like the kernel: rows past sum(gs) left unwritten (stale memory: 7.0)
            return jnp.where(jnp.arange(out.shape[0])[:, None] < jnp.sum(gs), out, 7.0).astype(out.dtype)
        return out

    def kernel(lhs, rhs, gs, *, transpose_rhs, cfg):
        calls.append(("d_lhs" if transpose_rhs else "fwd", cfg.name))
        out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, gs).astype(lhs.dtype)
        return jnp.where(jnp.arange(out.shape[0])[:, None] < jnp.sum(gs), out, 7.0).astype(out.dtype)

    def transposed(lhs, d_out, gs):
        calls.append(("d_rhs", gs.shape[0]))
        return jax.lax.ragged_dot_general(lhs, d_out, gs, D._RAGGED_CONTRACTING_DIMS,
                                          preferred_element_type=jnp.float32).astype(lhs.dtype)

    leaf.ragged_dot, leaf._ragged_dot_kernel, leaf.transposed_ragged_dot = ragged_dot, kernel, transposed
    names = ["jla", "jla.ops", "jla.ops.mosaic_gpu"]
    mods = [types.ModuleType(n) for n in names]
    mods[0].ops, mods[1].mosaic_gpu, mods[2].ragged_dot = mods[1], mods[2], leaf
    for n, m in zip(names + [leaf.__name__], mods + [leaf]):
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(D, "_importable", lambda module: module == "jla")
    monkeypatch.setattr(D, "_platform", lambda: _H200)
    return calls


M, K, N, E = 256, 128, 256, 4
SIZES = jnp.array([150, 0, 37, 41], jnp.int32)  # one large group, an empty one, 28 tail rows


def _run(plan, full_groups=False):
    lhs = jax.random.normal(jax.random.PRNGKey(0), (M, K)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(1), (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(2), (M, N)).astype(jnp.bfloat16)
    if plan == "xla":
        f = lambda a, b: D.grouped_matmul(a, b, SIZES, implementation="xla", preferred_element_type=jnp.bfloat16)  # noqa: E731
    else:
        f = lambda a, b: D._jla_grouped_matmul(a, b, SIZES, jnp.bfloat16, plan, full_groups)  # noqa: E731
    y, vjp = jax.vjp(f, lhs, rhs)
    return (y, *vjp(cot))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def test_full_groups_skips_the_tail_zeroing_only_in_jla(monkeypatch):
    """full_groups=True is a promise: jla then leaves the (here stale: 7.0) rows past the groups as the
    kernels wrote them, in the output and in d_lhs; the valid rows are unchanged. XLA ignores it."""
    calls = _fake_jla(monkeypatch)
    y, d_lhs, d_rhs = _run(D.JlaPlan(), full_groups=True)
    y_m, d_lhs_m, d_rhs_m = _run(D.JlaPlan())
    assert np.all(np.asarray(y[228:], np.float32) == 7.0) and np.all(np.asarray(d_lhs[228:], np.float32) == 7.0)
    for a, b in ((y, y_m), (d_lhs, d_lhs_m)):
        np.testing.assert_array_equal(np.asarray(a[:228], np.float32), np.asarray(b[:228], np.float32))
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.asarray(d_rhs_m, np.float32))
    assert float(jnp.abs(y_m[228:]).max()) == 0.0 and float(jnp.abs(d_lhs_m[228:]).max()) == 0.0
    assert ("fwd", None) in calls
    lhs = jnp.ones((6, 3)); rhs = jnp.ones((2, 3, 4)); sizes = jnp.array([2, 3], jnp.int32)
    for impl in ("xla", "blocked"):  # traced sizes (concrete ones with sum < M are refused)
        out = jax.jit(lambda s, impl=impl: D.grouped_matmul(lhs, rhs, s, implementation=impl, full_groups=True))(sizes)
        np.testing.assert_array_equal(out, np.concatenate([np.full((5, 4), 3.0), np.zeros((1, 4))]))


def test_dropless_moe_through_jla_promises_full_groups_and_matches_xla(monkeypatch):
    """dropless_moe's groups come from permute (every routed row counted), so it passes full_groups=True;
    through the stand-in jla kernels it equals the xla path, forward and gradients."""
    _fake_jla(monkeypatch)
    seen = []
    real = D._FULL_GROUPS_VARIANTS["jla"]
    monkeypatch.setitem(D._FULL_GROUPS_VARIANTS, "jla", lambda *a: seen.append(a[0].shape) or real(*a))
    tokens, top_k, d, f, e = 64, 2, 128, 128, 4
    ks = jax.random.split(jax.random.PRNGKey(4), 5)
    x = jax.random.normal(ks[0], (tokens, d)).astype(jnp.bfloat16)
    ws = [(jax.random.normal(k, s) * s[1] ** -0.5).astype(jnp.bfloat16)
          for k, s in zip(ks[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    ids = jax.lax.top_k(jax.random.normal(ks[4], (tokens, e)), top_k)[1].astype(jnp.int32)
    w = jnp.full((tokens, top_k), 0.5, jnp.float32)

    def run(impl):
        f_ = lambda x, *ws: jnp.sum(D.dropless_moe(x, ids, w, *ws, implementation=impl) ** 2)  # noqa: E731
        return jax.value_and_grad(f_, argnums=(0, 1, 2, 3))(x, *ws)

    (v, g), (v_x, g_x) = run("jla"), run("xla")
    assert seen == [(tokens * top_k, d), (tokens * top_k, d), (tokens * top_k, f)]
    assert abs(float(v) - float(v_x)) < 1e-2 * abs(float(v_x))
    for a, b in zip(g, g_x):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("split_rows", [None, 64, 1])
def test_jla_d_rhs_split_equals_xla(monkeypatch, split_rows):
    """The split d_rhs (150 rows in 3 pieces of <= 64; or every row its own piece) equals XLA's within
    bf16 rounding of the pieces, the empty group's gradient is exactly zero, and the kernel saw
    E + M // split_rows virtual groups."""
    calls = _fake_jla(monkeypatch)
    y, d_lhs, d_rhs = _run(D.JlaPlan(d_rhs_split_rows=split_rows))
    y_x, d_lhs_x, d_rhs_x = _run("xla")
    assert d_rhs.dtype == jnp.bfloat16 and d_rhs.shape == (E, K, N)
    assert _rel(y, y_x) < 4e-3 and _rel(d_lhs, d_lhs_x) < 4e-3
    assert _rel(d_rhs, d_rhs_x) < (4e-3 if split_rows in (None, 64) else 2e-2)
    assert float(jnp.abs(d_rhs[1]).max()) == 0.0 and float(jnp.abs(d_lhs[228:]).max()) == 0.0
    virtual = E if split_rows is None else E + M // split_rows
    assert ("d_rhs", virtual) in calls and len([c for c in calls if c[0] == "d_rhs"]) == 1
    # a split that would need more than LIBRARY_MAX_GROUPS virtual groups (here 8 or 260 > 5) is not made
    monkeypatch.setattr(D, "LIBRARY_MAX_GROUPS", E + 1)
    calls.clear()
    _, _, d_rhs_capped = _run(D.JlaPlan(d_rhs_split_rows=split_rows))
    assert [c for c in calls if c[0] == "d_rhs"] == [("d_rhs", E)]
    assert _rel(d_rhs_capped, d_rhs_x) < 4e-3


@pytest.mark.parametrize(
    "plan,expected",
    [
        (D.JlaPlan(), [("fwd", None), ("d_lhs", "PERSISTENT")]),
        # the 256-wide tile divides the forward (K=128 contraction, N=256 width) but not d_lhs (width K=128):
        # refused for the forward (jla's ragged_dot(config=) needs both) and for d_lhs
        (D.JlaPlan(forward_config="PERSISTENT_WS", d_lhs_config="PERSISTENT_WS"),
         [("fwd", None), ("d_lhs", "PERSISTENT")]),
        (D.JlaPlan(forward_config="PERSISTENT", d_lhs_config="PERSISTENT"),
         [("fwd", "PERSISTENT"), ("d_lhs", "PERSISTENT")]),
        # a named tiling the installed jla lacks (here ALIGNED, not faked) gives jla's default
        (D.JlaPlan(forward_config="ALIGNED"), [("fwd", None), ("d_lhs", "PERSISTENT")]),
    ],
)
def test_jla_plan_tilings_are_used_only_where_they_divide(monkeypatch, plan, expected):
    calls = _fake_jla(monkeypatch)
    y, d_lhs, _ = _run(plan)
    assert [c for c in calls if c[0] != "d_rhs"] == expected
    y_x, d_lhs_x, _ = _run("xla")
    assert _rel(y, y_x) < 4e-3 and _rel(d_lhs, d_lhs_x) < 4e-3


def test_wide_tile_used_for_d_lhs_where_it_divides(monkeypatch):
    """With K = 256 the 256-wide tile divides the d_lhs GEMM (contraction N=256, width K=256)."""
    calls = _fake_jla(monkeypatch)
    lhs = jnp.ones((M, 256), jnp.bfloat16)
    rhs = jnp.ones((E, 256, 256), jnp.bfloat16)
    f = lambda a, b: D._jla_grouped_matmul(a, b, SIZES, jnp.float32, D.JlaPlan(forward_config="PERSISTENT_WS",
                                                                                 d_lhs_config="PERSISTENT_WS"))  # noqa: E731
    y, vjp = jax.vjp(f, lhs, rhs)
    d_lhs, _ = vjp(jnp.ones_like(y))
    assert [c for c in calls if c[0] != "d_rhs"] == [("fwd", "PERSISTENT_WS"), ("d_lhs", "PERSISTENT_WS")]
    np.testing.assert_array_equal(np.asarray(d_lhs[:228], np.float32), 256.0)


@pytest.mark.gpu
@pytest.mark.parametrize("plan,full_groups", [(D.JlaPlan(), False), (D.JlaPlan(d_rhs_split_rows=256), False),
                                              (D.JlaPlan("PERSISTENT_WS", "PERSISTENT_WS", 512), False),
                                              (D.JLA_PLAN, False), (D.JLA_PLAN, True)])
def test_jla_plans_on_the_gpu_match_xla(plan, full_groups):
    """The real jla kernels (H100/H200) under every candidate plan: output, d_lhs, d_rhs against XLA's
    ragged_dot with skewed sizes, an empty group and 256 tail rows (none with full_groups)."""
    if not D._importable("jla"):
        pytest.skip("jax-linear-attention not installed")
    m, k, n = 2048, 256, 512
    sizes = jnp.array([1200, 0, 37, 300, 5, 100, 50, 356 if full_groups else 100], jnp.int32)
    total = int(sizes.sum())
    lhs = jax.random.normal(jax.random.PRNGKey(0), (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(1), (8, k, n)) * k ** -0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(2), (m, n)).astype(jnp.bfloat16)
    assert D.grouped_matmul_supported("jla", lhs, rhs, sizes)[0]

    def run(f):
        y, vjp = jax.vjp(f, lhs, rhs)
        return (y, *vjp(cot.astype(y.dtype)))

    got = jax.jit(lambda: run(lambda a, b: D._jla_grouped_matmul(a, b, sizes, jnp.bfloat16, plan, full_groups)))()
    ref = jax.jit(lambda: run(lambda a, b: D.grouped_matmul(a, b, sizes, implementation="xla",
                                                             preferred_element_type=jnp.float32)))()
    for g, r in zip(got, ref):
        assert _rel(g, r) < 8e-3
    assert float(jnp.abs(got[0][total:]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(got[1][total:]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(got[2][1]).max()) == 0.0
