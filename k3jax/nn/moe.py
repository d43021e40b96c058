"""Mixture-of-Experts SwiGLU feed-forward (flax NNX): router, balancing, dropless/capacity dispatch.

The math lives in :mod:`k3jax.ops.routing`, :mod:`k3jax.ops.balancing` and
:mod:`k3jax.ops.token_dispatch`; this module owns the parameters and wires them together.
Sources: DeepSeekMoE / DeepSeek-V3 §2.1 (routed + shared experts, sigmoid router, selection bias),
Kimi K3 §2.3.3 (Quantile Balancing), Switch (capacity).

Bias protocol: the router bias is a :class:`RouterBias` variable (fp32, NOT an ``nnx.Param``, so an
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never touches it). ``__call__`` never mutates it: it
returns ``aux["next_bias"]`` (and ``aux["next_state"]`` for stateful methods) and the TRAIN step
writes them back (``ffn.router_bias.set_value(aux["next_bias"])``); evaluation ignores them, and
with ``train=False`` they equal the current values anyway. ``"quantile_threshold"`` re-routes within
the step in evaluation too (same-step diversion is its routing rule); only its window is frozen.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax import sharding as sharding_lib
from k3jax.ops import grouped_matmul as gmm_ops
from k3jax.ops import token_dispatch
from k3jax.ops import balancing as balancing_ops
from k3jax.ops import routing as routing_ops
from k3jax.ops import threshold_routing
from k3jax.ops.balancing import BalancingMethod, NoBalancing

__all__ = ["BalancingState", "MoEFeedForward", "RouterBias"]


class RouterBias(nnx.Variable):
    """Per-expert selection bias ``[E]`` fp32; non-trainable (not an ``nnx.Param``), updated by the
    train step from ``aux["next_bias"]``."""


class BalancingState(nnx.Variable):
    """Cross-step balancing state (e.g. the sliding load window of ``"quantile_threshold"``);
    non-trainable, updated by the train step from ``aux["next_state"]``."""


def _expert_init(batch_axis: int = 0):
    return jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(batch_axis,)
    )


class MoEFeedForward(nnx.Module):
    """Routed SwiGLU experts (+ optional shared experts) with a top-k router and one balancing method.

    Args:
      d_model: D. d_ff: F, the hidden width of ONE expert. num_experts: E routed experts.
      top_k: k experts per token.
      num_shared_experts: always-on experts (DeepSeekMoE), fused into one SwiGLU of width
        ``num_shared_experts · d_ff`` whose output is added unweighted.
      score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
      routed_scaling_factor: multiplies the routed gate weights (DeepSeek-V3).
      balancing: a :mod:`k3jax.ops.balancing` method config.
      capacity_factor: None = dropless (grouped matmul); a float = capacity dispatch with dropping.
      dispatch_implementation: grouped-matmul implementation name (see
        :func:`k3jax.ops.grouped_matmul.grouped_matmul`), None = default.
      dtype: compute dtype of the expert matmuls (bf16; fp32 accumulation). The router runs in fp32.
      param_dtype: parameter dtype (fp32).
      mesh: None (single device / plain ``jax.jit``), or a ``(data, expert)`` mesh from
        :func:`k3jax.sharding.make_mesh`: the layer then runs under ``jax.shard_map`` with tokens
        (batch dim) sharded over both axes, experts over ``"expert"`` (two ``all_to_all``), and every
        balancing statistic psum'ed over both axes. Dropless only; E and the batch must divide.
      rngs: ``nnx.Rngs``.

    Raises:
      ValueError: invalid sizes or options.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        num_shared_experts: int = 0,
        score_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        balancing: BalancingMethod = NoBalancing(),
        capacity_factor: float | None = None,
        dispatch_implementation: str | None = None,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        if min(d_model, d_ff, num_experts) < 1:
            raise ValueError(f"sizes must be >= 1; got {d_model=}, {d_ff=}, {num_experts=}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts=}]; got {top_k=}")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0; got {num_shared_experts=}")
        if score_func not in routing_ops.SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {routing_ops.SCORE_FUNCS}; got {score_func=}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be None or > 0; got {capacity_factor=}")
        if balancing.method in ("quantile", "quantile_threshold") and top_k >= num_experts:
            raise ValueError(f"{balancing.method=} needs top_k < num_experts; got {top_k=}, {num_experts=}")
        if (
            dispatch_implementation is not None
            and dispatch_implementation not in gmm_ops.BACKENDS
        ):
            raise ValueError(
                f"dispatch_implementation must be None or one of "
                f"{sorted(gmm_ops.BACKENDS)}; got {dispatch_implementation=}"
            )
        if mesh is not None:
            if capacity_factor is not None:
                raise ValueError("expert parallelism (mesh) supports dropless dispatch only: capacity_factor=None")
            if tuple(mesh.axis_names) != sharding_lib.TOKEN_AXES:
                raise ValueError(f"mesh axes must be {sharding_lib.TOKEN_AXES}; got {mesh.axis_names=}")
            if num_experts % mesh.shape[sharding_lib.EXPERT]:
                raise ValueError(f"num_experts must divide by the expert axis; got {num_experts=}, {mesh.shape=}")
        self.mesh = mesh
        self.d_model = d_model
        self.d_ff = d_ff
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_shared_experts = num_shared_experts
        self.score_func = score_func
        self.routed_scaling_factor = routed_scaling_factor
        self.balancing = balancing
        self.capacity_factor = capacity_factor
        self.dispatch_implementation = dispatch_implementation
        self.dtype = dtype
        self.param_dtype = param_dtype

        init = _expert_init()
        self.router = nnx.Param(
            jax.nn.initializers.normal(stddev=d_model**-0.5)(rngs.params(), (d_model, num_experts), jnp.float32)
        )
        self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))
        state = balancing_ops.init_balancing_state(balancing, num_experts)
        self.balancing_state = BalancingState(state) if state is not None else None
        self.w_gate = nnx.Param(init(rngs.params(), (num_experts, d_model, d_ff), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (num_experts, d_model, d_ff), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, d_ff, d_model), param_dtype))
        if num_shared_experts:
            width = num_shared_experts * d_ff
            dense = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
            self.shared_gate = nnx.Param(dense(rngs.params(), (d_model, width), param_dtype))
            self.shared_up = nnx.Param(dense(rngs.params(), (d_model, width), param_dtype))
            self.shared_down = nnx.Param(dense(rngs.params(), (width, d_model), param_dtype))
        else:
            self.shared_gate = self.shared_up = self.shared_down = None

    def __call__(
        self,
        x: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        train: bool = True,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Apply the MoE FFN.

        Args:
          x: ``[B, T, D]`` activations (any float dtype; experts run in ``dtype``).
          segment_ids: ``[B, T]`` int32, 0 = padding (excluded from loads, statistics, losses and
            capacity); None = every token is real.
          train: False (evaluation) returns the current bias/state as ``next_bias``/``next_state``.

        Returns:
          ``(y [B, T, D] in x.dtype, aux)`` with ``aux = {"loss": fp32 scalar, "next_bias": [E] fp32,
          "next_state": pytree or None, "stats": {"loads" [E], "max_vio", "cv", "dropped_fraction",
          "dead_experts", "entropy", "diverted_fraction"} (fp32)}``.

        Raises:
          ValueError: ``x`` not ``[B, T, d_model]`` or ``segment_ids`` not ``[B, T]``.
        """
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [B, T, {self.d_model}]; got {x.shape=}")
        batch, seq_len, d_model = x.shape
        num_tokens = batch * seq_len
        if segment_ids is not None:
            if segment_ids.shape != (batch, seq_len):
                raise ValueError(f"segment_ids must be [B, T] = {(batch, seq_len)}; got {segment_ids.shape=}")
            token_mask = (segment_ids != 0).reshape(num_tokens)
        else:
            token_mask = None
        if token_mask is None:
            token_mask = jnp.ones((num_tokens,), jnp.bool_)
        bias = self.router_bias.get_value()
        state = self.balancing_state.get_value() if self.balancing_state is not None else None
        experts = tuple(v.get_value() for v in (self.w_gate, self.w_up, self.w_down))
        shared = None
        if self.shared_gate is not None:
            shared = tuple(v.get_value() for v in (self.shared_gate, self.shared_up, self.shared_down))
        router = self.router.get_value()
        mask = token_mask.reshape(batch, seq_len)
        if self.mesh is None:
            y, out, dropped = self._apply(
                x, mask, router, bias, state, experts, shared, axis_names=(), expert_axis=None
            )
        else:
            tok = P(sharding_lib.TOKEN_AXES)
            exp = P(sharding_lib.EXPERT)
            if all(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types):
                # explicit axes: shard_map needs its inputs in the token sharding already; the mask is
                # built here (unsharded when segment_ids is None). Auto axes reshard by themselves.
                x = jax.reshard(x, jax.sharding.NamedSharding(self.mesh, tok))
                mask = jax.reshard(mask, jax.sharding.NamedSharding(self.mesh, tok))
            fn = functools.partial(self._apply, axis_names=sharding_lib.TOKEN_AXES, expert_axis=sharding_lib.EXPERT)
            y, out, dropped = jax.shard_map(
                fn,
                mesh=self.mesh,
                in_specs=(tok, tok, P(), P(), P(), (exp, exp, exp), P()),
                out_specs=(tok, P(), P()),
            )(x, mask, router, bias, state, experts, shared)
        stats = dict(out.stats)
        stats["dropped_fraction"] = dropped
        if train:
            next_bias, next_state = out.next_bias, out.next_state
        else:
            next_bias, next_state = bias, state
        aux = {"loss": out.loss, "next_bias": next_bias, "next_state": next_state, "stats": stats}
        return y, aux

    def _apply(self, x, mask, router, bias, state, experts, shared, *, axis_names, expert_axis):
        """Routing, balancing and experts on (local) arrays; ``x [b, T, D]``, ``mask [b, T]`` bool."""
        batch, seq_len, d_model = x.shape
        num_tokens = batch * seq_len
        token_mask = mask.reshape(num_tokens)
        xf = x.reshape(num_tokens, d_model)
        logits = jnp.dot(xf.astype(jnp.float32), router.astype(jnp.float32))
        scores = routing_ops.router_scores(logits, self.score_func)
        demand = None
        if isinstance(self.balancing, balancing_ops.QuantileThreshold):
            routing, demand = threshold_routing.threshold_route(
                scores, self.top_k, state, **self.balancing.route_options(), score_func=self.score_func,
                routed_scaling_factor=self.routed_scaling_factor, token_mask=token_mask,
                axis_names=axis_names,
            )
        else:
            routing = routing_ops.route(
                scores, bias, self.top_k, score_func=self.score_func,
                routed_scaling_factor=self.routed_scaling_factor,
            )
        out = balancing_ops.balance(
            self.balancing, scores, routing, bias, state, score_func=self.score_func,
            token_mask=token_mask, sequence_length=seq_len, demand_loads=demand, axis_names=axis_names,
        )
        xc = xf.astype(self.dtype)
        w_gate, w_up, w_down = (w.astype(self.dtype) for w in experts)
        if expert_axis is not None:
            y = token_dispatch.expert_parallel_dropless_moe(
                xc, routing.expert_ids, routing.weights, w_gate, w_up, w_down,
                expert_axis=expert_axis, implementation=self.dispatch_implementation,
            )
            dropped = jnp.float32(0.0)
        elif self.capacity_factor is None:
            y = token_dispatch.dropless_moe(
                xc, routing.expert_ids, routing.weights, w_gate, w_up, w_down,
                implementation=self.dispatch_implementation,
            )
            dropped = jnp.float32(0.0)
        else:
            y, dropped = token_dispatch.capacity_moe(
                xc, routing.expert_ids, routing.weights, w_gate, w_up, w_down,
                self.capacity_factor, token_mask=token_mask,
            )
        if shared is not None:
            g_w, u_w, d_w = (w.astype(self.dtype) for w in shared)
            g = jnp.dot(xc, g_w, preferred_element_type=jnp.float32)
            u = jnp.dot(xc, u_w, preferred_element_type=jnp.float32)
            h = (jax.nn.silu(g) * u).astype(self.dtype)
            y = y + jnp.dot(h, d_w, preferred_element_type=jnp.float32)
        return y.reshape(batch, seq_len, d_model).astype(x.dtype), out, dropped
