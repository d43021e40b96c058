"""Autoregressive sampling with per-layer caches (KV cache for attention, recurrent state for KDA)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.models.lm import LanguageModel


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "vocab_size"))
def _generate(graphdef, state, prompt, rng, temperature, *, max_new_tokens, top_k, vocab_size):
    model = nnx.merge(graphdef, state)
    b, p = prompt.shape
    total = p + max_new_tokens
    cache = model.init_cache(b, total)
    tokens = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)

    def body(carry, t):
        tokens, cache, rng = carry
        model_t = nnx.merge(graphdef, state)
        logits, cache = model_t.decode(tokens[:, t], cache, t)
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
        if top_k:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        rng, key = jax.random.split(rng)
        sampled = jnp.where(temperature > 0,
                            jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6)),
                            jnp.argmax(logits, axis=-1)).astype(jnp.int32)
        nxt = jnp.where(t + 1 < p, tokens[:, jnp.minimum(t + 1, total - 1)], sampled)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], jnp.minimum(t + 1, total - 1), axis=1)
        return (tokens, cache, rng), None

    del model
    (tokens, _, _), _ = jax.lax.scan(body, (tokens, cache, rng), jnp.arange(total - 1))
    return tokens


def generate(model: LanguageModel, prompt, *, max_new_tokens: int, rng, temperature: float = 0.8,
             top_k: int = 0, vocab_size: int | None = None):
    """Sample `max_new_tokens` continuations of `prompt`.

    Args:
      model: the LM. prompt: [B, P] int32 token ids (P >= 1; a common length per batch).
      max_new_tokens: tokens to sample after the prompt. rng: a PRNG key.
      temperature: softmax temperature; 0 = greedy. top_k: keep only the k most likely ids (0 = all).
      vocab_size: ids >= this are never sampled (default: the model config's vocab_size).

    Returns:
      [B, P + max_new_tokens] int32: the prompt followed by the samples.

    Raises:
      ValueError: on an empty prompt or negative lengths/temperature.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, P] with P >= 1, got {prompt.shape=}")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError(f"max_new_tokens, temperature and top_k must be >= 0, got "
                         f"{max_new_tokens=}, {temperature=}, {top_k=}")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, rng, jnp.float32(temperature), max_new_tokens=max_new_tokens,
                     top_k=top_k, vocab_size=vocab_size or model.cfg.vocab_size)
