"""The hybrid language model: embedding -> L x (mixer sublayer, FFN sublayer) -> final norm -> LM head.

Mixers: "A" causal softmax attention (`k3jax.nn.attention`), "K" Kimi Delta Attention (`k3jax.nn.kda`).
FFN: SwiGLU MLP or routed MoE. Residual scheme: see `ResidualConfig.kind`.
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
        return CausalSelfAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, rope=cfg.attention.rope,
                                   rope_theta=cfg.attention.rope_theta, implementation=cfg.attention.implementation,
                                   dtype=dtype, rngs=rngs)
    from k3jax.nn.kda import KimiDeltaAttention  # noqa: PLC0415 (keeps attention-only models light)
    return KimiDeltaAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, gate=cfg.kda.gate,
                              lower_bound=cfg.kda.lower_bound, chunk_size=cfg.kda.chunk_size,
                              implementation=cfg.kda.implementation,
                              conv_implementation=cfg.kda.conv_implementation, dtype=dtype, rngs=rngs)


def _make_ffn(cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
    dtype = _dtype(cfg.dtype)
    if cfg.ffn == "mlp":
        return SwiGLU(cfg.d_model, cfg.d_ff, dtype=dtype, rngs=rngs)
    from k3jax.nn.moe import MoEFeedForward  # noqa: PLC0415
    return MoEFeedForward(cfg.d_model, cfg.moe.d_ff or cfg.d_ff, cfg.moe.num_experts, cfg.moe.top_k,
                          num_shared_experts=cfg.moe.num_shared_experts, score_func=cfg.moe.score_func,
                          routed_scaling_factor=cfg.moe.routed_scaling_factor,
                          balancing=cfg.moe.balancing, capacity_factor=cfg.moe.capacity_factor,
                          dispatch_implementation=cfg.moe.dispatch_implementation, dtype=dtype, mesh=mesh,
                          rngs=rngs)


class LanguageModel(nnx.Module):
    """Decoder-only LM over byte tokens.

    `__call__(inputs [B, T] int32, *, segment_ids [B, T], positions [B, T])` returns
    `(logits [B, T, padded_vocab] fp32, aux)`; `aux` is a dict with "moe" (a list of per-MoE-layer aux
    dicts, empty for MLP models). Parameters are fp32; activations in `cfg.dtype`. `segment_ids`: one id per
    packed document, its tokens contiguous, no id reused later in the row (KDA and its conv restart at every
    change of id, softmax attention masks by equal ids: a reused id would join two documents there only).

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
        if cfg.residual.kind in ("block_attnres", "full_attnres"):
            # one zero-initialised pseudo-query + key norm per sublayer, and one for the final mix
            self.depth_mixes = nnx.List([DepthMix(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
                                         for _ in range(cfg.num_sublayers + 1)])
        if cfg.residual.kind == "article_block":
            self.block_scales = nnx.List([BlockScale(rngs=rngs) for _ in range(cfg.residual.blocks - 1)])
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
        if self.cfg.residual.kind == "prenorm":
            return residual_ops.prenorm_forward(h, fns)
        if self.cfg.residual.kind == "article_block":
            alphas = jnp.stack([s.alpha[...] for s in self.block_scales]) if self.block_scales else jnp.zeros((0,))
            return residual_ops.article_block_forward(h, fns, self.layout, alphas)
        queries = jnp.stack([m.pseudo_query[...] for m in self.depth_mixes])
        scales = jnp.stack([m.key_norm_scale[...] for m in self.depth_mixes])
        return residual_ops.attnres_forward(h, fns, self.layout, queries, scales, eps=self.cfg.norm_eps,
                                            implementation=self.cfg.residual.implementation)

    def _scan_stack(self, h, segment_ids, positions, train: bool, keep_inputs: bool = False):
        """The stack as one `lax.scan` over the G = num_layers / P repeats of the P-layer mixer pattern.

        Each period's modules are rebuilt inside the scan body from the layers' states stacked over G
        (`nnx.split` / `nnx.merge`; parameters stay per layer). Block AttnRes keeps its sources in a
        zero-initialised buffer `[N + 1, B, T, D]` carried through the scan: sublayer l adds its output
        to slot `block_id[l]` (the running partial sum of its block, which becomes source b_n) and its
        mix reads the first `num_sources[l]` slots (`BlockLayout.scan_inputs`; the buffer is threaded
        through `depth_attention_carry`, so the Pallas backward updates its cotangent in place). Returns what
        `_run_stack` returns (depth weights padded to N + 1 sources are cut to each mix's count) and the
        MoE aux dicts in layer order. The remat policy `cfg.remat` wraps the scan body; with AttnRes and remat
        "full" the scan is `residual_ops.scan_source_buffer`, which keeps two buffers and a slot per period for
        the backward pass instead of one buffer per period. Each sublayer's
        input is reduced to a finiteness flag inside the body (`sublayer_finite`); the inputs themselves are
        stacked out of the scan only with `keep_inputs` (diagnostics).
        """
        cfg = self.cfg
        period = len(cfg.mixer_pattern)
        groups = cfg.num_layers // period

        def stacked(modules):
            defs, states = [], []
            for j in range(period):
                parts = [nnx.split(modules[g * period + j]) for g in range(groups)]
                defs.append(parts[0][0])
                states.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in parts]))
            return defs, states

        mixer_defs, mixer_states = stacked(self.mixers)
        ffn_defs, ffn_states = stacked(self.ffns)
        mnorm_defs, mnorm_states = stacked(self.mixer_norms)
        fnorm_defs, fnorm_states = stacked(self.ffn_norms)
        xs = {"mixer": mixer_states, "ffn": ffn_states, "mnorm": mnorm_states, "fnorm": fnorm_states}
        attnres = cfg.residual.kind != "prenorm"
        per_period = lambda a: a.reshape(groups, 2 * period, *a.shape[1:])  # noqa: E731
        if attnres:
            queries = jnp.stack([m.pseudo_query[...] for m in self.depth_mixes])
            scales = jnp.stack([m.key_norm_scale[...] for m in self.depth_mixes])
            scan_in = self.layout.scan_inputs()
            xs.update(query=per_period(queries[:-1]), scale=per_period(scales[:-1]),
                      slot=per_period(jnp.asarray(scan_in["slot"])), num_valid=per_period(jnp.asarray(scan_in["num_valid"])))
            carry = jnp.zeros((self.layout.max_sources, *h.shape), h.dtype).at[0].set(h)
        else:
            carry = h

        def sublayer(i, x, xs, aux):  # sublayer i of the period: layer j's mixer (even i) or FFN (odd i)
            j = i // 2
            if i % 2 == 0:
                norm = nnx.merge(mnorm_defs[j], xs["mnorm"][j])
                mixer = nnx.merge(mixer_defs[j], xs["mixer"][j])
                return mixer(norm(x), segment_ids=segment_ids, positions=positions)
            norm = nnx.merge(fnorm_defs[j], xs["fnorm"][j])
            ffn = nnx.merge(ffn_defs[j], xs["ffn"][j])
            if cfg.ffn == "moe":
                y, aux[j] = ffn(norm(x), segment_ids=segment_ids, train=train)
                return y
            return ffn(norm(x))

        def body(carry, xs):
            inputs, finite, weights, aux = [], [], [], [None] * period
            for i in range(2 * period):
                if attnres:
                    x, w, carry = residual_ops.depth_attention_carry(
                        carry, xs["query"][i], xs["scale"][i], eps=cfg.norm_eps, num_valid=xs["num_valid"][i],
                        implementation=cfg.residual.implementation)
                    weights.append(w)
                else:
                    x = carry
                finite.append(jnp.all(jnp.isfinite(jax.lax.stop_gradient(x))))
                if keep_inputs:
                    inputs.append(x)
                out = sublayer(i, x, xs, aux)
                if attnres:
                    carry = residual_ops.add_to_slot(carry, out, xs["slot"][i])
                else:
                    carry = carry + out
            return carry, {"inputs": jnp.stack(inputs) if keep_inputs else None, "finite": jnp.stack(finite),
                           "weights": jnp.stack(weights) if weights else None, "aux": aux if cfg.ffn == "moe" else None}

        if attnres and cfg.remat == "full":  # not one buffer per period kept for the backward
            # block ids never decrease over sublayers, so period g writes slots first_slot[g]..first_slot[g + 1]
            carry, ys = residual_ops.scan_source_buffer(body, carry, xs, per_period(scan_in["slot"])[:, 0])
        else:
            if cfg.remat != "none":
                policy = None if cfg.remat == "full" else getattr(jax.checkpoint_policies, cfg.remat)
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            carry, ys = jax.lax.scan(body, carry, xs)
        num_sublayers = cfg.num_sublayers
        unstack = lambda a: [a[l // (2 * period), l % (2 * period)] for l in range(num_sublayers)]  # noqa: E731
        inputs = tuple(unstack(ys["inputs"])) if keep_inputs else ()
        finite = ys["finite"].reshape(-1)  # [G, 2 period] -> [L], sublayer order
        moe_aux = []
        if cfg.ffn == "moe":
            moe_aux = [jax.tree.map(lambda a, g=l // period: a[g], ys["aux"][l % period])
                       for l in range(cfg.num_layers)]
        if not attnres:
            return residual_ops.DepthForward(carry, inputs, (), finite), moe_aux
        hidden, final_w = residual_ops.depth_attention(carry, queries[-1], scales[-1], eps=cfg.norm_eps,
                                                       return_weights=True, implementation=cfg.residual.implementation)
        weights = tuple(w[:n] for w, n in zip(unstack(ys["weights"]), self.layout.num_sources)) + (final_w,)
        return residual_ops.DepthForward(hidden, inputs, weights, finite), moe_aux

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

    def head_inputs(self, h):
        """(`final_norm(h)` [..., D] in the compute dtype, the head matrix [D, padded V] fp32): the logits of
        `_logits(h)` are their product in the compute dtype, cast to fp32. For a loss that never holds all
        the logits (`k3jax.ops.cross_entropy.chunked_cross_entropy`)."""
        weight = self.embed.embedding[...].T if self.cfg.tie_embeddings else self.head.kernel[...]
        return self.final_norm(h), weight

    def forward(self, inputs, *, segment_ids=None, positions=None, train: bool = True,
                keep_sublayer_inputs: bool = False):
        """Like `__call__`, but returns `(logits, aux, DepthForward)` with the depth weights. Unrolled: the
        per-sublayer inputs (`sublayer_finite` None). Scanned: `sublayer_finite`, and the inputs only with
        `keep_sublayer_inputs` (the scan then stacks them over depth: L activations)."""
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [B, T] token ids, got {inputs.shape=}")
        if segment_ids is None:
            segment_ids = jnp.ones(inputs.shape, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        if self.cfg.scan_layers:
            depth, moe_aux = self._scan_stack(self.embed(inputs), segment_ids, positions, train,
                                              keep_inputs=keep_sublayer_inputs)
            return self._logits(depth.hidden), {"moe": moe_aux}, depth
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
        _, _, depth = self.forward(inputs, segment_ids=segment_ids, positions=positions, train=False,
                                   keep_sublayer_inputs=True)
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
