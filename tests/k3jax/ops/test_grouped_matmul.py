"""k3jax.ops.grouped_matmul: every backend against jax.lax.ragged_dot / a per-group loop, forward and
gradients; the automatic choice; the GPU adapters on stand-ins for jla and tokamax (absent in CI)."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.ops import grouped_matmul as G
from k3jax.ops import token_dispatch as T
from tests.jaxpr_testing import jit_calls, shared


@pytest.mark.parametrize("implementation", ["xla", "blocked", None])
def test_grouped_matmul_matches_per_group_loop_and_zero_tail(implementation):
    lhs = jax.random.normal(jax.random.PRNGKey(1), (9, 5))
    rhs = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 4))
    sizes = jnp.array([2, 0, 5], jnp.int32)  # 7 of 9 rows used; an empty group
    out = G.grouped_matmul(lhs, rhs, sizes, implementation=implementation)
    assert out.dtype == jnp.float32
    ref = np.concatenate([lhs[:2] @ rhs[0], lhs[2:7] @ rhs[2], np.zeros((2, 4))])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="implementation"):
        G.grouped_matmul(lhs, rhs, sizes, implementation="cutlass")
    with pytest.raises(ValueError, match="shape"):
        G.grouped_matmul(lhs, rhs[:, :4], sizes)


def test_blocked_equals_ragged_dot_across_blocks_forward_and_gradients():
    """M = 300 rows over 3 blocks of 128, 6 groups (two empty), 17 tail rows; bf16 operands."""
    sizes = jnp.array([130, 0, 1, 100, 0, 52], jnp.int32)
    lhs = jax.random.normal(jax.random.PRNGKey(3), (300, 24)).astype(jnp.bfloat16)
    rhs = jax.random.normal(jax.random.PRNGKey(4), (6, 24, 40)).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(5), (300, 40))

    def run(impl):
        f = lambda a, b: jnp.sum(G.grouped_matmul(a, b, sizes, implementation=impl) * cot)  # noqa: E731
        return jax.jit(lambda a, b: (G.grouped_matmul(a, b, sizes, implementation=impl),
                                     jax.grad(f, argnums=(0, 1))(a, b)))(lhs, rhs)

    (y_b, g_b), (y_x, g_x) = run("blocked"), run("xla")
    np.testing.assert_allclose(y_b, y_x, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(y_b[283:]).max()) == 0.0
    for a, b in zip(g_b, g_x):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    assert G.default_implementation() == "blocked"  # CPU


def test_grouped_matmul_registry_hook_is_used():
    calls = []

    def fake(lhs, rhs, group_sizes, preferred_element_type, full_groups):
        calls.append((lhs.shape, full_groups))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    G.register_backend("test_hook", fake)
    try:
        lhs = jnp.ones((4, 3))
        rhs = jnp.ones((2, 3, 2))
        out = G.grouped_matmul(lhs, rhs, jnp.array([1, 3]), implementation="test_hook")
        assert calls == [((4, 3), False)]
        np.testing.assert_allclose(out, np.full((4, 2), 3.0))
        with pytest.raises(ValueError, match="name"):
            G.register_backend("xla", fake)
    finally:
        G.BACKENDS.pop("test_hook")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the off-GPU behaviour")
def test_library_kernels_refused_off_gpu():
    """On CPU the GPU library kernels are never chosen and an explicit request raises (fail-closed)."""
    lhs = jnp.ones((128, 128), jnp.bfloat16)
    rhs = jnp.ones((2, 128, 128), jnp.bfloat16)
    sizes = jnp.array([100, 28], jnp.int32)
    for name in ("tokamax", "jla"):
        ok, reason = G.supported(name, lhs, rhs, sizes)
        assert not ok and "NVIDIA" in reason
        with pytest.raises(ValueError, match="does not support"):
            G.grouped_matmul(lhs, rhs, sizes, implementation=name)
    assert G.default_implementation(lhs, rhs, sizes) == "blocked"
    with pytest.raises(ValueError, match="implementation"):
        G.supported("cutlass", lhs, rhs, sizes)


_H200 = ("gpu", "NVIDIA H200", "9.0")
_RAGGED_DOT_DIMS = jax.lax.RaggedDotDimensionNumbers(  # jax.lax.ragged_dot's [M, K] x [E, K, N]
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _install_fake_jla(monkeypatch, calls, *, supports=True):
    """jla 0.1.0's public ragged_dot module as XLA stand-ins: ``ragged_dot(lhs, rhs, gs, *, full_groups,
    config)`` with its own VJP (d_lhs by the transposed-rhs GEMM, d_rhs by ``transposed_ragged_dot``),
    bf16 outputs, and, like the kernels, rows past sum(gs) left unwritten (stale: 7.0) when
    ``full_groups`` (else zeroed). ``calls`` records ("fwd" | "d_lhs", full_groups) and ("d_rhs",), once per
    distinct GEMM (operand shapes): under jit a kernel is traced twice, for the jit's jaxpr and by the VJP's
    forward rule."""
    leaf = types.ModuleType("jla.ops.mosaic_gpu.ragged_dot")
    seen = set()

    def gemm(tag, lhs, rhs, gs, full_groups):
        if (tag, full_groups, lhs.shape, rhs.shape) not in seen:
            seen.add((tag, full_groups, lhs.shape, rhs.shape))
            calls.append((tag, full_groups))
        out = jax.lax.ragged_dot(lhs, rhs, gs).astype(lhs.dtype)
        tail = jnp.arange(out.shape[0])[:, None] >= jnp.sum(gs)
        return jnp.where(tail, 7.0 if full_groups else 0.0, out).astype(out.dtype)

    def transposed(lhs, d_out, gs):
        calls.append(("d_rhs",))
        return jax.lax.ragged_dot_general(lhs, d_out, gs, G._RAGGED_CONTRACTING_DIMS,
                                          preferred_element_type=jnp.float32).astype(lhs.dtype)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def ragged(lhs, rhs, gs, full_groups):
        return gemm("fwd", lhs, rhs, gs, full_groups)

    def ragged_bwd(full_groups, res, d_out):
        lhs, rhs, gs = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs = gemm("d_lhs", d_out, jnp.swapaxes(rhs, 1, 2), gs, full_groups)
        return d_lhs, transposed(lhs, d_out, gs).astype(rhs.dtype), None

    ragged.defvjp(lambda lhs, rhs, gs, fg: (ragged(lhs, rhs, gs, fg), (lhs, rhs, gs)), ragged_bwd)
    leaf.ragged_dot = lambda lhs, rhs, gs, *, full_groups=False, config=None: ragged(
        lhs, rhs, gs.astype(jnp.int32), full_groups)
    leaf.transposed_ragged_dot = transposed
    leaf.supports = lambda lhs, rhs, gs, config=None: supports
    names = ["jla", "jla.ops", "jla.ops.mosaic_gpu"]
    mods = [types.ModuleType(n) for n in names]
    mods[0].ops, mods[1].mosaic_gpu, mods[2].ragged_dot = mods[1], mods[2], leaf
    for n, m in zip(names + [leaf.__name__], mods + [leaf]):
        monkeypatch.setitem(sys.modules, n, m)


def _fake_library_modules(monkeypatch, *, tokamax=True, jla=True, jla_supports=True):
    """Stand-ins for the GPU libraries (absent in CI): the same entry points, computed by
    jax.lax.ragged_dot_general, with the real kernels' restrictions that matter here: tokamax refuses
    operands of different dtypes (the failure of moe_gemm_h200.md) and leaves rows past sum(group_sizes)
    unwritten (here: 7.0); jla returns the operand dtype."""
    import sys
    import types

    calls = []
    if tokamax:
        mod = types.ModuleType("tokamax")

        def general(lhs, rhs, group_sizes, dims, precision=None, preferred_element_type=None, *, implementation):
            if lhs.dtype != rhs.dtype:
                raise NotImplementedError(f"lhs and rhs must have same dtype (got {lhs.dtype=}, {rhs.dtype=})")
            calls.append((implementation, str(lhs.dtype), str(rhs.dtype)))
            out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32)
            if dims.rhs_group_dimensions:  # row-ragged output: fake stale memory in the tail rows
                tail = jnp.arange(out.shape[0]) >= jnp.sum(group_sizes)
                out = jnp.where(tail[:, None], 7.0, out)
            return out.astype(preferred_element_type)

        mod.ragged_dot_general = general
        mod.ragged_dot = lambda lhs, rhs, gs, preferred_element_type=None, *, implementation: general(
            lhs, rhs, gs, _RAGGED_DOT_DIMS, preferred_element_type=preferred_element_type,
            implementation=implementation)
        monkeypatch.setitem(sys.modules, "tokamax", mod)
    if jla:
        _install_fake_jla(monkeypatch, calls, supports=jla_supports)
    installed = {name for name, present in (("tokamax", tokamax), ("jla", jla)) if present}
    monkeypatch.setattr(G, "_importable", lambda module: module in installed)
    return calls


@pytest.mark.parametrize(
    "platform,libs,dtype,m,expected",
    [
        (_H200, dict(tokamax=True, jla=True), jnp.bfloat16, 256, "jla"),
        (_H200, dict(tokamax=True, jla=False), jnp.bfloat16, 256, "xla"),  # tokamax: by name only
        (_H200, dict(tokamax=True, jla=True, jla_supports=False), jnp.bfloat16, 256, "xla"),
        (_H200, dict(tokamax=False, jla=True), jnp.bfloat16, 256, "jla"),
        (_H200, dict(tokamax=False, jla=True, jla_supports=False), jnp.bfloat16, 256, "xla"),
        (_H200, dict(tokamax=False, jla=False), jnp.bfloat16, 256, "xla"),
        (_H200, dict(tokamax=True, jla=True), jnp.float32, 256, "xla"),  # not bf16
        (_H200, dict(tokamax=True, jla=True), jnp.bfloat16, 200, "xla"),  # M not a multiple of 128
        (("gpu", "NVIDIA A100-SXM4-40GB", "8.0"), dict(tokamax=True, jla=True), jnp.bfloat16, 256, "xla"),
        (("tpu", "TPU v5 lite", ""), dict(tokamax=True, jla=True), jnp.bfloat16, 256, "xla"),
    ],
)
def test_gpu_default_is_the_library_kernel_only_where_supported(monkeypatch, platform, libs, dtype, m, expected):
    _fake_library_modules(monkeypatch, **libs)
    monkeypatch.setattr(G, "_platform", lambda: platform)
    lhs = jax.ShapeDtypeStruct((m, 256), dtype)
    rhs = jax.ShapeDtypeStruct((4, 256, 128), dtype)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert G.default_implementation(lhs, rhs, sizes) == expected
    # without operands: the platform + installed jla decide (a 128 x 128 bf16 probe)
    jla_ok = platform == _H200 and libs["jla"] and libs.get("jla_supports", True)
    assert G.default_implementation() == ("jla" if jla_ok else "xla")


@pytest.mark.parametrize("name", ["tokamax", "jla"])
def test_library_adapters_match_xla_forward_and_gradients_with_fp32_cotangent(monkeypatch, name):
    """Adapters on the mocked libraries, as the MoE calls them: bf16 operands, fp32 output, an fp32
    cotangent (the case that broke tokamax's own VJP). 56 tail rows must come back zero in the output
    and in d_lhs; grads equal the xla path's within bf16 rounding."""
    calls = _fake_library_modules(monkeypatch)
    monkeypatch.setattr(G, "_platform", lambda: _H200)
    m, k, n = 256, 128, 256
    sizes = jnp.array([90, 0, 64, 46], jnp.int32)  # sum 200 < M
    lhs = jax.random.normal(jax.random.PRNGKey(6), (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(7), (4, k, n)) * k**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(8), (m, n))

    def run(impl):
        f = lambda a, b: G.grouped_matmul(a, b, sizes, implementation=impl)  # noqa: E731
        y, vjp = jax.vjp(f, lhs, rhs)
        return y, vjp(cot)

    y, (d_lhs, d_rhs) = run(None if name == "jla" else name)
    y_x, (d_lhs_x, d_rhs_x) = run("xla")
    assert y.dtype == jnp.float32 and d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    assert float(jnp.abs(y[200:]).max()) == 0.0 and float(jnp.abs(d_lhs[200:]).max()) == 0.0
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))  # noqa: E731
    assert rel(y, y_x) < 4e-3  # jla rounds its output to bf16
    assert rel(d_lhs, d_lhs_x) < 1e-2 and rel(d_rhs, d_rhs_x) < 1e-2
    if name == "tokamax":  # forward, d_lhs, d_rhs through tokamax, all with bf16 operands
        assert calls == [("mosaic_gpu", "bfloat16", "bfloat16")] * 3


