"""KimiDeltaAttention layer: shapes, decode chain == full call, document isolation, init ranges."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.nn.kda import KimiDeltaAttention, short_causal_conv

B, T, D, H, K = 2, 37, 24, 2, 8


def _layer(gate="bounded", dtype=jnp.float32):
    return KimiDeltaAttention(D, H, K, gate=gate, chunk_size=16, dtype=dtype, rngs=nnx.Rngs(0))


@nnx.jit
def _call(layer, x, seg, pos):
    return layer(x, segment_ids=seg, positions=pos)


def _x(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))


def test_shapes_dtype_and_init():
    layer = _layer(dtype=jnp.bfloat16)
    y = _call(layer, _x(), jnp.zeros((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1)))
    assert y.shape == (B, T, D) and y.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    A = np.exp(np.asarray(layer.A_log[...]))
    assert A.min() >= 1.0 and A.max() <= 16.0
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...])))                      # softplus(dt_bias) = dt
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    cache = layer.init_cache(B, 100)
    assert cache["state"].shape == (B, H, K, K) and cache["state"].dtype == jnp.float32
    with pytest.raises(ValueError, match="gate"):
        KimiDeltaAttention(D, H, K, gate="sigmoid", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(D, H, K, lower_bound=-8.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@jax.default_matmul_precision("highest")  # fp32 tolerances on a GPU too (its default rounds fp32 matmuls to TF32)
def test_decode_chain_equals_full_call(gate):
    layer = _layer(gate)
    x = _x(1)
    y_full = _call(layer, x, jnp.zeros((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1)))

    @nnx.jit
    def step(layer, x_t, cache, pos):
        return layer.decode(x_t, cache, position=pos)
    cache = layer.init_cache(B, T)
    cache = jax.tree.map(lambda c: c + 1.0, cache)          # stale cache: position 0 must reset it
    ys = []
    for t in range(T):
        y_t, cache = step(layer, x[:, t:t + 1], cache, jnp.full((B,), t, jnp.int32))
        ys.append(y_t)
    np.testing.assert_allclose(jnp.concatenate(ys, axis=1), y_full, rtol=2e-4, atol=2e-5)


def test_documents_are_isolated():
    layer = _layer()
    x = _x(2)
    cut = 19                                                   # mid chunk, mid conv window
    seg = jnp.asarray([[0] * cut + [1] * (T - cut), [5] * T], jnp.int32)
    pos = jnp.tile(jnp.arange(T), (B, 1))
    y = _call(layer, x, seg, pos)
    y_a = _call(layer, x[:1, :cut], jnp.zeros((1, cut), jnp.int32), pos[:1, :cut])
    y_b = _call(layer, x[:1, cut:], jnp.zeros((1, T - cut), jnp.int32), pos[:1, :T - cut])
    np.testing.assert_allclose(y[:1, :cut], y_a, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(y[:1, cut:], y_b, rtol=2e-4, atol=2e-5)
    # Changing the first document leaves the second untouched (up to fp32 rounding: the chunk's cumsum
    # of gates, and so the anchors, still run through the first document's tokens).
    y2 = _call(layer, x.at[:1, :cut].set(0.3), seg, pos)
    np.testing.assert_allclose(y2[:1, cut:], y[:1, cut:], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:1, :cut], y[:1, :cut])


def test_short_conv_matches_numpy_and_respects_segments():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 10, 3)).astype(np.float32)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    seg = np.array([[0] * 6 + [1] * 4], np.int32)
    ref = np.zeros_like(x)
    for t in range(10):
        for s in range(4):
            if t - s >= 0 and seg[0, t - s] == seg[0, t]:
                ref[0, t] += w[3 - s] * x[0, t - s]
    np.testing.assert_allclose(short_causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg)), ref,
                               rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_parameter():
    layer = _layer()
    x = _x(3)
    seg = jnp.zeros((B, T), jnp.int32)
    pos = jnp.tile(jnp.arange(T), (B, 1))
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x, segment_ids=seg, positions=pos) ** 2)))(layer)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads)):
        assert bool(jnp.all(jnp.isfinite(g))), path
        assert float(jnp.abs(g).max()) > 0.0, path


def _install_jla_conv_stand_ins(monkeypatch):
    """jla 0.1.0's short_conv / short_conv_l2norm modules as XLA stand-ins (weight [C, W], SiLU, per-head
    L2 norm with eps 1e-6 inside the sqrt), so the fused path's wiring runs on CPU."""
    import sys
    import types

    def conv(x, weight, bias=None, *, activation=True, segment_ids=None):
        assert bias is None and activation
        return jax.nn.silu(short_causal_conv(x, weight.T, segment_ids))

    def conv_l2norm(x, weight, bias=None, *, head_dim, activation=True, segment_ids=None):
        y = conv(x, weight, bias, activation=activation, segment_ids=segment_ids).astype(jnp.float32)
        y = y.reshape(*x.shape[:2], -1, head_dim)
        y = y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + 1e-6)
        return y.reshape(x.shape).astype(x.dtype)

    short_conv = types.SimpleNamespace(short_conv=conv)
    short_conv_l2norm = types.SimpleNamespace(short_conv_l2norm=conv_l2norm,
                                              unsupported_reason=lambda x, w, *, head_dim: None)
    names = ["jla", "jla.ops", "jla.ops.mosaic_gpu"]
    mods = [types.ModuleType(n) for n in names]
    mods[0].ops, mods[1].mosaic_gpu = mods[1], mods[2]
    mods[2].short_conv, mods[2].short_conv_l2norm = short_conv, short_conv_l2norm
    for name, mod in zip(names, mods):
        monkeypatch.setitem(sys.modules, name, mod)


