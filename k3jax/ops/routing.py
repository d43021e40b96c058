"""Top-k MoE routing, load-balancing methods and balance metrics (pure functions).

Notation (DESIGN.md): N tokens, E routed experts, top_k = k experts per token. Router scores
``s [N, E]`` are fp32; a per-expert selection bias ``b [E]`` (fp32) only changes WHICH experts a token
picks, never the gate weights, and it never carries a gradient (``stop_gradient``).

Balancing methods (one interface, :class:`BalancingConfig` + :func:`balance`):

- ``"none"``: no balancing.
- ``"aux_loss"``: Switch Transformer auxiliary loss ``α·E·Σ_j f_j·P_j`` (Fedus et al. 2021, eq. 4).
- ``"seq_aux_loss"``: DeepSeek-V3 sequence-wise auxiliary loss (DeepSeek-V3 report §2.1.2,
  "Complementary Sequence-Wise Auxiliary Loss"),
  the same expression per sequence, averaged over sequences.
- ``"loss_free"``: DeepSeek auxiliary-loss-free bias, ``b_j += γ·sign(mean load − load_j)``
  (Wang et al. 2024, arXiv 2408.15664, Alg. 1; DeepSeek-V3 §2.1.2), from global counts, applied at the
  next step.
- ``"quantile"``: Quantile Balancing (Su, kexue.fm/archives/11619; Kimi K3 report §2.3.3 and App. D):
  the per-expert bias is the closed-form dual solution of the balanced-assignment LP, a quantile of
  per-token margins; applied at the next step (causal; frozen at inference). Estimators: ``exact``
  (sort) and ``histogram`` (K3 App. D; ``histogram_passes=2`` adds a refinement histogram).
- ``"quantile_threshold"``: the seed article's literal description (same-step diversion away from
  experts above a high load percentile, priority boost for experts below a low percentile, sliding
  window smoothing, adaptive thresholds). No public counterpart; kept as a named variant so it can be
  compared. It is NOT causal: see :func:`threshold_route` and :func:`causal_leakage`.

Everything that is a score, a statistic or a bias is computed in fp32. Functions that aggregate over
tokens take ``axis_names``: when called inside ``jax.shard_map`` with tokens sharded over those mesh
axes, counts/histograms are ``jax.lax.psum``-ed over them so every device sees the global statistic.

Input checks: shapes, dtypes and static arguments raise ``ValueError`` naming the argument. Values of
arrays (NaN scores, expert ids outside [0, E)) cannot raise inside ``jit``; :func:`route` and
:func:`expert_loads` take ``check_values=True`` to add ``jax.experimental.checkify`` checks for them
(eagerly they raise ``JaxRuntimeError``, a ``ValueError``, at once; under ``jit`` wrap the caller with
``checkify.checkify`` and call ``err.throw()``; a jitted call that is not functionalised fails to trace).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import checkify

SCORE_FUNCS = ("softmax", "sigmoid")
BALANCING_METHODS = ("none", "aux_loss", "seq_aux_loss", "loss_free", "quantile", "quantile_threshold")
QUANTILE_ESTIMATORS = ("exact", "histogram")
HISTOGRAM_PASSES = (1, 2)

__all__ = [
    "BALANCING_METHODS",
    "BalanceOutput",
    "BalancingConfig",
    "QUANTILE_ESTIMATORS",
    "Routing",
    "SCORE_FUNCS",
    "aux_loss",
    "balance",
    "causal_leakage",
    "dead_experts",
    "expert_loads",
    "init_balancing_state",
    "load_cv",
    "load_entropy",
    "load_stats",
    "loss_free_update",
    "max_vio",
    "max_vio_global",
    "quantile_bias",
    "quantile_margins",
    "route",
    "router_scores",
    "seq_aux_loss",
    "threshold_route",
]


# ----------------------------------------------------------------------------------------------
# Scores and top-k routing.
# ----------------------------------------------------------------------------------------------


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


def _check_scores(scores: jax.Array, name: str = "scores") -> None:
    if scores.ndim != 2:
        raise ValueError(f"{name} must be [N, E]; got {name}.shape={scores.shape}")


def _check_bias(bias: jax.Array, num_experts: int) -> None:
    if bias.shape != (num_experts,):
        raise ValueError(f"bias must be [E] with E={num_experts}; got {bias.shape=}")


def _check_routing(routing: Routing, num_tokens: int, num_experts: int) -> None:
    """``routing`` must describe the same N tokens as the scores it is used with (static shapes)."""
    ids = routing.expert_ids
    if ids.ndim != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"routing.expert_ids must be [N, k] with N={num_tokens} (the scores' tokens); "
                         f"got routing.expert_ids.shape={ids.shape}")
    if not 1 <= ids.shape[1] <= num_experts:
        raise ValueError(f"routing.expert_ids must be [N, k] with 1 <= k <= E={num_experts}; "
                         f"got routing.expert_ids.shape={ids.shape}")
    for name in ("weights", "diverted"):
        x = getattr(routing, name)
        if x is not None and x.shape != ids.shape:
            raise ValueError(f"routing.{name} must be [N, k] = {ids.shape}; got routing.{name}.shape={x.shape}")
    if routing.cutoff is not None and routing.cutoff.shape != (num_tokens,):
        raise ValueError(f"routing.cutoff must be [N] with N={num_tokens}; got routing.cutoff.shape="
                         f"{routing.cutoff.shape}")


def _check_finite(x: jax.Array, name: str, where: str) -> None:
    """checkify check that every value of ``x`` is finite (message names ``where`` and ``name``)."""
    bad = jnp.sum(~jnp.isfinite(x))
    checkify.check(bad == 0, f"{where}: {name} must be finite; got {{bad}} NaN/inf values of {x.size}", bad=bad)


def _gate_weights(
    scores: jax.Array, expert_ids: jax.Array, routed_scaling_factor: float, renormalize: bool
) -> jax.Array:
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
    _check_scores(scores)
    num_experts = scores.shape[-1]
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}]; got {top_k=}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}; got {score_func=}")
    if bias is not None:
        _check_bias(bias, num_experts)
    if check_values:
        _check_finite(scores, "scores", "route")
        if bias is not None:
            _check_finite(bias, "bias", "route")
    scores = scores.astype(jnp.float32)
    biased = scores
    if bias is not None:
        biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
    biased = jax.lax.stop_gradient(biased)
    kk = min(top_k + 1, num_experts)
    top_vals, top_ids = jax.lax.top_k(biased, kk)
    expert_ids = top_ids[:, :top_k].astype(jnp.int32)
    cutoff = top_vals[:, top_k] if top_k < num_experts else None
    weights = _gate_weights(scores, expert_ids, routed_scaling_factor, renormalize)
    return Routing(expert_ids=expert_ids, weights=weights, cutoff=cutoff)


# ----------------------------------------------------------------------------------------------
# Metrics.
# ----------------------------------------------------------------------------------------------


def _token_mask(token_mask: jax.Array | None, num_tokens: int) -> jax.Array:
    if token_mask is None:
        return jnp.ones((num_tokens,), jnp.bool_)
    if token_mask.shape != (num_tokens,):
        raise ValueError(f"token_mask must be [N] with N={num_tokens}; got {token_mask.shape=}")
    return token_mask.astype(jnp.bool_)


def _psum(x: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    return jax.lax.psum(x, tuple(axis_names)) if axis_names else x


def _gather_tokens(x: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    """All-gather ``x [n, ...]`` along dim 0 over ``axis_names`` in device order (first axis major),
    as a psum of zero-padded slots so the result is device-invariant (shard_map's vma check)."""
    size = math.prod(jax.lax.axis_size(a) for a in axis_names)
    index = jax.lax.axis_index(tuple(axis_names))
    buf = jnp.zeros((size,) + x.shape, x.dtype).at[index].set(x)
    return jax.lax.psum(buf, tuple(axis_names)).reshape((size * x.shape[0],) + x.shape[1:])


def expert_loads(
    expert_ids: jax.Array,
    num_experts: int,
    *,
    token_mask: jax.Array | None = None,
    axis_names: Sequence[str] = (),
    check_values: bool = False,
) -> jax.Array:
    """Number of (token, slot) assignments per expert.

    Args:
      expert_ids: ``[N, k]`` int expert indices, each in [0, E): an id outside it counts for no
        expert (``jax.nn.one_hot``), so ``check_values=True`` is the way to catch one.
      num_experts: E.
      token_mask: ``[N]`` bool, False for padding tokens (they are not counted); None = all count.
      axis_names: mesh axes the tokens are sharded over (psum inside ``shard_map``).
      check_values: add a ``checkify`` check that every id of a counted token is in [0, E) (module
        docstring: how to run it under jit).

    Returns:
      ``[E]`` fp32 loads L_j (exact integers below 2^24); ``Σ_j L_j = k · (valid tokens)``.

    Raises:
      ValueError: ``expert_ids`` not rank 2 or not of an integer dtype, ``num_experts`` not an int >= 1,
        ``token_mask`` of the wrong shape; ``JaxRuntimeError`` (a ValueError) from the value check.
    """
    if expert_ids.ndim != 2:
        raise ValueError(f"expert_ids must be [N, k]; got {expert_ids.shape=}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must have an integer dtype; got {expert_ids.dtype=}")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1; got {num_experts=}")
    if check_values:
        valid = _token_mask(token_mask, expert_ids.shape[0])[:, None]
        bad = jnp.sum(valid & ((expert_ids < 0) | (expert_ids >= num_experts)))
        checkify.check(bad == 0, f"expert_loads: expert_ids must be in [0, num_experts={num_experts}); got "
                       "{bad} ids outside it (max id {top})", bad=bad, top=jnp.max(expert_ids))
    mask = _token_mask(token_mask, expert_ids.shape[0])
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [N, k, E]
    loads = jnp.sum(one_hot * mask[:, None, None].astype(jnp.float32), axis=(0, 1))
    return _psum(loads, axis_names)


def max_vio(loads: jax.Array) -> jax.Array:
    """MaxVio = (max_j L_j − mean_j L_j) / mean_j L_j (Wang et al. 2024, arXiv 2408.15664, "MaxVio").

    Args:
      loads: ``[E]`` per-expert loads (counts or fractions).

    Returns:
      fp32 scalar; 0 at perfect balance, E − 1 when one expert takes everything; 0 if all loads are 0.

    Raises:
      ValueError: ``loads`` is not 1-D (use :func:`max_vio_global` for ``[S, E]``).
    """
    loads = jnp.asarray(loads, jnp.float32)
    if loads.ndim != 1:
        raise ValueError(f"loads must be [E]; got {loads.shape=} (max_vio_global takes [S, E])")
    mean = jnp.mean(loads)
    return jnp.where(mean > 0, (jnp.max(loads) - mean) / jnp.where(mean > 0, mean, 1.0), 0.0)


def max_vio_global(batch_loads: jax.Array) -> jax.Array:
    """MaxVio over a whole evaluation set: :func:`max_vio` of the loads summed over batches.

    Args:
      batch_loads: ``[S, E]`` loads of S evaluation batches (or any running sum as ``[1, E]``).

    Returns:
      fp32 scalar MaxVio_global (Wang et al. 2024, arXiv 2408.15664: loads over the validation set).
    """
    batch_loads = jnp.asarray(batch_loads, jnp.float32)
    if batch_loads.ndim != 2:
        raise ValueError(f"batch_loads must be [S, E]; got {batch_loads.shape=}")
    return max_vio(jnp.sum(batch_loads, axis=0))


def load_cv(loads: jax.Array) -> jax.Array:
    """Coefficient of variation of the load: population std / mean over experts (fp32 scalar; 0 if
    all loads are 0)."""
    loads = jnp.asarray(loads, jnp.float32)
    mean = jnp.mean(loads)
    return jnp.where(mean > 0, jnp.std(loads) / jnp.where(mean > 0, mean, 1.0), 0.0)


def dead_experts(loads: jax.Array) -> jax.Array:
    """Number of experts with zero load (L_j = 0), as an fp32 scalar."""
    return jnp.sum(jnp.asarray(loads) == 0).astype(jnp.float32)


def load_entropy(loads: jax.Array) -> jax.Array:
    """Normalised entropy of the load distribution: ``−Σ p_j ln p_j / ln E`` with ``p = L / Σ L``.

    Returns an fp32 scalar in [0, 1]: 1 at perfect balance, 0 when one expert takes every token
    (and 0 when all loads are 0). Units cancel (nats / nats).
    """
    loads = jnp.asarray(loads, jnp.float32)
    num_experts = loads.shape[-1]
    total = jnp.sum(loads)
    p = loads / jnp.where(total > 0, total, 1.0)
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    if num_experts == 1:
        return jnp.float32(0.0)
    return -jnp.sum(plogp) / jnp.float32(math.log(num_experts))


def load_stats(loads: jax.Array) -> dict[str, jax.Array]:
    """All load metrics at once: ``{"loads", "max_vio", "cv", "dead_experts", "entropy"}`` (fp32)."""
    loads = jnp.asarray(loads, jnp.float32)
    return {
        "loads": loads,
        "max_vio": max_vio(loads),
        "cv": load_cv(loads),
        "dead_experts": dead_experts(loads),
        "entropy": load_entropy(loads),
    }


# ----------------------------------------------------------------------------------------------
# Auxiliary losses.
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
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    top_k = expert_ids.shape[-1]
    mask = _token_mask(token_mask, num_tokens).astype(jnp.float32)
    loads = expert_loads(expert_ids, num_experts, token_mask=token_mask, axis_names=axis_names)
    n_valid = jnp.maximum(_psum(jnp.sum(mask), axis_names), 1.0)
    f = jax.lax.stop_gradient(loads) / (top_k * n_valid)
    p_sum = _psum(jnp.sum(_normalized_scores(scores, score_func) * mask[:, None], axis=0), axis_names)
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
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if sequence_length <= 0 or num_tokens % sequence_length:
        raise ValueError(f"sequence_length must divide N={num_tokens}; got {sequence_length=}")
    top_k = expert_ids.shape[-1]
    num_seq = num_tokens // sequence_length
    mask = _token_mask(token_mask, num_tokens).astype(jnp.float32).reshape(num_seq, sequence_length)
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32).sum(axis=1)  # [N, E]
    one_hot = one_hot.reshape(num_seq, sequence_length, num_experts) * mask[..., None]
    n_b = jnp.sum(mask, axis=1)  # [B]
    safe_n = jnp.maximum(n_b, 1.0)
    f = jax.lax.stop_gradient(jnp.sum(one_hot, axis=1)) / (top_k * safe_n[:, None])  # fraction
    s = _normalized_scores(scores, score_func).reshape(num_seq, sequence_length, num_experts)
    p = jnp.sum(s * mask[..., None], axis=1) / safe_n[:, None]
    per_seq = num_experts * jnp.sum(f * p, axis=-1) * (n_b > 0)
    total = _psum(jnp.sum(per_seq), axis_names)
    count = jnp.maximum(_psum(jnp.sum((n_b > 0).astype(jnp.float32)), axis_names), 1.0)
    return jnp.float32(alpha) * total / count


