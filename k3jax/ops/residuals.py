"""Residual schemes over depth: Block Attention Residuals (AttnRes) and the seed article's variant.

Block AttnRes (Kimi Team, "Attention Residuals", arXiv 2603.15031, §3; Kimi K3 report §2.2) replaces
the fixed residual sum with a softmax mix over depth. Count attention/mixer and FFN sublayers as
f_1..f_L; b_0 is the token embedding; the L sublayers are split into N consecutive blocks. Inside
block n (n = 1..N) a running partial sum b_n^i = Σ_{j ≤ i} f_{n,j}(h_{n,j}) of the block's sublayer
outputs is kept; when the block ends it becomes the source b_n. The input of the i-th sublayer of
block n is

    h_{n,i} = Σ_{s ∈ S_{n,i}} α_s · s,   α = softmax_s( w_{n,i} · RMSNorm(s) ),          (AttnRes)
    S_{n,1} = [b_0, …, b_{n−1}],  S_{n,i} = [b_0, …, b_{n−1}, b_n^{i−1}]  for i ≥ 2,

with one learned pseudo-query w ∈ R^D per sublayer (zero-initialised: uniform weights at start), an
RMSNorm with its own scale on the keys only (values are not normalised), no 1/√D, softmax in fp32.
The final norm reads one more mix over [b_0, …, b_N] with its own pseudo-query and key norm.

First sublayer of a block. Its partial sum is still empty, so it is NOT a source: the mix runs over
the completed sources only. This is what the paper's reference pseudocode does (the block-boundary
test appends the finished partial sum to ``blocks`` after it was used as the last value of the
pre-attention mix and restarts from ``None``; the first sublayer of the whole network mixes over the
embedding alone), and it is the only choice for which N = L reproduces Full AttnRes,
h_l = Σ_{i<l} α_{i→l} v_i with v_0 = embedding and v_i = f_i(h_i) (a zero source would add a spurious
value 0 with logit 0 and soak up weight).

Consequences worth knowing: the first sublayer's input is always the embedding (one source, weight 1)
so its pseudo-query gets exactly zero gradient; a source buffer needs N + 1 slots.

Article-literal variant ("article_block", the seed article §4.2): per-layer PreNorm residuals inside
blocks of whole transformer layers; at each block boundary the attention output times a learned
scalar α becomes the next block's input with no residual add. See `article_block_forward`.

Precision: RMS statistics, logits, softmax and the weighted sum over depth are fp32 (elementwise
products and reductions, no TF32 matmul); outputs are returned in the sources' dtype.

Implementations of the depth mix: "xla" (the jnp code below, autodiff) and "pallas"
(`pallas_kernels.depth_attention`: one fused kernel forward and one backward that read each valid
source once / twice; implementation=None picks it on an H100/H200, compiled).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

UNITS = ("sublayers", "layers")
IMPLEMENTATIONS = ("xla", "pallas")
SUBLAYERS_PER_LAYER = 2  # one mixer (attention or KDA) + one FFN (MLP or MoE) per transformer layer


# ---------------------------------------------------------------------------------------------------
# Depth attention
# ---------------------------------------------------------------------------------------------------
def _source_logits(x: Array, query: Array, eps: float) -> Array:
    """w · RMSNorm(x) over the last axis in fp32: (x · (w ⊙ γ)) / sqrt(mean(x²) + eps)."""
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1)
    return jnp.sum(x32 * query, axis=-1) * jax.lax.rsqrt(mean_square + eps)


def depth_attention(sources, pseudo_query, key_norm_scale, *, eps: float = 1e-6, num_valid=None,
                    return_weights: bool = False, implementation: str | None = None, interpret: bool = False):
    """Softmax attention over depth with a learned pseudo-query (AttnRes, arXiv 2603.15031 §3).

        out = Σ_s α_s · source_s,   α = softmax_s( w · RMSNorm_γ(source_s) ),
        RMSNorm_γ(x) = γ ⊙ x / sqrt(mean_d(x_d²) + eps)

    per token. Values are the raw sources (not normalised); there is no 1/√D temperature.

    Args:
      sources: the depth sources, either one stacked array `[S, B, T, D]` (any leading shape after S
        works: `[S, ..., D]`) or a sequence of S arrays `[B, T, D]` of one shape and dtype. Prefer the
        sequence inside a Python loop over layers: no stacked copy is made (except by "pallas" with a
        traced `num_valid`, which stacks the sequence into one buffer), so the backward pass keeps
        each source once however many sublayers read it (measured, XLA CPU temp memory of jit(grad)
        for 64 sublayers, in units of one [B, T, D] fp32 array: plain PreNorm 209, AttnRes with
        sequences 282 (N = 8) / 286 (N = 16), with a fresh jnp.stack per sublayer 589 / 870).
        Any float dtype.
      pseudo_query: `w [D]`, the sublayer's learned query (zero-initialised in the model).
      key_norm_scale: `γ [D]`, the scale of the RMSNorm applied to the keys (ones at init).
      eps: RMSNorm epsilon (added to the mean square).
      num_valid: None (all S sources take part) or the number of leading sources that take part,
        as a Python int in [1, S] or a traced int32 scalar (for a fixed-size source buffer inside
        `lax.scan`; a traced value is not range-checked and must be ≥ 1). The others get logit −inf
        via a select and are also selected out of the sum, so they never affect the output; they
        must hold finite values for their (zero) gradient to stay finite: zero-initialise buffers.
      return_weights: also return the depth weights.
      implementation: None (the Pallas kernels where their GPU tests ran: compiled on a CUDA device
        of compute capability 9.0, tested on the H200 only, for calls `pallas_kernels.depth_attention.supported` covers; else
        "xla"), "xla" or "pallas" (an explicit "pallas" it cannot run raises).
      interpret: run the Pallas kernels in interpret mode (CPU); with implementation=None it keeps the
        dispatch on "xla".

    Returns:
      `out [B, T, D]` in the sources' dtype; with `return_weights=True`, `(out, weights)` where
      `weights [S, B, T]` fp32 sums to 1 over S (masked sources have weight exactly 0).

    Precision: the mean square, the logits, the softmax and the weighted sum are computed in fp32
    from the sources as given (bf16 sources are upcast, never the other way round).

    Raises:
      ValueError: `sources` empty, of rank < 2, or of mixed shapes/dtypes; `pseudo_query` or
        `key_norm_scale` not `[D]`; static `num_valid` outside [1, S]; `eps` negative; an unknown
        `implementation`, or "pallas" for a call it cannot run.
    """
    sources, num_sources, dtype = _check_depth_inputs(sources, pseudo_query, key_norm_scale, eps, num_valid)
    implementation = _choose(implementation, num_sources, sources, interpret)
    if implementation == "pallas":
        from pallas_kernels.depth_attention import depth_attention_pallas  # noqa: PLC0415
        query = jnp.asarray(pseudo_query, jnp.float32) * jnp.asarray(key_norm_scale, jnp.float32)
        cut = 0
        if isinstance(sources, list) and num_valid is not None:
            if isinstance(num_valid, (int, np.integer)):  # the first num_valid arrays, weight 0 for the rest
                cut, sources, num_valid = num_sources - int(num_valid), sources[:int(num_valid)], None
            else:
                sources = jnp.stack(sources)
        if isinstance(sources, list):
            out, weights = depth_attention_pallas(tuple(sources), query, eps=eps, interpret=interpret)
        else:
            out, weights = depth_attention_pallas(sources, query, eps=eps, num_valid=num_valid, interpret=interpret)
        if cut:
            weights = jnp.concatenate([weights, jnp.zeros((cut, *weights.shape[1:]), weights.dtype)])
        return (out, weights) if return_weights else out
    return _depth_attention_xla(sources, pseudo_query, key_norm_scale, eps=eps, num_valid=num_valid,
                                return_weights=return_weights)


def depth_attention_carry(buffer, pseudo_query, key_norm_scale, *, eps: float = 1e-6, num_valid=None,
                          implementation: str | None = None, interpret: bool = False):
    """`depth_attention` on a source buffer `[S, B, T, D]` that also returns the buffer, for a scan.

    Thread the buffer through this call (use the returned one from then on): with "pallas" the
    backward then adds the sources' gradient into the buffer's cotangent in place, reading and writing
    only the first `num_valid` slots, instead of materialising a full `[S, B, T, D]` gradient per call.
    With "xla" the buffer is returned as it is.

    Args:
      buffer: the source buffer `[S, B, T, D]` (any leading shape after S; bf16, fp16 or fp32 for
        "pallas"); slots at and after `num_valid` must hold finite values (zero-initialise it).
      pseudo_query, key_norm_scale, eps, num_valid, implementation, interpret: as `depth_attention`
        (`w [D]`, `γ [D]`).

    Returns:
      `(out [B, T, D] in the buffer's dtype, weights [S, B, T] fp32, buffer)`.

    Raises:
      ValueError: as `depth_attention`; `buffer` a sequence.
    """
    if isinstance(buffer, (list, tuple)):
        raise ValueError("buffer must be one array [S, B, T, D], got a sequence")
    buffer, num_sources, _ = _check_depth_inputs(buffer, pseudo_query, key_norm_scale, eps, num_valid)
    if _choose(implementation, num_sources, buffer, interpret) == "pallas":
        from pallas_kernels.depth_attention import depth_attention_pallas  # noqa: PLC0415
        query = jnp.asarray(pseudo_query, jnp.float32) * jnp.asarray(key_norm_scale, jnp.float32)
        return depth_attention_pallas(buffer, query, eps=eps, num_valid=num_valid, pass_through=True,
                                      interpret=interpret)
    out, weights = _depth_attention_xla(buffer, pseudo_query, key_norm_scale, eps=eps, num_valid=num_valid,
                                        return_weights=True)
    return out, weights, buffer


@jax.custom_vjp
def add_to_slot(buffer, update, slot):
    """`buffer` with `update` added to slot `slot`: the scanned source buffer's partial-sum update.

    Args:
      buffer: `[S, B, T, D]`. update: `[B, T, D]`, exactly `buffer.shape[1:]` (cast to the buffer's
        dtype). slot: int scalar, may be traced; read as `jax.lax.dynamic_index_in_dim` reads it
        (a negative slot counts from the end, then it is clamped to `[0, S)`).

    Returns:
      The updated buffer, `buffer`'s shape and dtype.

    Raises:
      ValueError: `update`'s shape is not `buffer.shape[1:]` (no broadcasting).

    The gradient is written by hand: the buffer's cotangent passes through unchanged and the update's
    is that slot of it. JAX's own derivative of index + add + update zeroes the slot in a copy and adds
    a zero-padded slot back, a full pass over the buffer per sublayer that XLA cannot fuse into the
    Pallas depth-mix backward.
    """
    if update.shape != buffer.shape[1:]:
        raise ValueError(f"update must be buffer.shape[1:] = {buffer.shape[1:]}; got {update.shape}")
    current = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, current + update.astype(buffer.dtype), slot, 0)


def _add_to_slot_fwd(buffer, update, slot):
    return add_to_slot(buffer, update, slot), (slot, jnp.zeros((0,), update.dtype))


def _add_to_slot_bwd(res, g):
    slot, like = res
    dupdate = jax.lax.dynamic_index_in_dim(g, slot, 0, keepdims=False).astype(like.dtype)
    return g, dupdate, np.zeros(np.shape(slot), jax.dtypes.float0)


add_to_slot.defvjp(_add_to_slot_fwd, _add_to_slot_bwd)


def scan_source_buffer(body: Callable, buffer: Array, xs, first_slot) -> tuple[Array, object]:
    """`jax.lax.scan(jax.checkpoint(body), buffer, xs)` over a source buffer that only grows, keeping two
    buffers and one slot per step for the backward pass instead of one buffer per step.

    A scan saves its carry at every step for the backward pass: with Block AttnRes's buffer
    `[N + 1, B, T, D]` carried over G steps that is G buffers (Full AttnRes at 32 layers, d 512,
    16 × 1024 tokens, bf16: 32 GiB of the step's 39.6 on an H100, `experiments/results/depth_gpu_h100.md`).
    Here the forward keeps the first buffer, the final one, and per step the slot that step starts
    adding to; the backward rebuilds step g's buffer exactly from them and recomputes the step (as remat
    "full" does): slots below `first_slot[g]` hold their final values, slot `first_slot[g]` its saved
    partial sum, the slots above it still hold the first buffer's. The reverse scan carries the rebuilt
    buffer and rewrites a window of `1 + max_g(first_slot[g + 1] - first_slot[g])` slots per step from
    step g + 1's, not the whole buffer; so a body that breaks the contract below at step g also corrupts
    the rebuild of every step before it.

    Args:
      body: `(buffer [S, ...], x) -> (buffer, y)`, one step. Step g may write only slots s with
        `first_slot[g] <= s <= first_slot[g + 1]` (any s >= first_slot[g] for the last step): then no
        slot below a step's first slot changes after it, which the rebuild needs. This is not checked: a
        body that breaks it gets the right values and silently wrong gradients (the model's block ids never
        decrease, so its periods satisfy it). The backward runs `body` again, so anything random in it
        must come from `xs` or the closure. It may close over arrays; every closed-over array becomes an
        argument of the custom VJP (integer ones get float0 cotangents).
      buffer: the initial buffer `[S, ...]` (any float dtype).
      xs: the scanned inputs, a pytree of arrays with leading axis G.
      first_slot: `[G]` ints, non-decreasing (a NumPy array or a sequence; static): the lowest slot
        step g writes.

    Returns:
      `(final buffer, ys)` as `jax.lax.scan` returns them; the same values and gradients as
      `jax.lax.scan(jax.checkpoint(body), buffer, xs)` (`tests/k3jax/ops/test_residuals.py`).

    Raises:
      ValueError: `xs` without arrays; `first_slot` not 1-D of length G, decreasing, or outside `[0, S)`.
    """
    first_slot = np.asarray(first_slot)
    if not jax.tree.leaves(xs):
        raise ValueError("xs must hold at least one array with the leading axis G (the number of steps)")
    steps = jax.tree.leaves(xs)[0].shape[0]
    if first_slot.ndim != 1 or first_slot.shape[0] != steps:
        raise ValueError(f"first_slot must be [G] = [{steps}], got shape {first_slot.shape}")
    if np.any(np.diff(first_slot) < 0) or first_slot.min() < 0 or first_slot.max() >= buffer.shape[0]:
        raise ValueError(f"first_slot must be non-decreasing in [0, {buffer.shape[0]}), got {first_slot.tolist()}")
    step, consts = _lift_constants(body, buffer, jax.tree.map(lambda a: a[0], xs))
    return _scan_source_buffer(step, tuple(int(s) for s in first_slot), consts, buffer, xs)


def _lift_constants(body, buffer, x):
    """`body` as a function of `(buffer, x, *consts)` with EVERY array it closes over in consts.

    `jax.closure_convert` lifts only values that may carry a gradient; an integer tracer of an enclosing
    jit (segment ids, positions) would stay inside the custom VJP's non-differentiable `step` and fail
    under `grad(jit(...))`."""
    closed, out_shape = jax.make_jaxpr(body, return_shape=True)(buffer, x)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = closed.jaxpr

    def step(b, x_, *consts):
        out = jax.core.eval_jaxpr(jaxpr, consts, *jax.tree.leaves((b, x_)))
        return jax.tree.unflatten(out_tree, out)
    return step, [jnp.asarray(c) for c in closed.consts]


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _float0_like(x):
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _rebuilt(final, first, partial, slot):
    """The buffer a step that starts at `slot` saw: final values below it, `partial` at it, `first` above."""
    index = jnp.arange(final.shape[0]).reshape((-1,) + (1,) * (final.ndim - 1))
    return jnp.where(index < slot, final, jnp.where(index == slot, partial[None], first))


def _rebuilt_from_next(seen_next, first, partial, slot, next_slot, width):
    """Step g's buffer from step g + 1's (`seen_next`, which starts at `next_slot` >= `slot`): slots
    `slot + 1 .. next_slot` back to `first`, slot `slot` to `partial`. `width` (static) >= next_slot - slot;
    only a window of `width` slots is read and written."""
    if width > 0:
        start = jnp.minimum(slot + 1, seen_next.shape[0] - width)  # the clamp dynamic_update_slice would do
        window = jax.lax.dynamic_slice_in_dim(seen_next, start, width, 0)
        index = (start + jnp.arange(width)).reshape((-1,) + (1,) * (seen_next.ndim - 1))
        restore = (index > slot) & (index <= next_slot)
        window = jnp.where(restore, jax.lax.dynamic_slice_in_dim(first, start, width, 0), window)
        seen_next = jax.lax.dynamic_update_slice_in_dim(seen_next, window, start, 0)
    return jax.lax.dynamic_update_index_in_dim(seen_next, partial.astype(seen_next.dtype), slot, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan_source_buffer(step, first_slot, consts, buffer, xs):
    final, ys, _ = _scan_forward(step, first_slot, consts, buffer, xs)
    return final, ys


def _scan_forward(step, first_slot, consts, buffer, xs):
    def one(carry, inputs):
        x, slot = inputs
        partial = jax.lax.dynamic_index_in_dim(carry, slot, 0, keepdims=False)
        carry, y = step(carry, x, *consts)
        return carry, (y, partial)

    final, (ys, partials) = jax.lax.scan(one, buffer, (xs, jnp.asarray(first_slot, jnp.int32)))
    return final, ys, partials


def _scan_source_buffer_fwd(step, first_slot, consts, buffer, xs):
    final, ys, partials = _scan_forward(step, first_slot, consts, buffer, xs)
    return (final, ys), (consts, buffer, xs, final, partials)


def _scan_source_buffer_bwd(step, first_slot, res, cts):
    consts, first, xs, final, partials = res
    ct_final, ct_ys = cts
    # integer leaves (float0 cotangents) do not go through the reverse scan: they are rebuilt outside it
    x_leaves, x_tree = jax.tree.flatten(xs)
    x_float = [_is_float(a) for a in x_leaves]
    y_leaves, y_tree = jax.tree.flatten(ct_ys)
    y_float = [c.dtype != jax.dtypes.float0 for c in y_leaves]
    c_float = [_is_float(c) for c in consts]

    # step g's buffer is built from step g + 1's; the last step's once, from the final buffer
    next_slot = np.append(first_slot[1:], first_slot[-1])
    width = int(np.max(next_slot - np.asarray(first_slot)))

    def one(carry, inputs):
        ct_buffer, ct_consts, seen = carry
        x, slot, nxt, partial, ct_y_float = inputs
        x_step = jax.tree.unflatten(x_tree, x)
        seen = _rebuilt_from_next(seen, first, partial, slot, nxt, width)
        (_, y), pullback = jax.vjp(step, seen, x_step, *consts)
        it = iter(ct_y_float)
        ct_y = [next(it) if f else _float0_like(l) for f, l in zip(y_float, jax.tree.leaves(y))]
        ct_b, ct_x, *ct_c = pullback((ct_buffer, jax.tree.unflatten(y_tree, ct_y)))
        ct_consts = [a + b for a, b in zip(ct_consts, (c for c, f in zip(ct_c, c_float) if f))]
        ct_x = [c for c, f in zip(jax.tree.leaves(ct_x), x_float) if f]
        return (ct_b, ct_consts, seen), ct_x

    last = _rebuilt(final, first, partials[-1], first_slot[-1])
    init = (ct_final, [jnp.zeros_like(c) for c, f in zip(consts, c_float) if f], last)
    inputs = (x_leaves, jnp.asarray(first_slot, jnp.int32), jnp.asarray(next_slot, jnp.int32), partials,
              [c for c, f in zip(y_leaves, y_float) if f])
    (ct_buffer, ct_consts, _), ct_x_float = jax.lax.scan(one, init, inputs, reverse=True)
    it_c, it_x = iter(ct_consts), iter(ct_x_float)
    ct_consts = [next(it_c) if f else _float0_like(c) for c, f in zip(consts, c_float)]
    ct_xs = jax.tree.unflatten(x_tree, [next(it_x) if f else _float0_like(a) for a, f in zip(x_leaves, x_float)])
    return ct_consts, ct_buffer, ct_xs


_scan_source_buffer.defvjp(_scan_source_buffer_fwd, _scan_source_buffer_bwd)


def _pallas_covers(num_sources: int, d: int, dtype, interpret: bool) -> bool:
    """implementation=None runs the kernels only where their GPU tests ran (compiled, compute capability
    9.0: the H200 of `pytest -m gpu`) and for calls `supported` accepts."""
    if interpret or jax.default_backend() != "gpu":
        return False
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        return False
    from pallas_kernels.depth_attention import supported  # noqa: PLC0415
    return supported(num_sources, d, dtype)[0]


def _choose(implementation, num_sources, sources, interpret) -> str:
    if implementation not in (None,) + IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}; got {implementation=}")
    first = sources[0] if isinstance(sources, list) else sources
    d, dtype = first.shape[-1], first.dtype
    if implementation is None:
        return "pallas" if _pallas_covers(num_sources, d, dtype, interpret) else "xla"
    if implementation == "pallas":
        from pallas_kernels.depth_attention import supported  # noqa: PLC0415
        ok, why = supported(num_sources, d, dtype)
        if not ok:
            raise ValueError(f"{implementation=} cannot run this call: {why}")
        if not interpret and jax.default_backend() != "gpu":
            raise ValueError(f"{implementation=} with interpret=False compiles the kernels for a CUDA GPU (Triton "
                             f"lowering); the backend is {jax.default_backend()!r}: pass interpret=True on CPU")
    return implementation


def _check_depth_inputs(sources, pseudo_query, key_norm_scale, eps, num_valid):
    """Shape / dtype checks of `depth_attention` (ValueError naming the argument); returns (sources as an
    array or a list of arrays, S, dtype)."""
    stacked = not isinstance(sources, (list, tuple))
    if stacked:
        sources = jnp.asarray(sources)
        if sources.ndim < 2:
            raise ValueError(f"sources must be [S, B, T, D] (or a sequence of [B, T, D]), got {sources.shape=}")
        num_sources, d = sources.shape[0], sources.shape[-1]
        dtype = sources.dtype
    else:
        if not sources:
            raise ValueError("sources must hold at least one source, got an empty sequence")
        sources = [jnp.asarray(s) for s in sources]
        first = sources[0]
        for s in sources[1:]:
            if s.shape != first.shape or s.dtype != first.dtype:
                raise ValueError("sources must share one shape and dtype, got "
                                 f"{[(tuple(x.shape), str(x.dtype)) for x in sources]}")
        if first.ndim < 1:
            raise ValueError(f"each source must be [B, T, D], got {first.shape=}")
        num_sources, d = len(sources), first.shape[-1]
        dtype = first.dtype
    if num_sources < 1:
        raise ValueError(f"sources must hold at least one source, got S = {num_sources}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"sources must be floating point, got {dtype=}")
    pseudo_query = jnp.asarray(pseudo_query)
    key_norm_scale = jnp.asarray(key_norm_scale)
    if pseudo_query.shape != (d,):
        raise ValueError(f"pseudo_query must be [D] = [{d}], got {pseudo_query.shape=}")
    if key_norm_scale.shape != (d,):
        raise ValueError(f"key_norm_scale must be [D] = [{d}], got {key_norm_scale.shape=}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps=}")
    if num_valid is not None and isinstance(num_valid, (int, np.integer)):
        if isinstance(num_valid, bool) or not 1 <= int(num_valid) <= num_sources:
            raise ValueError(f"num_valid must be in [1, S] = [1, {num_sources}], got {num_valid=}")
    return sources, num_sources, dtype


def _depth_attention_xla(sources, pseudo_query, key_norm_scale, *, eps, num_valid, return_weights):
    """The jnp depth mix (inputs already checked by `_check_depth_inputs`)."""
    stacked = not isinstance(sources, (list, tuple))
    dtype = sources.dtype if stacked else sources[0].dtype
    pseudo_query, key_norm_scale = jnp.asarray(pseudo_query), jnp.asarray(key_norm_scale)
    query = pseudo_query.astype(jnp.float32) * key_norm_scale.astype(jnp.float32)
    if stacked:
        logits = _source_logits(sources, query, eps)  # [S, ...]
    else:
        logits = jnp.stack([_source_logits(s, query, eps) for s in sources])  # [S, ...]

    valid = None
    if num_valid is not None:
        index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0)
        valid = index < jnp.asarray(num_valid, jnp.int32)
        logits = jnp.where(valid, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=0)  # fp32 [S, ...]

    if stacked:
        values = sources.astype(jnp.float32)
        if valid is not None:
            values = jnp.where(valid[..., None], values, 0.0)
        out = jnp.sum(weights[..., None] * values, axis=0)
    else:
        terms = [weights[s][..., None] * x.astype(jnp.float32) for s, x in enumerate(sources)]
        if valid is not None:
            terms = [jnp.where(valid[s][..., None], t, 0.0) for s, t in enumerate(terms)]
        out = terms[0]
        for t in terms[1:]:
            out = out + t
    out = out.astype(dtype)
    return (out, weights) if return_weights else out


# ---------------------------------------------------------------------------------------------------
# Block bookkeeping
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Which block every sublayer belongs to, and what its depth mix reads (hashable, jit-static).

    Sublayers are numbered l = 0..L−1 in execution order (even l = mixer of transformer layer l//2,
    odd l = its FFN). Blocks are numbered n = 1..N, as the paper does, so that block n's completed
    sum is source b_n and source slot n of a buffer `[N + 1, B, T, D]` whose slot 0 is the embedding.

    Attributes:
      num_layers: transformer layers (each = 2 sublayers).
      num_blocks: N.
      unit: "sublayers" (blocks partition the 2·num_layers sublayers, the paper's count) or "layers"
        (blocks partition whole transformer layers, K3's count: "blocks of 12 layers").
      block_sizes: sublayers per block, length N; equal as possible, the first blocks get the extra
        unit (in `unit`s: sizes q + 1 for the first r blocks and q for the rest, divmod(units, N) = (q, r)).
      block_id: per sublayer, its block n ∈ 1..N.
      position_in_block: per sublayer, its 1-based position i inside its block.
      closes_block: per sublayer, whether its output completes its block (b_n^i becomes b_n).
      num_sources: per sublayer, how many sources its mix reads: n (= [b_0..b_{n−1}]) when i = 1,
        n + 1 (the partial sum b_n^{i−1} added) when i ≥ 2. With a buffer whose slot k holds b_k
        (and slot n the running partial sum), this is exactly the `num_valid` to pass.
    """

    num_layers: int
    num_blocks: int
    unit: str
    block_sizes: tuple[int, ...]
    block_id: tuple[int, ...]
    position_in_block: tuple[int, ...]
    closes_block: tuple[bool, ...]
    num_sources: tuple[int, ...]

    @property
    def num_sublayers(self) -> int:
        """L = 2 · num_layers."""
        return len(self.block_id)

    @property
    def max_sources(self) -> int:
        """N + 1: the source-buffer size (embedding + N block sums; the final mix reads them all)."""
        return self.num_blocks + 1

    @property
    def final_num_sources(self) -> int:
        """Sources read by the final mix before the output norm: [b_0..b_N], i.e. N + 1."""
        return self.num_blocks + 1

    @property
    def starts_block(self) -> tuple[bool, ...]:
        """Per sublayer: i = 1 (its mix excludes the still-empty partial sum)."""
        return tuple(i == 1 for i in self.position_in_block)

    def scan_inputs(self) -> dict[str, np.ndarray]:
        """Per-sublayer int32 arrays `[L]` for a scan over a `[N + 1, B, T, D]` source buffer.

        "slot": the buffer slot the sublayer's output is added to (= its block id n; the partial sum
        lives in the slot it will occupy once complete); "num_valid": `num_sources` (the leading
        slots its mix reads). Reshape to `[num_layers, 2]` to scan over transformer layers.
        """
        return {"slot": np.asarray(self.block_id, np.int32),
                "num_valid": np.asarray(self.num_sources, np.int32)}


