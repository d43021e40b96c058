"""Tests for k3jax.ops.dispatch: grouped matmul, dropless and capacity dispatch vs dense references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.ops import dispatch as D

N, DM, F, E, K = 10, 8, 12, 4, 2


def _params(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (N, DM))
    wg = jax.random.normal(ks[1], (E, DM, F)) / math.sqrt(DM)
    wu = jax.random.normal(ks[2], (E, DM, F)) / math.sqrt(DM)
    wd = jax.random.normal(ks[3], (E, F, DM)) / math.sqrt(F)
    logits = jax.random.normal(ks[4], (N, E))
    _, ids = jax.lax.top_k(logits, K)
    w = jax.nn.softmax(jnp.take_along_axis(logits, ids, 1), -1)
    return x, ids.astype(jnp.int32), w, wg, wu, wd


def _ffn(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _loop_reference(x, ids, w, wg, wu, wd, keep=None):
    """Dense reference: every expert on every token (a Python loop over experts), then
    y_i = Σ_s w_is · FFN_{e_is}(x_i) picked with a one-hot of the routing; no sorting, no ragged_dot."""
    ids = np.asarray(ids)
    sel = np.zeros((x.shape[0], ids.shape[1], wg.shape[0]), np.float32)
    for i in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            if keep is None or keep[i, s]:
                sel[i, s, ids[i, s]] = 1.0
    combine = jnp.einsum("nk,nke->ne", w, sel)
    y = jnp.zeros_like(x)
    for e in range(wg.shape[0]):
        y = y + combine[:, e:e + 1] * _ffn(x, wg[e], wu[e], wd[e])
    return y


@pytest.mark.parametrize("implementation", ["xla", "blocked", None])
def test_grouped_matmul_matches_per_group_loop_and_zero_tail(implementation):
    lhs = jax.random.normal(jax.random.PRNGKey(1), (9, 5))
    rhs = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 4))
    sizes = jnp.array([2, 0, 5], jnp.int32)  # 7 of 9 rows used; an empty group
    out = D.grouped_matmul(lhs, rhs, sizes, implementation=implementation)
    assert out.dtype == jnp.float32
    ref = np.concatenate([lhs[:2] @ rhs[0], lhs[2:7] @ rhs[2], np.zeros((2, 4))])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="implementation"):
        D.grouped_matmul(lhs, rhs, sizes, implementation="cutlass")
    with pytest.raises(ValueError, match="shape"):
        D.grouped_matmul(lhs, rhs[:, :4], sizes)


def test_blocked_equals_ragged_dot_across_blocks_forward_and_gradients():
    """M = 300 rows over 3 blocks of 128, 6 groups (two empty), 17 tail rows; bf16 operands."""
    sizes = jnp.array([130, 0, 1, 100, 0, 52], jnp.int32)
    lhs = jax.random.normal(jax.random.PRNGKey(3), (300, 24)).astype(jnp.bfloat16)
    rhs = jax.random.normal(jax.random.PRNGKey(4), (6, 24, 40)).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(5), (300, 40))

    def run(impl):
        f = lambda a, b: jnp.sum(D.grouped_matmul(a, b, sizes, implementation=impl) * cot)  # noqa: E731
        return jax.jit(lambda a, b: (D.grouped_matmul(a, b, sizes, implementation=impl),
                                     jax.grad(f, argnums=(0, 1))(a, b)))(lhs, rhs)

    (y_b, g_b), (y_x, g_x) = run("blocked"), run("xla")
    np.testing.assert_allclose(y_b, y_x, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(y_b[283:]).max()) == 0.0
    for a, b in zip(g_b, g_x):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    assert D.default_grouped_matmul() == "blocked"  # CPU


def test_grouped_matmul_registry_hook_is_used():
    calls = []

    def fake(lhs, rhs, group_sizes, preferred_element_type):
        calls.append(lhs.shape)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    D.register_grouped_matmul("test_hook", fake)
    try:
        lhs = jnp.ones((4, 3))
        rhs = jnp.ones((2, 3, 2))
        out = D.grouped_matmul(lhs, rhs, jnp.array([1, 3]), implementation="test_hook")
        assert calls == [(4, 3)]
        np.testing.assert_allclose(out, np.full((4, 2), 3.0))
        with pytest.raises(ValueError, match="name"):
            D.register_grouped_matmul("xla", fake)
    finally:
        D.GROUPED_MATMUL_IMPLEMENTATIONS.pop("test_hook")
        D.GROUPED_MATMUL_SUPPORTED.pop("test_hook")


def test_library_kernels_refused_off_gpu():
    """On CPU the GPU library kernels are never chosen and an explicit request raises (fail-closed)."""
    lhs = jnp.ones((128, 128), jnp.bfloat16)
    rhs = jnp.ones((2, 128, 128), jnp.bfloat16)
    sizes = jnp.array([100, 28], jnp.int32)
    for name in ("tokamax", "jla"):
        ok, reason = D.grouped_matmul_supported(name, lhs, rhs, sizes)
        assert not ok and "NVIDIA" in reason
        with pytest.raises(ValueError, match="does not support"):
            D.grouped_matmul(lhs, rhs, sizes, implementation=name)
    assert D.default_grouped_matmul(lhs, rhs, sizes) == "blocked"
    with pytest.raises(ValueError, match="implementation"):
        D.grouped_matmul_supported("cutlass", lhs, rhs, sizes)


_H200 = ("gpu", "NVIDIA H200", "9.0")
_RAGGED_DOT_DIMS = jax.lax.RaggedDotDimensionNumbers(  # jax.lax.ragged_dot's [M, K] x [E, K, N]
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


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
        leaf = types.ModuleType("jla.ops.mosaic_gpu.ragged_dot")
        leaf.supports = lambda lhs, rhs, gs: jla_supports
        leaf.ragged_dot = lambda lhs, rhs, gs: jax.lax.ragged_dot(lhs, rhs, gs).astype(lhs.dtype)
        leaf._config_for = lambda config, k, n: (k, n)
        # the transposed-rhs kernel (d_lhs) and the ragged-contraction kernel (d_rhs) of jla 0.1.0
        leaf._ragged_dot_kernel = lambda lhs, rhs, gs, *, transpose_rhs, cfg: jax.lax.ragged_dot(
            lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, gs).astype(lhs.dtype)
        leaf.transposed_ragged_dot = lambda lhs, d_out, gs: jax.lax.ragged_dot_general(
            lhs, d_out, gs, D._RAGGED_CONTRACTING_DIMS, preferred_element_type=jnp.float32)
        names = ["jla", "jla.ops", "jla.ops.mosaic_gpu"]
        mods = [types.ModuleType(n) for n in names]
        mods[0].ops, mods[1].mosaic_gpu, mods[2].ragged_dot = mods[1], mods[2], leaf
        for n, m in zip(names + [leaf.__name__], mods + [leaf]):
            monkeypatch.setitem(sys.modules, n, m)
    installed = {name for name, present in (("tokamax", tokamax), ("jla", jla)) if present}
    monkeypatch.setattr(D, "_importable", lambda module: module in installed)
    return calls


@pytest.mark.parametrize(
    "platform,libs,dtype,m,expected",
    [
        (_H200, dict(tokamax=True, jla=True), jnp.bfloat16, 256, "jla"),
        (_H200, dict(tokamax=True, jla=False), jnp.bfloat16, 256, "tokamax"),
        (_H200, dict(tokamax=True, jla=True, jla_supports=False), jnp.bfloat16, 256, "tokamax"),
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
    monkeypatch.setattr(D, "_platform", lambda: platform)
    lhs = jax.ShapeDtypeStruct((m, 256), dtype)
    rhs = jax.ShapeDtypeStruct((4, 256, 128), dtype)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert D.default_grouped_matmul(lhs, rhs, sizes) == expected
    # without operands: the platform + installed libraries decide
    platform_ok = platform == _H200 and (libs["tokamax"] or libs["jla"])
    assert D.default_grouped_matmul() == (("jla" if libs["jla"] else "tokamax") if platform_ok else "xla")


@pytest.mark.parametrize("name", ["tokamax", "jla"])
def test_library_adapters_match_xla_forward_and_gradients_with_fp32_cotangent(monkeypatch, name):
    """Adapters on the mocked libraries, as the MoE calls them: bf16 operands, fp32 output, an fp32
    cotangent (the case that broke tokamax's own VJP). 56 tail rows must come back zero in the output
    and in d_lhs; grads equal the xla path's within bf16 rounding."""
    calls = _fake_library_modules(monkeypatch)
    monkeypatch.setattr(D, "_platform", lambda: _H200)
    m, k, n = 256, 128, 256
    sizes = jnp.array([90, 0, 64, 46], jnp.int32)  # sum 200 < M
    lhs = jax.random.normal(jax.random.PRNGKey(6), (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(7), (4, k, n)) * k**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(8), (m, n))

    def run(impl):
        f = lambda a, b: D.grouped_matmul(a, b, sizes, implementation=impl)  # noqa: E731
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
        marked = D._match_varying_axes(fresh, w)
        assert jax.typeof(marked).manual_axis_type.varying == frozenset({"expert"})
        assert D._match_varying_axes(marked, w) is marked  # nothing missing: unchanged
        return marked + w

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(jnp.ones((4, 3)))
    np.testing.assert_array_equal(out, np.ones((4, 3)))


def test_permute_sorts_by_expert_stably_and_combine_inverts():
    x = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[2, 0], [0, 1], [2, 1], [0, 2]], jnp.int32)
    xs, perm = D.permute(x, ids, 3)
    np.testing.assert_array_equal(perm.group_sizes, [3, 2, 3])
    # expert 0 rows: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2, 3
    np.testing.assert_array_equal(np.asarray(perm.order) // 2, [0, 1, 3, 1, 2, 0, 2, 3])
    np.testing.assert_array_equal(xs, np.asarray(x)[[0, 1, 3, 1, 2, 0, 2, 3]])
    w = jnp.array([[0.25, 0.75]] * 4)
    np.testing.assert_allclose(D.combine(xs, perm, w), x, rtol=1e-6)  # identity experts


def test_dropless_equals_dense_loop_forward_and_gradients():
    x, ids, w, wg, wu, wd = _params()

    def f_moe(x, w, wg, wu, wd):
        return D.dropless_moe(x, ids, w, wg, wu, wd)

    def f_ref(x, w, wg, wu, wd):
        return _loop_reference(x, ids, w, wg, wu, wd)

    args = (x, w, wg, wu, wd)
    cot = jax.random.normal(jax.random.PRNGKey(9), (N, DM))

    def vg(f):  # one compile per function: value and all five gradients
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * cot), argnums=(0, 1, 2, 3, 4))(*a)))

    y_moe, g_moe = vg(f_moe)(*args)
    y_ref, g_ref = vg(f_ref)(*args)
    np.testing.assert_allclose(y_moe, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "w", "w_gate", "w_up", "w_down"), g_moe, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_dropless_bf16_operands_close_to_fp32():
    x, ids, w, wg, wu, wd = _params(1)
    y32 = D.dropless_moe(x, ids, w, wg, wu, wd)
    bf = [a.astype(jnp.bfloat16) for a in (x, wg, wu, wd)]
    y16 = D.dropless_moe(bf[0], ids, w, *bf[1:])
    assert y16.dtype == jnp.float32
    rel = float(jnp.sqrt(jnp.mean((y16 - y32) ** 2)) / jnp.sqrt(jnp.mean(y32**2)))
    assert rel < 0.02


