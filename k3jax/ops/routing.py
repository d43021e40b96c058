"""Top-k MoE routing: router scores, top-k selection with a selection bias, gate weights.

Notation (DESIGN.md): N tokens, E routed experts, top_k = k experts per token. Router scores
``s [N, E]`` are fp32; a per-expert selection bias ``b [E]`` (fp32) only changes WHICH experts a token
picks, never the gate weights, and it never carries a gradient (``stop_gradient``). The bias comes from
a balancing method (:mod:`k3jax.ops.balancing`); the load metrics are in :mod:`k3jax.ops.balance_metrics`,
the seed article's same-step threshold router in :mod:`k3jax.ops.threshold_routing`.

Input checks: shapes, dtypes and static arguments raise ``ValueError`` naming the argument. Values of
arrays (NaN scores) cannot raise inside ``jit``: :func:`route` takes ``check_values=True`` to add
``jax.experimental.checkify`` checks (eagerly they raise ``JaxRuntimeError``, a ``ValueError``, at once;
under ``jit`` wrap the caller with ``checkify.checkify`` and call ``err.throw()``; a jitted call that is
not functionalised fails to trace).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops._moe_common import check_bias, check_finite, check_scores, is_int

SCORE_FUNCS = ("softmax", "sigmoid")

__all__ = ["SCORE_FUNCS", "Routing", "gate_weights", "route", "router_scores"]


def router_scores(logits: jax.Array, score_func: str = "softmax") -> jax.Array:
    """Router scores from router logits, in fp32.

    Args:
      logits: ``[N, E]`` router logits, any float dtype (cast to fp32 first).
      score_func: ``"softmax"`` (over the E experts; Switch, Mixtral, DeepSeek-V2) or ``"sigmoid"``
        (element-wise; DeepSeek-V3 §2.1.2, Kimi K2/K3).

    Returns:
      ``[N, E]`` fp32 scores in [0, 1].

    Raises:
      ValueError: ``logits`` is not rank 2 or ``score_func`` is unknown.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, E]; got {logits.shape=}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}; got {score_func=}")
    logits = logits.astype(jnp.float32)
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


class Routing(NamedTuple):
    """Result of top-k routing.

    Attributes:
      expert_ids: ``[N, k]`` int32 selected experts, in descending order of the selection score.
      weights: ``[N, k]`` fp32 combine (gate) weights, from the UNBIASED scores.
      cutoff: ``[N]`` fp32, the (k+1)-th largest biased score ``α_i`` (Quantile Balancing's per-token
        cutoff), or ``None`` when ``k == E`` (no (k+1)-th expert).
      diverted: ``[N, k]`` bool, True where a slot was moved away from the plain top-k choice in the
        same step (only :func:`threshold_route`); ``None`` otherwise.
    """

    expert_ids: jax.Array
    weights: jax.Array
    cutoff: jax.Array | None = None
    diverted: jax.Array | None = None


def gate_weights(
    scores: jax.Array, expert_ids: jax.Array, routed_scaling_factor: float, renormalize: bool
) -> jax.Array:
    """Gate weights ``[N, k]`` fp32: the selected scores, optionally divided by their sum, times the factor."""
    selected = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if renormalize:
        selected = selected / jnp.maximum(jnp.sum(selected, axis=-1, keepdims=True), 1e-20)
    return selected * jnp.float32(routed_scaling_factor)


def route(
    scores: jax.Array,
    bias: jax.Array | None,
    top_k: int,
    *,
    score_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    check_values: bool = False,
) -> Routing:
    """Top-k expert selection on biased scores; gate weights from the unbiased scores.

    Selection: the k largest of ``scores + stop_gradient(bias)`` per token (``jax.lax.top_k``; ties go
    to the lower expert index). Gate weights: the selected UNBIASED scores ``s_ij``; with
    ``renormalize=True`` (the default, for both score functions) they are divided by their sum over
    the k selected experts, then multiplied by ``routed_scaling_factor``.

    Convention: DeepSeek-V3 (§2.1.2, sigmoid, ``norm_topk_prob=True``) renormalises sigmoid
    scores over the k selected experts; for softmax we follow the same rule (Mixtral / Qwen-MoE
    ``norm_topk_prob=True`` / Marin), which equals a softmax over the selected logits, so the weights
    sum to exactly ``routed_scaling_factor``. ``renormalize=False`` gives Switch / DeepSeek-V2
    weights (the selected probabilities as they are).

    Args:
      scores: ``[N, E]`` fp32 router scores (:func:`router_scores`).
      bias: ``[E]`` fp32 selection bias or ``None`` (zero). No gradient flows into it.
      top_k: experts per token, ``1 <= top_k <= E``.
      score_func: ``"softmax"`` or ``"sigmoid"`` (validated; both use the rule above).
      routed_scaling_factor: multiplies the gate weights (DeepSeek-V3 / Kimi K2 use 2.5-2.8).
      renormalize: divide the selected scores by their sum (see above).
      check_values: add ``checkify`` checks that ``scores`` and ``bias`` are finite (NaN scores make
        the selection arbitrary and the weights NaN; module docstring: how to run them under jit).

    Returns:
      :class:`Routing` with ``expert_ids [N, k]`` int32, ``weights [N, k]`` fp32 and ``cutoff [N]``
      fp32 (the (k+1)-th biased score, ``None`` if ``k == E``).

    Raises:
      ValueError: bad shapes, ``top_k`` not an int in [1, E] or unknown ``score_func``;
        ``JaxRuntimeError`` (a ValueError) from the value checks with ``check_values=True``.
    """
    check_scores(scores)
    num_experts = scores.shape[-1]
    if not is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}]; got {top_k=}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}; got {score_func=}")
    if bias is not None:
        check_bias(bias, num_experts)
    if check_values:
        check_finite(scores, "scores", "route")
        if bias is not None:
            check_finite(bias, "bias", "route")
    scores = scores.astype(jnp.float32)
    biased = scores
    if bias is not None:
        biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
    biased = jax.lax.stop_gradient(biased)
    kk = min(top_k + 1, num_experts)
    top_vals, top_ids = jax.lax.top_k(biased, kk)
    expert_ids = top_ids[:, :top_k].astype(jnp.int32)
    cutoff = top_vals[:, top_k] if top_k < num_experts else None
    weights = gate_weights(scores, expert_ids, routed_scaling_factor, renormalize)
    return Routing(expert_ids=expert_ids, weights=weights, cutoff=cutoff)