def test_match_varying_axes_marks_library_cotangents_inside_shard_map():
    """Library kernels return arrays without manual-axis types; a custom VJP under shard_map must
    return cotangents varying over the axes its primals vary over (the H200 moe_ep failure)."""
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def body(w):
        fresh = jnp.zeros(w.shape, w.dtype)  # like a kernel output: varies over nothing
        assert jax.typeof(fresh).manual_axis_type.varying == frozenset()
        marked = G._match_varying_axes(fresh, w)
        assert jax.typeof(marked).manual_axis_type.varying == frozenset({"expert"})
        assert G._match_varying_axes(marked, w) is marked  # nothing missing: unchanged
        return marked + w

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(jnp.ones((4, 3)))
    np.testing.assert_array_equal(out, np.ones((4, 3)))




def test_grouped_matmul_rejects_float_group_sizes():
    lhs = jnp.ones((8, 4))
    rhs = jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match="group_sizes"):
        G.grouped_matmul(lhs, rhs, jnp.array([2.7, 5.3]))


def test_grouped_matmul_input_validation():
    lhs, rhs = jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
    sizes = jnp.array([3, 5], jnp.int32)
    for kwargs, word in [(dict(full_groups="yes"), "full_groups"), (dict(full_groups=None), "full_groups"),
                         (dict(preferred_element_type=jnp.int8), "preferred_element_type")]:
        with pytest.raises(ValueError, match=word):
            G.grouped_matmul(lhs, rhs, sizes, "xla", **kwargs)
    for args, word in [((lhs, rhs.astype(jnp.bfloat16), sizes), "dtype"), ((lhs, rhs, [3, 5]), "group_sizes"),
                       ((lhs, rhs, jnp.array([-1, 5], jnp.int32)), "group_sizes"),
                       ((lhs, rhs, jnp.array([5, 5], jnp.int32)), "group_sizes")]:
        with pytest.raises(ValueError, match=word):
            G.grouped_matmul(*args, implementation="xla")
    with pytest.raises(ValueError, match="full_groups"):
        G.grouped_matmul(lhs, rhs, jnp.array([3, 4], jnp.int32), "xla", full_groups=True)
    # traced sizes cannot be checked: the promise is the caller's
    out = jax.jit(lambda s: G.grouped_matmul(lhs, rhs, s, "xla", full_groups=True))(sizes)
    np.testing.assert_allclose(out, 4.0)


