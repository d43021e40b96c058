"""MoE load-balancing methods: one small frozen config and one step function each, in one table.

A method turns one step's router scores and routing into a loss term, the selection bias for the NEXT
step and its cross-step state (:func:`balance`). ``METHODS`` maps each name to its config class and step
function; :func:`balancing_config` builds a config from a name. Each config's ``method`` is a field set by
the class (not an argument), so ``dataclasses.asdict`` keeps it (``model.moe.balancing`` in a run's
config, `k3jax.models.config.balancing_from_dict`). Sources:

- ``"none"`` (:class:`NoBalancing`).
- ``"aux_loss"`` (:class:`AuxLoss`): Switch Transformer auxiliary loss ``α·E·Σ_j f_j·P_j`` (Fedus et al.
  2021, eq. 4).
- ``"seq_aux_loss"`` (:class:`SeqAuxLoss`): DeepSeek-V3 complementary sequence-wise auxiliary loss
  (DeepSeek-V3 report §2.1.2): the same expression per sequence, averaged over sequences.
- ``"loss_free"`` (:class:`LossFree`): auxiliary-loss-free bias ``b_j += γ·sign(mean load − load_j)``
  (Wang et al. 2024, arXiv 2408.15664, Alg. 1; DeepSeek-V3 §2.1.2), from global counts.
- ``"quantile"`` (:class:`QuantileBalancing`): Quantile Balancing (Su, kexue.fm/archives/11619; Kimi K3
  §2.3.3, App. D): the bias is a quantile of per-token margins (:mod:`k3jax.ops.quantile`); causal.
- ``"quantile_threshold"`` (:class:`QuantileThreshold`): the seed article's literal same-step diversion
  (:mod:`k3jax.ops.threshold_routing`); not causal, kept as a named variant to compare against.

Everything is fp32. ``axis_names``: mesh axes the tokens are sharded over inside ``jax.shard_map``;
counts and histograms are ``psum``-ed over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops._moe_common import (
    check_bias, check_nonnegative, check_routing, check_scores, is_int, psum, token_mask_or_all,
)
from k3jax.ops.balance_metrics import expert_loads, load_stats
from k3jax.ops.quantile import HISTOGRAM_PASSES, QUANTILE_ESTIMATORS, quantile_bias, quantile_margins
from k3jax.ops.routing import Routing
from k3jax.ops.threshold_routing import init_threshold_state, update_threshold_state

__all__ = [
    "AuxLoss", "BalanceOutput", "LossFree", "METHODS", "NoBalancing", "QuantileBalancing", "QuantileThreshold",
    "SeqAuxLoss", "StepInputs", "aux_loss", "balance", "balancing_config", "init_balancing_state",
    "loss_free_update", "seq_aux_loss",
]


# ----------------------------------------------------------------------------------------------
# Losses and updates.
# ----------------------------------------------------------------------------------------------


def _normalized_scores(scores: jax.Array, score_func: str) -> jax.Array:
    if score_func == "sigmoid":
        return scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-20)
    return scores


def aux_loss(
    scores: jax.Array,
    expert_ids: jax.Array,
    *,
    alpha: float = 1e-2,
    score_func: str = "softmax",
    token_mask: jax.Array | None = None,
    axis_names: Sequence[str] = (),
) -> jax.Array:
    """Switch Transformer load-balancing loss ``α · E · Σ_j f_j · P_j`` (Fedus et al. 2021, eq. 4).

    ``f_j = L_j / (k · N)`` is the fraction of the N·k assignments that went to expert j (no
    gradient), ``P_j = (1/N) Σ_i s'_ij`` the mean router probability (gradient flows to the scores);
    ``s' = s`` for softmax and ``s / Σ_j s`` for sigmoid (DeepSeek-V3 §2.1.2, sequence-wise loss). Normalisation: with
    ``Σ f = Σ P = 1`` the loss is ``α`` exactly on uniform routing (f = P = 1/E) and at most ``α·E``.
    Padding tokens (``token_mask`` False) are excluded; N counts valid tokens over ``axis_names``.

    Args:
      scores: ``[N, E]`` fp32 router scores. expert_ids: ``[N, k]`` int32 selection.
      alpha: α. score_func: ``"softmax"``/``"sigmoid"``. token_mask: ``[N]`` bool or None.
      axis_names: mesh axes tokens are sharded over.

    Returns:
      fp32 scalar loss.
    """
    check_scores(scores)
    num_tokens, num_experts = scores.shape
    top_k = expert_ids.shape[-1]
    mask = token_mask_or_all(token_mask, num_tokens).astype(jnp.float32)
    loads = expert_loads(expert_ids, num_experts, token_mask=token_mask, axis_names=axis_names)
    n_valid = jnp.maximum(psum(jnp.sum(mask), axis_names), 1.0)
    f = jax.lax.stop_gradient(loads) / (top_k * n_valid)
    p_sum = psum(jnp.sum(_normalized_scores(scores, score_func) * mask[:, None], axis=0), axis_names)
    p = p_sum / n_valid
    return jnp.float32(alpha) * num_experts * jnp.sum(f * p)


def seq_aux_loss(
    scores: jax.Array,
    expert_ids: jax.Array,
    sequence_length: int,
    *,
    alpha: float = 1e-4,
    score_func: str = "softmax",
    token_mask: jax.Array | None = None,
    axis_names: Sequence[str] = (),
) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss (DeepSeek-V3 §2.1.2, complementary sequence-wise loss).

    Per sequence b of T tokens: ``L_b = α · Σ_j f_bj · P_bj`` with ``f_bj = E/(k·T_b) · L_bj`` and
    ``P_bj = (1/T_b) Σ_t s'_btj`` (``s'`` as in :func:`aux_loss`), i.e. the Switch expression computed
    per sequence; the result is the mean over sequences with at least one valid token (over
    ``axis_names`` too). Equals ``α`` exactly on uniform routing. Tokens must be laid out
    sequence-major: row ``b·T + t``.

    Args:
      scores: ``[N, E]`` fp32, N = B·T. expert_ids: ``[N, k]``. sequence_length: T (divides N).
      alpha, score_func, token_mask, axis_names: as in :func:`aux_loss`.

    Returns:
      fp32 scalar loss.

    Raises:
      ValueError: ``sequence_length`` does not divide N.
    """
    check_scores(scores)
    num_tokens, num_experts = scores.shape
    if sequence_length <= 0 or num_tokens % sequence_length:
        raise ValueError(f"sequence_length must divide N={num_tokens}; got {sequence_length=}")
    top_k = expert_ids.shape[-1]
    num_seq = num_tokens // sequence_length
    mask = token_mask_or_all(token_mask, num_tokens).astype(jnp.float32).reshape(num_seq, sequence_length)
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32).sum(axis=1)  # [N, E]
    one_hot = one_hot.reshape(num_seq, sequence_length, num_experts) * mask[..., None]
    n_b = jnp.sum(mask, axis=1)  # [B]
    safe_n = jnp.maximum(n_b, 1.0)
    f = jax.lax.stop_gradient(jnp.sum(one_hot, axis=1)) / (top_k * safe_n[:, None])  # fraction
    s = _normalized_scores(scores, score_func).reshape(num_seq, sequence_length, num_experts)
    p = jnp.sum(s * mask[..., None], axis=1) / safe_n[:, None]
    per_seq = num_experts * jnp.sum(f * p, axis=-1) * (n_b > 0)
    total = psum(jnp.sum(per_seq), axis_names)
    count = jnp.maximum(psum(jnp.sum((n_b > 0).astype(jnp.float32)), axis_names), 1.0)
    return jnp.float32(alpha) * total / count


