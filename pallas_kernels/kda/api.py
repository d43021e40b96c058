"""`kda_pallas`: chunked KDA with Pallas kernels behind a `jax.custom_vjp`, and `supported`.

The stage pipeline (plan.py picks a backend per stage; docs/kda_kernels.md):
  forward:  G = chunk cumsum of g; intra_fwd -> qg, kd, w, u, aqk, e^{G_last} (and A, M for the
            backward); [sequence split: per-segment transitions + a scan over segments]; the serial
            state pass with the output o (and the per-chunk states h for the backward).
  backward: [sequence split]; the reverse state pass -> dV', dh; solve_bwd (state products, W / U /
            solve backward) -> dv, dbeta, partial dq, dk, dG and the score gradients; score_bwd ->
            dq, dk, dG; dg = reverse chunk cumsum of dG.
The kernels read and write the user's token-major [B, T, H, .] tensors through BlockSpecs / TMA; XLA
only pads (T to a multiple of 64, K and V to powers of two >= 16: inert zeros) and, with segment_ids,
computes the per-chunk document offsets. Saved for the backward (bf16 inputs, K = V = 128, per
(batch, head) and T tokens): qg, kd, w, u, aqk bf16 (T x 576 x 2 bytes), A, M fp32 (T x 128 x 4),
the per-chunk states h bf16 (T / 64 x 128 x 128 x 2), plus the inputs; nothing is recomputed.
This package never imports k3jax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import mosaic_gpu as mgpu
from pallas_kernels.kda import plan as plan_lib
from pallas_kernels.kda import sequence_split, triton
from pallas_kernels.kda.plan import CHUNK_SIZE, MIN_LOWER_BOUND, Plan, Tuning
from pallas_kernels.kda.triton import common as tcm

MAX_HEAD_DIM = 128         # largest K, V the tests cover
# Largest K, V for compiled fp32 calls: fp32 at K = V = 32 passed the H200 tests; at K = V = 128 the
# backward failed to launch (shared memory 245760 > 232448 bytes, 2026-11-30).
MAX_FP32_HEAD_DIM = 32
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def saved_state_dtype(dtype):
    """Storage dtype of the per-chunk states h, dh: bf16 for bf16 inputs (as fla; the carried state
    stays fp32 in registers), fp32 for fp32 inputs."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def document_offsets(segment_ids, chunk_size: int, padded_length: int):
    """rel [B, Tp] int32 for the kernels' document masks (triton/common.Segments), from segment_ids
    [B, T] (any int): the state restarts at every token whose id differs from the previous token's
    (token 0 never: the initial state belongs to each row's first document); padding joins the last
    document; rel = document index - document index of the token before the chunk."""
    B, T = segment_ids.shape
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    run = jnp.cumsum(jnp.concatenate([jnp.zeros((B, 1), jnp.int32), change], axis=1), axis=1)
    run = jnp.pad(run, ((0, 0), (0, padded_length - T)), mode="edge")
    run = run.reshape(B, padded_length // chunk_size, chunk_size)
    run_in = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), run[:, :-1, -1]], axis=1)
    return (run - run_in[:, :, None]).reshape(B, padded_length).astype(jnp.int32)


