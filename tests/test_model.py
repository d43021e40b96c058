"""The language model: shapes, decode == forward, document isolation, config validation."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models.config import ModelConfig
from k3jax.models.generate import generate
from k3jax.models.lm import LanguageModel

TINY = dict(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64)


def _model(**kw):
    return LanguageModel(ModelConfig(**{**TINY, **kw}), rngs=nnx.Rngs(0))


def test_output_shapes_and_dtype():
    model = _model()
    logits, aux = model(jnp.zeros((3, 10), jnp.int32))
    chex.assert_shape(logits, (3, 10, model.cfg.padded_vocab_size))
    assert logits.dtype == jnp.float32
    assert aux == {"moe": []}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_chain_equals_forward(dtype):
    model = _model(dtype=dtype)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 259)
    logits, _ = model(tokens)
    cache = model.init_cache(2, 12)
    steps = []
    for t in range(12):
        lt, cache = model.decode(tokens[:, t], cache, t)
        steps.append(lt)
    tol = 1e-4 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(logits), atol=tol, rtol=tol)


def test_packed_documents_do_not_attend_across_boundaries():
    """A packed row of two documents gives the same logits as each document run alone."""
    model = _model()
    a = jax.random.randint(jax.random.key(2), (1, 7), 0, 256)
    b = jax.random.randint(jax.random.key(3), (1, 9), 0, 256)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 7 + [2] * 9])
    pos = jnp.array([list(range(7)) + list(range(9))])
    logits, _ = model(packed, segment_ids=seg, positions=pos)
    la, _ = model(a)
    lb, _ = model(b)
    np.testing.assert_allclose(logits[:, :7], la, atol=1e-5)
    np.testing.assert_allclose(logits[:, 7:], lb, atol=1e-5)
    # and the mask really matters: without segment ids the second document sees the first
    unmasked, _ = model(packed, positions=pos)
    assert np.abs(np.asarray(unmasked[:, 7:] - lb)).max() > 1e-3


def test_greedy_generation_matches_argmax_of_forward():
    model = _model()
    prompt = jnp.array([[100, 101, 102]])
    out = generate(model, prompt, max_new_tokens=6, rng=jax.random.key(0), temperature=0.0)
    chex.assert_shape(out, (1, 9))
    np.testing.assert_array_equal(out[:, :3], prompt)
    logits, _ = model(out[:, :-1])
    masked = jnp.where(jnp.arange(logits.shape[-1]) < 259, logits, -jnp.inf)
    np.testing.assert_array_equal(jnp.argmax(masked[0, 2:], -1), out[0, 3:])


@pytest.mark.parametrize("field,value", [
    ("d_model", 0), ("num_layers", -1), ("mixer_pattern", "AX"), ("ffn", "dense"),
    ("residual", "postnorm"), ("dtype", "float16"), ("kda_lower_bound", -6.0), ("kda_gate", "relu"),
])
def test_bad_model_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_mixer_pattern_tiles_over_layers():
    assert ModelConfig(num_layers=6, mixer_pattern="KKKA").layer_mixers == ("K", "K", "K", "A", "K", "K")
