"""Kimi Delta Attention (KDA): gates, the public op with its dispatch, and the one-token decode step.

- `kda_gate`: the two log-decay parameterisations (Kimi Linear's softplus gate; K3's bounded gate).
- `kda`: the one public entry point; `implementation` picks the recurrent oracle, the XLA chunk form
  (`kda_chunked`, see k3jax/ops/kda_chunked.py) or the Pallas kernel.
- `kda_decode_step`: one token per sequence against a cached fp32 state (generation).

Shapes follow fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] fp32.
Source: Kimi Linear (arXiv 2510.26692) Eq. 1; fla `fla/ops/kda` (naive.py, gate.py, chunk.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from k3jax.ops.kda_chunked import kda_chunked, validate_chunk_size, validate_lower_bound
from k3jax.ops.kda_reference import kda_recurrent, l2_normalize, validate_kda_inputs

__all__ = ["kda", "kda_gate", "kda_gate_init", "kda_chunked", "kda_recurrent", "kda_decode_step", "kda_value_checks",
           "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("recurrent", "chunked", "pallas")


def kda_gate(
    g_raw: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array | None = None,
    *,
    lower_bound: float | None = None,
) -> jax.Array:
    """Per-channel log-decay g (nats, <= 0) from the gate projection, in fp32.

    lower_bound=None (Kimi Linear):  g = -exp(A_log[h]) * softplus(g_raw + dt_bias)   (g in (-inf, 0])
    lower_bound=b (K3, bounded):     g = b * sigmoid(exp(A_log[h]) * (g_raw + dt_bias)) (g in [b, 0])
    (mathematically open intervals; fp32 sigmoid/softplus saturate, so b and 0 themselves occur)

    Args:
      g_raw: [B, T, H, K] gate projection output (any float dtype).
      A_log: [H] log of the per-head decay rate.
      dt_bias: [H * K] or [H, K] bias added to g_raw, or None.
      lower_bound: None, or a Python number in [-5, 0).

    Returns:
      g: [B, T, H, K] float32.

    Raises:
      ValueError: g_raw not 4-D, A_log not [H], dt_bias not [H*K]/[H, K], lower_bound outside [-5, 0).

    Source: fla `fla/ops/kda/gate.py` (`naive_kda_gate` and its lower_bound variant); ANCHORS.md §1.
    """
    validate_lower_bound(lower_bound)
    if g_raw.ndim != 4:
        raise ValueError(f"g_raw must be [B, T, H, K]; got {g_raw.shape=}")
    H, K = g_raw.shape[2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must be [H] = {(H,)}; got {A_log.shape=}")
    x = g_raw.astype(jnp.float32)
    if dt_bias is not None:
        if dt_bias.shape not in ((H * K,), (H, K)):
            raise ValueError(f"dt_bias must be [H*K] = {(H * K,)} or [H, K] = {(H, K)}; got {dt_bias.shape=}")
        x = x + dt_bias.astype(jnp.float32).reshape(H, K)
    A = jnp.exp(A_log.astype(jnp.float32))[:, None]                       # [H, 1]
    if lower_bound is None:
        return -A * jax.nn.softplus(x)
    return float(lower_bound) * jax.nn.sigmoid(A * x)


def kda_gate_init(A_log_key, dt_key, num_heads: int, head_dim: int, *, dtype=jnp.float32):
    """fla's initialisation of the gate parameters: (A_log [H], dt_bias [H*K]) in `dtype`.

    A_log = log U(1, 16); dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1], so that
    softplus(dt_bias) = dt. Source: fla `fla/layers/kda.py` (A_log, dt_bias init). Two keys, one per draw.
    """
    A_log = jnp.log(jax.random.uniform(A_log_key, (num_heads,), dtype, 1.0, 16.0))
    dt = jnp.exp(jax.random.uniform(dt_key, (num_heads * head_dim,), dtype, math.log(1e-3), math.log(1e-1)))
    return A_log, dt + jnp.log(-jnp.expm1(-dt))                            # inverse softplus


def _pallas_covers(q, k, v, g, beta, *, lower_bound, segment_ids, chunk_size, initial_state, interpret) -> bool:
    """Whether implementation=None runs the Pallas kernel: only where its GPU tests ran (a CUDA
    device of compute capability 9.0: the H200 of tests/pallas_kernels -m gpu), compiled, and
    for calls `supported` accepts. On the H200 the kernels measured 5.9x / 3.7x faster than the
    chunked op forward / forward+backward at 8x4096x16x128 bf16 (2026-12-01, before the round-12
    reorder of the Hopper passes' loads; experiments/results/kda_h200.md)."""
    if interpret or jax.default_backend() != "gpu":
        return False
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        return False
    import pallas_kernels.kda as pallas_kda
    ok, _ = pallas_kda.supported(q, k, v, g, beta, lower_bound=lower_bound, segment_ids=segment_ids,
                                 use_qk_l2norm=False, chunk_size=chunk_size, initial_state=initial_state,
                                 interpret=False)
    return ok


def kda_value_checks(q, k, v, g, beta, *, lower_bound: float | None = None, initial_state=None) -> None:
    """`jax.experimental.checkify` checks of the values `kda` assumes (what `kda(check_values=True)` runs).

    q, k, v, beta and initial_state finite; g finite and <= 0 (log-decay in nats); g >= lower_bound when
    one is declared. None of these can raise inside `jit` on their own: eagerly a failed check raises
    `JaxRuntimeError` (a ValueError) at once; under `jit`, functionalise the caller,
    `err, out = jax.jit(checkify.checkify(f))(...)`, and `err.throw()`. A jitted caller that is not
    functionalised fails to trace (checkify's "not functionalized" error), so checks never vanish silently.
    Cost: one reduction over each input.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", initial_state), ("g", g)):
        if x is None:
            continue
        bad = jnp.sum(~jnp.isfinite(x))
        checkify.check(bad == 0, f"kda: {name} must be finite; got {{bad}} NaN/inf values of {x.size}", bad=bad)
    g_max, g_min = jnp.max(g), jnp.min(g)
    checkify.check(g_max <= 0, "kda: g must be <= 0 (log-decay in nats); got max(g) = {g_max}", g_max=g_max)
    if lower_bound is not None:
        checkify.check(g_min >= lower_bound, f"kda: g must be >= lower_bound={float(lower_bound)} (the caller's "
                       "promise); got min(g) = {g_min}", g_min=g_min)


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    implementation: str | None = None,
    interpret: bool = False,
    check_values: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T (scale q_t), per head.

    Contract on values (not checked by default; shapes and dtypes always are): g finite and <= 0, and
    >= lower_bound when one is declared; q, k, v, beta finite. A NaN in g turns that head's outputs NaN
    from its token on (every implementation); g > 0 makes the state grow exponentially (g = 0.5 over 128
    tokens: |state| ~ 1e25); g below a declared lower_bound can turn the bounded chunked path's outputs
    all NaN (g = -6 with lower_bound=-5). `check_values=True` checks all of it (`kda_value_checks`).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (nats, finite, <= 0;
        -inf gives NaN in the chunk forms); beta: [B, T, H]. All of a floating dtype.
      scale: query scale, None = K ** -0.5.
      initial_state: [B, H, K, V] fp32 state before token 0 (first segment of each row only).
      output_final_state: also return the fp32 final state [B, H, K, V].
      segment_ids: [B, T] integer document ids; the state restarts at every change of id.
      use_qk_l2norm: L2-normalise q, k along K first.
      lower_bound: the caller's promise that g >= lower_bound (in [-5, 0)); lets the chunked op use a
        single bf16 GEMM per 16-token diagonal tile. None = exact path for any finite g <= 0 (the
        chunk forms take differences of within-chunk cumsums: with one gate near -1e4 among mild
        ones the fp32 error of the mild tokens' decay reaches ~1e-3 relative, in "chunked" and
        "pallas" alike; tests/pallas_kernels/kda/test_edges.py).
      chunk_size: chunk length for "chunked" (power of two >= 16).
      implementation: None = "pallas" where its GPU tests cover the call (compiled, i.e.
        interpret=False, on a CUDA device of compute capability 9.0 — the tests ran on an H200 —
        and `pallas_kernels.kda.supported` true: bounded or unbounded gates, segment_ids,
        states), else "chunked" (fail-closed: never a call the kernel was not tested for);
        "recurrent" (the fp32 oracle, O(T) sequential steps), "chunked" (XLA chunk form) or
        "pallas" (pallas_kernels.kda.kda_pallas, backend "auto", with use_qk_l2norm done by XLA before it; an
        explicit request it does not cover, e.g. chunk_size=32, raises).
      interpret: run the Pallas kernel in interpret mode (CPU); with implementation=None it keeps
        the dispatch off the kernel; ignored by "recurrent" and "chunked".
      check_values: add the `jax.experimental.checkify` checks of `kda_value_checks` (the contract
        above) before dispatch: eagerly they raise at once; under `jit` wrap the caller with
        `checkify.checkify` (a jitted call without it fails to trace). A debugging aid: one reduction
        per input.

    Returns:
      (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None).

    Raises:
      ValueError: unknown implementation, "pallas" for a call the kernel does not cover (or with
        interpret=False off a GPU), mismatched shapes, a non-floating q/k/v/g/beta, bad chunk_size or
        lower_bound (the message names the argument). With check_values=True, `JaxRuntimeError` (a
        ValueError) naming the input whose values break the contract.

    Source: Kimi Linear (arXiv 2510.26692) Eq. 1; fla `chunk_kda` / `naive_recurrent_kda`.
    """
    if implementation not in (None,) + IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}; got {implementation=}")
    validate_lower_bound(lower_bound)
    validate_chunk_size(chunk_size)
    # Every implementation gets the same shape / dtype checks (ValueError naming the argument) before
    # dispatch, so an explicit "pallas" call never fails inside a kernel on a bad shape.
    validate_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, scale=scale)
    if check_values:
        kda_value_checks(q, k, v, g, beta, lower_bound=lower_bound, initial_state=initial_state)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  segment_ids=segment_ids, use_qk_l2norm=use_qk_l2norm)
    if implementation is None and _pallas_covers(q, k, v, g, beta, lower_bound=lower_bound, segment_ids=segment_ids,
                                                 chunk_size=chunk_size,
                                                 initial_state=initial_state, interpret=interpret):
        implementation = "pallas"
    if implementation == "pallas":
        # Unsupported explicit requests raise with the kernel's reason.
        import pallas_kernels.kda as pallas_kda
        if use_qk_l2norm:  # in XLA before the kernel: fp32 norms (as the chunked op), then q's / k's dtype
            q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
        ok, why = pallas_kda.supported(q, k, v, g, beta, lower_bound=lower_bound, segment_ids=segment_ids,
                                       chunk_size=chunk_size, initial_state=initial_state, interpret=interpret)
        if not ok:
            raise ValueError(f"{implementation=} cannot run this call: {why}")
        if not interpret and jax.default_backend() != "gpu":
            raise ValueError(f"{implementation=} with interpret=False compiles the kernels for a CUDA GPU (Triton "
                             f"lowering); the backend is {jax.default_backend()!r}: pass interpret=True on CPU")
        return pallas_kda.kda_pallas(q, k, v, g, beta, lower_bound=lower_bound, scale=scale,
                                     initial_state=initial_state, output_final_state=output_final_state,
                                     segment_ids=segment_ids, chunk_size=chunk_size, interpret=interpret)
    if implementation == "recurrent":
        return kda_recurrent(q, k, v, g, beta, **common)
    return kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, lower_bound=lower_bound, **common)


