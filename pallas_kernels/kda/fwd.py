"""KDA chunk forward kernels: intra-chunk factors (parallel) and the serial state pass (state_fwd:
state and o in one serial pass; or, ops.KernelOptions.parallel_output, state_fwd_vp carrying only
the state and writing V' and the per-chunk states, then output_fwd forming o in parallel, as fla).
The intra-chunk factors are one kernel (intra_fwd) or, ops.KernelOptions.split_intra_fwd, two
(intra_fwd_split: scores and solve, then W / U, as fla's recompute_w_u). Unbounded gates
(`unbounded=True`, no lower_bound) run only in intra_fwd_split with the XLA gate cumsum: its
kernel a forms the diagonal score tiles exactly (common.own_block_scores); the state and output
kernels need no bound (every exp they use was taken in intra_fwd of a non-positive number).

Layouts: the user-facing tensors stay token-major as given, q, k, g [B, T, H, K], v and o
[B, T, H, V], beta [B, T, H] (BlockSpecs pick one head's [C, K] rows with stride H * K: no transposes
in XLA); the kernels' own intermediates (chunk factors, saved states) are head-major [B, H, T, .].
States are stored TRANSPOSED as [V, K] so that the per-channel decay exp(G_last) [1, K] broadcasts
along rows. T is a multiple of the chunk size C; K, V are powers of two >= 16 (the wrapper in ops.py
pads). Gate units: nats, fp32.

Source: the chunk form of Kimi Linear (arXiv 2510.26692) Eq. 1 as in fla `chunk_kda`
(ANCHORS.md section 1):
  A = (I + L)^-1,  W = A (beta e^G K),  U = A (beta V)
  V' = U - W S;  O = scale (Q e^G) S + tril(Aqk) V';  S <- e^{G_last} S + (K e^{G_last - G})^T V'.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import common as cm
from pallas_kernels.kda.common import F32


def _intra_fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, dtype,
                      ablate=frozenset(), gate_cumsum=False, segmented=False):
    seg_ref, refs = (refs[0], refs[1:]) if segmented else (None, refs)
    qg_ref, kd_ref, w_ref, u_ref, aqk_ref, gl_ref, *solve_refs = refs
    if "compute" in ablate:                   # profiling: the I/O + launch floor (wrong results)
        _intra_fwd_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, qg_ref, kd_ref, w_ref, u_ref,
                           aqk_ref, gl_ref, *solve_refs)
        return
    gate = cm.gate_of(g_ref, ablate, gate_cumsum)
    seg = cm.segments_of(seg_ref)       # documents (segment_ids): select masks, see cm.Segments
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    qg_ref[...] = cm.keep(scale * q * jnp.exp(gate.G), seg, "row_in").astype(qg_ref.dtype)
    kd_ref[...] = cm.keep(k * jnp.exp(gate.G_last - gate.G), seg, "in_last").astype(kd_ref.dtype)
    gl_ref[...] = cm.keep(jnp.exp(gate.G_last), seg, "carry").reshape(gl_ref.shape)
    b = beta_ref[...].astype(F32)[:, None]
    f = cm.chunk_factors(q, k, v_ref[...].astype(F32), b, gate, scale=scale, dtype=dtype,
                         ablate=ablate, seg=seg)
    aqk_ref[...] = f["Aqk"].astype(aqk_ref.dtype)
    w_ref[...] = f["W"].astype(w_ref.dtype)
    u_ref[...] = f["U"].astype(u_ref.dtype)
    if solve_refs:
        a_ref, m_ref = solve_refs
        a_ref[...] = f["A"]
        m_ref[...] = f["M"]


def _intra_fwd_io_only(q_ref, k_ref, v_ref, g_ref, beta_ref, qg_ref, kd_ref, w_ref, u_ref,
                       aqk_ref, gl_ref, *solve_refs):
    """The "compute" ablation: every input read, every output written, no chunk arithmetic."""
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)
    g = g_ref[...].astype(F32)
    b = beta_ref[...].astype(F32)[:, None]
    C = q.shape[0]
    rows, cols = cm.iotas(C, C)
    qg_ref[...] = (q + g).astype(qg_ref.dtype)
    kd_ref[...] = (k * b).astype(kd_ref.dtype)
    w_ref[...] = (k + g).astype(w_ref.dtype)
    u_ref[...] = (v * b).astype(u_ref.dtype)
    aqk = jnp.where(rows >= cols, cm.row_sums(q) * jnp.ones((1, C), F32), 0.0)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    gl_ref[...] = jnp.sum(g, axis=0, keepdims=True).reshape(gl_ref.shape)
    if solve_refs:
        a_ref, m_ref = solve_refs
        a_ref[...] = aqk
        m_ref[...] = jnp.where(rows > cols, cm.row_sums(k) * jnp.ones((1, C), F32), 0.0)


def intra_fwd(q, k, v, g, beta, *, scale: float, chunk_size: int, interpret: bool,
              factor_dtype=F32, save_solve: bool = False, bf16_dots: bool = False,
              gate_cumsum: bool = False, segments=None, split: bool = False,
              unbounded: bool = False, _ablate: tuple[str, ...] = (), _params=None):
    """Per-chunk factors, one program per (batch, head, chunk).

    Args: q, k [B, T, H, K] (bf16 or fp32); v [B, T, H, V]; g [B, T, H, K] fp32 log-decay (nats);
      beta [B, T, H]. T % chunk_size == 0.
      factor_dtype: storage dtype of qg, kd, w, u, aqk (one dtype, or a tuple of 5 in that order;
        computed in fp32, rounded once on store; the state kernels upcast on load).
    Returns: qg = scale q e^G [B,H,T,K]; kd = k e^{G_last-G} [B,H,T,K]; w [B,H,T,K]; u [B,H,T,V];
      aqk [B,H,T,C] (row-block c holds the chunk's lower-triangular scaled q.k scores), in
      factor_dtype; gl = e^{G_last} [B,H,NT,K] fp32; with save_solve also A = (I + L)^-1 and M (the
      unweighted strictly lower k.k anchored scores, L = beta M), each [B,H,T,C] fp32 (row block c
      holds the chunk's matrix), for the backward.
      bf16_dots: bf16 inputs only: the solve and W / U dots take bf16 operands (BF16_OPERANDS, as
        fla) instead of fp32 operands at TF32 (ops.KernelOptions.bf16_intra_dots).
      gate_cumsum: g is already the chunk-local inclusive cumsum G (common.chunk_cumsum or
        cumsum.chunk_cumsum, fp32; ops.KernelOptions.xla_gate_cumsum): no cumsum and no anchor
        reductions in the kernel.
      segments: None, or rel [B, T] int32 (common.document_offsets of segment_ids): packed
        documents; the factors are masked (common.Segments) so that the unchanged state passes
        reset the state at every document start: qg and w zero on rows whose document started
        inside the chunk, kd zero outside the chunk's last document, gl zero when the chunk holds a
        document start, aqk and M (hence A) zero across documents.
      split: run it as two kernels (intra_fwd_split; ops.KernelOptions.split_intra_fwd): the
        scores and the solve, then W = A X, U = A Y reading A; same math, same returns.
      unbounded: g has no lower bound (any g <= 0): the diagonal score tiles are computed exactly
        (common.own_block_scores) instead of as one anchored dot. Needs split=True and
        gate_cumsum=True (the tested combination); False: the bounded kernels, unchanged.
      _ablate: PRIVATE profiling option (static; results WRONG, timing only): names from
        common.FWD_ABLATIONS whose part of the kernel body is replaced by a cheap stand-in.
      _params: PRIVATE profiling option: Triton compiler params (default common.INTRA_PARAMS).
    Raises: ValueError for an unknown _ablate name, any _ablate with split, or unbounded without
      split and gate_cumsum.
    """
    ablate = cm.check_ablate(_ablate, cm.FWD_ABLATIONS, "_ablate")
    if unbounded and not split:
        raise ValueError(f"{unbounded=} runs only in the two-kernel forward: pass split=True "
                         f"(ops.KernelOptions.split_intra_fwd); got {split=}")
    if split:
        if ablate:
            raise ValueError(f"{_ablate=} applies to the fused kernel only (split=False)")
        return intra_fwd_split(q, k, v, g, beta, scale=scale, chunk_size=chunk_size,
                               interpret=interpret, factor_dtype=factor_dtype,
                               save_solve=save_solve, bf16_dots=bf16_dots,
                               gate_cumsum=gate_cumsum, segments=segments, unbounded=unbounded,
                               _params=_params)
    if bf16_dots and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16):
        ablate = ablate | {"bf16_dots"}          # the same code path as the timing ablation
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = T // C
    sp = cm.chunk_specs(C, K, V)
    ik, iv, ib, tk, tv, ta, tg = sp.ik, sp.iv, sp.ib, sp.tk, sp.tv, sp.ta, sp.tg
    fd = factor_dtype if isinstance(factor_dtype, tuple) else (factor_dtype,) * 5
    out_shape = [jax.ShapeDtypeStruct((B, H, T, K), fd[0]), jax.ShapeDtypeStruct((B, H, T, K), fd[1]),
                 jax.ShapeDtypeStruct((B, H, T, K), fd[2]), jax.ShapeDtypeStruct((B, H, T, V), fd[3]),
                 jax.ShapeDtypeStruct((B, H, T, C), fd[4]), jax.ShapeDtypeStruct((B, H, NT, K), F32)]
    out_specs = [tk, tk, tk, tv, ta, tg]
    if save_solve:
        out_shape += [jax.ShapeDtypeStruct((B, H, T, C), F32)] * 2
        out_specs += [ta, ta]
    segmented = segments is not None
    if segmented and "compute" in ablate:
        raise ValueError(f"{_ablate=}: the 'compute' ablation does not take segments")
    kernel = functools.partial(_intra_fwd_kernel, scale=scale, dtype=q.dtype, ablate=ablate,
                               gate_cumsum=gate_cumsum, segmented=segmented)
    return pl.pallas_call(
        kernel, grid=(B, H, NT),
        in_specs=[ik, ik, iv, ik, ib] + ([cm.seg_spec(C)] if segmented else []),
        out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS,
        name="kda_intra_fwd",
    )(q, k, v, g, beta, *([segments] if segmented else []))


def _intra_fwd_a_kernel(q_ref, k_ref, g_ref, beta_ref, *refs, scale, dtype, flags=frozenset()):
    seg_ref, refs = (refs[0], refs[1:]) if "segmented" in flags else (None, refs)
    qg_ref, kd_ref, aqk_ref, gl_ref, a_ref, *m_ref = refs
    gate = cm.gate_of(g_ref, gate_cumsum="gate_cumsum" in flags)
    seg = cm.segments_of(seg_ref)
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    qg_ref[...] = cm.keep(scale * q * jnp.exp(gate.G), seg, "row_in").astype(qg_ref.dtype)
    kd_ref[...] = cm.keep(k * jnp.exp(gate.G_last - gate.G), seg, "in_last").astype(kd_ref.dtype)
    gl_ref[...] = cm.keep(jnp.exp(gate.G_last), seg, "carry").reshape(gl_ref.shape)
    b = beta_ref[...].astype(F32)[:, None]
    own_rows = None
    if "unbounded" in flags:                  # g_ref holds G (gate_cumsum): exact diagonal tiles
        own_rows = (lambda j: k_ref[pl.ds(j, 1), :].astype(F32),
                    lambda j: g_ref[pl.ds(j, 1), :].astype(F32))
    f = cm.solve_factors(q, k, b, gate, scale=scale, dtype=dtype,
                         ablate=flags & {"bf16_dots"}, seg=seg, own_rows=own_rows)
    aqk_ref[...] = f["Aqk"].astype(aqk_ref.dtype)
    a_ref[...] = f["A"]
    if m_ref:
        m_ref[0][...] = f["M"]


def _intra_fwd_b_kernel(k_ref, v_ref, g_ref, beta_ref, a_ref, *refs, dtype, flags=frozenset()):
    seg_ref, refs = (refs[0], refs[1:]) if "segmented" in flags else (None, refs)
    w_ref, u_ref = refs
    g = g_ref[...].astype(F32)
    G = g if "gate_cumsum" in flags else jnp.cumsum(g, axis=0)
    f = cm.wu_factors(a_ref[...], k_ref[...].astype(F32), v_ref[...].astype(F32),
                      beta_ref[...].astype(F32)[:, None], G, dtype=dtype,
                      ablate=flags & {"bf16_dots"}, seg=cm.segments_of(seg_ref))
    w_ref[...] = f["W"].astype(w_ref.dtype)
    u_ref[...] = f["U"].astype(u_ref.dtype)


def intra_fwd_split(q, k, v, g, beta, *, scale: float, chunk_size: int, interpret: bool,
                    factor_dtype=F32, save_solve: bool = False, bf16_dots: bool = False,
                    gate_cumsum: bool = False, segments=None, unbounded: bool = False,
                    _params=None):
    """intra_fwd as two kernels, each one program per (batch, head, chunk); same args and returns.

    Kernel a ("kda_intra_fwd_a"): gate cumsum, the anchored score GEMMs and (I + L)^-1: writes qg,
    kd, aqk, e^{G_last} and A [B, H, T, C] fp32 (always: kernel b reads it), M with save_solve.
    Kernel b ("kda_intra_fwd_b", fla's recompute_w_u): X = beta e^G k, Y = beta v, W = A X,
    U = A Y from k, v, g, beta and A (its own chunk cumsum of g unless gate_cumsum). Round-3 lever
    (kda_pallas_notes.md): the fused body holds the score values, the solve and the [C, K] / [C, V]
    W / U operands at once; split, neither does. Cost: A written and read once more (32 KiB per
    chunk; with save_solve it is written anyway) and k, v, g, beta read twice. Both kernels apply
    the segment masks (cm.Segments) that concern their outputs.
    unbounded (needs gate_cumsum): kernel a forms the diagonal 16x16 score tiles exactly
    (common.own_block_scores: elementwise fp32 with every exp argument <= 0; the off-diagonal tiles
    stay row-block GEMMs over earlier blocks), so any g <= 0 is exact; kernel b is unchanged.
    Raises: ValueError for unbounded without gate_cumsum (intra_fwd_a's check).
    """
    kw = dict(chunk_size=chunk_size, interpret=interpret, factor_dtype=factor_dtype, bf16_dots=bf16_dots,
              gate_cumsum=gate_cumsum, segments=segments, _params=_params)
    qg, kd, aqk, gl, A, *M = intra_fwd_a(q, k, g, beta, scale=scale, save_solve=save_solve, unbounded=unbounded,
                                         **kw)
    w, u = intra_fwd_b(k, v, g, beta, A, **kw)
    return (qg, kd, w, u, aqk, gl) + ((A, M[0]) if save_solve else ())


def intra_fwd_a(q, k, g, beta, *, scale: float, chunk_size: int, interpret: bool, factor_dtype,
                save_solve: bool = False, bf16_dots: bool = False, gate_cumsum: bool = False, segments=None,
                unbounded: bool = False, _params=None):
    """Kernel a of intra_fwd_split ("kda_intra_fwd_a"; its args; factor_dtype one dtype or five):
    returns qg, kd [B, H, T, K] (factor_dtype[0], [1]), aqk [B, H, T, C] (factor_dtype[4]), gl
    [B, H, T / C, K] fp32, A [B, H, T, C] fp32 and, with save_solve, M [B, H, T, C] fp32.
    Raises: ValueError for unbounded without gate_cumsum."""
    if unbounded and not gate_cumsum:
        raise ValueError(f"{unbounded=} needs gate_cumsum=True (the diagonal tiles load rows of G "
                         f"from g's ref); got {gate_cumsum=}")
    B, T, H, K = q.shape
    C = chunk_size
    NT = T // C
    sp = cm.chunk_specs(C, K, K)
    fd = factor_dtype if isinstance(factor_dtype, tuple) else (factor_dtype,) * 5
    segmented = segments is not None
    flags = cm.split_kernel_flags(q.dtype, bf16_dots=bf16_dots, gate_cumsum=gate_cumsum, segmented=segmented,
                                  unbounded=unbounded)
    return tuple(pl.pallas_call(
        functools.partial(_intra_fwd_a_kernel, scale=scale, dtype=q.dtype, flags=flags),
        grid=(B, H, NT), in_specs=[sp.ik, sp.ik, sp.ik, sp.ib] + ([cm.seg_spec(C)] if segmented else []),
        out_specs=[sp.tk, sp.tk, sp.ta, sp.tg, sp.ta] + ([sp.ta] if save_solve else []),
        out_shape=[jax.ShapeDtypeStruct((B, H, T, K), fd[0]),
                   jax.ShapeDtypeStruct((B, H, T, K), fd[1]),
                   jax.ShapeDtypeStruct((B, H, T, C), fd[4]),
                   jax.ShapeDtypeStruct((B, H, NT, K), F32),
                   jax.ShapeDtypeStruct((B, H, T, C), F32)]
                  + ([jax.ShapeDtypeStruct((B, H, T, C), F32)] if save_solve else []),
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_fwd_a",
    )(q, k, g, beta, *([segments] if segmented else [])))


def intra_fwd_b(k, v, g, beta, A, *, chunk_size: int, interpret: bool, factor_dtype,
                bf16_dots: bool = False, gate_cumsum: bool = False, segments=None, _params=None):
    """Kernel b of intra_fwd_split ("kda_intra_fwd_b", fla's recompute_w_u; its args, A from kernel
    a; the dots round as k's dtype says, which is q's in the op): returns W [B, H, T, K]
    (factor_dtype[2]) and U [B, H, T, V] (factor_dtype[3])."""
    fd = factor_dtype if isinstance(factor_dtype, tuple) else (factor_dtype,) * 5
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    sp = cm.chunk_specs(C, K, V)
    segmented = segments is not None
    flags = cm.split_kernel_flags(k.dtype, bf16_dots=bf16_dots, gate_cumsum=gate_cumsum, segmented=segmented,
                                  unbounded=False)       # kernel b has no diagonal tiles
    return tuple(pl.pallas_call(
        functools.partial(_intra_fwd_b_kernel, dtype=k.dtype, flags=flags),
        grid=(B, H, T // C), in_specs=[sp.ik, sp.iv, sp.ik, sp.ib, sp.ta] + ([cm.seg_spec(C)] if segmented else []),
        out_specs=[sp.tk, sp.tv],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, K), fd[2]),
                   jax.ShapeDtypeStruct((B, H, T, V), fd[3])],
        interpret=interpret, compiler_params=_params or cm.INTRA_PARAMS, name="kda_intra_fwd_b",
    )(k, v, g, beta, A, *([segments] if segmented else [])))



def _state_fwd_kernel(qg_ref, kd_ref, w_ref, u_ref, aqk_ref, gl_ref, h0_ref, o_ref, *refs,
                      chunk_size, precision, ablate=frozenset()):
    h_ref, ht_ref = refs if len(refs) == 2 else (None, refs[0])
    C = chunk_size
    NT = qg_ref.shape[0] // C

    def body(c, St):                                    # St: [BV, K] fp32 state entering chunk c
        rows = pl.ds(c * C, C)
        if h_ref is not None:
            h_ref[c] = St.astype(h_ref.dtype)
        vp = u_ref[rows, :].astype(F32) - cm.dot_nt(w_ref[rows, :].astype(F32), St, precision)
        if "output" in ablate:                # profiling ablation (wrong results)
            o = vp
        else:
            o = (cm.dot_nt(qg_ref[rows, :].astype(F32), St, precision)
                 + cm.dot(aqk_ref[rows, :].astype(F32), vp, precision))
        o_ref[rows, :] = o.astype(o_ref.dtype)
        gl = gl_ref[pl.ds(c, 1), :]                                       # [1, K]
        return St * gl + cm.dot_tn(vp, kd_ref[rows, :].astype(F32), precision)

    ht_ref[...] = jax.lax.fori_loop(0, NT, body, h0_ref[...].astype(F32))


def state_fwd(qg, kd, w, u, aqk, gl, h0, *, chunk_size: int, block_v: int, out_dtype,
              interpret: bool, precision=None, save_states: bool = True, state_dtype=F32,
              _ablate: tuple[str, ...] = (), _params=None):
    """Serial pass over chunks, one program per (batch, head, V-block, segment); fp32 state in
    registers.

    Args: the intra_fwd outputs; h0 [B, H, V, K] fp32 (transposed initial state), or
      [B, H, NS, V, K]: the true state entering each of NS equal segments of chunks
      (split.segment_scan), which then run in parallel; precision of the fp32 dots
      (common.mm_precision of the input dtype); save_states: also write the per-chunk states for
      the backward (False for a forward-only call: saves T / 64 * V * K * 4 bytes per (batch, head),
      2.1 GB at 8x4096x16, K = V = 128 in fp32); state_dtype: storage dtype of those states.
      _ablate: PRIVATE profiling option (static; results WRONG, timing only): names from
        common.STATE_ABLATIONS ("output": skip o's two dots; "bf16_dots": bf16 dot operands).
      _params: PRIVATE profiling option: Triton compiler params (default common.STATE_PARAMS).
    Returns: o [B, T, H, V] (out_dtype); h [B, H, NT, V, K] (state_dtype; state entering each chunk) or
      None when save_states is False; ht fp32, transposed, of h0's rank: the state after the last
      chunk ([B, H, V, K]) or after each segment ([B, H, NS, V, K]).
    Raises: ValueError for an unknown _ablate name.
    """
    ablate = cm.check_ablate(_ablate, cm.STATE_ABLATIONS, "_ablate")
    if "bf16_dots" in ablate:
        precision = cm.BF16_OPERANDS
    B, H, T, K = qg.shape
    V = u.shape[-1]
    C = chunk_size
    NT = T // C
    BV = block_v
    lay = cm.serial_layout(h0, T, K, C, BV)
    h0, per_segment, NS, L = lay.state, lay.per_segment, lay.num_segments, lay.chunks_per_segment * C
    fk, fv, fa, fg, fs, fh = lay.k, lay.v, lay.a, lay.g, lay.s, lay.h
    fo = pl.BlockSpec((None, L, None, BV), lambda b, h, iv, s: (b, s, h, iv))
    out_specs = [fo, fh, fs] if save_states else [fo, fs]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
                 jax.ShapeDtypeStruct((B, H, NT, V, K), state_dtype),
                 jax.ShapeDtypeStruct((B, H, NS, V, K), F32)]
    if not save_states:
        out_shape = [out_shape[0], out_shape[2]]
    outs = pl.pallas_call(
        functools.partial(_state_fwd_kernel, chunk_size=C, precision=precision, ablate=ablate),
        grid=(B, H, V // BV, NS),
        in_specs=[fk, fk, fk, fv, fa, fg, fs],
        out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=_params or cm.STATE_PARAMS, name="kda_state_fwd",
    )(qg, kd, w, u, aqk, gl, h0)
    o, h, ht = tuple(outs) if save_states else (outs[0], None, outs[1])
    return o, h, (ht if per_segment else ht[:, :, 0])


def _state_vp_kernel(kd_ref, w_ref, u_ref, gl_ref, h0_ref, vp_ref, h_ref, ht_ref, *, chunk_size,
                     precision):
    C = chunk_size
    NT = kd_ref.shape[0] // C

    def body(c, St):                                    # St: [BV, K] fp32 state entering chunk c
        rows = pl.ds(c * C, C)
        h_ref[c] = St.astype(h_ref.dtype)
        vp = u_ref[rows, :].astype(F32) - cm.dot_nt(w_ref[rows, :].astype(F32), St, precision)
        vp_ref[rows, :] = vp.astype(vp_ref.dtype)
        gl = gl_ref[pl.ds(c, 1), :]                                       # [1, K]
        return St * gl + cm.dot_tn(vp, kd_ref[rows, :].astype(F32), precision)

    ht_ref[...] = jax.lax.fori_loop(0, NT, body, h0_ref[...].astype(F32))


def state_fwd_vp(kd, w, u, gl, h0, *, chunk_size: int, block_v: int, interpret: bool,
                 precision=None, state_dtype=F32, vp_dtype=F32, _params=None):
    """Serial pass that only carries the state (fla's `chunk_gated_delta_rule_fwd_h` split):
    per chunk V' = U - W S and S <- e^{G_last} S + Kd^T V', writing V' and the state entering each
    chunk; the output is left to the parallel `output_fwd`. One program per (batch, head, V-block,
    segment); fp32 state in registers. Round-3 lever 2 (kda_pallas_notes.md): 2 dots per serial
    step instead of state_fwd's 4.

    Args: kd, w [B, H, T, K], u [B, H, T, V], gl [B, H, NT, K] (intra_fwd outputs); h0 as
      state_fwd ([B, H, V, K] or per segment [B, H, NS, V, K], fp32, transposed); precision of the
      two dots (common.mm_precision, or common.BF16_OPERANDS: S and V' rounded to bf16 as
      operands, as fla); state_dtype, vp_dtype: storage dtypes of h and V'.
    Returns: vp = V' [B, H, T, V] (vp_dtype); h [B, H, NT, V, K] (state_dtype; state entering each
      chunk, transposed); ht fp32 of h0's rank (after the last chunk / each segment).
    """
    B, H, T, K = kd.shape
    V = u.shape[-1]
    C = chunk_size
    NT = T // C
    BV = block_v
    lay = cm.serial_layout(h0, T, K, C, BV)
    h0, per_segment, NS = lay.state, lay.per_segment, lay.num_segments
    fk, fv, fg, fs, fh = lay.k, lay.v, lay.g, lay.s, lay.h
    vp, h, ht = pl.pallas_call(
        functools.partial(_state_vp_kernel, chunk_size=C, precision=precision),
        grid=(B, H, V // BV, NS),
        in_specs=[fk, fk, fv, fg, fs],
        out_specs=[fv, fh, fs],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, V), vp_dtype),
                   jax.ShapeDtypeStruct((B, H, NT, V, K), state_dtype),
                   jax.ShapeDtypeStruct((B, H, NS, V, K), F32)],
        interpret=interpret, compiler_params=_params or cm.STATE_PARAMS, name="kda_state_fwd_vp",
    )(kd, w, u, gl, h0)
    return vp, h, (ht if per_segment else ht[:, :, 0])


def _output_kernel(qg_ref, aqk_ref, vp_ref, h_ref, o_ref, *, precision):
    o = (cm.dot_nt(qg_ref[...].astype(F32), h_ref[...].astype(F32), precision)
         + cm.dot(aqk_ref[...].astype(F32), vp_ref[...].astype(F32), precision))
    o_ref[...] = o.astype(o_ref.dtype)


def output_fwd(qg, aqk, vp, h, *, chunk_size: int, out_dtype, interpret: bool, precision=None,
               _params=None):
    """o = Qg S_c + tril(Aqk) V' per chunk, in parallel over (batch, head, chunk) (fla's
    `chunk_gla_fwd_o`); the second half of round-3 lever 2.

    Args: qg [B, H, T, K], aqk [B, H, T, C] (intra_fwd); vp [B, H, T, V] and h [B, H, NT, V, K]
      (state_fwd_vp: V' and the transposed state entering each chunk); precision of the two dots
      (as state_fwd_vp).
    Returns: o [B, T, H, V] in out_dtype (token-major, the user's layout).
    """
    B, H, T, K = qg.shape
    V = vp.shape[-1]
    C = chunk_size
    NT = T // C
    return pl.pallas_call(
        functools.partial(_output_kernel, precision=precision), grid=(B, H, NT),
        in_specs=[pl.BlockSpec((None, None, C, K), lambda b, h, c: (b, h, c, 0)),
                  pl.BlockSpec((None, None, C, C), lambda b, h, c: (b, h, c, 0)),
                  pl.BlockSpec((None, None, C, V), lambda b, h, c: (b, h, c, 0)),
                  pl.BlockSpec((None, None, None, V, K), lambda b, h, c: (b, h, c, 0, 0))],
        out_specs=pl.BlockSpec((None, C, None, V), lambda b, h, c: (b, c, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
        interpret=interpret, compiler_params=_params or cm.OUTPUT_PARAMS, name="kda_output_fwd",
    )(qg, aqk, vp, h)
