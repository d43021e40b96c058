"""The chunked LM-head cross-entropy equals the plain one in value and gradient, and never holds the
whole [tokens, vocab] fp32 logits (issue 28)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.cross_entropy import auto_chunk_size, chunked_cross_entropy, cross_entropy


def _inputs(b=2, t=37, d=16, v=300, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(ks[0], (b, t, d), jnp.float32)
    weight = jax.random.normal(ks[1], (d, v), jnp.float32) * d ** -0.5
    targets = jax.random.randint(ks[2], (b, t), 0, v)
    mask = jax.random.uniform(ks[3], (b, t)) > 0.2
    return hidden, weight, targets, mask


def _value_and_grads(fn, hidden, weight, targets, mask):
    def loss(h, w):
        nats, count = fn(h, w, targets, mask)
        return nats / count, count
    (value, count), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, weight)
    return value, count, grads


@pytest.mark.parametrize("chunk_size", [8, 74, 128])  # pads 74 tokens to 80; one chunk; a chunk > tokens
def test_chunked_equals_plain_in_value_and_gradient_fp32(chunk_size):
    args = _inputs()
    value, count, (dh, dw) = _value_and_grads(cross_entropy, *args)
    c_value, c_count, (c_dh, c_dw) = _value_and_grads(
        lambda *a: chunked_cross_entropy(*a, chunk_size=chunk_size), *args)
    assert float(c_count) == float(count) == float(args[3].sum())
    np.testing.assert_allclose(c_value, value, rtol=1e-6)
    np.testing.assert_allclose(c_dh, dh, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(c_dw, dw, rtol=1e-5, atol=1e-8)


def test_chunked_equals_plain_bf16_and_the_plain_loss_is_the_models():
    hidden, weight, targets, mask = _inputs(v=512)
    hidden = hidden.astype(jnp.bfloat16)
    value, _, (dh, dw) = _value_and_grads(lambda *a: cross_entropy(*a, dtype=jnp.bfloat16), hidden, weight, targets, mask)
    c_value, _, (c_dh, c_dw) = _value_and_grads(
        lambda *a: chunked_cross_entropy(*a, chunk_size=16, dtype=jnp.bfloat16), hidden, weight, targets, mask)
    assert dh.dtype == c_dh.dtype == jnp.bfloat16 and c_dw.dtype == jnp.float32
    np.testing.assert_allclose(c_value, value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(c_dh, np.float32), np.asarray(dh, np.float32), rtol=2e-2, atol=1e-4)
    np.testing.assert_allclose(c_dw, dw, rtol=2e-2, atol=1e-4)
    # The plain loss is the trainer's: optax on the head's fp32-cast logits, masked sum.
    from k3jax.train.step import masked_cross_entropy
    logits = jnp.dot(hidden, weight.astype(jnp.bfloat16)).astype(jnp.float32)
    np.testing.assert_array_equal(masked_cross_entropy(logits, targets, mask)[0],
                                  cross_entropy(hidden, weight, targets, mask, dtype=jnp.bfloat16)[0])


def test_chunked_loss_never_holds_the_whole_logits():
    n, d, v, chunk = 4096, 64, 8192, 256  # fp32 logits: 128 MiB; one chunk's: 8 MiB
    shapes = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32))
    targets, mask = jnp.zeros((n,), jnp.int32), jnp.ones((n,), bool)

    def temp_bytes(fn):
        step = jax.jit(jax.grad(lambda h, w: fn(h, w, targets, mask)[0], argnums=(0, 1)))
        return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = n * v * 4
    assert temp_bytes(cross_entropy) >= logits_bytes
    assert temp_bytes(lambda *a: chunked_cross_entropy(*a, chunk_size=chunk)) < logits_bytes / 4


def test_auto_chunk_size_and_errors():
    assert auto_chunk_size(320) == auto_chunk_size(8192) == 0  # bytes and small BPEs: the plain loss
    assert auto_chunk_size(32768) == 4096 and auto_chunk_size(131072) == 1024 and auto_chunk_size(50304) == 2048
    h, w, t, m = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(h, w, t, m, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        chunked_cross_entropy(h, w.T, t, m, chunk_size=8)
