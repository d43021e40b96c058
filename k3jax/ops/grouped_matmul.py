"""Grouped matmul (``jax.lax.ragged_dot`` semantics) over a registry of backends.

``grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes [E])`` multiplies rows
``[o_g, o_g + group_sizes[g])`` of ``lhs`` (``o_g`` = sum of the earlier sizes) by ``rhs[g]``; rows
at or after ``sum(group_sizes)`` give zeros. It is the expert GEMM of dropless MoE
(:mod:`k3jax.ops.token_dispatch`).

Backends (:data:`BACKENDS`), each with a ``supported(...) -> (ok, reason)`` that reads only shapes,
dtypes and the platform (so it works on tracers):

* "xla": ``jax.lax.ragged_dot``. Correct everywhere; on an H200 26x slower forward and 37x slower
  forward+backward than "jla" (experiments/results/moe_gemm_h200.md), on CPU ~E x the useful FLOPs.
* "blocked": one batched matmul over row blocks (MegaBlocks' block-sparse layout); the CPU default.
* "jla": jax-linear-attention 0.1.0's Mosaic GPU grouped GEMM (``jla.ops.mosaic_gpu.ragged_dot``).
* "tokamax": tokamax 0.0.17 ``ragged_dot(implementation="mosaic_gpu")`` with our VJP. Chosen by name
  only: on the H200 its forward+backward was 2.12 / 2.80 ms vs jla's 1.20 / 1.66 ms (balanced /
  skewed groups) and its d_rhs 4.4e-2 (relative RMS) off XLA's (moe_gemm_h200.md).

``implementation=None`` (:func:`default_implementation`): "blocked" on CPU; elsewhere "jla" where it
supports the call, else "xla". The two GPU libraries are not base dependencies: ``pip install -e
".[gpu]"`` installs both (pinned); the device machine, which has no network, gets them as the wheels
of experiments/gpu_wheels.txt.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BACKENDS",
    "GPU_AUTO_ORDER",
    "Backend",
    "default_implementation",
    "grouped_matmul",
    "register_backend",
    "supported",
]

# A backend's kernel: fn(lhs [M, K], rhs [E, K, N], group_sizes [E] int32, preferred_element_type,
# full_groups) -> [M, N] in preferred_element_type, differentiable in lhs and rhs. With
# full_groups=False rows past sum(group_sizes) are zero; with True they may be anything.
Kernel = Callable[..., jax.Array]
# supported(lhs, rhs, group_sizes, preferred_element_type) -> (ok, reason); reason is "" when ok.
Support = Callable[..., tuple[bool, str]]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One grouped-matmul implementation: its kernel and the calls it is tested for."""

    fn: Kernel
    supported: Support