def loss_free_update(loads: jax.Array, gamma: float = 1e-3) -> jax.Array:
    """DeepSeek auxiliary-loss-free bias update, centred: returns Δb [E] fp32 with Σ Δb = 0.

    The paper's update is ``Δb_j = γ · sign(mean(L) − L_j)`` (Wang et al. 2024, arXiv 2408.15664,
    Alg. 1; DeepSeek-V3 §2.1.2). We subtract its mean over experts. Top-k selection is invariant to
    adding one constant to every bias, so routing is IDENTICAL to the paper's update; centring only
    stops the common component of the bias from drifting (it would grow by up to γ per step).

    Args:
      loads: ``[E]`` GLOBAL loads of the current step (psum'ed over all token-sharded axes).
      gamma: update rate γ >= 0 (paper: 1e-3); a Python/numpy number is checked, a jax array is not.

    Raises:
      ValueError: ``gamma`` a number that is negative, NaN or inf.
    """
    check_nonnegative(gamma, "gamma")
    loads = jnp.asarray(loads, jnp.float32)
    delta = jnp.float32(gamma) * jnp.sign(jnp.mean(loads) - loads)
    return delta - jnp.mean(delta)


# ----------------------------------------------------------------------------------------------
# Method configs (frozen) and step functions.
# ----------------------------------------------------------------------------------------------