def supported(q, k, v, g, beta, *, lower_bound=None, segment_ids=None, use_qk_l2norm=False, chunk_size=CHUNK_SIZE,
              initial_state=None, interpret=False, backend: str = "auto") -> tuple[bool, str]:
    """Whether `kda_pallas` covers this call, and why not if it does not.

    Args: as kda_pallas (arrays or ShapeDtypeStructs), plus use_qk_l2norm (not implemented in the
      kernels; k3jax's kda normalises in XLA first). Returns (True, "") or (False, reason).
    """
    if use_qk_l2norm:
        return False, "use_qk_l2norm=True is not supported by the Pallas KDA kernels"
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            return False, (f"lower_bound must be None or a Python number in [{MIN_LOWER_BOUND}, 0) (a static "
                           f"compile-time promise); got {type(lower_bound).__name__} {lower_bound!r}")
        if not MIN_LOWER_BOUND <= float(lower_bound) < 0:
            return False, f"{lower_bound=} must lie in [{MIN_LOWER_BOUND}, 0) for the Pallas KDA kernels"
    if chunk_size != CHUNK_SIZE:
        return False, f"{chunk_size=} is not supported by the Pallas KDA kernels (only {CHUNK_SIZE})"
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        return False, f"expected q, k, g of one shape [B, T, H, K]; got {q.shape=} {k.shape=} {g.shape=}"
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        return False, f"expected v [B, T, H, V], beta [B, T, H]; got {v.shape=} {beta.shape=}"
    V = v.shape[-1]
    if min(B, T, H, K, V) == 0:
        return False, f"every dimension must be positive; got {q.shape=} {v.shape=}"
    if not jnp.issubdtype(beta.dtype, jnp.floating) or not jnp.issubdtype(g.dtype, jnp.floating):
        return False, f"g and beta must be floating point; got {g.dtype=} {beta.dtype=}"
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return False, f"head dims K={K}, V={V} above {MAX_HEAD_DIM} are not covered by the tests"
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        return False, f"q, k, v must share one dtype in (bfloat16, float32); got {sorted(d.name for d in dtypes)}"
    if not interpret and jnp.dtype(q.dtype) == jnp.dtype(jnp.float32) and max(K, V) > MAX_FP32_HEAD_DIM:
        return False, (f"float32 inputs with K={K}, V={V} above {MAX_FP32_HEAD_DIM} are not supported compiled: "
                       "the backward exceeded the H200's shared memory at K = V = 128 (245760 > 232448 bytes); "
                       "use bfloat16 inputs or interpret=True")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        return False, f"expected initial_state [B, H, K, V]; got {initial_state.shape=}"
    if segment_ids is not None and (tuple(segment_ids.shape) != (B, T)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        return False, f"expected segment_ids [B, T] = {(B, T)} of an integer dtype; got {segment_ids.shape=} " \
                      f"{segment_ids.dtype=}"
    try:
        plan_lib.resolve_backend(backend, q.dtype, _pow2(K), _pow2(V), bool(interpret))
    except ValueError as e:
        return False, str(e)
    return True, ""


def kda_plan(q, k, v, g, beta, *, lower_bound, segment_ids=None, interpret: bool = False, backend: str = "auto",
             sequence_split: int | None = None, tuning: Tuning | None = None) -> Plan:
    """The Plan (which kernel runs each stage) of a kda_pallas call; arrays or ShapeDtypeStructs."""
    B, T, H, K = q.shape
    return plan_lib.make_plan(q.dtype, B, H, -(-T // CHUNK_SIZE) * CHUNK_SIZE, _pow2(K), _pow2(v.shape[-1]),
                              lower_bound=lower_bound, segmented=segment_ids is not None, backend=backend,
                              interpret=bool(interpret), sequence_split=sequence_split, tuning=tuning)


# ------------------------------------------------------------------------------------- stages
def _intra_fwd(plan: Plan, q, k, v, G, beta, rel, *, scale, interpret, save_solve):
    """(qg, kd, w, u, aqk, gl) + (A, M) with save_solve."""
    if plan.intra_fwd == "mosaic_gpu":
        return mgpu.intra_fwd(q, k, v, G, beta, scale=scale, centre=plan.centre, save_solve=save_solve,
                              segments=rel, interpret=interpret)
    qg, kd, w, u, aqk, gl, A, *M = triton.intra_fwd(
        q, k, v, G, beta, scale=scale, centre=plan.centre, unbounded=plan.unbounded, segments=rel,
        save_solve=save_solve, num_warps=plan.tuning.intra_warps, interpret=interpret)
    return (qg, kd, w, u, aqk, gl) + ((A, M[0]) if save_solve else ())


def _state_fwd(plan: Plan, fac, h0, *, out_dtype, interpret, save_states):
    """(o, h or None, ht): the serial pass (split into segments with plan.seg_chunks) and the output."""
    qg, kd, w, u, aqk, gl = fac
    tu = plan.tuning
    starts, ht = h0, None
    if plan.seg_chunks:
        exact = tcm.precisions(qg.dtype)[1]
        P, R = sequence_split.transitions_fwd(kd, w, u, gl, chunk_size=CHUNK_SIZE, seg_chunks=plan.seg_chunks,
                                              block_v=plan.block_v, interpret=interpret, precision=exact,
                                              num_warps=tu.state_warps)
        starts, ht = sequence_split.segment_scan(h0, P, R, reverse=False, block_v=plan.block_v, interpret=interpret,
                                                 precision=exact, num_warps=tu.state_warps)
    if plan.state_fwd == "mosaic_gpu":
        o, h, ht_pass = mgpu.state_fwd(kd, w, u, gl, starts, qg, aqk, write_states=save_states, interpret=interpret)
    else:
        vp, h, ht_pass = triton.state_fwd(kd, w, u, gl, starts, state_dtype=saved_state_dtype(qg.dtype),
                                          block_v=plan.block_v, num_warps=tu.state_warps, interpret=interpret)
        o = triton.output_fwd(qg, aqk, vp, h, out_dtype=out_dtype, num_warps=tu.output_warps, interpret=interpret)
    return o, h, (ht if plan.seg_chunks else ht_pass)


def _state_bwd(plan: Plan, qg, kd, w, aqk, gl, do, dht, *, interpret):
    """(du, dh, dh0): the reverse serial pass (split into segments with plan.seg_chunks)."""
    tu = plan.tuning
    ends = dht
    if plan.seg_chunks:
        exact = tcm.precisions(qg.dtype)[1]
        Q, Z = sequence_split.transitions_bwd(qg, kd, w, aqk, gl, do, chunk_size=CHUNK_SIZE,
                                              seg_chunks=plan.seg_chunks, block_v=plan.block_v, interpret=interpret,
                                              precision=exact, num_warps=tu.state_warps)
        ends, _ = sequence_split.segment_scan(dht, Q, Z, reverse=True, block_v=plan.block_v, interpret=interpret,
                                              precision=exact, num_warps=tu.state_warps)
    if plan.state_bwd == "mosaic_gpu":
        du, dh, dh0 = mgpu.state_bwd(qg, kd, w, aqk, gl, do, ends, interpret=interpret)
    else:
        du, dh, dh0 = triton.state_bwd(qg, kd, w, aqk, gl, do, ends, state_dtype=saved_state_dtype(qg.dtype),
                                       block_v=plan.block_v, num_warps=tu.state_warps, interpret=interpret)
    return du, dh, (dh0[:, :, 0] if plan.seg_chunks else dh0)


# --------------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _core(q, k, v, g, beta, h0, rel, plan, scale, interpret):
    """Padded token-major core: q, k, g [B, Tp, H, Kp]; v [B, Tp, H, Vp]; beta [B, Tp, H]; h0
    [B, H, Vp, Kp] fp32 (transposed); rel None or [B, Tp] int32. Forward-only calls land here: the
    Mosaic GPU pass then writes no per-chunk states."""
    G = triton.chunk_cumsum(g, CHUNK_SIZE, num_warps=plan.tuning.state_warps, interpret=interpret)
    fac = _intra_fwd(plan, q, k, v, G, beta, rel, scale=scale, interpret=interpret, save_solve=False)
    o, _, ht = _state_fwd(plan, fac, h0, out_dtype=v.dtype, interpret=interpret, save_states=False)
    return o, ht


def _core_fwd(q, k, v, g, beta, h0, rel, plan, scale, interpret):
    G = triton.chunk_cumsum(g, CHUNK_SIZE, num_warps=plan.tuning.state_warps, interpret=interpret)
    *fac, A, M = _intra_fwd(plan, q, k, v, G, beta, rel, scale=scale, interpret=interpret, save_solve=True)
    o, h, ht = _state_fwd(plan, fac, h0, out_dtype=v.dtype, interpret=interpret, save_states=True)
    return (o, ht), (q, k, v, G, beta, h0, rel, h, tuple(fac), A, M)


def _core_bwd(plan, scale, interpret, res, cts):
    q, k, v, G, beta, h0, rel, h, (qg, kd, w, u, aqk, gl), A, M = res
    do, dht = cts
    du, dh, dh0 = _state_bwd(plan, qg, kd, w, aqk, gl, do, dht, interpret=interpret)
    tu = plan.tuning
    if plan.solve_bwd == "mosaic_gpu":
        parts = mgpu.solve_bwd(q, k, v, G, beta, do, du, h, dh, w, u, A, M, scale=scale, segments=rel,
                               interpret=interpret)
    else:
        parts = triton.solve_bwd(q, k, v, G, beta, do, du, h, dh, w, u, A, M, scale=scale, segments=rel,
                                 num_warps=tu.intra_warps, interpret=interpret)
    dv, dbeta, *scores = parts
    if plan.score_bwd == "mosaic_gpu":
        dq, dk, dG = mgpu.score_bwd(q, k, G, *scores, scale=scale, centre=plan.centre, interpret=interpret)
    else:
        dq, dk, dG = triton.score_bwd(q, k, G, *scores, scale=scale, centre=plan.centre, unbounded=plan.unbounded,
                                      num_warps=tu.intra_warps, interpret=interpret)
    dg = triton.chunk_cumsum(dG, CHUNK_SIZE, reverse=True, num_warps=tu.state_warps, interpret=interpret)
    return dq, dk, dv, dg, dbeta.astype(beta.dtype), dh0.astype(h0.dtype), None


_core.defvjp(_core_fwd, _core_bwd)
# Under one jit per (plan, shapes), the KDA layers of a model share one traced jaxpr forward and
# backward, so JAX lowers each kernel once instead of once per layer (Mosaic GPU lowering: ~1.5 s a kernel on a CPU host).
_core_jit = jax.jit(_core, static_argnums=(7, 8, 9))


def kda_pallas(q, k, v, g, beta, *, lower_bound: float | None, scale: float | None = None, initial_state=None,
               output_final_state: bool = False, segment_ids=None, chunk_size: int = CHUNK_SIZE,
               backend: str = "auto", interpret: bool = False, sequence_split: int | None = None,
               tuning: Tuning | None = None):
    """Chunked KDA with Pallas kernels, differentiable (custom_vjp; the backward in Pallas too).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (one dtype, bf16 or fp32; bf16 inputs: bf16 dot operands
        with fp32 accumulation, bf16x3 for the error-sensitive dots); g: [B, T, H, K] log-decay in
        nats with lower_bound <= g <= 0 (a caller PROMISE, not checked at run time; g <= 0 also
        without a bound); beta: [B, T, H].
      lower_bound: the declared gate bound in [-5, 0): every 16x16 diagonal tile is one dense dot
        with causal anchors and factors centred by an exact power of two (plan.centre_exponent), exact for
        cotangents of any scale in ~[3e-21, 1e20] with or without fp32 denormals. None: unbounded
        gates (e.g. Kimi Linear's softplus gate): the diagonal tiles run the exact elementwise form.
      scale: query scale, None = K ** -0.5.
      initial_state: [B, H, K, V] (fp32) state before token 0 (each row's first document), or None.
      output_final_state: also return the fp32 final state [B, H, K, V] (with segment_ids: of each
        row's last document).
      segment_ids: None or [B, T] integer document ids of packed sequences: the state restarts at
        every token whose id differs from the previous token's (as k3jax's kda_recurrent).
      chunk_size: 64 (the only supported value).
      backend: "auto" | "triton" | "mosaic_gpu" (plan.py: which kernel runs each stage).
      interpret: run the kernels in (Triton / Mosaic GPU) interpret mode on CPU.
      sequence_split: segment length in chunks of the exact sequence split of the serial passes:
        None = automatic (plan.split_chunks), 0 = one serial pass.
      tuning: plan.Tuning (warps, V block, split targets) or None for the defaults.
    Returns: (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None).
    Raises: ValueError with the reason when `supported(...)` is False.
    Source: Kimi Linear (arXiv 2510.26692) Eq. 1; fla `chunk_kda(..., safe_gate=True, lower_bound)`;
      unbounded gates: the exact pairwise diagonal tiles of k3jax's kda_chunked.
    """
    ok, why = supported(q, k, v, g, beta, lower_bound=lower_bound, chunk_size=chunk_size, interpret=interpret,
                        initial_state=initial_state, segment_ids=segment_ids, backend=backend)
    if not ok:
        raise ValueError(why)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = CHUNK_SIZE
    Tp = -(-T // C) * C
    Kp, Vp = _pow2(K), _pow2(V)
    plan = kda_plan(q, k, v, g, beta, lower_bound=lower_bound, segment_ids=segment_ids, interpret=interpret,
                    backend=backend, sequence_split=sequence_split, tuning=tuning)

    def prep(x, n=None):        # zero padding of T (and K / V) is inert; a no-op when aligned
        pad = [(0, 0), (0, Tp - T), (0, 0)] + ([] if n is None else [(0, n - x.shape[-1])])
        return jnp.pad(x, pad) if any(p[1] for p in pad) else x

    if initial_state is None:
        h0 = jnp.zeros((B, H, Vp, Kp), jnp.float32)
    else:
        h0 = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)
        h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Vp - V), (0, Kp - K)))
    rel = None if segment_ids is None else document_offsets(segment_ids, C, Tp)
    o, ht = _core_jit(prep(q, Kp), prep(k, Kp), prep(v, Vp), prep(g.astype(jnp.float32), Kp), prep(beta), h0, rel,
                  plan, float(scale), bool(interpret))
    o = o[:, :T, :, :V] if (Tp, Vp) != (T, V) else o
    final = jnp.swapaxes(ht[:, :, :V, :K], -1, -2) if output_final_state else None
    return o, final
