"""Mesh axes and helpers for data + expert parallelism.

Logical layout (GShard / DeepSeek-V3 style expert parallelism):

- mesh axes ``("data", "expert")``, both with ``AxisType.Explicit``;
- tokens (the batch dimension) are sharded over BOTH axes (``TOKEN_AXES``): every device holds its own
  tokens, so the expert axis also does data parallelism outside the MoE layers;
- routed expert weights ``[E, ...]`` are sharded over ``"expert"`` and replicated over ``"data"``;
  everything else (router, attention, embeddings) is replicated; gradients are averaged by ``jax.jit``.
- balancing statistics (loads, histograms, aux-loss terms) are ``psum``-ed over ``TOKEN_AXES``.

The MoE layer runs under ``jax.shard_map`` (:func:`k3jax.ops.token_dispatch.expert_parallel_dropless_moe`:
two ``all_to_all`` over ``"expert"``); the rest is plain ``jax.jit`` with shardings.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
EXPERT = "expert"
TOKEN_AXES = (DATA, EXPERT)

__all__ = [
    "DATA", "EXPERT", "TOKEN_AXES", "expert_sharding", "initialize_distributed", "make_mesh", "replicated",
    "token_sharding",
]


def make_mesh(data: int, expert: int, *, devices=None, explicit: bool = True) -> Mesh:
    """A ``(data, expert)`` mesh; both axes ``AxisType.Explicit`` (default) or both ``AxisType.Auto``.

    Explicit axes (sharding in types) suit the MoE layer alone. A whole
    :class:`~k3jax.models.lm.LanguageModel` needs ``explicit=False``: its KDA/attention ops index and
    reshape the sharded batch in ways that explicit mode rejects without per-op ``out_sharding``, while
    with Auto axes ``jax.jit`` propagates the input shardings (GSPMD) and only the MoE layers run under
    ``jax.shard_map``.

    Args:
      data, expert: axis sizes; ``data · expert`` must equal the number of devices used.
      devices: optional device list (default: ``jax.devices()``).
      explicit: axis type of both axes (True = Explicit, False = Auto).

    Raises:
      ValueError: sizes < 1 or the product does not match the device count.
    """
    devices = jax.devices() if devices is None else list(devices)
    if data < 1 or expert < 1 or data * expert != len(devices):
        raise ValueError(f"need data·expert == {len(devices)} devices; got {data=}, {expert=}")
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((data, expert), (DATA, EXPERT), axis_types=(axis_type, axis_type), devices=devices)


def token_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a ``[B, ...]`` token array: batch over ``TOKEN_AXES``, the rest replicated."""
    return NamedSharding(mesh, P(TOKEN_AXES, *([None] * (ndim - 1))))


def expert_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a ``[E, ...]`` expert weight: experts over ``"expert"``, replicated over ``"data"``."""
    return NamedSharding(mesh, P(EXPERT, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding."""
    return NamedSharding(mesh, P())


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Multi-process (multi-host) start-up: ``jax.distributed.initialize`` for every backend.

    Call once per process before any other JAX work. It selects gloo as the CPU backend's
    collectives so ``psum``/``all_to_all`` cross processes on CPU (the 2-process test); GPU/TPU use
    their own collectives. Afterwards build the mesh from ``jax.devices()`` (global) and create
    global arrays with ``jax.make_array_from_callback`` / ``jax.make_array_from_process_local_data``.

    Args:
      coordinator_address: ``"host:port"`` of process 0 (e.g. ``"127.0.0.1:23456"``).
      num_processes: number of processes. process_id: this process, ``0 <= process_id < num_processes``.

    Raises:
      ValueError: ``process_id`` out of range.
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"need 0 <= process_id < num_processes; got {process_id=}, {num_processes=}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only affects the CPU backend
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
