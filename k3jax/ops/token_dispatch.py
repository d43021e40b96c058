"""Token dispatch for MoE: permute / combine, dropless, capacity-factor and expert-parallel dispatch.

Notation: N tokens, model width D, expert width F, E experts, top_k = k, capacity C. A routing is
``expert_ids [N, k]`` int32 and ``weights [N, k]`` fp32 (:func:`k3jax.ops.routing.route`).

Dropless (MegaBlocks, Gale et al. 2022; the ``ragged_dot`` formulation of MaxText / Marin): the N·k
(token, slot) rows are stably sorted by expert (:func:`permute`), each expert's contiguous group is
multiplied by its own weights in grouped matmuls (:func:`k3jax.ops.grouped_matmul.grouped_matmul`),
each row's gate weight scales its SwiGLU hidden activation, and the rows are put back and summed.
Nothing is dropped. :func:`combine` is the same un-permute with the weights applied to the outputs.

Capacity dispatch (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021 §2.2): every expert has
``C = ceil(capacity_factor · N · k / E)`` slots (N = token rows, static); (token, slot) rows claim
them in token order (row-major over ``[N, k]``: token 0 slot 0, token 0 slot 1, ..., token 1 slot 0,
...); rows past C are dropped and contribute ZERO, so the token passes through the residual
connection unchanged by that expert. Padding tokens never take capacity.

Expert parallelism (:func:`expert_parallel_dropless_moe`, inside ``jax.shard_map``): dropless, with
the experts sharded over a mesh axis and the rows exchanged by ``all_to_all``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped_matmul import grouped_matmul

__all__ = [
    "CapacityDispatch",
    "Permutation",
    "capacity_dispatch",
    "capacity_moe",
    "combine",
    "dropless_moe",
    "expert_parallel_dropless_moe",
    "grouped_swiglu",
    "permute",
]


class Permutation(NamedTuple):
    """Sorted-by-expert layout of the N·k (token, slot) rows.

    Attributes:
      order: ``[N·k]`` int32, flat row index (``token·k + slot``) of each sorted row (stable sort).
      group_sizes: ``[E]`` int32 rows per expert.
      inverse: ``[N·k]`` int32, the sorted position of each flat row (``order[inverse] = arange``).
    """

    order: jax.Array
    group_sizes: jax.Array
    inverse: jax.Array


def _no_cotangent(a) -> np.ndarray:
    """The cotangent of an integer input of a custom VJP (float0 zeros of its shape)."""
    return np.zeros(a.shape, jax.dtypes.float0)


def _gather_sum(y: jax.Array, index: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """``out[n] = Σ_j w[n, j] · y[index[n, j]]`` in fp32 (``w = 1`` when weights is None); index ``[N, k]``.

    One gather per slot, summed in order, so XLA fuses the k gathers and the sum into one pass over
    ``[N, D]`` instead of materialising ``[N, k, D]``."""
    total = None
    for j in range(index.shape[1]):
        row = jnp.take(y, index[:, j], axis=0).astype(jnp.float32)
        if weights is not None:
            row = row * weights[:, j:j + 1].astype(jnp.float32)
        total = row if total is None else total + row
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, order, inverse, top_k):
    """``x_sorted[s] = x[order[s] // k]``: the k copies of every token in expert order ``[N·k, D]``;
    the gradient gathers each token's k rows back and sums them (no scatter-add)."""
    return jnp.take(x, order // top_k, axis=0)


def _dispatch_fwd(x, order, inverse, top_k):
    return _dispatch(x, order, inverse, top_k), (inverse, jnp.zeros((0,), x.dtype))


def _dispatch_bwd(top_k, res, g):
    inverse, like = res  # order has inverse's shape
    dx = _gather_sum(g, inverse.reshape(-1, top_k)).astype(like.dtype)
    return dx, _no_cotangent(inverse), _no_cotangent(inverse)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _weighted_combine(y_sorted, weights, order, inverse):
    """``y[n] = Σ_j weights[n, j] · y_sorted[inverse[n·k + j]]`` (fp32 ``[N, D]``); the gradients are
    gathers and row sums (no scatter-add)."""
    return _gather_sum(y_sorted, inverse.reshape(weights.shape), weights)


def _weighted_combine_fwd(y_sorted, weights, order, inverse):
    return _weighted_combine(y_sorted, weights, order, inverse), (y_sorted, weights, order, inverse)


def _weighted_combine_bwd(res, g):
    y_sorted, weights, order, inverse = res
    top_k = weights.shape[1]
    g = g.astype(jnp.float32)
    w_sorted = jnp.take(weights.reshape(-1).astype(jnp.float32), order)
    dy_sorted = (jnp.take(g, order // top_k, axis=0) * w_sorted[:, None]).astype(y_sorted.dtype)
    index = inverse.reshape(weights.shape)
    dweights = jnp.stack([jnp.sum(jnp.take(y_sorted, index[:, j], axis=0).astype(jnp.float32) * g, axis=-1)
                          for j in range(top_k)], axis=1).astype(weights.dtype)
    return dy_sorted, dweights, _no_cotangent(order), _no_cotangent(inverse)


_weighted_combine.defvjp(_weighted_combine_fwd, _weighted_combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_rows(y_sorted, order, inverse, top_k):
    """``y[n] = Σ_j y_sorted[inverse[n·k + j]]`` (fp32 ``[N, D]``), the transpose of :func:`_dispatch`;
    its gradient is one gather through ``order``."""
    return _gather_sum(y_sorted, inverse.reshape(-1, top_k))


def _combine_rows_fwd(y_sorted, order, inverse, top_k):
    return _combine_rows(y_sorted, order, inverse, top_k), (order, jnp.zeros((0,), y_sorted.dtype))


def _combine_rows_bwd(top_k, res, g):
    order, like = res
    dy_sorted = jnp.take(g, order // top_k, axis=0).astype(like.dtype)
    return dy_sorted, _no_cotangent(order), _no_cotangent(order)


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


@jax.custom_vjp
def _sort_rows(v, order, inverse):
    """``v[order]`` for a permutation ``order`` (``inverse`` its inverse); the gradient gathers through
    ``inverse`` instead of scatter-adding."""
    return jnp.take(v, order, axis=0)


def _sort_rows_fwd(v, order, inverse):
    return _sort_rows(v, order, inverse), (order, inverse)


def _sort_rows_bwd(res, g):
    order, inverse = res
    return jnp.take(g, inverse, axis=0), _no_cotangent(order), _no_cotangent(inverse)


_sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


def permute(x: jax.Array, expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, Permutation]:
    """Copy each token once per selected expert and sort the copies by expert (stable: token order
    inside an expert).

    Sorts and gathers only (no scatter in the forward or the backward): one stable sort of the ids gives
    the order, a second sort its inverse, a binary search of the sorted ids the group sizes; the copies
    are one gather from ``x`` (row ``s`` reads token ``order[s] // k``) whose gradient gathers each
    token's k rows and sums them in fp32 (jla's gather-only ``dispatch_rows`` formulation).

    Args:
      x: ``[N, D]`` tokens. expert_ids: ``[N, k]`` int in ``[0, E)``. num_experts: E.

    Returns:
      ``(x_sorted [N·k, D], Permutation)``.

    Raises:
      ValueError: shapes inconsistent.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"need x [N, D] and expert_ids [N, k]; got {x.shape=}, {expert_ids.shape=}")
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    rows = jnp.arange(flat.shape[0], dtype=jnp.int32)
    sorted_ids, order = jax.lax.sort((flat, rows), num_keys=1, is_stable=True)
    _, inverse = jax.lax.sort((order, rows), num_keys=1)
    bounds = jnp.searchsorted(sorted_ids, jnp.arange(num_experts + 1, dtype=jnp.int32), side="left")
    group_sizes = jnp.diff(bounds).astype(jnp.int32)
    x_sorted = _dispatch(x, order, inverse, top_k)
    return x_sorted, Permutation(order=order, group_sizes=group_sizes, inverse=inverse)


def combine(y_sorted: jax.Array, perm: Permutation, weights: jax.Array) -> jax.Array:
    """Inverse of :func:`permute` plus the weighted sum over the k slots (in fp32); gathers only: one
    fused pass of k gathers forward; backward ``d y_sorted`` gathers the token cotangents through
    ``order`` and ``d weights`` is a row dot of the gathered rows.

    Args:
      y_sorted: ``[N·k, D]`` expert outputs in sorted order. perm: from :func:`permute`.
      weights: ``[N, k]`` gate weights.

    Returns:
      ``[N, D]`` fp32, ``y_i = Σ_s w_is · y_sorted[row of (i, s)]``.
    """
    return _weighted_combine(y_sorted, weights, perm.order, perm.inverse)


def grouped_swiglu(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    implementation: str | None = None,
    full_groups: bool = False,
    out_dtype=jnp.float32,
    row_weights: jax.Array | None = None,
) -> jax.Array:
    """SwiGLU experts on expert-sorted rows: ``(silu(x W_g) ⊙ x W_u) W_d`` per group (Shazeer 2020).

    Args:
      x_sorted: ``[M, D]``; group_sizes ``[E]``; w_gate, w_up ``[E, D, F]``; w_down ``[E, F, D]``, all
        in the compute dtype (bf16 in training). Matmuls accumulate in fp32; the hidden activation is
        cast back to the compute dtype before the down projection.
      implementation, full_groups: passed to :func:`grouped_matmul` (``full_groups``: the caller
        promises ``sum(group_sizes) == M``).
      out_dtype: dtype of the down projection's output (`preferred_element_type` of the grouped matmul;
        the "jla" kernels accumulate in fp32 and return the compute dtype, so fp32 there is a cast up).
      row_weights: ``[M]`` fp32 or None; scales each row's hidden activation before the down
        projection (which is linear, so this equals scaling the output row). Dropless MoE passes the
        gate weights here: the weight and its gradient fuse into the SwiGLU elementwise pass instead of
        a separate pass over the ``[M, D]`` outputs.

    Returns:
      ``[M, D]`` in ``out_dtype``.

    The gate and up projections run as one grouped matmul against ``[W_g | W_u]`` (``[E, D, 2F]``), so
    the rows are read once forward and the backward forms one ``d x``.

    Raises:
      ValueError: ``w_gate`` and ``w_up`` of different shapes; ``row_weights`` not ``[M]``; from :func:`grouped_matmul` (ranks/shapes
        that do not chain, non-integer ``group_sizes``, an ``implementation`` unknown or not supporting the call).
    """
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must have one shape [E, D, F]; got {w_gate.shape=}, {w_up.shape=}")
    gmm = functools.partial(grouped_matmul, implementation=implementation, full_groups=full_groups)
    f = w_gate.shape[-1]
    gu = gmm(x_sorted, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes)
    h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
    if row_weights is not None:
        if row_weights.shape != (x_sorted.shape[0],):
            raise ValueError(f"row_weights must be [M] = [{x_sorted.shape[0]}]; got {row_weights.shape}")
        h = h * row_weights.astype(jnp.float32)[:, None]
    h = h.astype(x_sorted.dtype)
    return gmm(h, w_down, group_sizes, preferred_element_type=out_dtype)


def dropless_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """Dropless MoE SwiGLU: ``y_i = Σ_s w_is · FFN_{e_is}(x_i)`` via permute → grouped matmuls (each row's
    gate weight scaling its hidden activation) → un-permute and sum of the k rows.

    Args:
      x: ``[N, D]`` tokens (compute dtype). expert_ids: ``[N, k]`` int32 in ``[0, E)`` (every row then
        lands in a group, so the grouped matmuls run with ``full_groups=True``; an id outside that range
        gives its row an unspecified output with the "jla" kernels). weights: ``[N, k]`` fp32.
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]`` (compute dtype).
      implementation: grouped-matmul implementation (see :func:`grouped_matmul`).

    Returns:
      ``[N, D]`` fp32.

    Raises:
      ValueError: ``weights`` not of ``expert_ids``' shape; from :func:`permute` (``x`` not ``[N, D]`` or
        ``expert_ids`` not ``[N, k]``) and :func:`grouped_matmul` (weights that do not chain, an
        ``implementation`` that cannot run).

    Source: the dropless (no capacity, no token dropping) MoE of MegaBlocks (Gale et al. 2022,
    arXiv 2211.15841) as a sort by expert + grouped GEMMs + un-permute.
    """
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights must have expert_ids' shape [N, k] = {expert_ids.shape}; got {weights.shape}")
    num_experts = w_gate.shape[0]
    x_sorted, perm = permute(x, expert_ids, num_experts)
    top_k = expert_ids.shape[1]
    # gate weights scale the hidden activation (their gradient is a row dot over F inside the SwiGLU
    # pass), so the un-permute is a plain sum of the k rows
    w_sorted = _sort_rows(weights.reshape(-1).astype(jnp.float32), perm.order, perm.inverse)
    # permute's group sizes count every one of the N·k rows: the groups are full.
    # expert outputs in the compute dtype: the permutation gathers (and their cotangents) move half the
    # bytes; the k slots are summed in fp32
    y_sorted = grouped_swiglu(x_sorted, perm.group_sizes, w_gate, w_up, w_down, implementation=implementation,
                              full_groups=True, out_dtype=x.dtype, row_weights=w_sorted)
    return _combine_rows(y_sorted, perm.order, perm.inverse, top_k)


class CapacityDispatch(NamedTuple):
    """Capacity assignment of the ``[N, k]`` (token, slot) rows.

    Attributes:
      position: ``[N, k]`` int32 rank of the row in its expert's queue (token order).
      kept: ``[N, k]`` bool, row is valid and ``position < capacity``.
      capacity: C (python int).
      dropped_fraction: fp32 scalar, dropped valid rows / valid rows (N_valid · k).
    """

    position: jax.Array
    kept: jax.Array
    capacity: int
    dropped_fraction: jax.Array


def capacity_dispatch(
    expert_ids: jax.Array,
    num_experts: int,
    capacity_factor: float,
    *,
    token_mask: jax.Array | None = None,
) -> CapacityDispatch:
    """Assign expert slots with a hard capacity; overflow rows are dropped in token order.

    ``C = ceil(capacity_factor · N · k / E)`` with N the number of token rows (static, so padding
    rows count in N but never take a slot). Drop order = row-major order of ``[N, k]`` (GShard/Switch
    "first come first served" by token position; a token's slot 0 before its slot 1).

    Args:
      expert_ids: ``[N, k]`` int. num_experts: E. capacity_factor: > 0.
      token_mask: ``[N]`` bool, False rows take no capacity and count as neither kept nor dropped.

    Returns:
      :class:`CapacityDispatch`.

    Raises:
      ValueError: ``capacity_factor <= 0`` or bad shapes.
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0; got {capacity_factor=}")
    if expert_ids.ndim != 2:
        raise ValueError(f"expert_ids must be [N, k]; got {expert_ids.shape=}")
    num_tokens, top_k = expert_ids.shape
    if token_mask is None:
        token_mask = jnp.ones((num_tokens,), jnp.bool_)
    if token_mask.shape != (num_tokens,):
        raise ValueError(f"token_mask must be [N]; got {token_mask.shape=}")
    capacity = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
    valid = jnp.broadcast_to(token_mask.astype(jnp.bool_)[:, None], expert_ids.shape)
    one_hot = jax.nn.one_hot(expert_ids.reshape(-1), num_experts, dtype=jnp.int32)
    one_hot = one_hot * valid.reshape(-1, 1)
    position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1).reshape(num_tokens, top_k)
    kept = valid & (position < capacity)
    n_valid = jnp.sum(valid.astype(jnp.float32))
    dropped = jnp.sum((valid & ~kept).astype(jnp.float32)) / jnp.maximum(n_valid, 1.0)
    return CapacityDispatch(position=position.astype(jnp.int32), kept=kept, capacity=capacity, dropped_fraction=dropped)


def capacity_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    capacity_factor: float,
    *,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MoE SwiGLU with capacity-factor dispatch: dense ``[E, C, D]`` expert buffers, batched matmuls.

    Kept rows are scattered into their expert's buffer, the experts run as one batched einsum
    (fp32 accumulation), and outputs are gathered back and combined with the gate weights; dropped
    rows contribute exactly zero (the token passes through the residual).

    Args:
      x: ``[N, D]``; expert_ids ``[N, k]``; weights ``[N, k]`` fp32; w_gate, w_up ``[E, D, F]``;
        w_down ``[E, F, D]``; capacity_factor > 0; token_mask ``[N]`` bool or None.

    Returns:
      ``(y [N, D] fp32, dropped_fraction fp32 scalar)``.
    """
    num_tokens, d_model = x.shape
    num_experts = w_gate.shape[0]
    top_k = expert_ids.shape[1]
    disp = capacity_dispatch(expert_ids, num_experts, capacity_factor, token_mask=token_mask)
    cap = disp.capacity
    trash = num_experts * cap
    dest = jnp.where(disp.kept, expert_ids * cap + disp.position, trash).reshape(-1)  # [N·k]
    rows = jnp.repeat(x, top_k, axis=0)  # [N·k, D], row = token·k + slot
    buf = jnp.zeros((trash + 1, d_model), x.dtype).at[dest].set(rows)[:trash]
    buf = buf.reshape(num_experts, cap, d_model)
    g = jnp.einsum("ecd,edf->ecf", buf, w_gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("ecd,edf->ecf", buf, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    out = jnp.einsum("ecf,efd->ecd", h, w_down, preferred_element_type=jnp.float32)
    out = jnp.concatenate([out.reshape(trash, d_model), jnp.zeros((1, d_model), jnp.float32)], axis=0)
    y = jnp.take(out, dest, axis=0).reshape(num_tokens, top_k, d_model)
    w = weights.astype(jnp.float32) * disp.kept.astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, w), disp.dropped_fraction


def expert_parallel_dropless_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    expert_axis: str,
    implementation: str | None = None,
) -> jax.Array:
    """Expert-parallel dropless MoE SwiGLU; call INSIDE ``jax.shard_map``.

    Each of the P devices along ``expert_axis`` holds its own tokens and the ``E_l = E / P`` experts
    ``[p·E_l, (p+1)·E_l)``. Rows go to the device owning their expert with one ``all_to_all``, run
    through :func:`grouped_swiglu` there, come back with a second ``all_to_all`` and are combined
    with the gate weights (GShard-style expert parallelism, Lepikhin et al. 2020). Send buffers are
    padded to the worst case (all ``N_l·k`` local rows to one device), so nothing is ever dropped and
    the result equals :func:`dropless_moe` on the gathered tokens; the padding costs ``P×`` buffer
    memory and wire bytes (``jax.lax.ragged_all_to_all`` is the bandwidth-optimal replacement).

    Args:
      x: ``[N_l, D]`` local tokens. expert_ids: ``[N_l, k]`` int32 GLOBAL expert ids.
      weights: ``[N_l, k]`` fp32. w_gate, w_up: ``[E_l, D, F]``; w_down: ``[E_l, F, D]`` (local).
      expert_axis: mesh axis name the experts are sharded over.
      implementation: grouped-matmul implementation (:func:`grouped_matmul`).

    Returns:
      ``[N_l, D]`` fp32.
    """
    num_local = w_gate.shape[0]
    shards = jax.lax.axis_size(expert_axis)
    num_tokens, top_k = expert_ids.shape
    rows = num_tokens * top_k
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    dest = flat // num_local  # [rows] destination device along expert_axis
    one_hot = jax.nn.one_hot(dest, shards, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)  # position in dest buffer
    send_index = dest * rows + slot  # unique per row
    x_rows = jnp.repeat(x, top_k, axis=0)
    send = jnp.zeros((shards * rows, x.shape[1]), x.dtype).at[send_index].set(x_rows)
    send_ids = jnp.full((shards * rows,), num_local, jnp.int32).at[send_index].set(flat % num_local)
    recv = jax.lax.all_to_all(send.reshape(shards, rows, -1), expert_axis, 0, 0, tiled=False)
    recv_ids = jax.lax.all_to_all(send_ids.reshape(shards, rows), expert_axis, 0, 0, tiled=False)
    recv = recv.reshape(shards * rows, -1)
    recv_ids = recv_ids.reshape(-1)  # num_local = empty slot, sorted last
    order = jnp.argsort(recv_ids, stable=True)
    group_sizes = jnp.bincount(recv_ids, length=num_local).astype(jnp.int32)  # sentinel not counted
    y_sorted = grouped_swiglu(
        jnp.take(recv, order, axis=0), group_sizes, w_gate, w_up, w_down, implementation=implementation,
        out_dtype=x.dtype,  # the return all_to_all moves the compute dtype
    )
    y_recv = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    back = jax.lax.all_to_all(y_recv.reshape(shards, rows, -1), expert_axis, 0, 0, tiled=False)
    y_rows = jnp.take(back.reshape(shards * rows, -1), send_index, axis=0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("nkd,nk->nd", y_rows.astype(jnp.float32), weights.astype(jnp.float32))
