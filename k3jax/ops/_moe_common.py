"""Checks and collectives shared by the routing, balancing, quantile and metrics modules (internal)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import checkify


def is_int(value) -> bool:
    """A python/numpy integer, not a bool (True == 1 must not pass as a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_scores(scores: jax.Array, name: str = "scores") -> None:
    if scores.ndim != 2:
        raise ValueError(f"{name} must be [N, E]; got {name}.shape={scores.shape}")


def check_bias(bias: jax.Array, num_experts: int) -> None:
    if bias.shape != (num_experts,):
        raise ValueError(f"bias must be [E] with E={num_experts}; got {bias.shape=}")


def check_nonnegative(value, name: str) -> None:
    """A Python/numpy number must be finite and >= 0 (a jax array is not checked)."""
    if isinstance(value, numbers.Real) and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {name}={value!r}")


def check_routing(routing, num_tokens: int, num_experts: int) -> None:
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


def check_finite(x: jax.Array, name: str, where: str) -> None:
    """checkify check that every value of ``x`` is finite (message names ``where`` and ``name``)."""
    bad = jnp.sum(~jnp.isfinite(x))
    checkify.check(bad == 0, f"{where}: {name} must be finite; got {{bad}} NaN/inf values of {x.size}", bad=bad)


def token_mask_or_all(token_mask: jax.Array | None, num_tokens: int) -> jax.Array:
    """``[N]`` bool mask (all True when ``token_mask`` is None)."""
    if token_mask is None:
        return jnp.ones((num_tokens,), jnp.bool_)
    if token_mask.shape != (num_tokens,):
        raise ValueError(f"token_mask must be [N] with N={num_tokens}; got {token_mask.shape=}")
    return token_mask.astype(jnp.bool_)


def psum(x: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    return jax.lax.psum(x, tuple(axis_names)) if axis_names else x


def gather_tokens(x: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    """All-gather ``x [n, ...]`` along dim 0 over ``axis_names`` in device order (first axis major),
    as a psum of zero-padded slots so the result is device-invariant (shard_map's vma check)."""
    size = math.prod(jax.lax.axis_size(a) for a in axis_names)
    index = jax.lax.axis_index(tuple(axis_names))
    buf = jnp.zeros((size,) + x.shape, x.dtype).at[index].set(x)
    return jax.lax.psum(buf, tuple(axis_names)).reshape((size * x.shape[0],) + x.shape[1:])