# ----------------------------------------------------------------------------------------------
# Loss-free bias and Quantile Balancing.
# ----------------------------------------------------------------------------------------------


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
    _check_gamma(gamma, "gamma")
    loads = jnp.asarray(loads, jnp.float32)
    delta = jnp.float32(gamma) * jnp.sign(jnp.mean(loads) - loads)
    return delta - jnp.mean(delta)


def _check_gamma(gamma, name: str) -> None:
    if isinstance(gamma, numbers.Real) and not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {name}={gamma!r}")


def quantile_margins(scores: jax.Array, routing: Routing, bias: jax.Array | None = None) -> jax.Array:
    """Quantile Balancing margins ``r_ij = α_i − s_ij`` (Su, kexue.fm/archives/11619; K3 §2.3.3).

    ``α_i`` is the (k+1)-th largest BIASED score of token i (``routing.cutoff``). Expert j enters
    (or stays in) token i's selection under bias ``b'_j`` iff ``s_ij + b'_j > α_i``, i.e. iff
    ``b'_j > r_ij`` (holding the cutoff fixed), so ``r_ij`` is the bias expert j needs to take token i.

    Args:
      scores: ``[N, E]`` fp32 unbiased scores. routing: the :class:`Routing` from :func:`route` with
        ``cutoff`` set (requires k < E). bias: unused by the formula; accepted for symmetry.

    Returns:
      ``[N, E]`` fp32 margins (no gradient).

    Raises:
      ValueError: ``routing.cutoff`` is None (k == E: nothing to balance), or ``routing`` is not for
        the N tokens of ``scores``.
    """
    del bias
    _check_scores(scores)
    _check_routing(routing, *scores.shape)
    if routing.cutoff is None:
        raise ValueError("quantile balancing needs top_k < E (routing.cutoff is None)")
    r = routing.cutoff[:, None].astype(jnp.float32) - scores.astype(jnp.float32)
    return jax.lax.stop_gradient(r)


