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
from k3jax.nn.embedding import Embed
from k3jax.nn.mlp import SwiGLU
from k3jax.nn.residuals import BlockScale, DepthMix
from k3jax.ops import residuals as residual_ops


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


def _make_ffn(cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
    dtype = _dtype(cfg.dtype)
    if cfg.ffn == "mlp":
        return SwiGLU(cfg.d_model, cfg.d_ff, dtype=dtype, rngs=rngs)
    from k3jax.nn.moe import MoEFeedForward  # noqa: PLC0415
    return MoEFeedForward(cfg.d_model, cfg.moe_d_ff or cfg.d_ff, cfg.moe_num_experts, cfg.moe_top_k,
                          num_shared_experts=cfg.moe_num_shared_experts, score_func=cfg.moe_score_func,
                          routed_scaling_factor=cfg.moe_routed_scaling_factor,
                          balancing=cfg.balancing_config(), capacity_factor=cfg.moe_capacity_factor,
                          dispatch_implementation=cfg.moe_dispatch_implementation, dtype=dtype, mesh=mesh,
                          rngs=rngs)


class LanguageModel(nnx.Module):
    """Decoder-only LM over byte tokens.

    `__call__(inputs [B, T] int32, *, segment_ids [B, T], positions [B, T])` returns
    `(logits [B, T, padded_vocab] fp32, aux)`; `aux` is a dict with "moe" (a list of per-MoE-layer aux
    dicts, empty for MLP models). Parameters are fp32; activations in `cfg.dtype`.

    Expert parallelism: `mesh` (a `(data, expert)` mesh from `k3jax.sharding.make_mesh(...,
    explicit=False)`: the KDA/attention ops are written for GSPMD propagation, not sharding-in-types) is passed to
    every MoE FFN, which then runs under `jax.shard_map` with the batch sharded over both axes and the
    experts over "expert" (two all_to_all per layer; balancing statistics psum'ed over both axes).
    Everything else runs under `jax.jit` with the shardings of its inputs: put the batch with
    `k3jax.sharding.token_sharding`, expert weights with `shard_params` below and the rest replicated.
    The batch size must divide by the device count. `mesh=None` (default) = one device / plain jit.

    Raises:
      ValueError: `mesh` given with `cfg.ffn != "moe"`, or rejected by `MoEFeedForward`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        if mesh is not None and cfg.ffn != "moe":
            raise ValueError(f"mesh (expert parallelism) needs cfg.ffn == 'moe'; got {cfg.ffn=}")
        self.cfg = cfg
        self.mesh = mesh
        dtype = _dtype(cfg.dtype)
        self.embed = Embed(cfg.padded_vocab_size, cfg.d_model, dtype=dtype,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.mixers = nnx.List([_make_mixer(cfg, c, rngs) for c in cfg.layer_mixers])
        self.ffns = nnx.List([_make_ffn(cfg, rngs, mesh) for _ in range(cfg.num_layers)])
        norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)  # noqa: E731
        self.mixer_norms = nnx.List([norm() for _ in range(cfg.num_layers)])
        self.ffn_norms = nnx.List([norm() for _ in range(cfg.num_layers)])
        self.final_norm = norm()
        self.layout = cfg.block_layout()
        if cfg.residual in ("block_attnres", "full_attnres"):
            # one zero-initialised pseudo-query + key norm per sublayer, and one for the final mix
            self.depth_mixes = nnx.List([DepthMix(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
                                         for _ in range(cfg.num_sublayers + 1)])
        if cfg.residual == "article_block":
            self.block_scales = nnx.List([BlockScale(rngs=rngs) for _ in range(cfg.residual_blocks - 1)])
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.padded_vocab_size, use_bias=False, dtype=dtype,
                                   kernel_init=nnx.initializers.normal(cfg.d_model ** -0.5), rngs=rngs)

    def shard_params(self) -> None:
        """Place every parameter and variable on `self.mesh`: routed expert weights `[E, ...]` sharded
        over "expert" (replicated over "data"), everything else replicated. No-op without a mesh."""
        if self.mesh is None:
            return
        from k3jax import sharding as sharding_lib  # noqa: PLC0415
        from k3jax.nn.moe import MoEFeedForward  # noqa: PLC0415
        expert_names = ("w_gate", "w_up", "w_down")
        experts = {id(getattr(f, n)) for f in self.ffns if isinstance(f, MoEFeedForward) for n in expert_names}
        for _, variable in nnx.iter_graph(self):
            if isinstance(variable, nnx.Variable):
                value = variable.get_value()
                if value is None:
                    continue
                if id(variable) in experts:
                    target = sharding_lib.expert_sharding(self.mesh, value.ndim)
                else:  # may be a pytree (balancing state): one sharding for every leaf
                    target = sharding_lib.replicated(self.mesh)
                variable.set_value(jax.device_put(value, target))

    # -- the stack ---------------------------------------------------------------------------------
    def _run_stack(self, h, mixer_call, ffn_call) -> residual_ops.DepthForward:
        """Run the 2L sublayers over embedding `h` under the configured residual scheme.

        `mixer_call(layer, x)` / `ffn_call(layer, x)` apply layer's mixer / FFN to its normed input.
        The residual schemes are the readable references of `k3jax.ops.residuals`, used as they are.
        """
        fns = []
        for index in range(self.cfg.num_sublayers):
            layer = index // 2
            if index % 2 == 0:
                fns.append(lambda x, layer=layer: mixer_call(layer, self.mixer_norms[layer](x)))
            else:
                fns.append(lambda x, layer=layer: ffn_call(layer, self.ffn_norms[layer](x)))
        if self.cfg.residual == "prenorm":
            return residual_ops.prenorm_forward(h, fns)
        if self.cfg.residual == "article_block":
            alphas = jnp.stack([s.alpha[...] for s in self.block_scales]) if self.block_scales else jnp.zeros((0,))
            return residual_ops.article_block_forward(h, fns, self.layout, alphas)
        queries = jnp.stack([m.pseudo_query[...] for m in self.depth_mixes])
        scales = jnp.stack([m.key_norm_scale[...] for m in self.depth_mixes])
        return residual_ops.attnres_forward(h, fns, self.layout, queries, scales, eps=self.cfg.norm_eps)

    def _ffn_call(self, segment_ids, train, moe_aux):
        def call(layer, x):
            if self.cfg.ffn == "moe":
                y, aux = self.ffns[layer](x, segment_ids=segment_ids, train=train)
                moe_aux.append(aux)
                return y
            return self.ffns[layer](x)
        return call

    def _logits(self, h):
        h = self.final_norm(h)
        if self.cfg.tie_embeddings:
            return self.embed.attend(h).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)

    def forward(self, inputs, *, segment_ids=None, positions=None, train: bool = True):
        """Like `__call__`, but returns `(logits, aux, DepthForward)` with per-sublayer inputs and depth
        weights for diagnostics."""
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [B, T] token ids, got {inputs.shape=}")
        if segment_ids is None:
            segment_ids = jnp.ones(inputs.shape, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        moe_aux = []
        mixer_call = lambda layer, x: self.mixers[layer](x, segment_ids=segment_ids, positions=positions)  # noqa: E731
        depth = self._run_stack(self.embed(inputs), mixer_call, self._ffn_call(segment_ids, train, moe_aux))
        return self._logits(depth.hidden), {"moe": moe_aux}, depth

    def __call__(self, inputs, *, segment_ids=None, positions=None, train: bool = True):
        logits, aux, _ = self.forward(inputs, segment_ids=segment_ids, positions=positions, train=train)
        return logits, aux

    def diagnostics(self, inputs, *, segment_ids=None, positions=None) -> dict:
        """Depth diagnostics on a batch (eval mode): per-sublayer input RMS `[L]`, cosine between
        consecutive sublayer inputs `[L-1]`, and the mean depth weights `[L+1, max sources]` (AttnRes
        schemes only; rows = sublayers then the final mix, columns = sources b_0, b_1, ..., partial)."""
        _, _, depth = self.forward(inputs, segment_ids=segment_ids, positions=positions, train=False)
        out = {"hidden_rms": jnp.stack([residual_ops.hidden_rms(x).mean() for x in depth.sublayer_inputs]),
               "cosine": residual_ops.consecutive_cosine(list(depth.sublayer_inputs))}
        if depth.depth_weights:
            out["depth_weights"] = residual_ops.depth_weight_matrix(depth.depth_weights)
        return out

    # -- decoding ----------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int):
        """Per-layer mixer caches for `decode` (KV cache for attention, conv + fp32 state for KDA)."""
        return [m.init_cache(batch_size, max_len) for m in self.mixers]

    def decode(self, tokens, cache, position):
        """One step: `tokens [B]` int32 at `position` (int32 scalar) -> (logits [B, V] fp32, cache)."""
        b = tokens.shape[0]
        pos = jnp.full((b,), position, jnp.int32)
        new_cache = list(cache)

        def mixer_call(layer, x):
            y, new_cache[layer] = self.mixers[layer].decode(x, cache[layer], position=pos)
            return y

        depth = self._run_stack(self.embed(tokens[:, None]), mixer_call,
                                self._ffn_call(jnp.ones((b, 1), jnp.int32), False, []))
        return self._logits(depth.hidden)[:, 0], new_cache