class StepInputs(NamedTuple):
    """What a step function sees: scores ``[N, E]`` fp32, this step's routing, the bias ``[E]`` used for
    it, the state, this step's global ``loads [E]`` and the keyword arguments of :func:`balance`."""

    scores: jax.Array
    routing: Routing
    bias: jax.Array
    state: Any
    loads: jax.Array
    score_func: str
    token_mask: jax.Array | None
    sequence_length: int | None
    demand_loads: jax.Array | None
    axis_names: Sequence[str]


@dataclasses.dataclass(frozen=True)
class NoBalancing:
    """No balancing: loss 0, bias unchanged."""

    method: str = dataclasses.field(default="none", init=False)


@dataclasses.dataclass(frozen=True)
class AuxLoss:
    """Switch auxiliary loss (:func:`aux_loss`). ``alpha`` >= 0 (Switch: 1e-2)."""

    method: str = dataclasses.field(default="aux_loss", init=False)
    alpha: float = 1e-2

    def __post_init__(self):
        check_nonnegative(self.alpha, "alpha")


@dataclasses.dataclass(frozen=True)
class SeqAuxLoss:
    """DeepSeek-V3 sequence-wise auxiliary loss (:func:`seq_aux_loss`). ``alpha`` >= 0 (DeepSeek-V3: 1e-4)."""

    method: str = dataclasses.field(default="seq_aux_loss", init=False)
    alpha: float = 1e-4

    def __post_init__(self):
        check_nonnegative(self.alpha, "alpha")


@dataclasses.dataclass(frozen=True)
class LossFree:
    """Auxiliary-loss-free bias (:func:`loss_free_update`). ``gamma`` >= 0 (paper: 1e-3)."""

    method: str = dataclasses.field(default="loss_free", init=False)
    gamma: float = 1e-3

    def __post_init__(self):
        check_nonnegative(self.gamma, "gamma")


@dataclasses.dataclass(frozen=True)
class QuantileBalancing:
    """Quantile Balancing (Su; K3 §2.3.3, App. D); needs top_k < E.

    Attributes:
      quantile_estimator: ``"exact"`` or ``"histogram"`` (:func:`k3jax.ops.quantile.quantile_bias`).
      histogram_bins: bins of the histogram estimator (K3: 1000).
      histogram_passes: 1 (K3) or 2 (a refinement histogram inside the quantile's bin: bins² resolution).
      quantile_iterations: n >= 1 dual steps on the step's scores (1 = K3/Su). Step i recomputes every
        token's cutoff under the bias of step i−1 and solves the quantiles again; the result is still
        applied at the NEXT step. On one 16k-token batch, E = 32, top-4: MaxVio 5.49 → 0.65 after one
        step, 0.03 after eight (experiments/results/qb_convergence.md). Each extra step costs one
        top-(k+1) and one quantile (with the histogram, its psum too).
      ema: None, or β in [0, 1): the next bias is ``β·b + (1−β)·b_new``.
    """

    method: str = dataclasses.field(default="quantile", init=False)
    quantile_estimator: str = "exact"
    histogram_bins: int = 1000
    histogram_passes: int = 1
    quantile_iterations: int = 1
    ema: float | None = None

    def __post_init__(self):
        if self.quantile_estimator not in QUANTILE_ESTIMATORS:
            raise ValueError(
                f"quantile_estimator must be one of {QUANTILE_ESTIMATORS}; got {self.quantile_estimator=}")
        if not is_int(self.histogram_bins) or self.histogram_bins < 1:
            raise ValueError(f"histogram_bins must be an int >= 1; got {self.histogram_bins=}")
        if not is_int(self.histogram_passes) or self.histogram_passes not in HISTOGRAM_PASSES:
            raise ValueError(f"histogram_passes must be one of {HISTOGRAM_PASSES}; got {self.histogram_passes=}")
        if not is_int(self.quantile_iterations) or self.quantile_iterations < 1:
            raise ValueError(f"quantile_iterations must be an int >= 1; got {self.quantile_iterations=}")
        if self.ema is not None and not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be None or in [0, 1); got {self.ema=}")


