"""Token dispatch for MoE: dropless (sort + grouped matmul + unsort) and capacity-factor dispatch.

Notation: N tokens, model width D, expert width F, E experts, top_k = k, capacity C. A routing is
``expert_ids [N, k]`` int32 and ``weights [N, k]`` fp32 (:mod:`k3jax.ops.routing`).

Dropless (MegaBlocks, Gale et al. 2022; the ``ragged_dot`` formulation of MaxText / Marin): the N·k
(token, slot) rows are stably sorted by expert, each expert's contiguous group is multiplied by its
own weight matrix in one grouped matmul (:func:`grouped_matmul`, ``jax.lax.ragged_dot`` semantics),
and the rows are scattered back and combined with the gate weights. Nothing is dropped.

Capacity dispatch (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021 §2.2): every expert has
``C = ceil(capacity_factor · N · k / E)`` slots (N = token rows, static); (token, slot) rows claim them in token order
(row-major over ``[N, k]``: token 0 slot 0, token 0 slot 1, ..., token 1 slot 0, ...); rows past C are
dropped and contribute ZERO, so the token passes through the residual connection unchanged by that
expert. Padding tokens never take capacity.

Grouped-matmul kernels (:func:`grouped_matmul`, ``implementation=``): "xla" (``jax.lax.ragged_dot``),
"blocked" (the CPU default), and two GPU library kernels, each imported only when called and used only
where its ``supported`` check passes (NVIDIA sm_90, bf16 operands, M/K/N multiples of 128):
"jla" (jax-linear-attention 0.1.0 Mosaic GPU grouped GEMM, tried first) and "tokamax" (tokamax 0.0.17
``ragged_dot(implementation="mosaic_gpu")``), each with our VJP (cotangent cast to the operand dtype,
cotangents marked with their primals' manual mesh axes so they run under ``jax.shard_map``). Neither
library is a base dependency: ``pip install -e ".[gpu]"`` installs both (pinned); the device machine,
which has no network, gets them as wheels carried in the git-excluded ``.whl/``. Without them
``implementation=None`` uses "xla" on GPU (26x slower forward, 37x forward+backward at the shape of
moe_gemm_h200.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GPU_PREFERENCE",
    "GROUPED_MATMUL_IMPLEMENTATIONS",
    "GROUPED_MATMUL_SUPPORTED",
    "JLA_PLAN",
    "JlaPlan",
    "CapacityDispatch",
    "capacity_dispatch",
    "capacity_moe",
    "combine",
    "default_grouped_matmul",
    "grouped_matmul",
    "grouped_matmul_supported",
    "grouped_swiglu",
    "permute",
    "register_grouped_matmul",
    "split_group_sizes",
    "dropless_moe",
    "expert_parallel_dropless_moe",
    "Permutation",
]


def _xla_ragged_dot(lhs, rhs, group_sizes, preferred_element_type):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


BLOCKED_ROWS = 128


def _blocked_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type, block_rows: int = BLOCKED_ROWS):
    """Grouped matmul as one batched matmul over row blocks (MegaBlocks' block-sparse layout).

    Each group is padded to a multiple of ``bm`` rows so every block of ``bm`` rows belongs to one
    group; the blocks (a static bound of ``ceil(M/bm) + E``) are multiplied by their group's weight in
    one batched einsum. Costs at most ``(M + E·bm)·K·N`` MACs and a gather of one ``[K, N]`` weight per
    block. On CPU this is ~E× cheaper than XLA's ``ragged_dot``, which there computes every group over
    every row (measured 4.7 vs 78 ms at M=2048, K=128, N=384, E=16); it is NOT meant for GPU (the
    weight gather is heavy at large K·N).
    """
    num_rows, _ = lhs.shape
    num_groups = rhs.shape[0]
    bm = max(1, min(block_rows, num_rows))
    num_blocks = -(-num_rows // bm) + num_groups
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + bm - 1) // bm * bm
    start = jnp.cumsum(sizes) - sizes  # first row of each group in lhs
    padded_start = jnp.cumsum(padded) - padded  # first row of each group in the padded layout
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), rows, side="right"), 0, num_groups - 1)
    valid = rows < jnp.sum(sizes)
    trash = num_blocks * bm
    dest = jnp.where(valid, padded_start[group] + rows - start[group], trash)
    buf = jnp.zeros((trash + 1, lhs.shape[1]), lhs.dtype).at[dest].set(lhs)[:trash]
    block_first = jnp.arange(num_blocks, dtype=jnp.int32) * bm
    block_group = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), block_first, side="right"), 0, num_groups - 1)
    out = jnp.einsum(
        "bmk,bkn->bmn", buf.reshape(num_blocks, bm, -1), jnp.take(rhs, block_group, axis=0),
        preferred_element_type=preferred_element_type,
    )
    out = jnp.concatenate([out.reshape(trash, -1), jnp.zeros((1, out.shape[-1]), out.dtype)], axis=0)
    return jnp.take(out, dest, axis=0)


def _always_supported(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
    del lhs, rhs, group_sizes, preferred_element_type
    return True, ""


def _platform() -> tuple[str, str, str]:
    """``(backend, device_kind, compute_capability)`` of the default device ("" where absent).

    One function so the CPU tests can pretend to be an H200 (monkeypatch) and exercise the GPU selection.
    """
    device = jax.devices()[0]
    return jax.default_backend(), str(device.device_kind), str(getattr(device, "compute_capability", ""))


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (no work at import time)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The library kernels are checked on what they were measured on: bf16 operands of one dtype on an
# H100/H200 (sm_90), K and N multiples of 128 (the forward, d_lhs and d_rhs GEMMs all need it), M a
# multiple of 128 rows. Everything else goes to "xla" (fail-closed).
LIBRARY_TILE = 128
LIBRARY_MAX_GROUPS = 1024


def _library_supported(module: str):
    def supported(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
        backend, kind, capability = _platform()
        if backend != "gpu" or "NVIDIA" not in kind.upper():
            return False, f"needs an NVIDIA GPU; got {backend=}, {kind=}"
        if capability != "9.0":
            return False, f"tested on sm_90 (H100/H200) only; got compute capability {capability!r}"
        if not _importable(module):
            return False, f"{module} is not installed (GPU wheels: see k3jax.ops.dispatch docs)"
        if jnp.dtype(lhs.dtype) != jnp.bfloat16 or jnp.dtype(rhs.dtype) != jnp.bfloat16:
            return False, f"needs bf16 lhs and rhs; got {lhs.dtype=}, {rhs.dtype=}"
        if jnp.dtype(preferred_element_type) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            return False, f"preferred_element_type must be bf16 or fp32; got {preferred_element_type=}"
        (m, k), (e, _, n) = lhs.shape, rhs.shape
        if m % LIBRARY_TILE or k % LIBRARY_TILE or n % LIBRARY_TILE:
            return False, f"M, K, N must be multiples of {LIBRARY_TILE}; got {lhs.shape=}, {rhs.shape=}"
        if not 1 <= e <= LIBRARY_MAX_GROUPS:
            return False, f"needs 1 <= E <= {LIBRARY_MAX_GROUPS}; got {rhs.shape=}"
        return True, ""

    return supported


def _mask_tail_rows(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Zero rows at or after ``sum(group_sizes)`` (ragged_dot semantics; kernels may leave them unwritten)."""
    valid = jnp.arange(out.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def _match_varying_axes(x: jax.Array, like: jax.Array) -> jax.Array:
    """Mark ``x`` as varying over every manual mesh axis that ``like`` varies over.

    Inside ``jax.shard_map`` a custom VJP's cotangents must carry the manual-axis type of their primals
    (e.g. expert weights vary over "expert"), but library kernels return unmarked arrays (measured on
    the H200: "the bwd rule produced bfloat16[32,1024,2048] for an input bfloat16[...]{V:expert}").
    Outside shard_map, and when nothing is missing, this returns ``x`` unchanged.
    """
    want = jax.typeof(like).manual_axis_type.varying
    have = jax.typeof(x).manual_axis_type.varying
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# tokamax's dimension numbers for the two backward GEMMs (tokamax/_src/ops/ragged_dot/base.py):
# d_lhs [M, K] = d_out [M, N] . rhs[g]^T (contract N with rhs dim 2), d_rhs [E, K, N] = lhs^T d_out
# per group (the ragged dimension M is contracted).
_TRANS_RHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
_RAGGED_CONTRACTING_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)
TOKAMAX_IMPLEMENTATION = "mosaic_gpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tokamax_ragged_dot(lhs, rhs, group_sizes, out_dtype):
    import tokamax  # noqa: PLC0415 -- optional GPU dependency, imported only when used

    return tokamax.ragged_dot(
        lhs, rhs, group_sizes, preferred_element_type=out_dtype, implementation=TOKAMAX_IMPLEMENTATION
    )


def _tokamax_ragged_dot_fwd(lhs, rhs, group_sizes, out_dtype):
    return _tokamax_ragged_dot(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _tokamax_ragged_dot_bwd(out_dtype, residuals, d_out):
    import tokamax  # noqa: PLC0415

    del out_dtype
    lhs, rhs, group_sizes = residuals
    # tokamax's own VJP feeds the cotangent in its dtype to kernels that need both operands in ONE dtype
    # (fp32 d_out x bf16 weights fails: moe_gemm_h200.md). Cast it to the operand dtype first.
    d_out = d_out.astype(lhs.dtype)
    d_lhs = tokamax.ragged_dot_general(
        d_out, rhs, group_sizes, _TRANS_RHS_DIMS, preferred_element_type=lhs.dtype,
        implementation=TOKAMAX_IMPLEMENTATION,
    )
    d_rhs = tokamax.ragged_dot_general(
        lhs, d_out, group_sizes, _RAGGED_CONTRACTING_DIMS, preferred_element_type=rhs.dtype,
        implementation=TOKAMAX_IMPLEMENTATION,
    )
    d_lhs = _match_varying_axes(_mask_tail_rows(d_lhs, group_sizes), lhs)
    return d_lhs, _match_varying_axes(d_rhs, rhs), None


_tokamax_ragged_dot.defvjp(_tokamax_ragged_dot_fwd, _tokamax_ragged_dot_bwd)


def _tokamax_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type):
    """tokamax 0.0.17 ``ragged_dot(implementation="mosaic_gpu")`` (Pallas Mosaic GPU, sm_90 kernel) with
    our own VJP: the cotangent is cast to the operand dtype, then d_lhs and d_rhs are tokamax's
    ``ragged_dot_general`` with the dimension numbers of tokamax's ``base.vjp``. Tail rows are masked."""
    out = _tokamax_ragged_dot(lhs, rhs, group_sizes, jnp.dtype(preferred_element_type))
    return _mask_tail_rows(out, group_sizes)


def split_group_sizes(group_sizes: jax.Array, max_rows: int, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Split every group into consecutive virtual groups of at most ``max_rows`` rows.

    Group ``g`` of ``s_g`` rows becomes ``ceil(s_g / max_rows)`` virtual groups, in row order (all but
    its last hold ``max_rows`` rows); an empty group gets none. Rows do not move, so a ragged kernel
    called with the virtual sizes reads the same ``lhs`` rows, and per-group results are the sums of
    the virtual groups' results over ``owner`` (``jax.ops.segment_sum``). The number of virtual groups
    is static: ``V = G + num_rows // max_rows`` bounds ``Σ_g ceil(s_g / max_rows)`` whenever
    ``Σ_g s_g <= num_rows``; unused virtual groups (a suffix) are empty and owned by group ``G - 1``.
    Used to cut the largest experts' share of the ragged-contraction GEMM (``d_rhs``) into pieces
    that run on different SMs (issue #5).

    Args:
      group_sizes: ``[G]`` int rows per group (ragged_dot order), ``sum <= num_rows``.
      max_rows: most rows of one virtual group, ``>= 1`` (python int).
      num_rows: M, the row count of the ragged operand (python int, ``>= 0``).

    Returns:
      ``(sizes [V] int32, owner [V] int32)``: rows of each virtual group and the group it belongs to
      (non-decreasing).

    Raises:
      ValueError: ``group_sizes`` not 1-D integer, ``max_rows < 1`` or ``num_rows < 0``.
    """
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be [G] integer; got {group_sizes.shape=}, {group_sizes.dtype=}")
    if max_rows < 1 or num_rows < 0:
        raise ValueError(f"need max_rows >= 1 and num_rows >= 0; got {max_rows=}, {num_rows=}")
    num_groups = group_sizes.shape[0]
    num_virtual = num_groups + num_rows // max_rows
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    pieces = (sizes + max_rows - 1) // max_rows
    piece_end = jnp.cumsum(pieces)
    j = jnp.arange(num_virtual, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(piece_end, j, side="right"), num_groups - 1).astype(jnp.int32)
    within = j - (piece_end[owner] - pieces[owner])  # index of the piece inside its group
    virtual = jnp.clip(sizes[owner] - within * max_rows, 0, max_rows).astype(jnp.int32)
    return jnp.where(j < piece_end[-1], virtual, 0), owner


# The named TileConfigs of the pinned jax-linear-attention 0.1.0 (attributes of jla.ops.mosaic_gpu.ragged_dot).
JLA_TILE_CONFIGS: tuple[str, ...] = ("PERSISTENT", "PERSISTENT_WS", "ALIGNED", "WARP_SPECIALIZED", "BLOCK_ALIGNED")


@dataclasses.dataclass(frozen=True)
class JlaPlan:
    """Static choices of the "jla" adapter for its three GEMMs (issue #5).

    Attributes:
      forward_config: name of the jla ``TileConfig`` (an attribute of ``jla.ops.mosaic_gpu.ragged_dot``,
        e.g. "PERSISTENT", "PERSISTENT_WS") of the forward GEMM ``[M, K] x [E, K, N]``, or None for
        jla's default (``select_config``). Used only where it tiles the forward AND the d_lhs GEMM
        (jla's ``ragged_dot(config=)`` requires both), else jla's default (fail-closed). One of
        :data:`JLA_TILE_CONFIGS` (the named tilings of the pinned jla 0.1.0).
      d_lhs_config: the same for ``d_lhs = d_out rhs[g]^T`` (contraction N, width K); used only where it
        tiles that GEMM, else jla's default.
      d_rhs_split_rows: None: ``d_rhs`` is one ``transposed_ragged_dot`` over the E groups (jla's own
        backward). An int S >= 1: groups are cut into virtual groups of at most S rows
        (:func:`split_group_sizes`, ``E + M // S`` of them), the kernel computes each piece's
        ``lhs_piece^T d_out_piece`` (bf16), and pieces are summed per group in fp32, so one large
        expert's contraction is spread over more SMs; applied only where ``E + M // S <=``
        ``LIBRARY_MAX_GROUPS``.

    Measured on the H200 (issue #5, experiments/results/grouped_gemm_ops_h200.md: M=32768, K=2048,
    N=1024, 64 groups, bf16, medians of batched calls): jla's default tiling (PERSISTENT) is the
    fastest of jla's five named tilings and three unnamed ones for the forward and for d_lhs, with
    balanced and Zipf(1.5)-skewed groups; the d_rhs split costs 1.86 vs 1.06 ms fwd+bwd skewed (the
    fp32 segment sum of the pieces dominates; jla's d_rhs is only 7% slower skewed than balanced), so
    :data:`JLA_PLAN` is jla's own choice everywhere.

    Not a parameter of :func:`grouped_matmul` (which always uses :data:`JLA_PLAN`); the candidates are
    timed through ``_jla_grouped_matmul(..., plan)`` by experiments/bench_grouped_gemm_ops.py.

    Raises:
      ValueError: ``d_rhs_split_rows`` not None or an integer ``>= 1`` (bools refused), or a config
        that is neither None nor one of :data:`JLA_TILE_CONFIGS`.
    """

    forward_config: str | None = None
    d_lhs_config: str | None = None
    d_rhs_split_rows: int | None = None

    def __post_init__(self):
        for name in ("forward_config", "d_lhs_config"):
            value = getattr(self, name)
            if value is not None and value not in JLA_TILE_CONFIGS:
                raise ValueError(f"{name} must be None or one of {JLA_TILE_CONFIGS}; got {value!r}")
        rows = self.d_rhs_split_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1):
            raise ValueError(f"d_rhs_split_rows must be None or an integer >= 1; got {self.d_rhs_split_rows=}")
        if rows is not None:
            object.__setattr__(self, "d_rhs_split_rows", int(rows))


# The plan "jla" runs with (implementation=None on an H200 included).
JLA_PLAN = JlaPlan()


def _jla_tile(jla_ragged_dot, name: str | None, contraction: int, width: int, *, both: bool = False):
    """jla TileConfig ``name`` if it exists and tiles the GEMM (``both``: also the swapped one), else None
    (= jla's default tiling)."""
    cfg = None if name is None else getattr(jla_ragged_dot, name, None)
    if cfg is None or not cfg.divides(contraction, width) or (both and not cfg.divides(width, contraction)):
        return None
    return cfg


def _jla_d_rhs(jla_ragged_dot, lhs, d_out, group_sizes, num_groups: int, split_rows: int | None):
    """``d_rhs [E, K, N]`` (bf16) = ``lhs_g^T d_out_g`` per group by jla's ``transposed_ragged_dot``,
    optionally over virtual groups of at most ``split_rows`` rows summed in fp32 (see :class:`JlaPlan`)."""
    num_rows = lhs.shape[0]
    if split_rows is None or num_groups + num_rows // split_rows > LIBRARY_MAX_GROUPS:
        return jla_ragged_dot.transposed_ragged_dot(lhs, d_out, group_sizes).astype(lhs.dtype)
    sizes, owner = split_group_sizes(group_sizes, split_rows, num_rows)
    pieces = jla_ragged_dot.transposed_ragged_dot(lhs, d_out, sizes)
    total = jax.ops.segment_sum(pieces.astype(jnp.float32), owner, num_groups, indices_are_sorted=True)
    return total.astype(lhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _jla_ragged_dot(lhs, rhs, group_sizes, plan, full_groups):
    from jla.ops.mosaic_gpu import ragged_dot as jla_ragged_dot  # noqa: PLC0415 -- optional GPU dependency

    cfg = _jla_tile(jla_ragged_dot, plan.forward_config, rhs.shape[1], rhs.shape[2], both=True)
    kwargs = {} if cfg is None else {"config": cfg}
    if full_groups:  # else jla zeroes the rows past the groups with a select over the whole output
        kwargs["full_groups"] = True
    return jla_ragged_dot.ragged_dot(lhs, rhs, group_sizes, **kwargs)


def _jla_ragged_dot_fwd(lhs, rhs, group_sizes, plan, full_groups):
    return _jla_ragged_dot(lhs, rhs, group_sizes, plan, full_groups), (lhs, rhs, group_sizes)


def _jla_ragged_dot_bwd(plan, full_groups, residuals, d_out):
    from jla.ops.mosaic_gpu import ragged_dot as jla_ragged_dot  # noqa: PLC0415

    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    k, n = rhs.shape[1], rhs.shape[2]
    # jla 0.1.0's own backward (ragged_dot._ragged_dot_bwd) with the plan's tilings, and the manual-axis
    # types fixed for shard_map: d_lhs = d_out rhs[g]^T by the transposed-rhs kernel, d_rhs = lhs^T d_out
    # per group (or per virtual group, summed).
    cfg = jla_ragged_dot._config_for(_jla_tile(jla_ragged_dot, plan.d_lhs_config, n, k), n, k)  # noqa: SLF001
    d_lhs = jla_ragged_dot._ragged_dot_kernel(d_out, rhs, group_sizes, transpose_rhs=True, cfg=cfg)  # noqa: SLF001
    if not full_groups:
        d_lhs = _mask_tail_rows(d_lhs, group_sizes)
    d_rhs = _jla_d_rhs(jla_ragged_dot, lhs, d_out, group_sizes, rhs.shape[0], plan.d_rhs_split_rows)
    return _match_varying_axes(d_lhs, lhs), _match_varying_axes(d_rhs.astype(rhs.dtype), rhs), None


_jla_ragged_dot.defvjp(_jla_ragged_dot_fwd, _jla_ragged_dot_bwd)


def _jla_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type, plan: JlaPlan | None = None,
                        full_groups: bool = False):
    """jax-linear-attention 0.1.0 Mosaic GPU grouped GEMM (``jla.ops.mosaic_gpu.ragged_dot``): forward
    and d_lhs by its ragged kernel, d_rhs by its transposed kernel, bf16 cotangent; our VJP repeats
    jla's with the static choices of ``plan`` (default :data:`JLA_PLAN`) and marks the cotangents'
    manual mesh axes (so it runs under ``jax.shard_map``). Its output has the operand dtype: an fp32
    result is the bf16 output cast up (fp32 accumulation, bf16 rounding of the result).
    ``full_groups=True`` (the caller's promise that ``sum(group_sizes) == M``) skips zeroing the rows
    past the groups in the output and in d_lhs (jla's ``full_groups``)."""
    plan = JLA_PLAN if plan is None else plan
    out = _jla_ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), plan, bool(full_groups))
    return out.astype(preferred_element_type)


def _jla_supported(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
    ok, reason = _library_supported("jla")(lhs, rhs, group_sizes, preferred_element_type)
    if not ok:
        return ok, reason
    from jla.ops.mosaic_gpu import ragged_dot as jla_ragged_dot  # noqa: PLC0415

    if not jla_ragged_dot.supports(lhs, rhs, group_sizes):
        return False, f"jla ragged_dot.supports rejects {lhs.shape=}, {rhs.shape=}"
    return True, ""


# Grouped-matmul implementations: name -> fn(lhs [M, K], rhs [E, K, N], group_sizes [E] int32,
# preferred_element_type) -> [M, N], with jax.lax.ragged_dot semantics and differentiable.
#   "xla": jax.lax.ragged_dot; correct everywhere, 26x (fwd) / 37x (fwd+bwd) slower than jla on an
#          H200 (experiments/results/moe_gemm_h200.md) and ~E x the useful FLOPs on CPU.
#   "blocked": the CPU default (_blocked_grouped_matmul).
#   "tokamax": tokamax's Hopper Pallas kernel (_tokamax_grouped_matmul), GPU only.
#   "jla": jax-linear-attention's Mosaic GPU grouped GEMM (_jla_grouped_matmul), GPU only.
# GROUPED_MATMUL_SUPPORTED holds each one's supported(lhs, rhs, group_sizes, preferred_element_type)
# -> (ok, reason); it only reads shapes and dtypes, so it works on tracers.
GROUPED_MATMUL_IMPLEMENTATIONS: dict[str, Callable] = {
    "xla": _xla_ragged_dot,
    "blocked": _blocked_grouped_matmul,
    "tokamax": _tokamax_grouped_matmul,
    "jla": _jla_grouped_matmul,
}
GROUPED_MATMUL_SUPPORTED: dict[str, Callable] = {
    "xla": _always_supported,
    "blocked": _always_supported,
    "tokamax": _library_supported("tokamax"),
    "jla": _jla_supported,
}
# Variants used by grouped_matmul(full_groups=True): same contract, but rows past sum(group_sizes) are
# unspecified (the caller promises there are none); the others zero them anyway.
_FULL_GROUPS_VARIANTS: dict[str, Callable] = {"jla": functools.partial(_jla_grouped_matmul, full_groups=True)}
# Library kernels tried, in order, by implementation=None on GPU. jla first, on the H200 measurement
# (experiments/results/moe_gemm_h200.md, 2026-11-30): fwd+bwd 1.20 ms balanced / 1.66 ms skewed vs
# tokamax 2.12 / 2.80 ms (torch._grouped_mm 0.97 / 1.17), MoE layer fwd+bwd 15.2 vs 29.4 ms, and
# tokamax's d_rhs is 4.4e-2 (relative RMS) off XLA's where jla's matches.
GPU_PREFERENCE: tuple[str, ...] = ("jla", "tokamax")


def grouped_matmul_supported(
    implementation: str, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
    preferred_element_type=jnp.float32,
) -> tuple[bool, str]:
    """Whether ``implementation`` is tested for this call: ``(ok, reason)``; reason is "" when ok.

    Only shapes, dtypes and the platform are read (works on tracers). "xla" and "blocked" support
    everything; "tokamax" and "jla" need the library installed, an NVIDIA sm_90 GPU, bf16 ``lhs`` and
    ``rhs``, bf16/fp32 output and M, K, N multiples of 128 (and, for "jla", its own ``supports``).

    Raises:
      ValueError: unknown ``implementation``.
    """
    if implementation not in GROUPED_MATMUL_IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {sorted(GROUPED_MATMUL_IMPLEMENTATIONS)}; got {implementation=}"
        )
    check = GROUPED_MATMUL_SUPPORTED.get(implementation, _always_supported)
    return check(lhs, rhs, group_sizes, preferred_element_type)


def default_grouped_matmul(
    lhs: jax.Array | None = None,
    rhs: jax.Array | None = None,
    group_sizes: jax.Array | None = None,
    preferred_element_type=jnp.float32,
) -> str:
    """The implementation used for ``implementation=None``.

    CPU: "blocked". GPU/TPU: the first of :data:`GPU_PREFERENCE` ("jla", then "tokamax") that is
    importable on an NVIDIA sm_90 GPU and, when the operands are given, supports this call
    (:func:`grouped_matmul_supported`); otherwise "xla". Without operands only the platform and the
    installed libraries are checked.
    """
    backend, _, _ = _platform()
    if backend == "cpu":
        return "blocked"
    for name in GPU_PREFERENCE:
        if name not in GROUPED_MATMUL_IMPLEMENTATIONS:
            continue
        if lhs is None:
            probe_lhs = jax.ShapeDtypeStruct((LIBRARY_TILE, LIBRARY_TILE), jnp.bfloat16)
            probe_rhs = jax.ShapeDtypeStruct((1, LIBRARY_TILE, LIBRARY_TILE), jnp.bfloat16)
            probe_sizes = jax.ShapeDtypeStruct((1,), jnp.int32)
            ok, _ = _library_supported(name)(probe_lhs, probe_rhs, probe_sizes, jnp.float32)
        else:
            ok, _ = grouped_matmul_supported(name, lhs, rhs, group_sizes, preferred_element_type)
        if ok:
            return name
    return "xla"


def register_grouped_matmul(name: str, fn: Callable, *, supported: Callable | None = None) -> None:
    """Register a grouped-matmul implementation under ``name``.

    ``fn(lhs, rhs, group_sizes, preferred_element_type)`` must match ``jax.lax.ragged_dot``
    (rows ``sum(group_sizes):M`` of the output are zero) and be differentiable. ``supported(lhs, rhs,
    group_sizes, preferred_element_type) -> (ok, reason)`` says which calls it is tested for (default:
    all). It is chosen only by name (``implementation=name``), never by ``implementation=None`` unless
    listed in :data:`GPU_PREFERENCE`.

    Raises:
      ValueError: ``name`` is empty or already registered.
    """
    if not name or name in GROUPED_MATMUL_IMPLEMENTATIONS:
        raise ValueError(f"name must be new and non-empty; got {name=}")
    GROUPED_MATMUL_IMPLEMENTATIONS[name] = fn
    GROUPED_MATMUL_SUPPORTED[name] = supported or _always_supported


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str | None = None,
    preferred_element_type=jnp.float32,
    full_groups: bool = False,
) -> jax.Array:
    """Grouped matmul with ``jax.lax.ragged_dot`` semantics.

    Rows ``[o_g, o_g + group_sizes[g])`` of ``lhs`` (``o_g`` = sum of earlier sizes) are multiplied
    by ``rhs[g]``; rows at or after ``sum(group_sizes)`` give zeros. Differentiable in ``lhs`` and
    ``rhs``; the gradients come back in the operand dtypes whatever the cotangent's dtype.

    Args:
      lhs: ``[M, K]`` (bf16 or fp32). rhs: ``[E, K, N]`` same dtype. group_sizes: ``[E]`` int,
        ``sum <= M``.
      implementation: None = :func:`default_grouped_matmul` for this call ("blocked" on CPU; on an
        H100/H200 the library kernel "tokamax" or "jla" when installed and tested for these
        shapes/dtypes, else "xla"), or a name in ``GROUPED_MATMUL_IMPLEMENTATIONS``. Fail-closed: an
        unknown name, or a name whose ``supported`` check rejects the call, raises.
      preferred_element_type: accumulation/output dtype (fp32 default: bf16 operands, fp32 accum).
      full_groups: the caller's promise that ``sum(group_sizes) == M`` (every row in a group, as after
        :func:`permute`). Implementations in ``_FULL_GROUPS_VARIANTS`` ("jla") then skip zeroing the
        rows past the groups in the output and in d_lhs (jla's ``full_groups``; torch._grouped_mm
        does no such pass either): one read + write of ``[M, N]`` and of ``[M, K]`` less (~0.09 ms of
        HBM traffic at 4.3 TB/s); measured fwd+bwd on an H200 at M=32768, K=2048, N=1024, 64 groups,
        bf16 (experiments/results/grouped_gemm_full_groups_h200.md): 0.979 -> 0.867 ms balanced,
        1.057 -> 0.944 ms Zipf-skewed. Checked on concrete sizes only (a traced ``sum < M`` leaves
        those rows unspecified). Default False is always correct.

    Returns:
      ``[M, N]`` in ``preferred_element_type``.

    Raises:
      ValueError: non-array operands, bad ranks/shapes, ``lhs``/``rhs`` of different or non-floating
        dtypes, a non-floating ``preferred_element_type``, non-integer ``group_sizes`` (and, when they
        are concrete, negative sizes, ``sum > M`` or ``full_groups=True`` with ``sum != M``), a
        non-bool ``full_groups``, unknown ``implementation``, or an explicit ``implementation`` that
        does not support the call (the message gives the reason).
    """
    for name, value in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
        if not hasattr(value, "ndim") or not hasattr(value, "dtype"):
            raise ValueError(f"{name} must be an array; got {type(value).__name__}")
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"need lhs [M, K], rhs [E, K, N], group_sizes [E]; got {lhs.shape=}, {rhs.shape=}, {group_sizes.shape=}"
        )
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"shape mismatch: {lhs.shape=}, {rhs.shape=}, {group_sizes.shape=}")
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs and rhs must share one floating dtype; got {lhs.dtype=}, {rhs.dtype=}")
    if not jnp.issubdtype(jnp.dtype(preferred_element_type), jnp.floating):
        raise ValueError(f"preferred_element_type must be a floating dtype; got {preferred_element_type=}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer row counts; got {group_sizes.dtype=}")
    if not isinstance(full_groups, bool):
        raise ValueError(f"full_groups must be a bool; got {full_groups=!r}")
    if not isinstance(group_sizes, jax.core.Tracer):  # concrete sizes: check what can be checked
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any() or sizes.sum() > lhs.shape[0]:
            raise ValueError(f"group_sizes must be >= 0 with sum <= M={lhs.shape[0]}; got {sizes.tolist()}")
        if full_groups and sizes.sum() != lhs.shape[0]:
            raise ValueError(f"full_groups=True promises sum(group_sizes) == M={lhs.shape[0]}; got {int(sizes.sum())}")
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation is None:
        name = default_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type)
    else:
        name = implementation
        ok, reason = grouped_matmul_supported(name, lhs, rhs, group_sizes, preferred_element_type)
        if not ok:
            raise ValueError(f"{implementation=} does not support this call: {reason}")
    if full_groups and name in _FULL_GROUPS_VARIANTS:
        return _FULL_GROUPS_VARIANTS[name](lhs, rhs, group_sizes, preferred_element_type)
    return GROUPED_MATMUL_IMPLEMENTATIONS[name](lhs, rhs, group_sizes, preferred_element_type)


class Permutation(NamedTuple):
    """Sorted-by-expert layout of the N·k (token, slot) rows.

    Attributes:
      order: ``[N·k]`` int32, flat row index (``token·k + slot``) of each sorted row (stable sort).
      group_sizes: ``[E]`` int32 rows per expert.
    """

    order: jax.Array
    group_sizes: jax.Array


def permute(x: jax.Array, expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, Permutation]:
    """Copy each token once per selected expert and sort the copies by expert (stable: token order
    inside an expert).

    Args:
      x: ``[N, D]`` tokens. expert_ids: ``[N, k]`` int. num_experts: E.

    Returns:
      ``(x_sorted [N·k, D], Permutation)``.

    Raises:
      ValueError: shapes inconsistent.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"need x [N, D] and expert_ids [N, k]; got {x.shape=}, {expert_ids.shape=}")
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    x_sorted = jnp.take(x, order // top_k, axis=0)
    return x_sorted, Permutation(order=order, group_sizes=group_sizes)


def combine(y_sorted: jax.Array, perm: Permutation, weights: jax.Array) -> jax.Array:
    """Inverse of :func:`permute` plus the weighted sum over the k slots (in fp32).

    Args:
      y_sorted: ``[N·k, D]`` expert outputs in sorted order. perm: from :func:`permute`.
      weights: ``[N, k]`` gate weights.

    Returns:
      ``[N, D]`` fp32, ``y_i = Σ_s w_is · y_sorted[row of (i, s)]``.
    """
    num_tokens, top_k = weights.shape
    inverse = jnp.zeros_like(perm.order).at[perm.order].set(jnp.arange(perm.order.shape[0], dtype=jnp.int32))
    y = jnp.take(y_sorted, inverse, axis=0).reshape(num_tokens, top_k, -1).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(jnp.float32))


def grouped_swiglu(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    implementation: str | None = None,
    full_groups: bool = False,
) -> jax.Array:
    """SwiGLU experts on expert-sorted rows: ``(silu(x W_g) ⊙ x W_u) W_d`` per group (Shazeer 2020).

    Args:
      x_sorted: ``[M, D]``; group_sizes ``[E]``; w_gate, w_up ``[E, D, F]``; w_down ``[E, F, D]``, all
        in the compute dtype (bf16 in training). Matmuls accumulate in fp32; the hidden activation is
        cast back to the compute dtype before the down projection.
      implementation, full_groups: passed to :func:`grouped_matmul` (``full_groups``: the caller
        promises ``sum(group_sizes) == M``).

    Returns:
      ``[M, D]`` fp32.

    Raises:
      ValueError: from :func:`grouped_matmul` (ranks/shapes that do not chain, non-integer
        ``group_sizes``, an ``implementation`` unknown or not supporting the call).
    """
    gmm = functools.partial(grouped_matmul, implementation=implementation, full_groups=full_groups)
    g = gmm(x_sorted, w_gate, group_sizes)
    u = gmm(x_sorted, w_up, group_sizes)
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    return gmm(h, w_down, group_sizes)


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
    """Dropless MoE SwiGLU: ``y_i = Σ_s w_is · FFN_{e_is}(x_i)`` via permute → grouped matmuls → combine.

    Args:
      x: ``[N, D]`` tokens (compute dtype). expert_ids: ``[N, k]`` int32 in ``[0, E)`` (every row then
        lands in a group, so the grouped matmuls run with ``full_groups=True``; an id outside that range
        gives its row an unspecified output with the "jla" kernels). weights: ``[N, k]`` fp32.
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]`` (compute dtype).
      implementation: grouped-matmul implementation (see :func:`grouped_matmul`).

    Returns:
      ``[N, D]`` fp32.

    Raises:
      ValueError: from :func:`permute` (``x`` not ``[N, D]`` or ``expert_ids`` not ``[N, k]``) and
        :func:`grouped_matmul` (weights that do not chain, an ``implementation`` that cannot run).

    Source: the dropless (no capacity, no token dropping) MoE of MegaBlocks (Gale et al. 2022,
    arXiv 2211.15841) as a sort by expert + grouped GEMMs + weighted un-permute.
    """
    num_experts = w_gate.shape[0]
    x_sorted, perm = permute(x, expert_ids, num_experts)
    # permute's group sizes count every one of the N·k rows: the groups are full.
    y_sorted = grouped_swiglu(x_sorted, perm.group_sizes, w_gate, w_up, w_down, implementation=implementation,
                              full_groups=True)
    return combine(y_sorted, perm, weights)


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
        jnp.take(recv, order, axis=0), group_sizes, w_gate, w_up, w_down, implementation=implementation
    )
    y_recv = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    back = jax.lax.all_to_all(y_recv.reshape(shards, rows, -1), expert_axis, 0, 0, tiled=False)
    y_rows = jnp.take(back.reshape(shards * rows, -1), send_index, axis=0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("nkd,nk->nd", y_rows, weights.astype(jnp.float32))