def _exact_quantile(
    margins: jax.Array, mask: jax.Array, level: float, axis_names: Sequence[str]
) -> tuple[jax.Array, jax.Array]:
    if axis_names:
        margins = _gather_tokens(margins, axis_names)
        mask = _gather_tokens(mask.astype(jnp.int32), axis_names).astype(jnp.bool_)
    masked = jnp.where(mask[:, None], margins, jnp.inf)
    srt = jnp.sort(masked, axis=0)  # valid values first
    n = jnp.sum(mask.astype(jnp.int32))
    pos = jnp.float32(level) * (jnp.maximum(n, 1) - 1).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n, 1) - 1)
    frac = pos - lo.astype(jnp.float32)
    v_lo = srt[lo]
    v_hi = srt[hi]
    value = v_lo + frac * (v_hi - v_lo)
    return value, n > 0


def _histogram_counts(idx: jax.Array, weights: jax.Array, bins: int, axis_names: Sequence[str]) -> jax.Array:
    """int32 ``[E, bins]`` counts of bin indices ``idx [N, E]`` with int32 ``weights [N, E]``, psum'ed."""
    num_experts = idx.shape[1]
    flat = (jnp.arange(num_experts, dtype=jnp.int32)[None, :] * bins + idx).reshape(-1)
    counts = jnp.zeros((num_experts * bins,), jnp.int32).at[flat].add(weights.reshape(-1))
    return _psum(counts.reshape(num_experts, bins), axis_names)