def block_layout(num_layers: int, num_blocks: int, *, unit: str = "sublayers") -> BlockLayout:
    """Partition the 2·`num_layers` sublayers into `num_blocks` consecutive blocks (Block AttnRes).

    Args:
      num_layers: transformer layers; each is one mixer sublayer followed by one FFN sublayer.
      num_blocks: N ≥ 1. N = 1 is a plain residual with the embedding kept apart; N = L with
        unit="sublayers" is Full AttnRes (every sublayer output is its own source).
      unit: what a block is made of. "sublayers" (arXiv 2603.15031 counts attention and MLP as
        separate layers; a block may then end between a layer's mixer and its FFN) or "layers" (K3
        §2.2 counts whole transformer layers, so every block holds an even number of sublayers).

    Sizes are equal as possible with the extra units in the FIRST blocks: with
    divmod(units, N) = (q, r), blocks 1..r get q + 1 units and blocks r+1..N get q
    (units = 2·num_layers sublayers or num_layers layers).

    Returns:
      A frozen `BlockLayout`.

    Raises:
      ValueError: `num_layers` or `num_blocks` not a positive int; `num_blocks` larger than the
        number of units; `unit` not "sublayers" or "layers".
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit=}")
    for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    num_layers, num_blocks = int(num_layers), int(num_blocks)
    units = num_layers * SUBLAYERS_PER_LAYER if unit == "sublayers" else num_layers
    if num_blocks > units:
        raise ValueError(f"num_blocks must be <= the number of {unit} ({units}), got {num_blocks=}")
    q, r = divmod(units, num_blocks)
    per_unit = 1 if unit == "sublayers" else SUBLAYERS_PER_LAYER
    block_sizes = tuple((q + 1 if n < r else q) * per_unit for n in range(num_blocks))
    block_id, position, closes, num_sources = [], [], [], []
    for n, size in enumerate(block_sizes, start=1):
        for i in range(1, size + 1):
            block_id.append(n)
            position.append(i)
            closes.append(i == size)
            num_sources.append(n if i == 1 else n + 1)
    return BlockLayout(num_layers=num_layers, num_blocks=num_blocks, unit=unit, block_sizes=block_sizes,
                       block_id=tuple(block_id), position_in_block=tuple(position),
                       closes_block=tuple(closes), num_sources=tuple(num_sources))


# ---------------------------------------------------------------------------------------------------
# Readable references over depth (plain Python loops; the model is tested against these)
# ---------------------------------------------------------------------------------------------------
class DepthForward(NamedTuple):
    """Result of a reference forward over depth.

    hidden: `[B, T, D]`, what the final norm reads.
    sublayer_inputs: L arrays `[B, T, D]`, the input h_l each sublayer f_l was called with (empty where
      `sublayer_finite` stands in for them).
    depth_weights: for AttnRes, L + 1 fp32 arrays `[S_l, B, T]` (per sublayer, then the final mix);
      empty for the schemes without depth weights.
    sublayer_finite: `[L]` bool, whether each sublayer's input was all finite, or None. The scanned
      model computes it inside its scan and keeps `sublayer_inputs` empty unless asked for them (stacked
      over depth they would hold L activations: 24 GiB at the 1b shape).
    """

    hidden: Array
    sublayer_inputs: tuple[Array, ...]
    depth_weights: tuple[Array, ...]
    sublayer_finite: Array | None = None


def _check_sublayers(sublayer_fns, layout: BlockLayout | None, embedding):
    embedding = jnp.asarray(embedding)
    if embedding.ndim < 1:
        raise ValueError(f"embedding must be [B, T, D], got {embedding.shape=}")
    if layout is not None and len(sublayer_fns) != layout.num_sublayers:
        raise ValueError(f"sublayer_fns must hold layout.num_sublayers = {layout.num_sublayers} callables, "
                         f"got {len(sublayer_fns)}")
    return embedding


def prenorm_forward(embedding, sublayer_fns: Sequence[Callable[[Array], Array]]) -> DepthForward:
    """Plain residual stream: x_0 = embedding, x_l = x_{l−1} + f_l(x_{l−1}); returns x_L.

    The baseline ("prenorm": each f_l applies its own RMSNorm first). Shapes `[B, T, D]`.
    """
    x = _check_sublayers(sublayer_fns, None, embedding)
    inputs = []
    for f in sublayer_fns:
        inputs.append(x)
        x = x + f(x)
    return DepthForward(hidden=x, sublayer_inputs=tuple(inputs), depth_weights=())


def attnres_forward(embedding, sublayer_fns: Sequence[Callable[[Array], Array]], layout: BlockLayout,
                    pseudo_queries, key_norm_scales, *, eps: float = 1e-6,
                    implementation: str | None = None) -> DepthForward:
    """Block AttnRes over a whole stack, as a readable Python loop (arXiv 2603.15031 §3, K3 §2.2).

        blocks = [b_0 = embedding]; partial = none
        for sublayer l (i-th of block n):
            h_l = depth_attention(blocks + ([partial] if i ≥ 2), w_l, γ_l)
            partial = f_l(h_l) if i = 1 else partial + f_l(h_l)
            if l closes block n: blocks.append(partial)  (this is b_n); partial = none
        hidden = depth_attention(blocks = [b_0..b_N], w_L, γ_L)        (read by the final norm)

    The first sublayer of a block mixes over the completed sources only (module docstring says why).

    Identities (tested):
      * N = L, unit="sublayers" (Full AttnRes): h_l = Σ_{k<l} α_{k→l} v_k over v_0 = embedding and every
        earlier sublayer output v_k = f_k(h_k).
      * N = 1 (plain residual with the embedding kept apart): with r_l = Σ_{j≤l} f_j(h_j) the residual
        sum of sublayer outputs, h_1 = embedding and, for l ≥ 2 and for the final mix (l = L + 1),
            h_l = a_l · embedding + (1 − a_l) · r_{l−1},
            a_l = sigmoid( w_l · (RMSNorm_{γ_l}(embedding) − RMSNorm_{γ_l}(r_{l−1})) ).
        At init (w = 0) a_l = 1/2, so h_l = x_{l−1} / 2 with x the plain residual stream
        x_{l−1} = embedding + r_{l−1}; if every f_l is scale-invariant (a PreNorm sublayer,
        f(c·h) = f(h) for c > 0, exact when its RMSNorm eps is 0) the sublayer outputs equal those of
        `prenorm_forward` and `hidden` = x_L / 2, which the final RMSNorm maps to the same output.

    Args:
      embedding: b_0 `[B, T, D]`, any float dtype.
      sublayer_fns: L = layout.num_sublayers callables `h [B, T, D] -> [B, T, D]` (each applies its
        own PreNorm; mixer for even l, FFN for odd l).
      layout: from `block_layout`.
      pseudo_queries: `[L + 1, D]`; row l is w_l of sublayer l, row L the final mix's.
      key_norm_scales: `[L + 1, D]`; the key RMSNorm scales γ, same rows.
      eps: key RMSNorm epsilon.
      implementation: of every depth mix (`depth_attention`).

    Returns:
      `DepthForward(hidden [B, T, D], sublayer_inputs (L × [B, T, D]), depth_weights (L + 1 × [S_l, B, T]))`.

    Raises:
      ValueError: `sublayer_fns` length ≠ L; `pseudo_queries` / `key_norm_scales` not `[L + 1, D]`.
    """
    embedding = _check_sublayers(sublayer_fns, layout, embedding)
    num_sublayers, d = layout.num_sublayers, embedding.shape[-1]
    pseudo_queries, key_norm_scales = jnp.asarray(pseudo_queries), jnp.asarray(key_norm_scales)
    if pseudo_queries.shape != (num_sublayers + 1, d):
        raise ValueError(f"pseudo_queries must be [L + 1, D] = [{num_sublayers + 1}, {d}], got {pseudo_queries.shape=}")
    if key_norm_scales.shape != (num_sublayers + 1, d):
        raise ValueError(f"key_norm_scales must be [L + 1, D] = [{num_sublayers + 1}, {d}], got {key_norm_scales.shape=}")

    blocks, partial = [embedding], None
    inputs, weights = [], []
    for l, f in enumerate(sublayer_fns):
        sources = blocks + ([] if partial is None else [partial])
        h, w = depth_attention(sources, pseudo_queries[l], key_norm_scales[l], eps=eps, return_weights=True,
                               implementation=implementation)
        inputs.append(h)
        weights.append(w)
        out = f(h)
        partial = out if partial is None else partial + out
        if layout.closes_block[l]:
            blocks.append(partial)
            partial = None
    hidden, w = depth_attention(blocks, pseudo_queries[num_sublayers], key_norm_scales[num_sublayers],
                                eps=eps, return_weights=True, implementation=implementation)
    weights.append(w)
    return DepthForward(hidden=hidden, sublayer_inputs=tuple(inputs), depth_weights=tuple(weights))


def article_boundaries(layout: BlockLayout) -> tuple[int, ...]:
    """Sublayer index of each block-boundary attention of the article-literal variant (length N − 1).

    For blocks n = 1..N−1 (whole transformer layers, unit="layers") it is the mixer sublayer of the
    block's last transformer layer: closing index − 1. The last block has no next block, so none.

    Raises:
      ValueError: `layout.unit` is not "layers" (the article groups whole transformer layers).
    """
    if layout.unit != "layers":
        raise ValueError(f"layout.unit must be 'layers' for the article-literal variant, got {layout.unit=}")
    closing = [l for l, c in enumerate(layout.closes_block) if c]
    return tuple(l - 1 for l in closing[:-1])


def article_block_forward(embedding, sublayer_fns: Sequence[Callable[[Array], Array]], layout: BlockLayout,
                          alphas) -> DepthForward:
    """The seed article's literal "block attention residuals" (ablation "article_block"), as a loop.

    Article §4.2: "several consecutive Transformer layers are grouped into a Block, with per-layer
    residuals maintained within the Block. At Block boundaries, the attention module's output is
    multiplied by a learnable scaling factor α, and the residual addition with the Block's input is
    skipped, directly serving as the input to the next Block." No public model does this; it is NOT
    what arXiv 2603.15031 / K3 do (see `attnres_forward`). Our precise reading:

      * blocks are whole transformer layers (`layout.unit == "layers"`);
      * every sublayer is a plain PreNorm residual x_l = x_{l−1} + f_l(x_{l−1}), except
      * the boundary sublayer of each block n < N, the mixer (attention) sublayer of the block's last
        transformer layer (`article_boundaries`): x_l = α_n · f_l(x_{l−1}). "The attention output" is
        f_l's output (after its output projection, before any residual add); the residual add is
        skipped, so the stream restarts from the scaled attention output and everything the block
        carried (its input and earlier updates) reaches later blocks only through that attention.
        The layer's FFN then adds its residual as usual, and that layer's output is the next block's
        input. The last block ends the network: no boundary there (so N = 1 is the plain residual).

    Initialisation of α: 1 (`BlockScale` default). Every sublayer and the final norm are PreNorm, so
    α does not change what the next sublayer sees (RMSNorm is scale-invariant up to eps); it only
    weighs the restarted stream against the updates added after it. α = 1 starts that stream at the
    scale of an ordinary sublayer update, like the first block starting from the embedding; α = 0
    would cut every earlier layer off (their gradient is proportional to α); large α would let the
    boundary dominate later updates. What no α can fix, and what this ablation exists to measure: at
    initialisation the boundary discards the block's residual stream, so the next block starts from
    one randomly initialised attention output (token identity survives only as far as that
    attention's value path carries it).

    Args:
      embedding: x_0 `[B, T, D]`.
      sublayer_fns: L callables `h [B, T, D] -> [B, T, D]` (PreNorm inside; even l mixer, odd l FFN).
      layout: `block_layout(num_layers, N, unit="layers")`.
      alphas: `[N − 1]` learned scalars α_n, one per boundary (may be empty for N = 1).

    Returns:
      `DepthForward(hidden = x_L [B, T, D], sublayer_inputs (L × [B, T, D]), depth_weights=())`.

    Raises:
      ValueError: `layout.unit` not "layers"; `sublayer_fns` length ≠ L; `alphas` not `[N − 1]`.
    """
    embedding = _check_sublayers(sublayer_fns, layout, embedding)
    boundaries = article_boundaries(layout)
    alphas = jnp.asarray(alphas)
    if alphas.shape != (layout.num_blocks - 1,):
        raise ValueError(f"alphas must be [N - 1] = [{layout.num_blocks - 1}], got {alphas.shape=}")
    boundary_alpha = {l: k for k, l in enumerate(boundaries)}
    x, inputs = embedding, []
    for l, f in enumerate(sublayer_fns):
        inputs.append(x)
        out = f(x)
        if l in boundary_alpha:
            x = (alphas[boundary_alpha[l]] * out).astype(out.dtype)
        else:
            x = x + out
    return DepthForward(hidden=x, sublayer_inputs=tuple(inputs), depth_weights=())


# ---------------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------------
def hidden_rms(x) -> Array:
    """Root mean square over the hidden axis: `x [..., D]` -> `[...]` fp32 (sqrt(mean_d x_d²)).

    Per-sublayer hidden-state magnitude (AttnRes paper Fig. "output magnitude across depth"): reduce
    further with `.mean()` over tokens for one number per sublayer.
    """
    x32 = jnp.asarray(x).astype(jnp.float32)
    return jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1))


def consecutive_cosine(inputs, *, eps: float = 1e-12) -> Array:
    """Cosine similarity between consecutive sublayer inputs, averaged over tokens.

    Args:
      inputs: a sequence of L arrays `[..., D]` (e.g. `DepthForward.sublayer_inputs`) or one array
        `[L, ..., D]`.
      eps: guards the norms of all-zero vectors (their cosine is then 0).

    Returns:
      `[L − 1]` fp32; entry l = mean over tokens of cos(input_l, input_{l+1}). Values near 1 deep in
      the network are the "representations stop changing" symptom AttnRes targets.

    Raises:
      ValueError: fewer than 2 inputs, or inputs of different shapes.
    """
    x = jnp.stack([jnp.asarray(a) for a in inputs]) if isinstance(inputs, (list, tuple)) else jnp.asarray(inputs)
    if x.ndim < 2 or x.shape[0] < 2:
        raise ValueError(f"inputs must hold at least 2 arrays [..., D], got stacked {x.shape=}")
    x = x.astype(jnp.float32)
    a, b = x[:-1], x[1:]
    dot = jnp.sum(a * b, axis=-1)
    norms = jnp.sqrt(jnp.sum(a * a, axis=-1)) * jnp.sqrt(jnp.sum(b * b, axis=-1))
    cos = dot / jnp.maximum(norms, eps)
    return jnp.mean(cos.reshape(cos.shape[0], -1), axis=1)


def depth_weight_matrix(depth_weights: Sequence[Array]) -> Array:
    """Mean depth weights as a `[num_mixes, max S]` fp32 matrix (rows: sublayers then the final mix).

    Args:
      depth_weights: per mix, weights `[S_l, ...]` (as `DepthForward.depth_weights` or the model's
        `depth_attention(..., return_weights=True)` outputs); S_l may differ between rows.

    Returns:
      Row l = weights of mix l averaged over tokens, zero-padded to the longest row; each row sums
      to 1 over its S_l valid entries. Plot as the sublayer × source heatmap.

    Raises:
      ValueError: empty input.
    """
    if not depth_weights:
        raise ValueError("depth_weights must hold at least one [S, ...] array, got an empty sequence")
    rows = [jnp.asarray(w).astype(jnp.float32).reshape(jnp.shape(w)[0], -1).mean(axis=1) for w in depth_weights]
    width = max(r.shape[0] for r in rows)
    return jnp.stack([jnp.pad(r, (0, width - r.shape[0])) for r in rows])
