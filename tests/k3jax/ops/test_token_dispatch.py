"""k3jax.ops.token_dispatch: permute / combine, dropless and capacity dispatch against dense references
(the expert-parallel path: tests/k3jax/nn/test_moe.py and tests/k3jax/ops/test_grouped_matmul.py)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import token_dispatch as TD

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


def test_permute_sorts_by_expert_stably_and_combine_inverts():
    x = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[2, 0], [0, 1], [2, 1], [0, 2]], jnp.int32)
    xs, perm = TD.permute(x, ids, 3)
    np.testing.assert_array_equal(perm.group_sizes, [3, 2, 3])
    # expert 0 rows: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2, 3
    np.testing.assert_array_equal(np.asarray(perm.order) // 2, [0, 1, 3, 1, 2, 0, 2, 3])
    np.testing.assert_array_equal(xs, np.asarray(x)[[0, 1, 3, 1, 2, 0, 2, 3]])
    w = jnp.array([[0.25, 0.75]] * 4)
    np.testing.assert_allclose(TD.combine(xs, perm, w), x, rtol=1e-6)  # identity experts



def _scatter_permute_combine(x, ids, w, num_experts):
    """The earlier permute / combine: jnp.take of x[order // k] (scatter-add gradient), bincount, the
    inverse built by a scatter; the reference the sort + gather version must equal."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // ids.shape[1], axis=0)
    ys = jnp.tanh(xs) * (1.0 + flat[order].astype(x.dtype)[:, None])
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    y = jnp.take(ys, inverse, axis=0).reshape(*ids.shape, -1).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, w.astype(jnp.float32)), order, sizes


def _sort_gather_permute_combine(x, ids, w, num_experts):
    xs, perm = TD.permute(x, ids, num_experts)
    experts = jnp.take(ids.reshape(-1), perm.order).astype(x.dtype)
    ys = jnp.tanh(xs) * (1.0 + experts[:, None])  # an expert-dependent map of the sorted rows
    return TD.combine(ys, perm, w), perm.order, perm.group_sizes


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(10, 4, 2), (257, 16, 2), (64, 8, 3), (33, 5, 1)])
def test_sort_gather_permutation_equals_the_scatter_one_forward_and_gradients(num_tokens, num_experts, top_k):
    kx, kl, kc = jax.random.split(jax.random.key(num_tokens), 3)
    x = jax.random.normal(kx, (num_tokens, 24))
    logits = jax.random.normal(kl, (num_tokens, num_experts)).at[:, 0].add(2.0)  # unequal groups
    _, ids = jax.lax.top_k(logits, top_k)
    ids = ids.astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(kc, (num_tokens, top_k)), -1)
    cot = jax.random.normal(jax.random.key(7), (num_tokens, 24))
    outs = {}
    for name, fn in (("old", _scatter_permute_combine), ("new", _sort_gather_permute_combine)):
        f = lambda x, w, fn=fn: jnp.sum(fn(x, ids, w, num_experts)[0] * cot)  # noqa: E731
        y, order, sizes = fn(x, ids, w, num_experts)
        outs[name] = (y, order, sizes, *jax.grad(f, argnums=(0, 1))(x, w))
        if name == "new":
            jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
            assert "scatter" not in jaxpr
    for a, b in zip(outs["old"], outs["new"]):  # fp32 sums in another order: a few ulps
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_dropless_equals_dense_loop_forward_and_gradients():
    x, ids, w, wg, wu, wd = _params()

    def f_moe(x, w, wg, wu, wd):
        return TD.dropless_moe(x, ids, w, wg, wu, wd)

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
    """bf16 operands (hidden activations, gate weight included, and expert outputs rounded to bf16; the
    k slots summed in fp32): output and every
    gradient within bf16 rounding of the fp32 computation, at a loss scale of 1/tokens."""
    x, ids, w, wg, wu, wd = _params(1)
    cot = jax.random.normal(jax.random.key(3), x.shape) / x.shape[0]

    def run(x, w, wg, wu, wd):
        y, vjp = jax.vjp(lambda *a: TD.dropless_moe(a[0], ids, *a[1:]), x, w, wg, wu, wd)
        return (y, *vjp(cot))

    want = run(x, w, wg, wu, wd)
    bf = [a.astype(jnp.bfloat16) for a in (x, wg, wu, wd)]
    got = run(bf[0], w, *bf[1:])
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.bfloat16 and got[2].dtype == w.dtype
    for name, a, b in zip(("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))
        assert rel < 0.02, (name, rel)


def test_capacity_drops_exactly_the_overflow_in_token_order():
    ids = jnp.array([[0], [0], [0], [1], [0], [2]], jnp.int32)  # expert 0 gets 4 rows, C = 2
    disp = TD.capacity_dispatch(ids, 3, 1.0)
    assert disp.capacity == 2
    np.testing.assert_array_equal(disp.kept[:, 0], [True, True, False, True, False, True])
    assert float(disp.dropped_fraction) == pytest.approx(2 / 6)
    # padding rows take no capacity: masking token 0 lets token 2 in
    disp = TD.capacity_dispatch(ids, 3, 1.0, token_mask=jnp.array([0, 1, 1, 1, 1, 1], bool))
    np.testing.assert_array_equal(disp.kept[:, 0], [False, True, True, True, False, True])
    assert float(disp.dropped_fraction) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        TD.capacity_dispatch(ids, 3, 0.0)


@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0])
def test_capacity_moe_equals_loop_over_kept_rows(cf):
    x, ids, w, wg, wu, wd = _params(2)
    mask = jnp.arange(N) != 3
    y, dropped = TD.capacity_moe(x, ids, w, wg, wu, wd, cf, token_mask=mask)
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
        g = jax.grad(lambda wd_: jnp.sum(TD.capacity_moe(x, ids, w, wg, wu, wd_, cf, token_mask=mask)[0]))(wd)
        g_ref = jax.jit(jax.grad(lambda wd_: jnp.sum(_loop_reference(x, ids, w, wg, wu, wd_, keep=keep))))(wd)
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
    if cf == 2.0:
        assert float(dropped) == 0.0
        np.testing.assert_allclose(y, TD.dropless_moe(x, ids, w, wg, wu, wd) * mask[:, None], rtol=1e-5, atol=1e-5)