def _read_cdf(counts: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per expert: the first bin ``m`` whose cumulative count reaches ``target``, the count before it,
    and the in-bin fraction ``(target − before) / count_m`` clipped to [0, 1]."""
    bins = counts.shape[1]
    cdf = jnp.cumsum(counts, axis=1)
    m = jnp.minimum(jnp.sum((cdf.astype(jnp.float32) < target[:, None]).astype(jnp.int32), axis=1), bins - 1)
    c_m = jnp.take_along_axis(counts, m[:, None], axis=1)[:, 0].astype(jnp.float32)
    before = jnp.take_along_axis(cdf, m[:, None], axis=1)[:, 0].astype(jnp.float32) - c_m
    frac = jnp.clip((target - before) / jnp.maximum(c_m, 1.0), 0.0, 1.0)
    return m, before, frac


def _histogram_quantile(
    margins: jax.Array,
    mask: jax.Array,
    level: float,
    lo: jax.Array,
    hi: jax.Array,
    bins: int,
    axis_names: Sequence[str],
    passes: int = 1,
) -> tuple[jax.Array, jax.Array]:
    width = (hi - lo) / bins
    idx = jnp.clip(jnp.floor((margins - lo) / width).astype(jnp.int32), 0, bins - 1)  # [N, E]
    valid = jnp.broadcast_to(mask[:, None], margins.shape).astype(jnp.int32)
    counts = _histogram_counts(idx, valid, bins, axis_names)  # [E, bins] int32, pooled
    n = jnp.sum(counts, axis=1)  # [E], identical for every expert
    target = jnp.float32(level) * (jnp.maximum(n, 1) - 1).astype(jnp.float32) + 0.5  # [E]
    m, before, frac = _read_cdf(counts, target)
    if passes == 1:
        return lo + width * (m.astype(jnp.float32) + frac), n > 0
    # Second pass: re-bin only the margins of bin m_j (same index, so the same members, clipped
    # outliers included) into `bins` sub-bins of width w / bins, one more psum, and read the pooled
    # sub-CDF at the count left over inside bin m_j.
    # The sub-bin index is the global fine index (bins² bins over [lo, hi]) minus m_j·bins, from one
    # multiply by a scale computed once (no per-element division that XLA may fuse differently in
    # a sharded and a pooled program); members whose rounding disagrees land in an end sub-bin.
    fine_scale = jnp.float32(bins * bins) / (hi - lo)
    fine_global = jnp.floor((margins - lo) * fine_scale).astype(jnp.int32)
    fine_idx = jnp.clip(fine_global - m[None, :] * bins, 0, bins - 1)
    in_bin = valid * (idx == m[None, :]).astype(jnp.int32)
    fine_counts = _histogram_counts(fine_idx, in_bin, bins, axis_names)
    m2, _, frac2 = _read_cdf(fine_counts, target - before)
    return lo + (hi - lo) * ((m * bins + m2).astype(jnp.float32) + frac2) / jnp.float32(bins * bins), n > 0


def _is_int(value) -> bool:
    """A python/numpy integer, not a bool (True == 1 must not pass as a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def quantile_bias(
    margins: jax.Array,
    top_k: int,
    *,
    bias: jax.Array,
    token_mask: jax.Array | None = None,
    estimator: str = "exact",
    histogram_bins: int = 1000,
    histogram_passes: int = 1,
    center: bool = True,
    axis_names: Sequence[str] = (),
) -> jax.Array:
    """Quantile Balancing bias ``b = b̂ − mean(b̂)``, ``b̂_j = quantile_{k/E}(r_{:,j})``.

    Source: Su, kexue.fm/archives/11619 (closed-form dual of the balanced-assignment LP); Kimi K3
    report §2.3.3 and App. D (histogram form).

    Quantile convention (``"exact"``): the linear-interpolation quantile of the N valid margins of
    each expert at level p = k/E, i.e. position ``p·(N−1)`` in the ascending order (numpy's default
    ``"linear"`` method). With ``q = N·k/E`` an integer and no ties, ``p·(N−1) = q − p`` lies strictly
    between the 0-based positions q−1 and q, so ``r_(q) < b̂_j < r_(q+1)`` (1-based order statistics):
    exactly q margins are below ``b̂_j`` and expert j admits exactly q tokens at fixed cutoffs.
    (A "lower"/"higher" order-statistic convention would sit ON a margin and admit q−1 or q+1.)

    ``"histogram"``: each device bins its margins into an int32 ``[E, bins]`` histogram over
    ``[min_j b_j − 1, max_j b_j + 1]`` where b is the CURRENT bias (the one used to route). Scores lie
    in [0, 1], so ``r_ij = s_im + b_m − s_ij ∈ [min b − 1, max b + 1]`` always (values outside are
    clipped); the range needs no communication because b is replicated. Counts are summed with one
    ``psum`` over ``axis_names``; the quantile is read from the pooled CDF with in-bin linear
    interpolation at cumulative count ``p·(N−1) + 1/2`` (sample i sits at count i + 1/2, matching the
    exact convention). Guarantee: with bin width w, the estimate lies in ``[r_(q) − w, r_(q+1) + w]``
    (one bin around the exact bracket); on dense margins it is within one bin of the exact value.
    ``histogram_passes=2`` refines: a second int32 ``[E, bins]`` histogram of the margins that fell in
    the bin holding expert j's quantile (the same bin index, so the same tokens), over that bin split
    into ``bins`` sub-bins, summed with a second ``psum`` over the same axes; the quantile is read from
    it at the count remaining inside the bin, so the resolution is ``(max b − min b + 2) / bins²``
    and the guarantee holds with w replaced by that fine width (fp32 margins: useful down to a fine
    width of ~1e-6 at |r| ~ 1). It answers the stall of the 1-pass estimator when the margins are
    far narrower than the range (E = 32 softmax: one 1000-bin bin holds up to ~3x the quota; see
    experiments/results/qb_convergence.md). Costs one more scatter-add over [N, E] and one more psum.

    Args:
      margins: ``[N, E]`` fp32 from :func:`quantile_margins`. top_k: k (level k/E).
      bias: ``[E]`` fp32 current bias (histogram range; returned unchanged where no token is valid).
      token_mask: ``[N]`` bool, padding excluded. estimator: ``"exact"`` (sort; inside shard_map it
        all-gathers the margins over ``axis_names``) or ``"histogram"``.
      histogram_bins: number of bins (K3: 1000). histogram_passes: 1 (K3 App. D) or 2 (second
        refinement histogram inside the quantile's bin, bins² resolution). center: subtract ``mean(b̂)`` (the method; top-k
        selection is invariant to a common shift once the cutoffs are recomputed). ``center=False``
        returns ``b̂`` itself, the per-expert LP column solution at fixed cutoffs.
      axis_names: mesh axes the tokens are sharded over.

    Returns:
      ``[E]`` fp32 bias for the NEXT step (zero-mean when ``center``).

    Raises:
      ValueError: ``top_k`` not an int in [1, E), unknown estimator, bad shapes, ``histogram_bins < 1``,
        ``histogram_passes`` not 1 or 2.
    """
    _check_scores(margins, "margins")
    num_tokens, num_experts = margins.shape
    if not _is_int(top_k) or not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}) (level top_k / E of the quantile); "
                         f"got {top_k=}")
    _check_bias(bias, num_experts)
    if estimator not in QUANTILE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {QUANTILE_ESTIMATORS}; got {estimator=}")
    if not _is_int(histogram_bins) or histogram_bins < 1:
        raise ValueError(f"histogram_bins must be an int >= 1; got {histogram_bins=}")
    if not _is_int(histogram_passes) or histogram_passes not in HISTOGRAM_PASSES:
        raise ValueError(f"histogram_passes must be one of {HISTOGRAM_PASSES}; got {histogram_passes=}")
    mask = _token_mask(token_mask, num_tokens)
    level = top_k / num_experts
    margins = jax.lax.stop_gradient(margins.astype(jnp.float32))
    bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
    if estimator == "exact":
        b_hat, ok = _exact_quantile(margins, mask, level, axis_names)
    else:
        lo = jnp.min(bias) - 1.0
        hi = jnp.max(bias) + 1.0
        b_hat, ok = _histogram_quantile(margins, mask, level, lo, hi, histogram_bins, axis_names,
                                        histogram_passes)
    b_hat = jnp.where(ok, b_hat, bias)
    return b_hat - jnp.mean(b_hat) if center else b_hat


