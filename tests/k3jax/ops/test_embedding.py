"""The scatter-free embedding gradient equals jnp.take's (forward and gradient, fp32), small and large
vocabularies, untied and tied heads, and inside the model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.ops import embedding as embedding_ops
from k3jax.ops.embedding import embedding_lookup


def _inputs(vocab, d=24, shape=(3, 50), seed=0, id_range=None):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    table = jax.random.normal(k1, (vocab, d), jnp.float32)
    ids = jax.random.randint(k2, shape, 0, id_range or vocab)
    weights = jax.random.normal(k3, (*shape, d), jnp.float32)
    return table, ids, weights


def _loss(implementation, tied):
    def loss(table, ids, weights):
        x = embedding_lookup(table, ids, implementation=implementation)
        out = jnp.sum(jnp.sin(x) * weights)
        if tied:  # the tied head's logits read the same table
            out = out + jnp.sum(jax.nn.log_softmax(x @ table.T) ** 2) * 1e-3
        return out
    return loss


@pytest.mark.parametrize("vocab", [320, embedding_ops.ONE_HOT_MAX_VOCAB + 64])
@pytest.mark.parametrize("implementation", [None, "one_hot", "segment_sum"])
@pytest.mark.parametrize("tied", [False, True])
def test_forward_and_gradient_equal_take(vocab, implementation, tied):
    table, ids, weights = _inputs(vocab, id_range=min(vocab, 40))  # heavily repeated rows (the contended case)
    ids = ids.at[0, :3].set(vocab - 1)  # the last row too
    np.testing.assert_array_equal(embedding_lookup(table, ids, implementation=implementation),
                                  jnp.take(table, ids, axis=0))
    ref_val, ref_grad = jax.value_and_grad(_loss("take", tied))(table, ids, weights)
    val, grad = jax.jit(jax.value_and_grad(_loss(implementation, tied)))(table, ids, weights)
    np.testing.assert_allclose(val, ref_val, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(ref_grad).sum()) > 0
    unused = np.setdiff1d(np.arange(vocab), np.asarray(ids))
    if not tied:
        assert np.all(np.asarray(grad)[unused] == 0)


def test_default_picks_one_hot_for_small_vocabularies(monkeypatch):
    calls = []
    for name in ("_one_hot_grad", "_segment_sum_grad"):
        real = getattr(embedding_ops, name)
        monkeypatch.setattr(embedding_ops, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    for vocab in (320, embedding_ops.ONE_HOT_MAX_VOCAB + 1):
        table, ids, weights = _inputs(vocab)
        jax.grad(_loss(None, False))(table, ids, weights)
    assert calls == ["_one_hot_grad", "_segment_sum_grad"]


def test_bf16_table_gradient_dtype_and_value():
    table, ids, weights = _inputs(320)
    grad = jax.grad(lambda t: jnp.sum(embedding_lookup(t, ids).astype(jnp.float32) * weights))(table.astype(jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16
    ref = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * weights))(table)
    np.testing.assert_allclose(np.asarray(grad, np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("table, ids, implementation, message", [
    (jnp.zeros((4,)), jnp.zeros((2,), jnp.int32), None, "table must be"),
    (jnp.zeros((4, 2), jnp.int32), jnp.zeros((2,), jnp.int32), None, "table must be"),
    (jnp.zeros((4, 2)), jnp.zeros((2,)), None, "ids must be"),
    (jnp.zeros((4, 2)), jnp.zeros((2,), jnp.int32), "scatter", "implementation must be"),
])
def test_bad_inputs_raise(table, ids, implementation, message):
    with pytest.raises(ValueError, match=message):
        embedding_lookup(table, ids, implementation=implementation)


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradients_equal_those_of_the_take_lookup(tie, monkeypatch):
    from k3jax.models.config import ModelConfig
    from k3jax.models.lm import LanguageModel
    import k3jax.nn.embedding as nn_embedding
    cfg = ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64, tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 259)

    def grads():
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        def loss(m):
            logits, _ = m(tokens[:, :-1])
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
        return nnx.to_pure_dict(nnx.grad(loss)(model))

    new = grads()
    monkeypatch.setattr(nn_embedding, "embedding_lookup",
                        lambda t, i: embedding_ops.embedding_lookup(t, i, implementation="take"))
    old = grads()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), new, old)
    assert float(jnp.abs(new["embed"]["embedding"]).sum()) > 0
