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
