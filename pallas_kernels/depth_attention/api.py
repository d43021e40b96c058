"""`depth_attention_pallas`: the Block AttnRes depth mix as Pallas kernels behind a `jax.custom_vjp`.

Two call forms, as the model uses them:
  * a sequence of S source arrays [..., D] (an unrolled stack: every source is its own array, and
    each gets its own gradient; no stacked copy is made);
  * one source buffer [S, ..., D] with a static or traced `num_valid` (a scanned stack carries the
    sources in one buffer). With `pass_through=True` the buffer is also returned; threading it on
    lets the backward add the sources' gradient into the buffer's cotangent in place, touching only
    the num_valid slots (XLA's autodiff of the masked mix reads and writes all S slots in fp32).
Memory traffic per call, in units of one [N, D] source: forward n + 1 (n valid sources read once, the
output written); backward, sequence form: 2n + 1 reads (two passes over the sources, the output's
cotangent) and n writes; buffer form: 3n + 1 reads (also the n valid slots of the carried cotangent) and
n writes in place (without a carried cotangent, XLA first zero-fills all S slots); plus an fp32 partial
of ∂L/∂q per program. Kernels: kernels.py. This package never imports k3jax.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import kernels
from pallas_kernels.depth_attention.kernels import Tuning

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# The slot loop is unrolled in the kernels. At 65 slots (Full AttnRes at 32 layers) one compiled GPU test
# (2 x 1000 tokens, D 2048, bf16, gradients) was killed by a 265-s timeout on an H100 with no output
# (2026-12-06), so more slots need a looped slot axis. At 32 slots a buffer's fwd+bwd compiles in 57 s and
# takes 3.6x XLA's time at d 768 (H100, results/depth_gpu_h100.md).
MAX_SLOTS = 32
MAX_D = 8192        # one [1, 8192] fp32 register tile per program at the smallest token tile


def supported(num_slots: int, d: int, dtype) -> tuple[bool, str]:
    """Whether the kernels cover S = `num_slots` sources of hidden size `d` and `dtype`: (ok, why not).

    Shape and dtype only; whether the device can run them (a CUDA GPU, or interpret mode) is the caller's
    check (`k3jax.ops.residuals` runs them by default on compute capability 9.0 only)."""
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return False, f"dtype {jnp.dtype(dtype)} is not one of {[str(t) for t in SUPPORTED_DTYPES]}"
    if not 1 <= num_slots <= MAX_SLOTS:
        return False, f"{num_slots=} sources is outside [1, {MAX_SLOTS}]"
    if not 1 <= d <= MAX_D:
        return False, f"hidden size {d=} is outside [1, {MAX_D}]"
    return True, ""


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mix_list(eps, tuning, interpret, sources, query):
    return kernels.forward(sources, query, len(sources), eps=eps, tuning=tuning, interpret=interpret)


def _mix_list_fwd(eps, tuning, interpret, sources, query):
    out, weights = kernels.forward(sources, query, len(sources), eps=eps, tuning=tuning, interpret=interpret)
    return (out, weights), (sources, query, weights)


def _mix_list_bwd(eps, tuning, interpret, res, cts):
    sources, query, weights = res
    g, dw = cts
    d_sources, dq = kernels.backward(sources, query, len(sources), weights, g, dw.astype(jnp.float32), None,
                                     eps=eps, tuning=tuning, interpret=interpret)
    return d_sources, dq.astype(query.dtype)


_mix_list.defvjp(_mix_list_fwd, _mix_list_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _mix_buffer(static_valid, eps, tuning, interpret, buffer, query, num_valid):
    n = static_valid if static_valid is not None else num_valid
    out, weights = kernels.forward(buffer, query, n, eps=eps, tuning=tuning, interpret=interpret)
    return out, weights, buffer


def _mix_buffer_fwd(static_valid, eps, tuning, interpret, buffer, query, num_valid):
    out, weights, buffer = _mix_buffer(static_valid, eps, tuning, interpret, buffer, query, num_valid)
    return (out, weights, buffer), (buffer, query, num_valid, weights)


def _mix_buffer_bwd(static_valid, eps, tuning, interpret, res, cts):
    buffer, query, num_valid, weights = res
    g, dw, d_buffer = cts
    n = static_valid if static_valid is not None else num_valid
    d_buffer, dq = kernels.backward(buffer, query, n, weights, g, dw.astype(jnp.float32), d_buffer.astype(buffer.dtype),
                                    eps=eps, tuning=tuning, interpret=interpret)
    return d_buffer, dq.astype(query.dtype), None


_mix_buffer.defvjp(_mix_buffer_fwd, _mix_buffer_bwd)
# One jit per (source count, shapes): the depth mixes of an unrolled model that read as many sources share
# one traced jaxpr forward and backward, so JAX lowers each kernel once per source count, not once per mix.
_mix_list_jit = jax.jit(_mix_list, static_argnums=(0, 1, 2))
_mix_buffer_jit = jax.jit(_mix_buffer, static_argnums=(0, 1, 2, 3))


def depth_attention_pallas(sources, query, *, eps: float = 1e-6, num_valid=None, pass_through: bool = False,
                           tuning: Tuning = Tuning(), interpret: bool = False):
    """Softmax attention over depth (Block AttnRes, arXiv 2603.15031 §3) in Pallas kernels.

        out = Σ_s α_s x_s,   α = softmax_s(q · x_s / sqrt(mean_d x_s² + eps))     (per token)

    Args:
      sources: a sequence of S arrays `[..., D]` of one shape and dtype (bf16, fp16 or fp32), or one
        buffer `[S, ..., D]`.
      query: `q [D]`, the pseudo-query times the key RMSNorm scale (w ⊙ γ); cast to fp32, and its
        gradient is fp32.
      eps: the key RMSNorm epsilon.
      num_valid: buffers only: None (all S), a Python int in [1, S], or a traced int32 scalar (not
        range-checked; must be >= 1). Slots >= num_valid get weight 0 and zero gradient.
      pass_through: buffers only: also return the buffer (see the module docstring).
      tuning: tile sizes and warps (`kernels.Tuning`).
      interpret: run the kernel bodies in Pallas interpret mode (CPU).

    Returns:
      `(out [..., D] in the sources' dtype, weights [S, ...] fp32)`, plus the buffer with pass_through.

    Raises:
      ValueError: a buffer of rank < 2, an empty sequence, sources of mixed shapes or dtypes, a call
        `supported` refuses, `query` not `[D]`,
        num_valid or pass_through with a sequence, a static num_valid outside [1, S].
    """
    buffer = not isinstance(sources, (list, tuple))
    if buffer:
        if sources.ndim < 2:
            raise ValueError(f"sources must be [S, ..., D] or a sequence of [..., D]; got {sources.shape=}")
        num_slots, shape, dtype = sources.shape[0], sources.shape[1:], sources.dtype
    else:
        if not sources:
            raise ValueError("sources must hold at least one array")
        shape, dtype = sources[0].shape, sources[0].dtype
        if any(s.shape != shape or s.dtype != dtype for s in sources):
            raise ValueError(f"sources must share one shape and dtype; got {[(s.shape, str(s.dtype)) for s in sources]}")
        if num_valid is not None or pass_through:
            raise ValueError("num_valid and pass_through apply to a buffer [S, ..., D], not to a sequence of sources")
        num_slots = len(sources)
    d = shape[-1] if shape else 0
    ok, why = supported(num_slots, d, dtype)
    if not ok:
        raise ValueError(f"depth_attention_pallas cannot run this call: {why}")
    if query.shape != (d,):
        raise ValueError(f"query must be [D] = [{d}]; got {query.shape=}")
    query = query.astype(jnp.float32)
    num_tokens = math.prod(shape[:-1])
    if not buffer:
        flat = tuple(s.reshape(num_tokens, d) for s in sources)
        out, weights = _mix_list_jit(float(eps), tuning, interpret, flat, query)
        return out.reshape(shape), weights.reshape(num_slots, *shape[:-1])
    static = None
    if num_valid is None:
        static = num_slots
    elif isinstance(num_valid, int):
        if isinstance(num_valid, bool) or not 1 <= num_valid <= num_slots:
            raise ValueError(f"num_valid must be in [1, S] = [1, {num_slots}]; got {num_valid=}")
        static = num_valid
    n = jnp.reshape(jnp.asarray(num_valid if static is None else static, jnp.int32), (1,))
    out, weights, buf = _mix_buffer_jit(static, float(eps), tuning, interpret,
                                        sources.reshape(num_slots, num_tokens, d), query, n)
    result = (out.reshape(shape), weights.reshape(num_slots, *shape[:-1]))
    return result + (buf.reshape(sources.shape),) if pass_through else result
