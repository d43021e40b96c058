"""Quantile Balancing's bias: the per-token margins and per-expert quantile estimators.

Quantile Balancing (Su, kexue.fm/archives/11619; Kimi K3 report §2.3.3 and App. D) sets expert j's
selection bias to the k/E quantile of the margins ``r_ij = α_i − s_ij`` (``α_i`` the (k+1)-th biased
score of token i), the closed-form dual solution of the balanced-assignment LP, centred. Two estimators:
``"exact"`` (radix select; psums of counts inside ``shard_map``) and ``"histogram"`` (K3 App. D: one
int32 ``[E, bins]`` histogram and one ``psum``; ``histogram_passes=2`` adds a refinement histogram).
The balancing step that uses them is :class:`k3jax.ops.balancing.QuantileBalancing`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from k3jax.ops._moe_common import check_bias, check_routing, check_scores, is_int, psum, token_mask_or_all
from k3jax.ops.routing import Routing

QUANTILE_ESTIMATORS = ("exact", "histogram")
HISTOGRAM_PASSES = (1, 2)

__all__ = ["HISTOGRAM_PASSES", "QUANTILE_ESTIMATORS", "exact_quantile", "histogram_quantile", "quantile_bias",
           "quantile_margins"]


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
    check_scores(scores)
    check_routing(routing, *scores.shape)
    if routing.cutoff is None:
        raise ValueError("quantile balancing needs top_k < E (routing.cutoff is None)")
    r = routing.cutoff[:, None].astype(jnp.float32) - scores.astype(jnp.float32)
    return jax.lax.stop_gradient(r)


def _sortable_key(x: jax.Array) -> jax.Array:
    """fp32 -> uint32 keys in ascending order: negatives have every bit flipped, non-negatives only the
    sign bit. Every NaN is made the positive quiet NaN first, so NaNs sort last as in ``jnp.sort``
    (x86 produces sign-bit NaNs, e.g. ``inf - inf``). ``-0.0`` sorts just below ``+0.0`` (``jnp.sort``
    keeps them in input order); the interpolated quantile is the same value either way."""
    x = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), x.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    """Inverse of :func:`_sortable_key`."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _select(keys: jax.Array, rank: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    """Per column of ``keys [N, E]`` uint32 the key of 0-based ``rank`` in ascending order (radix select:
    one bit per pass from the top, each pass one count per column, psum'ed over ``axis_names``)."""
    found = jnp.zeros(keys.shape[1:], jnp.uint32)
    for bit in range(31, -1, -1):  # invariant: fewer than rank + 1 keys lie below `found`
        trial = found | jnp.uint32(1 << bit)
        below = psum(jnp.sum((keys < trial).astype(jnp.int32), axis=0), axis_names)
        found = jnp.where(below <= rank, trial, found)
    return found


def exact_quantile(
    margins: jax.Array, mask: jax.Array, level: float, axis_names: Sequence[str] = ()
) -> tuple[jax.Array, jax.Array]:
    """Per-column linear-interpolation quantile at ``level`` of the valid rows of ``margins [N, E]``
    (numpy's "linear"). Returns ``(value [E] fp32, any_valid bool scalar)``; with no valid row the
    value is NaN and ``any_valid`` False.

    The two order statistics it interpolates are found by radix select on order-preserving uint32 keys
    (32 passes, each an int32 count per column), not by sorting: the values of a ``jnp.sort`` of the
    valid rows, bit for bit (NaNs last), from 32 column reductions instead of a sort along the tokens.
    Inside shard_map the counts are psum'ed over ``axis_names`` (33 int32 ``[E]`` psums, one scalar psum
    and one pmin) instead of all-gathering the margins."""
    keys = jnp.where(mask[:, None], _sortable_key(margins), jnp.uint32(0xFFFFFFFF))  # invalid rows last
    # every pass must read the same keys: without the barrier XLA may recompute the margins (softmax and
    # all) inside each counting fusion, with rounding that differs between fusions
    keys = jax.lax.optimization_barrier(keys)
    n = psum(jnp.sum(mask.astype(jnp.int32)), axis_names)
    pos = jnp.float32(level) * (jnp.maximum(n, 1) - 1).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n, 1) - 1)
    frac = pos - lo.astype(jnp.float32)
    key_lo = _select(keys, lo, axis_names)
    # rank hi is key_lo again if more than hi keys are <= key_lo (ties), else the next larger key
    at_most = psum(jnp.sum((keys <= key_lo).astype(jnp.int32), axis=0), axis_names)
    larger = jnp.min(jnp.where(keys > key_lo, keys, jnp.uint32(0xFFFFFFFF)), axis=0)
    if axis_names:
        larger = jax.lax.pmin(larger, tuple(axis_names))
    key_hi = jnp.where(at_most > hi, key_lo, larger)
    v_lo, v_hi = _key_value(key_lo), _key_value(key_hi)
    value = v_lo + frac * (v_hi - v_lo)
    return value, n > 0