# ----------------------------------------------------------------------------------------------
# The seed article's literal method: same-step threshold diversion.
# ----------------------------------------------------------------------------------------------


def _percentile(x: jax.Array, q: float) -> jax.Array:
    return jnp.percentile(x, q, method="linear")


def threshold_route(
    scores: jax.Array,
    top_k: int,
    state: dict[str, jax.Array],
    *,
    high_percentile: float = 95.0,
    low_percentile: float = 5.0,
    tolerance: float = 0.05,
    priority_boost: float = 0.05,
    score_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    token_mask: jax.Array | None = None,
    axis_names: Sequence[str] = (),
) -> tuple[Routing, jax.Array]:
    """The seed article's "quantile balancing": same-step diversion by load percentiles.

    No public implementation exists; this is our literal reading of the seed article (§3.2), with
    the article's own remedies (sliding-window smoothing, adaptive thresholds) and the absolute
    tolerance ANCHORS.md §2 asks for. Per step:

    1. demand: plain top-k of the scores gives loads ``D_j`` (psum'ed over ``axis_names``);
    2. smoothing: relative load ``u_j = E · mean over {window fractions, D/ΣD}`` (1 = balanced), where
       the window holds the demand fractions of up to ``W`` previous steps (``state``);
    3. adaptive thresholds from the CURRENT distribution: ``θ_hi = max(P_high(u), 1 + tolerance)``,
       ``θ_lo = min(P_low(u), 1 − tolerance)`` (P = percentile over experts, linear); expert j is
       overloaded iff ``u_j ≥ P_high(u)`` and ``u_j > 1 + tolerance``, underloaded iff
       ``u_j ≤ P_low(u)`` and ``u_j < 1 − tolerance``. Without the tolerance a rank percentile flags
       a fixed share of experts even at perfect balance; with it a balanced step diverts nothing;
    4. priority: underloaded experts get ``+priority_boost`` on their selection score; top-k again;
    5. diversion in token order (row order of ``scores``, i.e. sequence-major, slot order inside a
       token; inside ``shard_map`` the global order, devices in ``axis_names`` order): the capacity
       is ``C = floor(θ_hi · N_valid · k / E)``; an expert that is overloaded OR that receives more
       than ``C`` slots after step 4 (the seed: "when an expert's load exceeds the threshold,
       subsequent tokens routed to it are diverted"; the boost alone can take an underloaded expert
       far above ``C`` when scores are peaked) keeps its first ``C`` slots; every later slot is shed
       to the token's best not-yet-selected expert that is neither (by the boosted score); if none
       is left the slot stays. Passes repeat on the new assignment (an expert that went above ``C``
       by receiving shed slots sheds its later ones; once marked, an expert takes no more slots)
       until nothing moves, at most E + 1 passes; the first pass alone was the original one-pass rule.

    Consequences measured in experiments/results/quantile_threshold_study.md: P95 over 32 experts
    flags the two most loaded and caps them AT P95 (between the 2nd and 3rd largest load), so
    MaxVio after diversion is ``θ_hi − 1``, never below the 3rd expert's violation; the absolute
    ``priority_boost`` diverts more the more peaked the router's softmax is, at equal demand; the
    window holds DEMAND fractions, so a boosted expert's own intake never clears its flag.

    Gate weights come from the unbiased scores of the final experts (renormalised as in :func:`route`).

    Causality: steps 1-3 use the loads of the WHOLE step, so a token's routing depends on tokens
    after it (in its own sequence and in later sequences): later tokens can flip which experts are
    flagged, move θ_hi/C_j and so change earlier tokens' experts. :func:`causal_leakage` measures it.

    Args:
      scores: ``[N, E]`` fp32 router scores. top_k: k < E.
      state: ``{"window_loads": [W, E] fp32 demand fractions, "filled": int32 scalar}``
        (:func:`init_balancing_state`).
      high_percentile, low_percentile: percentiles in [0, 100] (seed: 95 / 5).
      tolerance: absolute relative-load tolerance (≥ 0). priority_boost: score added to underloaded
        experts (score units, scores ∈ [0, 1]).
      score_func, routed_scaling_factor, renormalize: as in :func:`route`.
      token_mask: ``[N]`` bool (padding neither counts nor takes capacity). axis_names: mesh axes.

    Returns:
      ``(routing, demand_loads)``: :class:`Routing` with ``diverted [N, k]`` set (``cutoff`` None),
      and the ``[E]`` fp32 pre-diversion demand loads (for the window update in :func:`balance`).

    Raises:
      ValueError: bad shapes, ``top_k`` not in [1, E), percentiles out of range, negative tolerance.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}) for threshold routing; got {top_k=}")
    if not 0.0 <= low_percentile <= high_percentile <= 100.0:
        raise ValueError(f"need 0 <= low <= high <= 100; got {low_percentile=}, {high_percentile=}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0; got {tolerance=}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}; got {score_func=}")
    mask = _token_mask(token_mask, num_tokens)
    scores = scores.astype(jnp.float32)
    sel = jax.lax.stop_gradient(scores)

    # 1-2: demand and smoothed relative load.
    _, demand_ids = jax.lax.top_k(sel, top_k)
    demand = expert_loads(demand_ids, num_experts, token_mask=mask, axis_names=axis_names)
    frac = demand / jnp.maximum(jnp.sum(demand), 1.0)
    window = state["window_loads"].astype(jnp.float32)
    filled = jnp.minimum(state["filled"], window.shape[0])
    in_window = (jnp.arange(window.shape[0]) < filled).astype(jnp.float32)
    smoothed = (jnp.sum(window * in_window[:, None], axis=0) + frac) / (filled + 1).astype(jnp.float32)
    u = num_experts * smoothed

    # 3: adaptive thresholds with absolute tolerance.
    p_hi = _percentile(u, high_percentile)
    p_lo = _percentile(u, low_percentile)
    over = (u >= p_hi) & (u > 1.0 + tolerance)
    under = (u <= p_lo) & (u < 1.0 - tolerance)
    theta_hi = jnp.maximum(p_hi, 1.0 + tolerance)

    # 4: boosted selection, full ranking of experts per token.
    boosted = sel + jnp.float32(priority_boost) * under[None, :].astype(jnp.float32)
    _, order = jax.lax.top_k(boosted, num_experts)  # [N, E] descending
    order = order.astype(jnp.int32)
    chosen = order[:, :top_k]

    # 5: token-order capacity (global token order across devices). Every expert that RECEIVES more
    # than the cap sheds its later slots, not only the ones flagged by demand: the boost can put an
    # underloaded expert into most tokens' top-k (a peaked softmax's 4th score is far below
    # priority_boost), and shed slots can pile onto one receiver; passes repeat until no expert that
    # can still shed is above the cap. `full` only grows, so at most E passes run.
    n_valid = _psum(jnp.sum(mask.astype(jnp.float32)), axis_names)
    cap = jnp.floor(theta_hi * n_valid * top_k / num_experts)

    def shed_pass(carry):
        ids, full, _, passes = carry
        one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * mask[:, None, None]  # [N, k, E]
        local = jnp.sum(one_hot, axis=(0, 1))
        received = _psum(local, axis_names).astype(jnp.float32)
        full = full | (received > cap)
        position = jnp.cumsum(one_hot.reshape(-1, num_experts), axis=0).reshape(one_hot.shape) - 1
        if axis_names:  # rows on earlier devices come first
            counts = _gather_tokens(local[None], axis_names)  # [P, E]
            before = jnp.arange(counts.shape[0]) < jax.lax.axis_index(tuple(axis_names))
            position = position + jnp.sum(counts * before[:, None], axis=0)[None, None, :]
        position = jnp.sum(position * one_hot, axis=-1)  # [N, k] 0-based rank in token order
        shed = full[ids] & (position.astype(jnp.float32) >= cap) & mask[:, None]
        selected = jnp.any(jax.nn.one_hot(ids, num_experts, dtype=jnp.bool_), axis=1)  # [N, E]
        cand_ok = ~full[order] & ~jnp.take_along_axis(selected, order, axis=1)  # [N, E], boosted order
        cand_rank = jnp.cumsum(cand_ok.astype(jnp.int32), axis=1) - 1  # rank among allowed candidates
        shed_rank = jnp.cumsum(shed.astype(jnp.int32), axis=1) - 1  # which replacement each slot takes
        match = cand_ok[:, None, :] & (cand_rank[:, None, :] == shed_rank[:, :, None])  # [N, k, E]
        has_repl = jnp.any(match, axis=-1) & shed
        repl = jnp.sum(jnp.where(match, order[:, None, :], 0), axis=-1)
        moved = _psum(jnp.sum(has_repl.astype(jnp.int32)), axis_names)
        return jnp.where(has_repl, repl, ids).astype(jnp.int32), full, moved, passes + 1

    carry = shed_pass((chosen, over, jnp.int32(0), jnp.int32(0)))
    expert_ids, *_ = jax.lax.while_loop(
        lambda c: (c[2] > 0) & (c[3] < num_experts + 1), shed_pass, carry)
    plain_ids = demand_ids.astype(jnp.int32)
    diverted = jnp.all(expert_ids[:, :, None] != plain_ids[:, None, :], axis=-1) & mask[:, None]
    weights = _gate_weights(scores, expert_ids, routed_scaling_factor, renormalize)
    return Routing(expert_ids=expert_ids, weights=weights, cutoff=None, diverted=diverted), demand


def causal_leakage(
    route_fn: Callable[[jax.Array], jax.Array],
    scores: jax.Array,
    perturbed_scores: jax.Array,
    prefix_length: int,
    *,
    token_mask: jax.Array | None = None,
) -> jax.Array:
    """Fraction of EARLIER tokens whose routing changes when only LATER tokens change.

    Definition: for sequences ``[B, T, E]`` of scores that agree on positions ``t < prefix_length``
    and may differ after, route both (``route_fn``) and count the prefix tokens (valid ones, where
    ``token_mask`` is True) whose SET of selected experts differs; divide by the number of valid
    prefix tokens. A causal router (plain top-k, top-k with a bias from the previous step, i.e.
    ``"quantile"`` / ``"loss_free"``) gives exactly 0 for any inputs; same-step methods that read the
    whole step's loads (:func:`threshold_route`) do not. Used in tests and the MoE experiment.

    Args:
      route_fn: maps scores ``[B, T, E]`` to expert ids ``[B, T, k]`` (any jit-able router).
      scores, perturbed_scores: ``[B, T, E]`` fp32, equal on ``[:, :prefix_length]``.
      prefix_length: number of earlier positions compared, ``1 <= prefix_length <= T``.
      token_mask: ``[B, T]`` bool or None.

    Returns:
      fp32 scalar in [0, 1].

    Raises:
      ValueError: shapes differ, ``prefix_length`` out of range, or the prefixes differ
        (checked eagerly, so call it outside ``jit``).
    """
    if scores.ndim != 3 or scores.shape != perturbed_scores.shape:
        raise ValueError(f"need equal [B, T, E] inputs; got {scores.shape=}, {perturbed_scores.shape=}")
    seq_len = scores.shape[1]
    if not 1 <= prefix_length <= seq_len:
        raise ValueError(f"prefix_length must be in [1, T={seq_len}]; got {prefix_length=}")
    if not bool(jnp.array_equal(scores[:, :prefix_length], perturbed_scores[:, :prefix_length])):
        raise ValueError("scores and perturbed_scores must agree on positions < prefix_length")
    ids_a = route_fn(scores)[:, :prefix_length]
    ids_b = route_fn(perturbed_scores)[:, :prefix_length]
    num_experts = scores.shape[-1]
    set_a = jnp.sum(jax.nn.one_hot(ids_a, num_experts, dtype=jnp.int32), axis=-2)
    set_b = jnp.sum(jax.nn.one_hot(ids_b, num_experts, dtype=jnp.int32), axis=-2)
    changed = jnp.any(set_a != set_b, axis=-1)
    if token_mask is None:
        valid = jnp.ones(changed.shape, jnp.bool_)
    else:
        valid = token_mask[:, :prefix_length].astype(jnp.bool_)
    return jnp.sum(changed & valid).astype(jnp.float32) / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# One interface for every method.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BalancingConfig:
    """Load-balancing method and its hyper-parameters (frozen; see module docstring for sources).

    Attributes:
      method: one of ``BALANCING_METHODS``.
      aux_loss_alpha: α >= 0 of ``"aux_loss"`` / ``"seq_aux_loss"``; None = 1e-2 (Switch) / 1e-4
        (DeepSeek-V3 sequence-wise).
      loss_free_gamma: γ >= 0 of ``"loss_free"`` (1e-3).
      quantile_estimator: ``"exact"`` or ``"histogram"`` for ``"quantile"``.
      histogram_bins: bins of the histogram estimator (K3: 1000).
      histogram_passes: 1 (K3) or 2 (a refinement histogram inside the quantile's bin: bins² resolution).
      quantile_iterations: n >= 1 dual steps of ``"quantile"`` on the step's scores (1 = K3/Su: one
        closed-form step). Step i recomputes every token's cutoff under the bias of step i−1 and solves
        the quantiles again; the result is still applied at the NEXT step (causal). One QB step is a
        Jacobi step of the dual (all cutoffs move once every bias moves): on one 16k-token batch,
        E = 32, top-4, MaxVio 5.49 → 0.65 after one step, 0.03 after eight
        (experiments/results/qb_convergence.md). Each extra step costs one top-(k+1) and one quantile
        (with the histogram estimator, its psum too).
      ema: None, or β in [0, 1): ``"quantile"`` then returns ``β·b + (1−β)·b_new``.
      high_percentile, low_percentile: ``"quantile_threshold"`` load percentiles (seed: 95 / 5).
      tolerance: ``"quantile_threshold"`` absolute relative-load tolerance.
      window: ``"quantile_threshold"`` sliding window length in steps (≥ 1).
      priority_boost: ``"quantile_threshold"`` score boost for underloaded experts.
    """

    method: str = "none"
    aux_loss_alpha: float | None = None
    loss_free_gamma: float = 1e-3
    quantile_estimator: str = "exact"
    histogram_bins: int = 1000
    histogram_passes: int = 1
    quantile_iterations: int = 1
    ema: float | None = None
    high_percentile: float = 95.0
    low_percentile: float = 5.0
    tolerance: float = 0.05
    window: int = 8
    priority_boost: float = 0.05

    def __post_init__(self):
        if self.method not in BALANCING_METHODS:
            raise ValueError(f"method must be one of {BALANCING_METHODS}; got method={self.method!r}")
        _check_gamma(self.loss_free_gamma, "loss_free_gamma")
        if self.aux_loss_alpha is not None:
            _check_gamma(self.aux_loss_alpha, "aux_loss_alpha")
        if self.quantile_estimator not in QUANTILE_ESTIMATORS:
            raise ValueError(
                f"quantile_estimator must be one of {QUANTILE_ESTIMATORS}; got {self.quantile_estimator=}"
            )
        if not _is_int(self.histogram_bins) or self.histogram_bins < 1:
            raise ValueError(f"histogram_bins must be an int >= 1; got {self.histogram_bins=}")
        if not _is_int(self.histogram_passes) or self.histogram_passes not in HISTOGRAM_PASSES:
            raise ValueError(f"histogram_passes must be one of {HISTOGRAM_PASSES}; got {self.histogram_passes=}")
        if not _is_int(self.quantile_iterations) or self.quantile_iterations < 1:
            raise ValueError(f"quantile_iterations must be an int >= 1; got {self.quantile_iterations=}")
        if self.ema is not None and not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be None or in [0, 1); got {self.ema=}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1; got {self.window=}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0; got {self.tolerance=}")
        if not 0.0 <= self.low_percentile <= self.high_percentile <= 100.0:
            raise ValueError(f"need 0 <= low <= high <= 100; got {self.low_percentile=}, {self.high_percentile=}")

    @property
    def alpha(self) -> float:
        """The auxiliary-loss coefficient actually used."""
        if self.aux_loss_alpha is not None:
            return self.aux_loss_alpha
        return 1e-4 if self.method == "seq_aux_loss" else 1e-2

    @property
    def uses_bias(self) -> bool:
        """True for methods whose selection bias moves between steps."""
        return self.method in ("loss_free", "quantile")


def init_balancing_state(config: BalancingConfig, num_experts: int) -> dict[str, jax.Array] | None:
    """Initial cross-step state: ``{"window_loads": [W, E] fp32 zeros, "filled": int32 0}`` for
    ``"quantile_threshold"``, else None (the EMA of ``"quantile"`` lives in the bias itself)."""
    if config.method != "quantile_threshold":
        return None
    return {
        "window_loads": jnp.zeros((config.window, num_experts), jnp.float32),
        "filled": jnp.zeros((), jnp.int32),
    }


class BalanceOutput(NamedTuple):
    """Output of :func:`balance`: ``loss`` fp32 scalar (0 if none), ``stats`` dict of fp32 arrays
    (``loads, max_vio, cv, dead_experts, entropy, diverted_fraction``), ``next_bias [E]`` fp32 (to
    use at the NEXT step), ``next_state`` (pytree or None)."""

    loss: jax.Array
    stats: dict[str, jax.Array]
    next_bias: jax.Array
    next_state: Any


def balance(
    config: BalancingConfig,
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

    ``routing`` must come from :func:`route` with the same ``bias`` (or, for
    ``"quantile_threshold"``, from :func:`threshold_route`, whose ``demand_loads`` are passed here).
    The bias/state returned are for the NEXT step; nothing here mutates anything.

    - ``"none"``: loss 0, bias unchanged.
    - ``"aux_loss"`` / ``"seq_aux_loss"``: :func:`aux_loss` / :func:`seq_aux_loss` (needs
      ``sequence_length``), bias unchanged.
    - ``"loss_free"``: ``bias + loss_free_update(global loads, γ)``.
    - ``"quantile"``: :func:`quantile_margins` → :func:`quantile_bias`, ``quantile_iterations`` times
      (optional EMA).
    - ``"quantile_threshold"``: bias unchanged (zero); the window gets this step's demand fractions.

    Args:
      config: :class:`BalancingConfig`. scores: ``[N, E]`` fp32 (differentiable for aux losses).
      routing: this step's :class:`Routing`. bias: ``[E]`` fp32 bias used for ``routing``.
      state: :func:`init_balancing_state` pytree or None. score_func: ``"softmax"``/``"sigmoid"``.
      token_mask: ``[N]`` bool; padding (False) is excluded from every statistic.
      sequence_length: T for ``"seq_aux_loss"``. demand_loads: ``[E]`` from :func:`threshold_route`.
      axis_names: mesh axes the tokens are sharded over (all counts psum'ed over them).

    Returns:
      :class:`BalanceOutput`.

    Raises:
      ValueError: missing ``sequence_length`` / ``state`` / ``demand_loads`` for the method, bad shapes
        (``routing`` for other tokens than ``scores``).
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    _check_bias(bias, num_experts)
    _check_routing(routing, num_tokens, num_experts)
    bias = jnp.asarray(bias, jnp.float32)
    loads = expert_loads(routing.expert_ids, num_experts, token_mask=token_mask, axis_names=axis_names)
    stats = load_stats(loads)
    if routing.diverted is not None:
        mask = _token_mask(token_mask, num_tokens).astype(jnp.float32)
        n_div = _psum(jnp.sum(routing.diverted.astype(jnp.float32) * mask[:, None]), axis_names)
        n_all = _psum(jnp.sum(mask), axis_names) * routing.expert_ids.shape[-1]
        stats["diverted_fraction"] = n_div / jnp.maximum(n_all, 1.0)
    else:
        stats["diverted_fraction"] = jnp.float32(0.0)
    loss = jnp.float32(0.0)
    next_bias = bias
    next_state = state
    method = config.method
    if method == "aux_loss":
        loss = aux_loss(
            scores, routing.expert_ids, alpha=config.alpha, score_func=score_func,
            token_mask=token_mask, axis_names=axis_names,
        )
    elif method == "seq_aux_loss":
        if sequence_length is None:
            raise ValueError("seq_aux_loss needs sequence_length")
        loss = seq_aux_loss(
            scores, routing.expert_ids, sequence_length, alpha=config.alpha, score_func=score_func,
            token_mask=token_mask, axis_names=axis_names,
        )
    elif method == "loss_free":
        next_bias = bias + loss_free_update(loads, config.loss_free_gamma)
    elif method == "quantile":
        top_k = routing.expert_ids.shape[-1]
        margins = quantile_margins(scores, routing)
        new = bias
        for step in range(config.quantile_iterations):
            if step:  # the cutoffs under the previous dual step's bias (route's (k+1)-th biased score)
                biased = jax.lax.stop_gradient(scores.astype(jnp.float32) + new[None, :])
                cutoff = jax.lax.top_k(biased, top_k + 1)[0][:, top_k]
                margins = quantile_margins(scores, routing._replace(cutoff=cutoff))
            new = quantile_bias(
                margins, top_k, bias=new, token_mask=token_mask,
                estimator=config.quantile_estimator, histogram_bins=config.histogram_bins,
                histogram_passes=config.histogram_passes, axis_names=axis_names,
            )
        next_bias = new if config.ema is None else config.ema * bias + (1.0 - config.ema) * new
    elif method == "quantile_threshold":
        if state is None or demand_loads is None:
            raise ValueError("quantile_threshold needs state (init_balancing_state) and demand_loads")
        frac = demand_loads / jnp.maximum(jnp.sum(demand_loads), 1.0)
        window = jnp.roll(state["window_loads"], 1, axis=0).at[0].set(frac)
        next_state = {"window_loads": window, "filled": jnp.minimum(state["filled"] + 1, window.shape[0])}
    return BalanceOutput(loss=loss, stats=stats, next_bias=jax.lax.stop_gradient(next_bias), next_state=next_state)