def _packed_call_and_grads(layer, x):
    seg = jnp.asarray(np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [13, 12, 12], axis=1), jnp.int32)
    pos = jnp.tile(jnp.arange(x.shape[1]), (x.shape[0], 1))
    cot = jax.random.normal(jax.random.PRNGKey(7), x.shape[:2] + (layer.d_model,)) / (x.shape[0] * x.shape[1])

    def loss(m, x):
        return jnp.sum(m(x, segment_ids=seg, positions=pos).astype(jnp.float32) * cot)

    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(layer, x)


def test_fused_conv_path_equals_the_xla_path(monkeypatch):
    """conv_implementation="jla" (XLA stand-ins for jla's kernels: separate q/k/v projections, weights
    handed over as [C, W], q and k normalised by the kernel, not by the op) gives the "xla" path's loss
    and every gradient, with packed documents."""
    _install_jla_conv_stand_ins(monkeypatch)
    x = _x(5)
    with jax.default_matmul_precision("highest"):  # fp32 tolerances on a GPU too (no TF32)
        got, want = (_packed_call_and_grads(KimiDeltaAttention(D, H, K, chunk_size=16, conv_implementation=c,
                                                               dtype=jnp.float32, rngs=nnx.Rngs(0)), x)
                     for c in ("jla", "xla"))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[1][1], want[1][1], rtol=1e-4, atol=1e-7)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(got[1][0])),
                                 jax.tree_util.tree_leaves_with_path(nnx.state(want[1][0]))):
        # atol against the leaf's own size: fp32 sums in another order (an H100 gave 3.8e-8 on an entry
        # of 5.7e-5 in a leaf whose largest entry is ~1e-2)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=max(1e-8, 1e-5 * float(np.max(np.abs(b)))),
                                   err_msg=str(path))


def test_conv_implementation_validated():
    with pytest.raises(ValueError, match="conv_implementation"):
        KimiDeltaAttention(D, H, K, conv_implementation="triton", rngs=nnx.Rngs(0))
    if not _on_hopper_with_jla():  # "jla" where its kernels cannot run says so, with their reason
        layer = KimiDeltaAttention(D, H, K, chunk_size=16, conv_implementation="jla", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="conv_implementation='jla': .*: "):
            layer(_x(), segment_ids=jnp.zeros((B, T), jnp.int32), positions=jnp.zeros((B, T), jnp.int32))


def _on_hopper_with_jla() -> bool:
    try:
        import jla.ops.mosaic_gpu.short_conv_l2norm  # noqa: F401
    except ImportError:
        return False
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper_with_jla(), reason="jla's Mosaic GPU conv kernels need an sm_90 GPU and jla")
def test_hopper_jla_conv_kernels_match_the_xla_path():
    """The real kernels (bf16, K = 128 heads) against the XLA conv + op L2 norm: output and every gradient
    within bf16 rounding, at a loss scale of 1/tokens, with packed documents; None picks them here."""
    d, h, k = 256, 4, 128
    x = jax.random.normal(jax.random.PRNGKey(11), (B, T, d), jnp.bfloat16)
    layers = {c: KimiDeltaAttention(d, h, k, chunk_size=16, conv_implementation=c, rngs=nnx.Rngs(0))
              for c in (None, "jla", "xla")}
    assert layers[None]._fused_conv(x, None) is not None
    got, want = (_packed_call_and_grads(layers[c], x) for c in ("jla", "xla"))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30)

    assert rel(got[0], want[0]) < 0.02
    assert rel(got[1][1], want[1][1]) < 0.02
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(got[1][0])),
                                 jax.tree_util.tree_leaves_with_path(nnx.state(want[1][0]))):
        assert rel(a, b) < 0.02, path


def test_jla_conv_kernels_are_shared_by_the_layers(monkeypatch):
    """The layers' q, k and v convs call jla's two kernels (conv + L2 norm, conv) through one traced jit each,
    which JAX lowers once per model, not 3 times per layer (stand-ins for the kernels)."""
    from tests.jaxpr_testing import jit_calls, shared
    _install_jla_conv_stand_ins(monkeypatch)
    layers = [KimiDeltaAttention(D, H, K, chunk_size=16, conv_implementation="jla", dtype=jnp.float32,
                                 rngs=nnx.Rngs(i)) for i in range(2)]
    seg, pos = jnp.zeros((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1))

    def two_layers(x):
        return layers[1](layers[0](x, segment_ids=seg, positions=pos), segment_ids=seg, positions=pos)
    calls = jit_calls(jax.make_jaxpr(two_layers)(_x(5)), "_jla_conv")
    assert len(calls) == 6 and shared(calls) == 2