def _histogram_counts(idx: jax.Array, weights: jax.Array, bins: int, axis_names: Sequence[str]) -> jax.Array:
    """int32 ``[E, bins]`` counts of bin indices ``idx [N, E]`` with int32 ``weights [N, E]``, psum'ed."""
    num_experts = idx.shape[1]
    flat = (jnp.arange(num_experts, dtype=jnp.int32)[None, :] * bins + idx).reshape(-1)
    counts = jnp.zeros((num_experts * bins,), jnp.int32).at[flat].add(weights.reshape(-1))
    return psum(counts.reshape(num_experts, bins), axis_names)


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


def histogram_quantile(
    margins: jax.Array,
    mask: jax.Array,
    level: float,
    lo: jax.Array,
    hi: jax.Array,
    bins: int,
    axis_names: Sequence[str],
    passes: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Histogram estimate of :func:`exact_quantile` over ``[lo, hi]`` with ``bins`` int32 bins per column
    (K3 App. D), counts psum'ed over ``axis_names``; ``passes=2`` re-bins the quantile's bin into ``bins``
    sub-bins (one more psum). Returns ``(value [E] fp32, any_valid [E] bool)``; see :func:`quantile_bias`."""
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
      token_mask: ``[N]`` bool, padding excluded. estimator: ``"exact"`` (radix select; inside shard_map
        33 psums of ``[E]`` counts over ``axis_names``) or ``"histogram"``.
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
    check_scores(margins, "margins")
    num_tokens, num_experts = margins.shape
    if not is_int(top_k) or not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}) (level top_k / E of the quantile); "
                         f"got {top_k=}")
    check_bias(bias, num_experts)
    if estimator not in QUANTILE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {QUANTILE_ESTIMATORS}; got {estimator=}")
    if not is_int(histogram_bins) or histogram_bins < 1:
        raise ValueError(f"histogram_bins must be an int >= 1; got {histogram_bins=}")
    if not is_int(histogram_passes) or histogram_passes not in HISTOGRAM_PASSES:
        raise ValueError(f"histogram_passes must be one of {HISTOGRAM_PASSES}; got {histogram_passes=}")
    mask = token_mask_or_all(token_mask, num_tokens)
    level = top_k / num_experts
    margins = jax.lax.stop_gradient(margins.astype(jnp.float32))
    bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
    if estimator == "exact":
        b_hat, ok = exact_quantile(margins, mask, level, axis_names)
    else:  # range [min b - 1, max b + 1] holds every margin (scores in [0, 1]); no communication
        b_hat, ok = histogram_quantile(margins, mask, level, jnp.min(bias) - 1.0, jnp.max(bias) + 1.0,
                                       histogram_bins, axis_names, histogram_passes)
    b_hat = jnp.where(ok, b_hat, bias)
    return b_hat - jnp.mean(b_hat) if center else b_hat
