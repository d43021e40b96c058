"""The seed article's literal "quantile balancing": same-step threshold diversion, and its leakage.

The seed article describes routing that, within one step, diverts tokens away from experts above a
high load percentile and boosts experts below a low one, smoothed over a sliding window with adaptive
thresholds. No public implementation exists; :func:`threshold_route` is our literal reading (see
/work/shared/ANCHORS.md and docs/moe.md). It is NOT the K3 method (:mod:`k3jax.ops.quantile`) and it is
not causal: a token's experts depend on later tokens of the same step. :func:`causal_leakage` measures
that for any router. The balancing entry is :class:`k3jax.ops.balancing.QuantileThreshold`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from k3jax.ops._moe_common import check_scores, gather_tokens, psum, token_mask_or_all
from k3jax.ops.balance_metrics import expert_loads
from k3jax.ops.routing import SCORE_FUNCS, Routing, gate_weights

__all__ = ["causal_leakage", "init_threshold_state", "threshold_route", "update_threshold_state"]


def init_threshold_state(window: int, num_experts: int) -> dict[str, jax.Array]:
    """Empty sliding window: ``{"window_loads": [window, E] fp32 zeros, "filled": int32 0}``.

    Raises:
      ValueError: ``window < 1`` or ``num_experts < 1``.
    """
    if window < 1 or num_experts < 1:
        raise ValueError(f"window and num_experts must be >= 1; got {window=}, {num_experts=}")
    return {"window_loads": jnp.zeros((window, num_experts), jnp.float32), "filled": jnp.zeros((), jnp.int32)}


def update_threshold_state(state: dict[str, jax.Array], demand_loads: jax.Array) -> dict[str, jax.Array]:
    """Push this step's demand fractions ``D / ΣD`` (``demand_loads [E]`` from :func:`threshold_route`)
    into the window, newest first; ``filled`` counts the valid rows (at most the window length)."""
    frac = demand_loads / jnp.maximum(jnp.sum(demand_loads), 1.0)
    window = jnp.roll(state["window_loads"], 1, axis=0).at[0].set(frac)
    return {"window_loads": window, "filled": jnp.minimum(state["filled"] + 1, window.shape[0])}


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
        (:func:`init_threshold_state`).
      high_percentile, low_percentile: percentiles in [0, 100] (seed: 95 / 5).
      tolerance: absolute relative-load tolerance (≥ 0). priority_boost: score added to underloaded
        experts (score units, scores ∈ [0, 1]).
      score_func, routed_scaling_factor, renormalize: as in :func:`route`.
      token_mask: ``[N]`` bool (padding neither counts nor takes capacity). axis_names: mesh axes.

    Returns:
      ``(routing, demand_loads)``: :class:`Routing` with ``diverted [N, k]`` set (``cutoff`` None),
      and the ``[E]`` fp32 pre-diversion demand loads (for :func:`update_threshold_state`).

    Raises:
      ValueError: bad shapes, ``top_k`` not in [1, E), percentiles out of range, negative tolerance.
    """
    check_scores(scores)
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}) for threshold routing; got {top_k=}")
    if not 0.0 <= low_percentile <= high_percentile <= 100.0:
        raise ValueError(f"need 0 <= low <= high <= 100; got {low_percentile=}, {high_percentile=}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0; got {tolerance=}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}; got {score_func=}")
    mask = token_mask_or_all(token_mask, num_tokens)
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
    n_valid = psum(jnp.sum(mask.astype(jnp.float32)), axis_names)
    cap = jnp.floor(theta_hi * n_valid * top_k / num_experts)

    def shed_pass(carry):
        ids, full, _, passes = carry
        one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * mask[:, None, None]  # [N, k, E]
        local = jnp.sum(one_hot, axis=(0, 1))
        received = psum(local, axis_names).astype(jnp.float32)
        full = full | (received > cap)
        position = jnp.cumsum(one_hot.reshape(-1, num_experts), axis=0).reshape(one_hot.shape) - 1
        if axis_names:  # rows on earlier devices come first
            counts = gather_tokens(local[None], axis_names)  # [P, E]
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
        moved = psum(jnp.sum(has_repl.astype(jnp.int32)), axis_names)
        return jnp.where(has_repl, repl, ids).astype(jnp.int32), full, moved, passes + 1

    carry = shed_pass((chosen, over, jnp.int32(0), jnp.int32(0)))
    expert_ids, *_ = jax.lax.while_loop(
        lambda c: (c[2] > 0) & (c[3] < num_experts + 1), shed_pass, carry)
    plain_ids = demand_ids.astype(jnp.int32)
    diverted = jnp.all(expert_ids[:, :, None] != plain_ids[:, None, :], axis=-1) & mask[:, None]
    weights = gate_weights(scores, expert_ids, routed_scaling_factor, renormalize)
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
