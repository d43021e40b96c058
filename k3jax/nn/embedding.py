"""Token embedding: `flax.nnx.Embed` whose lookup gradient is scatter-free (`k3jax.ops.embedding`)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.ops.embedding import embedding_lookup


class Embed(nnx.Embed):
    """`nnx.Embed` (same parameter `embedding [V, D]`, same `attend` for a tied head) whose `__call__`
    runs `k3jax.ops.embedding.embedding_lookup`: `ids [...]` int -> `[..., D]` in `dtype` (the fp32 table
    cast first, as `nnx.Embed`); the table gradient is a one-hot GEMM (V <= 4096) or a sorted segment
    sum instead of a scatter-add.

    Raises:
      ValueError: non-integer `inputs`.
    """

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None:
            return super().__call__(inputs, out_sharding=out_sharding)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"inputs must be integer token ids, got {inputs.dtype=}")
        (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return embedding_lookup(table, inputs)
