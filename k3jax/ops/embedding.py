"""Embedding lookup whose gradient avoids XLA's contended scatter-add into the table.

The forward is the gather `table[ids]`. The plain `jnp.take` transposes to a scatter-add of every
token's cotangent row into its table row: with a small vocabulary (259 byte tokens, 65k tokens per
step) thousands of updates hit each row and the GPU scatter serialises on them (35 ms of a 251 ms
K3-small step on an H200, issue 26). Here the backward is, by vocabulary size V:

  * V <= `ONE_HOT_MAX_VOCAB`: `one_hot(ids)ᵀ @ cotangent` ([V, N] x [N, D], one GEMM, fp32 accumulation);
  * larger V: a sorted segment sum (sort the ids, gather the cotangent rows in that order, sum runs of
    equal ids with `jax.ops.segment_sum(..., indices_are_sorted=True)`).

Both equal the scatter-add up to the order of the fp32 additions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("take", "one_hot", "segment_sum")
ONE_HOT_MAX_VOCAB = 4096  # one-hot GEMM up to here (at 65k tokens: [4096, 65536] bf16 = 0.5 GiB transient)


def _one_hot_grad(ids, g, num_rows):
    one_hot = jax.nn.one_hot(ids, num_rows, dtype=g.dtype)  # [N, V]
    return jnp.einsum("nv,nd->vd", one_hot, g, preferred_element_type=jnp.float32)


def _segment_sum_grad(ids, g, num_rows):
    order = jnp.argsort(ids)
    return jax.ops.segment_sum(g[order].astype(jnp.float32), ids[order], num_segments=num_rows,
                               indices_are_sorted=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, implementation):
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids, implementation):
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _lookup_bwd(implementation, res, g):
    ids, dtype_probe, num_rows = res
    flat_ids = ids.reshape(-1)
    flat_g = g.reshape(-1, g.shape[-1])
    grad_fn = _one_hot_grad if implementation == "one_hot" else _segment_sum_grad
    d_table = grad_fn(flat_ids, flat_g, num_rows).astype(dtype_probe.dtype)
    return d_table, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embedding_lookup(table, ids, *, implementation: str | None = None):
    """`table[ids]` with a scatter-free gradient for `table` (module docstring).

    Args:
      table: `[V, D]` float (any float dtype; its gradient has this dtype, accumulated in fp32).
      ids: integer array of any shape `[...]`, values in [0, V) (not checked: traced values).
      implementation: None (`"one_hot"` for V <= `ONE_HOT_MAX_VOCAB`, else `"segment_sum"`) |
        `"one_hot"` | `"segment_sum"` | `"take"` (plain `jnp.take`: XLA's scatter-add gradient, the
        reference).

    Returns:
      `[..., D]` in the table's dtype.

    Raises:
      ValueError: `table` not a 2-D float array, `ids` not integer, or an unknown `implementation`.
    """
    table, ids = jnp.asarray(table), jnp.asarray(ids)
    if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"table must be a float [V, D] array, got {table.shape=} {table.dtype=}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer array, got {ids.dtype=}")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation=}")
    if implementation is None:
        implementation = "one_hot" if table.shape[0] <= ONE_HOT_MAX_VOCAB else "segment_sum"
    if implementation == "take":
        return jnp.take(table, ids, axis=0)
    return _lookup(table, ids, implementation)
