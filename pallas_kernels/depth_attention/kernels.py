"""Pallas (Triton on GPU) kernels of the depth attention of Block AttnRes, forward and backward.

Per token, over the S source slots of which the first n take part (arXiv 2603.15031 §3):

    r_s = (mean_d x_s² + eps)^-1/2,   u_s = x_s · q,   logit_s = u_s r_s,
    α = softmax_s(logit),             out = Σ_s α_s x_s                       (q = w ⊙ γ, fp32)

Backward, with g = ∂L/∂out and ω_s = ∂L/∂α_s (the cotangent of the returned weights):

    δ_s = g · x_s + ω_s,   c = Σ_s α_s δ_s,   ℓ_s = α_s (δ_s − c)            (∂L/∂logit_s)
    ∂L/∂x_s = α_s g + ℓ_s (r_s q − u_s r_s³ x_s / D),   ∂L/∂q = Σ_tokens Σ_s ℓ_s r_s x_s

A program owns a tile of `block_t` tokens × the whole (padded) hidden axis, so every per-token
reduction stays in registers and each valid source is read once forward (online softmax) and twice
backward (c needs every δ_s before any ℓ_s). Slots s >= n are predicated off the loads: they cost no
memory traffic. The hidden axis is padded to a power of two `block_d` by masked loads (Triton's
tensors are powers of two; the arrays are never padded). All arithmetic is fp32.
This module never imports k3jax.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Tile sizes and warps (a hashable jit-static value).

    fwd_elems / bwd_elems: elements of one [block_t, block_d] fp32 register tile (block_t =
      elems // block_d, clipped to [1, 64] and to the token count rounded up to a power of two);
      num_warps: Triton warps; fwd_elems = 4096 was the best forward tile of bench_depth_attention's
      `--sweep` at K3-small and 1b (H200, 2026-12-04; that sweep's page was not kept, re-run it), the
      other defaults were not beaten there;
      bwd_programs: target number of backward programs (each loops over several token tiles and
      writes one fp32 partial of ∂L/∂q, summed by XLA).
    """

    fwd_elems: int = 4096
    bwd_elems: int = 4096
    num_warps: int = 4
    bwd_programs: int = 1024

    def block_t(self, elems: int, num_tokens: int, d: int) -> int:
        return int(max(1, min(64, elems // next_pow2(d), next_pow2(num_tokens))))


def _params(num_warps: int):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


class _Slots:
    """The S source slots as the kernel sees them: S separate [N, D] refs (`num_valid` = S, static) or
    one [S, N, D] buffer ref with a static or traced `num_valid`."""

    def __init__(self, refs, buffer: bool, num_slots: int, num_valid):
        self.refs, self.buffer, self.num_slots, self.num_valid = refs, buffer, num_slots, num_valid

    def valid(self, s: int):
        """Whether slot s takes part: a Python bool for a static num_valid, else a traced bool."""
        return s < self.num_valid

    def at(self, ref_or_refs, s, rows, cols):
        if self.buffer:
            return ref_or_refs[0].at[s, rows, cols]
        return ref_or_refs[s].at[rows, cols]


def _masks(i, block_t, block_d, num_tokens, d):
    rows = i * block_t + jnp.arange(block_t)
    cols = jnp.arange(block_d)
    row_ok, col_ok = rows < num_tokens, cols < d
    return rows, cols, row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def _stats(x, q, d, eps):
    """r = (mean x² + eps)^-1/2 and u = x · q per row of an fp32 [block_t, block_d] tile."""
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    return r, jnp.sum(x * q[None, :], axis=1)


def _fwd_kernel(*refs, slots_in: int, buffer: bool, num_slots: int, static_valid, num_tokens: int, d: int,
                eps: float, block_t: int, block_d: int):
    n_ref, q_ref = (refs[0], refs[1]) if static_valid is None else (None, refs[0])
    src = refs[(2 if static_valid is None else 1):][:slots_in]
    out_ref, w_ref = refs[-2], refs[-1]
    num_valid = n_ref[0] if static_valid is None else static_valid
    slots = _Slots(src, buffer, num_slots, num_valid)
    rows, cols, row_ok, col_ok, mask = _masks(pl.program_id(0), block_t, block_d, num_tokens, d)
    q = pltriton.load(q_ref.at[cols], mask=col_ok, other=0.0)

    sp = next_pow2(num_slots)
    slot_ids = jnp.arange(sp)[:, None]
    m = jnp.full((block_t,), -jnp.inf, F32)
    l = jnp.zeros((block_t,), F32)
    acc = jnp.zeros((block_t, block_d), F32)
    logits = jnp.full((sp, block_t), -jnp.inf, F32)
    for s in range(num_slots):
        valid = slots.valid(s)
        if valid is False:
            continue
        ok = mask if valid is True else mask & valid
        x = pltriton.load(slots.at(src, s, rows[:, None], cols[None, :]), mask=ok, other=0.0).astype(F32)
        r, u = _stats(x, q, d, eps)
        logit = u * r
        if valid is not True:
            logit = jnp.where(valid, logit, -jnp.inf)
        logits = jnp.where(slot_ids == s, logit[None, :], logits)
        m_new = jnp.maximum(m, logit)
        rescale = jnp.where(m_new == -jnp.inf, 0.0, jnp.exp(m - m_new))
        p = jnp.where(logit == -jnp.inf, 0.0, jnp.exp(logit - m_new))
        l = l * rescale + p
        acc = acc * rescale[:, None] + p[:, None] * x
        m = m_new
    out = acc / l[:, None]
    pltriton.store(out_ref.at[rows[:, None], cols[None, :]], out.astype(out_ref.dtype), mask=mask)
    weights = jnp.where(logits == -jnp.inf, 0.0, jnp.exp(logits - m[None, :]) / l[None, :])
    pltriton.store(w_ref.at[slot_ids, rows[None, :]], weights,
                   mask=(slot_ids < num_slots) & row_ok[None, :])


def _bwd_kernel(*refs, slots_in: int, buffer: bool, num_slots: int, static_valid, num_tokens: int, d: int,
                eps: float, block_t: int, block_d: int, tiles: int):
    k = 0
    n_ref = None
    if static_valid is None:
        n_ref, k = refs[0], 1
    q_ref = refs[k]
    src = refs[k + 1:k + 1 + slots_in]
    w_ref, g_ref, dw_ref = refs[k + 1 + slots_in:k + 4 + slots_in]
    rest = refs[k + 4 + slots_in:]
    if buffer:  # inputs: the incoming buffer cotangent; outputs: the same buffer (aliased), dq partials
        dsrc_in, dsrc_out, dq_ref = (rest[0],), (rest[1],), rest[2]
    else:
        dsrc_out, dq_ref = rest[:num_slots], rest[num_slots]
    num_valid = n_ref[0] if static_valid is None else static_valid
    slots = _Slots(src, buffer, num_slots, num_valid)
    cols = jnp.arange(block_d)
    col_ok = cols < d
    q = pltriton.load(q_ref.at[cols], mask=col_ok, other=0.0)
    inv_d = 1.0 / d
    program = pl.program_id(0)

    def tile(t, dq):
        rows, _, row_ok, _, mask = _masks(program * tiles + t, block_t, block_d, num_tokens, d)
        g = pltriton.load(g_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(F32)
        loaded = []
        c = jnp.zeros((block_t,), F32)
        for s in range(num_slots):  # pass 1: c = Σ α_s δ_s
            valid = slots.valid(s)
            if valid is False:
                loaded.append(None)
                continue
            ok = mask if valid is True else mask & valid
            rok = row_ok if valid is True else row_ok & valid
            alpha = pltriton.load(w_ref.at[s, rows], mask=rok, other=0.0)
            omega = pltriton.load(dw_ref.at[s, rows], mask=rok, other=0.0)
            x = pltriton.load(slots.at(src, s, rows[:, None], cols[None, :]), mask=ok, other=0.0).astype(F32)
            delta = jnp.sum(g * x, axis=1) + omega
            c = c + alpha * delta
            loaded.append((ok, alpha, delta))
        for s in range(num_slots):  # pass 2: ∂L/∂x_s, ∂L/∂q
            if loaded[s] is None:
                continue
            ok, alpha, delta = loaded[s]
            x = pltriton.load(slots.at(src, s, rows[:, None], cols[None, :]), mask=ok, other=0.0).astype(F32)
            r, u = _stats(x, q, d, eps)
            ell = alpha * (delta - c)
            dx = alpha[:, None] * g + (ell * r)[:, None] * q[None, :] - (ell * u * r * r * r * inv_d)[:, None] * x
            dq = dq + jnp.sum((ell * r)[:, None] * x, axis=0)
            if buffer:
                prev = pltriton.load(slots.at(dsrc_in, s, rows[:, None], cols[None, :]), mask=ok, other=0.0)
                pltriton.store(slots.at(dsrc_out, s, rows[:, None], cols[None, :]),
                               (prev.astype(F32) + dx).astype(dsrc_out[0].dtype), mask=ok)
            else:
                pltriton.store(dsrc_out[s].at[rows[:, None], cols[None, :]], dx.astype(dsrc_out[s].dtype), mask=ok)
        return dq

    dq = jax.lax.fori_loop(0, tiles, tile, jnp.zeros((block_d,), F32))
    pltriton.store(dq_ref.at[program, cols], dq, mask=col_ok)


def forward(sources, query, num_valid, *, eps: float, tuning: Tuning, interpret: bool):
    """Pallas forward. sources: a tuple of S arrays [N, D] or one buffer [S, N, D]; query [D] fp32;
    num_valid: a Python int (static) or an int32 [1] array. Returns (out [N, D] in the sources' dtype,
    weights [S, N] fp32, zero for slots >= num_valid)."""
    buffer = not isinstance(sources, tuple)
    srcs = (sources,) if buffer else sources
    num_slots = sources.shape[0] if buffer else len(sources)
    num_tokens, d = srcs[0].shape[-2:]
    block_d = next_pow2(d)
    block_t = tuning.block_t(tuning.fwd_elems, num_tokens, d)
    static = num_valid if isinstance(num_valid, int) else None
    args = (() if static is not None else (num_valid,)) + (query,) + srcs
    kernel = functools.partial(_fwd_kernel, slots_in=len(srcs), buffer=buffer, num_slots=num_slots,
                               static_valid=static, num_tokens=num_tokens, d=d, eps=eps, block_t=block_t,
                               block_d=block_d)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(num_tokens, block_t),),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, d), srcs[0].dtype),
                   jax.ShapeDtypeStruct((num_slots, num_tokens), F32)),
        compiler_params=_params(tuning.num_warps), interpret=interpret, name="depth_attention_fwd")(*args)