@dataclasses.dataclass(frozen=True)
class QuantileThreshold:
    """The seed article's same-step threshold routing (:func:`k3jax.ops.threshold_routing.threshold_route`).

    Attributes:
      high_percentile, low_percentile: load percentiles over experts (seed: 95 / 5).
      tolerance: absolute relative-load tolerance (>= 0). window: sliding window in steps (>= 1).
      priority_boost: score added to underloaded experts (score units).
    """

    method: str = dataclasses.field(default="quantile_threshold", init=False)
    high_percentile: float = 95.0
    low_percentile: float = 5.0
    tolerance: float = 0.05
    window: int = 8
    priority_boost: float = 0.05

    def __post_init__(self):
        if not is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be an int >= 1; got {self.window=}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0; got {self.tolerance=}")
        if not 0.0 <= self.low_percentile <= self.high_percentile <= 100.0:
            raise ValueError(f"need 0 <= low <= high <= 100; got {self.low_percentile=}, {self.high_percentile=}")

    def route_options(self) -> dict[str, float]:
        """Keyword arguments of :func:`~k3jax.ops.threshold_routing.threshold_route`."""
        return {"high_percentile": self.high_percentile, "low_percentile": self.low_percentile,
                "tolerance": self.tolerance, "priority_boost": self.priority_boost}


BalancingMethod = NoBalancing | AuxLoss | SeqAuxLoss | LossFree | QuantileBalancing | QuantileThreshold


def _step_none(config: NoBalancing, x: StepInputs):
    return jnp.float32(0.0), x.bias, x.state


def _step_aux_loss(config: AuxLoss, x: StepInputs):
    loss = aux_loss(x.scores, x.routing.expert_ids, alpha=config.alpha, score_func=x.score_func,
                    token_mask=x.token_mask, axis_names=x.axis_names)
    return loss, x.bias, x.state


def _step_seq_aux_loss(config: SeqAuxLoss, x: StepInputs):
    if x.sequence_length is None:
        raise ValueError("seq_aux_loss needs sequence_length")
    loss = seq_aux_loss(x.scores, x.routing.expert_ids, x.sequence_length, alpha=config.alpha,
                        score_func=x.score_func, token_mask=x.token_mask, axis_names=x.axis_names)
    return loss, x.bias, x.state


def _step_loss_free(config: LossFree, x: StepInputs):
    return jnp.float32(0.0), x.bias + loss_free_update(x.loads, config.gamma), x.state


def _step_quantile(config: QuantileBalancing, x: StepInputs):
    top_k = x.routing.expert_ids.shape[-1]
    margins = quantile_margins(x.scores, x.routing)
    new = x.bias
    for step in range(config.quantile_iterations):
        if step:  # the cutoffs under the previous dual step's bias (route's (k+1)-th biased score)
            biased = jax.lax.stop_gradient(x.scores.astype(jnp.float32) + new[None, :])
            cutoff = jax.lax.top_k(biased, top_k + 1)[0][:, top_k]
            margins = quantile_margins(x.scores, x.routing._replace(cutoff=cutoff))
        new = quantile_bias(
            margins, top_k, bias=new, token_mask=x.token_mask, estimator=config.quantile_estimator,
            histogram_bins=config.histogram_bins, histogram_passes=config.histogram_passes,
            axis_names=x.axis_names,
        )
    next_bias = new if config.ema is None else config.ema * x.bias + (1.0 - config.ema) * new
    return jnp.float32(0.0), next_bias, x.state


def _step_quantile_threshold(config: QuantileThreshold, x: StepInputs):
    if x.state is None or x.demand_loads is None:
        raise ValueError("quantile_threshold needs state (init_balancing_state) and demand_loads")
    return jnp.float32(0.0), x.bias, update_threshold_state(x.state, x.demand_loads)


class Method(NamedTuple):
    """A table row: the config class and ``step(config, StepInputs) -> (loss, next_bias, next_state)``."""

    config: type
    step: Callable[[Any, StepInputs], tuple[jax.Array, jax.Array, Any]]


METHODS: dict[str, Method] = {
    cls.method: Method(cls, step) for cls, step in (
        (NoBalancing, _step_none),
        (AuxLoss, _step_aux_loss),
        (SeqAuxLoss, _step_seq_aux_loss),
        (LossFree, _step_loss_free),
        (QuantileBalancing, _step_quantile),
        (QuantileThreshold, _step_quantile_threshold),
    )
}