M, K, N, E = 256, 128, 256, 4
SIZES = jnp.array([150, 0, 37, 41], jnp.int32)  # one large group, an empty one, 28 tail rows


def _fake_jla(monkeypatch):
    calls = []
    _install_fake_jla(monkeypatch, calls)
    monkeypatch.setattr(G, "_importable", lambda module: module == "jla")
    monkeypatch.setattr(G, "_platform", lambda: _H200)
    return calls


def _run(impl, full_groups=False, sizes=SIZES):
    lhs = jax.random.normal(jax.random.PRNGKey(0), (M, K)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(1), (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(2), (M, N)).astype(jnp.bfloat16)
    f = lambda a, b: G.grouped_matmul(a, b, sizes, impl, preferred_element_type=jnp.bfloat16,  # noqa: E731
                                      full_groups=full_groups)
    y, vjp = jax.vjp(f, lhs, rhs)
    return (y, *vjp(cot))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def test_jla_is_jlas_own_vjp_and_matches_xla(monkeypatch):
    """Outside shard_map "jla" is jla's ragged_dot with its own backward (forward, d_lhs, d_rhs kernels);
    output and both gradients equal XLA's within bf16 rounding, tail rows and the empty group's d_rhs zero."""
    calls = _fake_jla(monkeypatch)
    y, d_lhs, d_rhs = _run("jla")
    assert calls == [("fwd", False), ("d_lhs", False), ("d_rhs",)]
    y_x, d_lhs_x, d_rhs_x = _run("xla")
    assert d_rhs.dtype == jnp.bfloat16 and d_rhs.shape == (E, K, N)
    assert _rel(y, y_x) < 4e-3 and _rel(d_lhs, d_lhs_x) < 4e-3 and _rel(d_rhs, d_rhs_x) < 4e-3
    assert float(jnp.abs(d_rhs[1]).max()) == 0.0
    assert float(jnp.abs(y[228:]).max()) == 0.0 and float(jnp.abs(d_lhs[228:]).max()) == 0.0


def test_full_groups_skips_the_tail_zeroing_only_in_jla(monkeypatch):
    """full_groups=True is a promise: jla then leaves the (here stale: 7.0) rows past the groups as the
    kernels wrote them, in the output and in d_lhs; the valid rows are unchanged. XLA ignores it."""
    calls = _fake_jla(monkeypatch)
    y, d_lhs, d_rhs = jax.jit(lambda s: _run("jla", True, s))(SIZES)  # traced: the promise is not checked
    y_m, d_lhs_m, d_rhs_m = jax.jit(lambda s: _run("jla", False, s))(SIZES)
    assert ("fwd", True) in calls and ("d_lhs", True) in calls
    assert np.all(np.asarray(y[228:], np.float32) == 7.0) and np.all(np.asarray(d_lhs[228:], np.float32) == 7.0)
    for a, b in ((y, y_m), (d_lhs, d_lhs_m)):
        np.testing.assert_array_equal(np.asarray(a[:228], np.float32), np.asarray(b[:228], np.float32))
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.asarray(d_rhs_m, np.float32))
    lhs = jnp.ones((6, 3)); rhs = jnp.ones((2, 3, 4)); sizes = jnp.array([2, 3], jnp.int32)
    for impl in ("xla", "blocked"):  # traced sizes (concrete ones with sum < M are refused)
        out = jax.jit(lambda s, impl=impl: G.grouped_matmul(lhs, rhs, s, impl, full_groups=True))(sizes)
        np.testing.assert_array_equal(out, np.concatenate([np.full((5, 4), 3.0), np.zeros((1, 4))]))


