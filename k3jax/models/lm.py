"""The hybrid language model: embedding -> L x (mixer sublayer, FFN sublayer) -> final norm -> LM head.

Mixers: "A" causal softmax attention (`k3jax.nn.attention`), "K" Kimi Delta Attention (`k3jax.nn.kda`).
FFN: SwiGLU MLP or routed MoE. Residual scheme: see `ModelConfig.residual`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.models.config import ModelConfig
from k3jax.nn.attention import CausalSelfAttention
from k3jax.nn.mlp import SwiGLU


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _make_mixer(cfg: ModelConfig, letter: str, rngs: nnx.Rngs):
    dtype = _dtype(cfg.dtype)
    if letter == "A":
        return CausalSelfAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, rope=cfg.attention_rope,
                                   rope_theta=cfg.rope_theta, dtype=dtype, rngs=rngs)
    from k3jax.nn.kda import KimiDeltaAttention  # noqa: PLC0415 (keeps attention-only models light)
    return KimiDeltaAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, gate=cfg.kda_gate,
                              lower_bound=cfg.kda_lower_bound, chunk_size=cfg.kda_chunk_size,
                              implementation=cfg.kda_implementation, dtype=dtype, rngs=rngs)


def _make_ffn(cfg: ModelConfig, rngs: nnx.Rngs):
    dtype = _dtype(cfg.dtype)
    if cfg.ffn == "mlp":
        return SwiGLU(cfg.d_model, cfg.d_ff, dtype=dtype, rngs=rngs)
    raise ValueError(f"model.ffn={cfg.ffn!r} is not available in this build")


class LanguageModel(nnx.Module):
    """Decoder-only LM over byte tokens.

    `__call__(inputs [B, T] int32, *, segment_ids [B, T], positions [B, T])` returns
    `(logits [B, T, padded_vocab] fp32, aux)`; `aux` is a dict with "moe" (a list of per-MoE-layer aux
    dicts, empty for MLP models). Parameters are fp32; activations in `cfg.dtype`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = _dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.padded_vocab_size, cfg.d_model, dtype=dtype,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.mixers = nnx.List([_make_mixer(cfg, c, rngs) for c in cfg.layer_mixers])
        self.ffns = nnx.List([_make_ffn(cfg, rngs) for _ in range(cfg.num_layers)])
        norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)  # noqa: E731
        self.mixer_norms = nnx.List([norm() for _ in range(cfg.num_layers)])
        self.ffn_norms = nnx.List([norm() for _ in range(cfg.num_layers)])
        self.final_norm = norm()
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.padded_vocab_size, use_bias=False, dtype=dtype,
                                   kernel_init=nnx.initializers.normal(cfg.d_model ** -0.5), rngs=rngs)

    # -- sublayers ---------------------------------------------------------------------------------
    def _sublayer(self, index: int, x, *, segment_ids, positions, train: bool):
        """Sublayer `index` (even = mixer of layer index//2, odd = FFN) on its residual input x."""
        layer = index // 2
        if index % 2 == 0:
            return self.mixers[layer](self.mixer_norms[layer](x), segment_ids=segment_ids, positions=positions), None
        ffn = self.ffns[layer]
        h = self.ffn_norms[layer](x)
        if self.cfg.ffn == "moe":
            return ffn(h, segment_ids=segment_ids, train=train)
        return ffn(h), None

    def _logits(self, h):
        h = self.final_norm(h)
        if self.cfg.tie_embeddings:
            return self.embed.attend(h).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)

    def __call__(self, inputs, *, segment_ids=None, positions=None, train: bool = True):
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [B, T] token ids, got {inputs.shape=}")
        if segment_ids is None:
            segment_ids = jnp.ones(inputs.shape, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        h = self.embed(inputs)
        moe_aux = []
        for index in range(self.cfg.num_sublayers):
            y, aux = self._sublayer(index, h, segment_ids=segment_ids, positions=positions, train=train)
            h = h + y
            if aux is not None:
                moe_aux.append(aux)
        return self._logits(h), {"moe": moe_aux}

    # -- decoding ----------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int):
        """Per-layer mixer caches for `decode` (KV cache for attention, conv + fp32 state for KDA)."""
        return [m.init_cache(batch_size, max_len) for m in self.mixers]

    def decode(self, tokens, cache, position):
        """One step: `tokens [B]` int32 at `position` (int32 scalar) -> (logits [B, V] fp32, cache)."""
        b = tokens.shape[0]
        pos = jnp.full((b,), position, jnp.int32)
        seg = jnp.ones((b, 1), jnp.int32)
        h = self.embed(tokens[:, None])
        new_cache = []
        for index in range(self.cfg.num_sublayers):
            layer = index // 2
            if index % 2 == 0:
                y, c = self.mixers[layer].decode(self.mixer_norms[layer](h), cache[layer], position=pos)
                new_cache.append(c)
            else:
                y, _ = self._sublayer(index, h, segment_ids=seg, positions=pos[:, None], train=False)
            h = h + y
        return self._logits(h)[:, 0], new_cache