def test_grouped_swiglu_fused_gate_up_equals_three_gemms():
    """grouped_swiglu's one [W_g | W_u] GEMM equals separate gate and up GEMMs (forward and gradients);
    gate and up weights of different shapes raise."""
    from k3jax.ops.grouped_matmul import grouped_matmul

    ks = jax.random.split(jax.random.key(3), 4)
    E, D, F, M = 4, 32, 48, 40
    x = jax.random.normal(ks[0], (M, D), jnp.float32)
    wg, wu = (jax.random.normal(k, (E, D, F), jnp.float32) * D ** -0.5 for k in ks[1:3])
    wd = jax.random.normal(ks[3], (E, F, D), jnp.float32) * F ** -0.5
    sizes = jnp.array([10, 0, 25, 5], jnp.int32)

    def separate(x, wg, wu, wd):
        g, u = grouped_matmul(x, wg, sizes, implementation="xla"), grouped_matmul(x, wu, sizes, implementation="xla")
        return grouped_matmul(jax.nn.silu(g) * u, wd, sizes, implementation="xla")

    fused = lambda x, wg, wu, wd: TD.grouped_swiglu(x, sizes, wg, wu, wd, implementation="xla")  # noqa: E731
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    (v, g), (v_ref, g_ref) = (jax.value_and_grad(loss(f), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
                              for f in (fused, separate))
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="w_gate and w_up must have one shape"):
        TD.grouped_swiglu(x, sizes, wg, wu[:, :, :-1], wd)


def test_grouped_swiglu_row_weights_scale_the_output_rows():
    """row_weights on the hidden activation equal scaling each output row (the down projection is
    linear), forward and every gradient, the weights' own included; a wrong shape raises."""
    ks = jax.random.split(jax.random.key(4), 5)
    E, D, F, M = 3, 16, 24, 30
    x = jax.random.normal(ks[0], (M, D), jnp.float32)
    wg, wu = (jax.random.normal(k, (E, D, F), jnp.float32) * D ** -0.5 for k in ks[1:3])
    wd = jax.random.normal(ks[3], (E, F, D), jnp.float32) * F ** -0.5
    rw = jax.random.uniform(ks[4], (M,), jnp.float32)
    sizes = jnp.array([12, 8, 10], jnp.int32)
    swiglu = functools.partial(TD.grouped_swiglu, group_sizes=sizes, implementation="xla")
    inner = lambda x, wg, wu, wd, rw: swiglu(x, w_gate=wg, w_up=wu, w_down=wd, row_weights=rw)  # noqa: E731
    outer = lambda x, wg, wu, wd, rw: swiglu(x, w_gate=wg, w_up=wu, w_down=wd) * rw[:, None]  # noqa: E731
    cot = jax.random.normal(jax.random.key(5), (M, D)) / M
    got, want = (jax.vjp(f, x, wg, wu, wd, rw) for f in (inner, outer))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down", "row_weights"), got[1](cot), want[1](cot)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=name)
    with pytest.raises(ValueError, match="row_weights must be"):
        TD.grouped_swiglu(x, sizes, wg, wu, wd, row_weights=rw[:-1])


def test_dropless_weights_of_another_shape_raise():
    """A transposed, flat or k-mismatched weights array is refused by name (it would otherwise be
    reshaped into the sorted order and scramble or NaN the output)."""
    x, ids, w, wg, wu, wd = _params()
    for bad in (w.T, w.reshape(-1), w[:, :1]):
        with pytest.raises(ValueError, match="weights must have expert_ids' shape"):
            TD.dropless_moe(x, ids, bad, wg, wu, wd)