def balancing_config(method: str, **options) -> BalancingMethod:
    """The config of ``method`` (a key of ``METHODS``) with ``options`` as its fields.

    Raises:
      ValueError: unknown ``method``, an option the method does not have, or a bad option value.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}; got {method=}")
    cls = METHODS[method].config
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"method {method!r} takes the options {sorted(fields)}; got {unknown}")
    return cls(**options)


def _method(config) -> Method:
    row = METHODS.get(getattr(config, "method", None))
    if row is None or not isinstance(config, row.config):
        raise ValueError(f"config must be one of the METHODS configs {[m.config.__name__ for m in METHODS.values()]}; "
                         f"got {config!r}")
    return row


def init_balancing_state(config: BalancingMethod, num_experts: int) -> dict[str, jax.Array] | None:
    """Initial cross-step state: the sliding window for :class:`QuantileThreshold`
    (:func:`~k3jax.ops.threshold_routing.init_threshold_state`), else None."""
    _method(config)
    if isinstance(config, QuantileThreshold):
        return init_threshold_state(config.window, num_experts)
    return None


class BalanceOutput(NamedTuple):
    """Output of :func:`balance`: ``loss`` fp32 scalar (0 if none), ``stats`` dict of fp32 arrays
    (``loads, max_vio, cv, dead_experts, entropy, diverted_fraction``), ``next_bias [E]`` fp32 (to
    use at the NEXT step), ``next_state`` (pytree or None)."""

    loss: jax.Array
    stats: dict[str, jax.Array]
    next_bias: jax.Array
    next_state: Any


def balance(
    config: BalancingMethod,
    scores: jax.Array,
    routing: Routing,
    bias: jax.Array,
    state: Any = None,
    *,
    score_func: str = "softmax",
    token_mask: jax.Array | None = None,
    sequence_length: int | None = None,
    demand_loads: jax.Array | None = None,
    axis_names: Sequence[str] = (),
) -> BalanceOutput:
    """Loss term, statistics, next bias and next state of one balancing method for one step.

    ``routing`` must come from :func:`k3jax.ops.routing.route` with the same ``bias`` (or, for
    :class:`QuantileThreshold`, from ``threshold_route``, whose ``demand_loads`` are passed here).
    The bias/state returned are for the NEXT step; nothing here mutates anything. The method's step
    function is looked up in ``METHODS``.

    Args:
      config: a ``METHODS`` config. scores: ``[N, E]`` fp32 (differentiable for aux losses).
      routing: this step's :class:`Routing`. bias: ``[E]`` fp32 bias used for ``routing``.
      state: :func:`init_balancing_state` pytree or None. score_func: ``"softmax"``/``"sigmoid"``.
      token_mask: ``[N]`` bool; padding (False) is excluded from every statistic.
      sequence_length: T for ``"seq_aux_loss"``. demand_loads: ``[E]`` from ``threshold_route``.
      axis_names: mesh axes the tokens are sharded over (all counts psum'ed over them).

    Returns:
      :class:`BalanceOutput`.

    Raises:
      ValueError: ``config`` not a ``METHODS`` config; missing ``sequence_length`` / ``state`` /
        ``demand_loads`` for the method; bad shapes (``routing`` for other tokens than ``scores``).
    """
    row = _method(config)
    check_scores(scores)
    num_tokens, num_experts = scores.shape
    check_bias(bias, num_experts)
    check_routing(routing, num_tokens, num_experts)
    bias = jnp.asarray(bias, jnp.float32)
    loads = expert_loads(routing.expert_ids, num_experts, token_mask=token_mask, axis_names=axis_names)
    stats = load_stats(loads)
    if routing.diverted is not None:
        mask = token_mask_or_all(token_mask, num_tokens).astype(jnp.float32)
        n_div = psum(jnp.sum(routing.diverted.astype(jnp.float32) * mask[:, None]), axis_names)
        n_all = psum(jnp.sum(mask), axis_names) * routing.expert_ids.shape[-1]
        stats["diverted_fraction"] = n_div / jnp.maximum(n_all, 1.0)
    else:
        stats["diverted_fraction"] = jnp.float32(0.0)
    inputs = StepInputs(scores, routing, bias, state, loads, score_func, token_mask, sequence_length,
                        demand_loads, tuple(axis_names))
    loss, next_bias, next_state = row.step(config, inputs)
    return BalanceOutput(loss=loss, stats=stats, next_bias=jax.lax.stop_gradient(next_bias), next_state=next_state)