def backward(sources, query, num_valid, weights, g, dw, d_buffer, *, eps: float, tuning: Tuning, interpret: bool):
    """Pallas backward. As `forward`, plus weights [S, N] fp32 (its output), g [N, D] (∂L/∂out), dw [S, N]
    fp32 (∂L/∂weights) and, for a buffer, d_buffer [S, N, D]: the buffer's incoming cotangent, into
    whose slots < num_valid ∂L/∂x_s is added in place (input/output aliasing; the other slots are not
    touched). Returns (∂L/∂sources: a tuple of S arrays, or the updated d_buffer; ∂L/∂query [D] fp32)."""
    buffer = not isinstance(sources, tuple)
    srcs = (sources,) if buffer else sources
    num_slots = sources.shape[0] if buffer else len(sources)
    num_tokens, d = srcs[0].shape[-2:]
    block_d = next_pow2(d)
    block_t = tuning.block_t(tuning.bwd_elems, num_tokens, d)
    num_tiles = pl.cdiv(num_tokens, block_t)
    tiles = pl.cdiv(num_tiles, min(num_tiles, tuning.bwd_programs))
    programs = pl.cdiv(num_tiles, tiles)
    static = num_valid if isinstance(num_valid, int) else None
    args = (() if static is not None else (num_valid,)) + (query,) + srcs + (weights, g, dw)
    dq_shape = jax.ShapeDtypeStruct((programs, d), F32)
    if buffer:
        args = args + (d_buffer,)
        out_shape = (jax.ShapeDtypeStruct(d_buffer.shape, d_buffer.dtype), dq_shape)
        aliases = {len(args) - 1: 0}
    else:
        out_shape = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in srcs) + (dq_shape,)
        aliases = {}
    kernel = functools.partial(_bwd_kernel, slots_in=len(srcs), buffer=buffer, num_slots=num_slots,
                               static_valid=static, num_tokens=num_tokens, d=d, eps=eps, block_t=block_t,
                               block_d=block_d, tiles=tiles)
    outs = pl.pallas_call(
        kernel, grid=(programs,), out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=_params(tuning.num_warps), interpret=interpret, name="depth_attention_bwd")(*args)
    dq = jnp.sum(outs[-1], axis=0)
    return (outs[0] if buffer else tuple(outs[:-1])), dq