def test_capacity_drops_exactly_the_overflow_in_token_order():
    ids = jnp.array([[0], [0], [0], [1], [0], [2]], jnp.int32)  # expert 0 gets 4 rows, C = 2
    disp = D.capacity_dispatch(ids, 3, 1.0)
    assert disp.capacity == 2
    np.testing.assert_array_equal(disp.kept[:, 0], [True, True, False, True, False, True])
    assert float(disp.dropped_fraction) == pytest.approx(2 / 6)
    # padding rows take no capacity: masking token 0 lets token 2 in
    disp = D.capacity_dispatch(ids, 3, 1.0, token_mask=jnp.array([0, 1, 1, 1, 1, 1], bool))
    np.testing.assert_array_equal(disp.kept[:, 0], [False, True, True, True, False, True])
    assert float(disp.dropped_fraction) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        D.capacity_dispatch(ids, 3, 0.0)


@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0])
def test_capacity_moe_equals_loop_over_kept_rows(cf):
    x, ids, w, wg, wu, wd = _params(2)
    mask = jnp.arange(N) != 3
    y, dropped = D.capacity_moe(x, ids, w, wg, wu, wd, cf, token_mask=mask)
    cap = math.ceil(cf * N * K / E)
    # numpy reference of the keep rule: first `cap` valid rows per expert in row-major order
    seen = np.zeros(E, int)
    keep = np.zeros((N, K), bool)
    for i in range(N):
        for s in range(K):
            if not bool(mask[i]):
                continue
            e = int(ids[i, s])
            keep[i, s] = seen[e] < cap
            seen[e] += 1
    loads = np.bincount(np.asarray(ids)[np.asarray(mask)].ravel(), minlength=E)
    assert float(dropped) == pytest.approx(np.maximum(loads - cap, 0).sum() / (int(mask.sum()) * K))
    ref = jax.jit(lambda *a: _loop_reference(a[0], ids, *a[1:], keep=keep))(x, w, wg, wu, wd)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    if cf == 0.5:
        assert 0 < float(dropped) < 1
        g = jax.grad(lambda wd_: jnp.sum(D.capacity_moe(x, ids, w, wg, wu, wd_, cf, token_mask=mask)[0]))(wd)
        g_ref = jax.jit(jax.grad(lambda wd_: jnp.sum(_loop_reference(x, ids, w, wg, wu, wd_, keep=keep))))(wd)
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
    if cf == 2.0:
        assert float(dropped) == 0.0
        np.testing.assert_allclose(y, D.dropless_moe(x, ids, w, wg, wu, wd) * mask[:, None], rtol=1e-5, atol=1e-5)


def test_grouped_matmul_rejects_float_group_sizes():
    lhs = jnp.ones((8, 4))
    rhs = jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match="group_sizes"):
        D.grouped_matmul(lhs, rhs, jnp.array([2.7, 5.3]))