def _always_supported(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
    del lhs, rhs, group_sizes, preferred_element_type
    return True, ""


def _xla(lhs, rhs, group_sizes, preferred_element_type, full_groups=False):
    del full_groups
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


BLOCKED_ROWS = 128


def _blocked(lhs, rhs, group_sizes, preferred_element_type, full_groups=False, block_rows: int = BLOCKED_ROWS):
    """Grouped matmul as one batched matmul over row blocks (MegaBlocks' block-sparse layout).

    Each group is padded to a multiple of ``bm`` rows so every block of ``bm`` rows belongs to one
    group; the blocks (a static bound of ``ceil(M/bm) + E``) are multiplied by their group's weight in
    one batched einsum. Costs at most ``(M + E·bm)·K·N`` MACs and a gather of one ``[K, N]`` weight per
    block. On CPU ~E x cheaper than XLA's ``ragged_dot``, which there computes every group over every
    row (4.7 vs 78 ms at M=2048, K=128, N=384, E=16); not for GPU (the weight gather is heavy at large
    K·N).
    """
    del full_groups
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


# The library kernels are used on what they were measured on: bf16 operands on an H100/H200 (sm_90),
# M, K and N multiples of 128 (the forward, d_lhs and d_rhs GEMMs all need it). Everything else is
# refused, so implementation=None falls back to "xla" (fail-closed).
LIBRARY_TILE = 128
LIBRARY_MAX_GROUPS = 1024


def _library_supported(module: str) -> Support:
    def check(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
        del group_sizes
        backend, kind, capability = _platform()
        if backend != "gpu" or "NVIDIA" not in kind.upper():
            return False, f"needs an NVIDIA GPU; got {backend=}, {kind=}"
        if capability != "9.0":
            return False, f"tested on sm_90 (H100/H200) only; got compute capability {capability!r}"
        if not _importable(module):
            return False, f"{module} is not installed (experiments/gpu_wheels.txt lists the wheels)"
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

    return check


def _mask_tail_rows(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Zero rows at or after ``sum(group_sizes)`` (ragged_dot semantics; kernels may leave them unwritten)."""
    valid = jnp.arange(out.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def _varying(x: jax.Array) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``jax.shard_map``)."""
    return jax.typeof(x).manual_axis_type.varying


def _match_varying_axes(x: jax.Array, like: jax.Array) -> jax.Array:
    """Mark ``x`` as varying over every manual mesh axis that ``like`` varies over.

    Inside ``jax.shard_map`` a custom VJP's cotangents must carry the manual-axis type of their primals
    (e.g. expert weights vary over "expert"), but library kernels return unmarked arrays (on the H200:
    "the bwd rule produced bfloat16[32,1024,2048] for an input bfloat16[...]{V:expert}"). Outside
    shard_map, and when nothing is missing, this returns ``x`` unchanged.
    """
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --- jla: jax-linear-attention 0.1.0, public API only -------------------------------------------------

def _jla_module():
    from jla.ops.mosaic_gpu import ragged_dot  # noqa: PLC0415 -- optional GPU dependency, imported when used

    return ragged_dot


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _jla_marked(lhs, rhs, group_sizes, full_groups):
    return _jla_module().ragged_dot(lhs, rhs, group_sizes, full_groups=full_groups)


def _jla_marked_fwd(lhs, rhs, group_sizes, full_groups):
    return _jla_marked(lhs, rhs, group_sizes, full_groups), (lhs, rhs, group_sizes)


def _jla_marked_bwd(full_groups, residuals, d_out):
    jla = _jla_module()
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    # d_lhs = d_out rhs[g]^T; jla's public forward needs rhs^T materialised (one [E, N, K] copy).
    d_lhs = jla.ragged_dot(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes, full_groups=full_groups)
    d_rhs = jla.transposed_ragged_dot(lhs, d_out, group_sizes).astype(rhs.dtype)  # lhs_g^T d_out_g
    return _match_varying_axes(d_lhs, lhs), _match_varying_axes(d_rhs, rhs), None


_jla_marked.defvjp(_jla_marked_fwd, _jla_marked_bwd)


def _jla(lhs, rhs, group_sizes, preferred_element_type, full_groups=False):
    """jla's ``ragged_dot`` (forward, d_lhs and d_rhs by its Mosaic GPU kernels, bf16 cotangent).

    Its output has the operand dtype: an fp32 result is the bf16 output cast up. ``full_groups``
    skips jla's zeroing of the rows past the groups in the output and d_lhs. Outside ``shard_map``
    this is jla's own VJP; on operands that vary over manual mesh axes its VJP would return unmarked
    cotangents (refused by JAX), so the same GEMMs run from jla's public functions with the
    cotangents marked (:func:`_match_varying_axes`), at the cost of one transposed copy of ``rhs``.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    if _varying(lhs) or _varying(rhs):
        out = _jla_marked(lhs, rhs, group_sizes, bool(full_groups))
    else:
        out = _jla_ragged_dot(lhs, rhs, group_sizes, kernel=_jla_module().ragged_dot, full_groups=bool(full_groups))
    return out.astype(preferred_element_type)


# One jit per (kernel, shapes): the MoE layers of an unrolled model share one traced jaxpr forward and
# backward, so JAX lowers jla's Mosaic GPU kernels once per model, not once per layer.
@functools.partial(jax.jit, static_argnames=("kernel", "full_groups"))
def _jla_ragged_dot(lhs, rhs, group_sizes, *, kernel, full_groups: bool):
    return kernel(lhs, rhs, group_sizes, full_groups=full_groups)


def _jla_supported(lhs, rhs, group_sizes, preferred_element_type) -> tuple[bool, str]:
    ok, reason = _library_supported("jla")(lhs, rhs, group_sizes, preferred_element_type)
    if not ok:
        return ok, reason
    if not _jla_module().supports(lhs, rhs, group_sizes):
        return False, f"jla ragged_dot.supports rejects {lhs.shape=}, {rhs.shape=}"
    return True, ""


# --- tokamax 0.0.17 ------------------------------------------------------------------------------------

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
    # tokamax's kernels need both operands in ONE dtype (fp32 d_out x bf16 weights fails: moe_gemm_h200.md).
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


def _tokamax(lhs, rhs, group_sizes, preferred_element_type, full_groups=False):
    """tokamax ``ragged_dot(implementation="mosaic_gpu")`` with our VJP: the cotangent cast to the
    operand dtype, d_lhs and d_rhs by tokamax's ``ragged_dot_general`` with the dimension numbers of
    tokamax's own ``base.vjp``. Tail rows are masked."""
    del full_groups
    out = _tokamax_ragged_dot(lhs, rhs, group_sizes, jnp.dtype(preferred_element_type))
    return _mask_tail_rows(out, group_sizes)


BACKENDS: dict[str, Backend] = {
    "xla": Backend(_xla, _always_supported),
    "blocked": Backend(_blocked, _always_supported),
    "jla": Backend(_jla, _jla_supported),
    "tokamax": Backend(_tokamax, _library_supported("tokamax")),
}
# Backends tried, in order, by implementation=None off CPU; "xla" when none supports the call.
GPU_AUTO_ORDER: tuple[str, ...] = ("jla",)


def supported(
    implementation: str, lhs, rhs, group_sizes, preferred_element_type=jnp.float32
) -> tuple[bool, str]:
    """Whether backend ``implementation`` is tested for this call: ``(ok, reason)``, reason "" when ok.

    Only shapes, dtypes and the platform are read (arrays, tracers or ``jax.ShapeDtypeStruct``).
    "xla" and "blocked" support everything; "jla" and "tokamax" need the library installed, an
    NVIDIA sm_90 GPU, bf16 ``lhs`` and ``rhs``, a bf16/fp32 output, M, K, N multiples of 128 and
    1 <= E <= 1024 (and, for "jla", its own ``supports``: E <= 512 in jla 0.1.0).

    Raises:
      ValueError: unknown ``implementation``.
    """
    if implementation not in BACKENDS:
        raise ValueError(f"implementation must be one of {sorted(BACKENDS)}; got {implementation=}")
    return BACKENDS[implementation].supported(lhs, rhs, group_sizes, preferred_element_type)


def default_implementation(lhs=None, rhs=None, group_sizes=None, preferred_element_type=jnp.float32) -> str:
    """The backend ``implementation=None`` runs.

    CPU: "blocked". Otherwise the first of :data:`GPU_AUTO_ORDER` ("jla") that supports the call, else
    "xla". Without operands, a 128 x 128 bf16 probe stands in for them, so only the platform and the
    installed libraries decide.
    """
    backend, _, _ = _platform()
    if backend == "cpu":
        return "blocked"
    if lhs is None:
        lhs = jax.ShapeDtypeStruct((LIBRARY_TILE, LIBRARY_TILE), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((1, LIBRARY_TILE, LIBRARY_TILE), jnp.bfloat16)
        group_sizes = jax.ShapeDtypeStruct((1,), jnp.int32)
    for name in GPU_AUTO_ORDER:
        if supported(name, lhs, rhs, group_sizes, preferred_element_type)[0]:
            return name
    return "xla"


def register_backend(name: str, fn: Kernel, *, supported: Support | None = None) -> None:
    """Add a backend, selectable by ``implementation=name`` (never by None).

    ``fn(lhs, rhs, group_sizes, preferred_element_type, full_groups)`` must match
    ``jax.lax.ragged_dot`` (rows ``sum(group_sizes):M`` zero unless ``full_groups``) and be
    differentiable; ``supported(lhs, rhs, group_sizes, preferred_element_type) -> (ok, reason)``
    says which calls it is tested for (default: all).

    Raises:
      ValueError: ``name`` is empty or already registered.
    """
    if not name or name in BACKENDS:
        raise ValueError(f"name must be new and non-empty; got {name=}")
    BACKENDS[name] = Backend(fn, supported or _always_supported)


def _check_operands(lhs, rhs, group_sizes, preferred_element_type, full_groups) -> None:
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


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    implementation: str | None = None,
    *,
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
      implementation: None = :func:`default_implementation` for this call, or a name in
        :data:`BACKENDS`. Fail-closed: an unknown name, or a name whose ``supported`` check rejects
        the call, raises.
      preferred_element_type: accumulation/output dtype (fp32 default: bf16 operands, fp32 accum).
      full_groups: the caller's promise that ``sum(group_sizes) == M`` (every row in a group, as after
        :func:`k3jax.ops.token_dispatch.permute`). "jla" then skips zeroing the rows past the groups
        in the output and in d_lhs: fwd+bwd on an H200 at M=32768, K=2048, N=1024, 64 groups, bf16
        0.979 -> 0.867 ms balanced, 1.057 -> 0.944 ms Zipf-skewed
        (experiments/results/grouped_gemm_h200.md). Checked on concrete sizes only (a
        traced ``sum < M`` leaves those rows unspecified). Default False is always correct.

    Returns:
      ``[M, N]`` in ``preferred_element_type``.

    Raises:
      ValueError: non-array operands, bad ranks/shapes, ``lhs``/``rhs`` of different or non-floating
        dtypes, a non-floating ``preferred_element_type``, non-integer ``group_sizes`` (and, when they
        are concrete, negative sizes, ``sum > M`` or ``full_groups=True`` with ``sum != M``), a
        non-bool ``full_groups``, unknown ``implementation``, or an explicit ``implementation`` that
        does not support the call (the message gives the reason).
    """
    _check_operands(lhs, rhs, group_sizes, preferred_element_type, full_groups)
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation is None:
        name = default_implementation(lhs, rhs, group_sizes, preferred_element_type)
    else:
        ok, reason = supported(implementation, lhs, rhs, group_sizes, preferred_element_type)
        if not ok:
            raise ValueError(f"{implementation=} does not support this call: {reason}")
        name = implementation
    return BACKENDS[name].fn(lhs, rhs, group_sizes, preferred_element_type, full_groups)