def kda_decode_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One KDA token per sequence against a cached state (the recurrence's step, fp32).

    Args:
      q, k, g: [B, H, K] (one token; no time axis). g is the log-decay in nats.
      v: [B, H, V].
      beta: [B, H].
      state: [B, H, K, V] state before this token (cast to fp32).
      scale: query scale, None = K ** -0.5.
      use_qk_l2norm: L2-normalise q, k along K first.

    Returns:
      (o [B, H, V] in v's dtype, state [B, H, K, V] fp32 after this token).

    Raises:
      ValueError: mismatched shapes (the message names the argument).

    Source: fla `naive_recurrent_kda` step (decay, delta rule, output); Kimi Linear Eq. 1.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, K] (one token); got {q.shape=}")
    B, H, K = q.shape
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape [B, H, K]; got {name}.shape={x.shape}, {q.shape=}")
    if v.ndim != 3 or v.shape[:2] != (B, H):
        raise ValueError(f"v must be [B, H, V]; got {v.shape=}, {q.shape=}")
    if beta.shape != (B, H):
        raise ValueError(f"beta must be [B, H]; got {beta.shape=}")
    if state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}; got {state.shape=}")
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k, g, b = q.astype(f32) * scale, k.astype(f32), g.astype(f32), beta.astype(f32)
    S = state.astype(f32) * jnp.exp(g)[..., None]
    v_old = jnp.einsum("bhk,bhkv->bhv", k, S, precision=jax.lax.Precision.HIGHEST)
    S = S + jnp.einsum("bhk,bhv->bhkv", b[..., None] * k, v.astype(f32) - v_old,
                       precision=jax.lax.Precision.HIGHEST)
    o = jnp.einsum("bhk,bhkv->bhv", q, S, precision=jax.lax.Precision.HIGHEST)
    return o.astype(v.dtype), S
