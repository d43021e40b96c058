"""Load-balance metrics of a routing: per-expert loads, MaxVio, CV, dead experts, entropy (fp32).

``expert_loads`` counts (token, slot) assignments per expert; with ``axis_names`` (inside
``jax.shard_map``, tokens sharded over those mesh axes) the counts are ``psum``-ed so every device sees
the global load. MaxVio is Wang et al. 2024 (arXiv 2408.15664); the others are standard statistics.
``check_values=True`` adds a ``checkify`` check of the ids (see :mod:`k3jax.ops.routing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from k3jax.ops._moe_common import is_int, psum, token_mask_or_all

__all__ = ["dead_experts", "expert_loads", "load_cv", "load_entropy", "load_stats", "max_vio", "max_vio_global"]


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
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1; got {num_experts=}")
    if check_values:
        valid = token_mask_or_all(token_mask, expert_ids.shape[0])[:, None]
        bad = jnp.sum(valid & ((expert_ids < 0) | (expert_ids >= num_experts)))
        checkify.check(bad == 0, f"expert_loads: expert_ids must be in [0, num_experts={num_experts}); got "
                       "{bad} ids outside it (max id {top})", bad=bad, top=jnp.max(expert_ids))
    mask = token_mask_or_all(token_mask, expert_ids.shape[0])
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [N, k, E]
    loads = jnp.sum(one_hot * mask[:, None, None].astype(jnp.float32), axis=(0, 1))
    return psum(loads, axis_names)


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