def _moe_inputs(tokens, top_k, d, f, e, seed=4):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (tokens, d)).astype(jnp.bfloat16)
    ws = [(jax.random.normal(k, s) * s[1] ** -0.5).astype(jnp.bfloat16)
          for k, s in zip(ks[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    ids = jax.lax.top_k(jax.random.normal(ks[4], (tokens, e)), top_k)[1].astype(jnp.int32)
    return x, ws, ids, jnp.full((tokens, top_k), 0.5, jnp.float32)


def test_dropless_moe_through_jla_promises_full_groups_and_matches_xla(monkeypatch):
    """dropless_moe's groups come from permute (every routed row counted), so it passes full_groups=True;
    it runs two grouped GEMMs forward (gate and up fused, then down); through the stand-in jla kernels
    it equals the xla path, forward and gradients."""
    calls = _fake_jla(monkeypatch)
    x, ws, ids, w = _moe_inputs(64, 2, 128, 128, 4)

    def run(impl):
        f_ = lambda x, *ws: jnp.sum(T.dropless_moe(x, ids, w, *ws, implementation=impl) ** 2)  # noqa: E731
        return jax.value_and_grad(f_, argnums=(0, 1, 2, 3))(x, *ws)

    (v, g), (v_x, g_x) = run("jla"), run("xla")
    assert [c for c in calls if c[0] == "fwd"] == [("fwd", True)] * 2
    program = jax.make_jaxpr(lambda x, *ws: T.dropless_moe(x, ids, w, *ws, implementation="jla"))(x, *ws)
    assert len(jit_calls(program, "_jla_ragged_dot")) == 2  # two forward GEMMs, each one call
    assert abs(float(v) - float(v_x)) < 1e-2 * abs(float(v_x))
    for a, b in zip(g, g_x):
        assert _rel(a, b) < 2e-2


def test_jla_layers_share_one_traced_gemm(monkeypatch):
    """Two MoE layers of one shape call jla's kernel through one traced jit (one lowering per model, not
    per layer: 48 of K3-small's 58 Mosaic GPU lowerings before, experiments/results/lowering_cpu.md)."""
    _fake_jla(monkeypatch)
    x, ws, ids, w = _moe_inputs(64, 2, 128, 128, 4)

    def two_layers(x, *ws):
        y = T.dropless_moe(x, ids, w, *ws, implementation="jla").astype(x.dtype)
        return T.dropless_moe(y, ids, w, *ws, implementation="jla")
    calls = jit_calls(jax.make_jaxpr(two_layers)(x, *ws), "_jla_ragged_dot")
    assert len(calls) == 4 and shared(calls) == 2  # gate+up and down, each shared by both layers


def test_jla_under_shard_map_marks_cotangents_and_matches_xla(monkeypatch):
    """Expert-parallel dropless MoE (experts and tokens over a 2-device "expert" axis) through "jla": the
    operands vary over "expert", so the backward runs jla's public GEMMs (d_lhs as a forward on rhs^T,
    d_rhs by transposed_ragged_dot) with marked cotangents; forward and gradients equal the xla path's."""
    calls = _fake_jla(monkeypatch)
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    x, ws, ids, w = _moe_inputs(64, 2, 128, 128, 4, seed=5)  # 32 tokens x top-2 x 2 devices = 128 rows each
    cot = jax.random.normal(jax.random.PRNGKey(6), x.shape, jnp.float32)

    def run(impl):
        moe = jax.shard_map(
            lambda x, ids, w, *ws: T.expert_parallel_dropless_moe(x, ids, w, *ws, expert_axis="expert",
                                                                  implementation=impl),
            mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
        f_ = lambda x, *ws: jnp.sum(moe(x, ids, w, *ws) * cot)  # noqa: E731
        return jax.jit(jax.value_and_grad(f_, argnums=(0, 1, 2, 3)))(x, *ws)

    (v, g), (v_x, g_x) = run("jla"), run("xla")
    assert ("d_lhs", False) not in calls and ("fwd", False) in calls and ("d_rhs",) in calls
    assert abs(float(v) - float(v_x)) < 1e-2 * abs(float(v_x))
    for a, b in zip(g, g_x):
        assert _rel(a, b) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("full_groups", [False, True])
def test_jla_on_the_gpu_matches_xla(full_groups):
    """The real jla kernels (H100/H200): output, d_lhs, d_rhs against XLA's ragged_dot with skewed sizes,
    an empty group and 256 tail rows (none with full_groups)."""
    if not G._importable("jla"):
        pytest.skip("jax-linear-attention not installed")
    m, k, n = 2048, 256, 512
    sizes = jnp.array([1200, 0, 37, 300, 5, 100, 50, 356 if full_groups else 100], jnp.int32)
    total = int(sizes.sum())
    lhs = jax.random.normal(jax.random.PRNGKey(0), (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(1), (8, k, n)) * k ** -0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(2), (m, n)).astype(jnp.bfloat16)
    assert G.supported("jla", lhs, rhs, sizes)[0]

    def run(impl, out_dtype):
        f = lambda a, b: G.grouped_matmul(a, b, sizes, impl, preferred_element_type=out_dtype,  # noqa: E731
                                          full_groups=full_groups and impl == "jla")
        y, vjp = jax.vjp(f, lhs, rhs)
        return (y, *vjp(cot.astype(y.dtype)))

    got = jax.jit(lambda: run("jla", jnp.bfloat16))()
    ref = jax.jit(lambda: run("xla", jnp.float32))()
    for g, r in zip(got, ref):
        assert _rel(g, r) < 8e-3
    assert float(jnp.abs(got[0][total:]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(got[1][total:]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(got[2][1]).max()) == 0.0
