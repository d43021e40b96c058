"""Chunked Kimi Delta Attention in XLA: the "uniform GEMM" chunk form with 16-token diagonal tiles.

Public entry point: `kda_chunked` (re-exported from `k3jax.ops.kda`). Numerics (ANCHORS.md §1):

Inside a chunk of C tokens, G = inclusive cumsum of g (fp32) and, for j <= i,
    L_ij   = beta_i  sum_c k_ic k_jc exp(G_ic - G_jc)     (j < i)
    Aqk_ij = scale   sum_c q_ic k_jc exp(G_ic - G_jc)     (j <= i)
The chunk is cut into 16-token tiles. Tile b has a causal anchor a_b = G just before the tile (the
cumsum of the previous tiles), so for a row i of tile b and a column j:
    exp(G_i - G_j) = exp(G_i - a_b) * exp(a_b - G_j).
For columns in earlier tiles both factors have exponents <= 0 (the per-row-block anchor): one fp32 GEMM
per row tile, never overflows. For the diagonal tile exp(a_b - G_j) >= 1 grows with the tile:
- `lower_bound` declared (every g >= lower_bound >= -5): a tile spans at most 16 * 5 = 80 nats, so the
  tile is ONE dense matmul (Q*e^(G-a) 2^s)(K*e^(a-G) 2^-s)^T with bf16 operands (for 16-bit inputs;
  fp32 operands for fp32 inputs) and fp32 accumulation, masked with a select. The exact power of two
  2^s = 2^58 ~ e^40 (`centre_exponent`) centres both factors in e^(+-40): uncentred, the backward forms
  (cotangent * e^-80), which backends without fp32 denormals (XLA:CPU, TPU) flush to zero for
  cotangents below ~1e-3, and (cotangent * e^80), which overflows above ~1e3;
- no bound: the exact pairwise form sum_c q_ic k_jc exp(G_ic - G_jc) on the masked (j <= i) entries,
  which never overflows for any g <= 0.
The anchor is never a tile's middle or last row: that would let future gates enter past outputs
through rounding (fla issue #1240).

Then A = (I + L)^-1 (fp32 unit-lower triangular solve), W = A(beta*exp(G)*K), U = A(beta*V), and a
scan over chunks carries the fp32 state S [K, V]:
    V' = U - W S;   O = scale (Q*exp(G)) S + Aqk V';   S <- Diag(exp(G_last)) S + (K*exp(G_last - G))^T V'.

Packed documents (segment_ids): every entry that couples two different documents is selected away
(L, Aqk, and the state terms of rows whose document started inside the chunk), which is the exact
recurrence with the state reset at each document start.

Source: Kimi Linear (arXiv 2510.26692) §3 chunk form; fla `fla/ops/kda/chunk*.py` (`chunk_kda`, with
`safe_gate=True, lower_bound=...` for the bounded diagonal path).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda_reference import l2_normalize, segment_restarts, validate_kda_inputs

__all__ = ["kda_chunked", "validate_lower_bound", "validate_chunk_size", "TILE"]

TILE = 16                       # diagonal tile length (tokens)
_HI = jax.lax.Precision.HIGHEST  # fp32 GEMMs stay fp32 on every backend (no TF32)


def validate_lower_bound(lower_bound) -> None:
    """lower_bound must be None or a Python number in [-5, 0); raises ValueError otherwise."""
    if lower_bound is None:
        return
    if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool):
        raise ValueError(f"lower_bound must be a Python number in [-5, 0) or None; got {lower_bound=}")
    if not -5.0 <= float(lower_bound) < 0.0:
        raise ValueError(
            f"lower_bound must be in [-5, 0) so a 16-token tile's exp(-G) <= e^80 fits bf16; got {lower_bound=}")


def validate_chunk_size(chunk_size) -> None:
    """chunk_size must be a power-of-two int >= 16; raises ValueError otherwise."""
    if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) or chunk_size < TILE
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two >= {TILE}; got {chunk_size=}")


def centre_exponent(lower_bound: float, tile: int = TILE) -> int:
    """s = round(tile |lower_bound| / (2 ln 2)) (58 for -5: 2^58 ~ e^40): the bounded diagonal tile's
    factors are (a e^(G - anchor)) 2^s and (k e^(anchor - G)) 2^-s, so both lie in e^(+-40) instead of
    [e^-80, 1] and [1, e^80]. A power of two, so the scaling is exact (an additive shift of the exp
    argument would round it to ulp(40) ~ 4e-6), and a constant, so the anchor stays causal.

    Why: uncentred, the backward forms (cotangent x e^-80) before multiplying by e^80, which is below
    fp32's normal range (1.2e-38) for cotangents under ~1e-3 and is flushed to zero on backends
    without denormals (XLA:CPU, TPU), and (cotangent x e^80) overflows above ~1e3. Centred, every
    product of a cotangent or input entry x with a factor stays within |x| e^(+-40): exact for |x|
    (times |q|, |k|) between ~3e-21 and ~1e20.
    """
    return round(0.5 * tile * abs(float(lower_bound)) / float(np.log(2.0)))


def _tile_operand_dtype(dtype) -> jnp.dtype:
    """Operand dtype of the bounded diagonal-tile GEMM: bf16 for 16-bit inputs, else the input dtype.

    fp16 inputs also use bf16: e^80 would overflow fp16 (max 65504), not bf16 (same exponent as fp32).
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype).itemsize <= 2 else jnp.dtype(dtype)


def _masked_exp(x, mask):
    """exp(x) where mask else 0, with a zero (never inf/NaN) gradient through the masked entries."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _diag_tile(a, b, Gl, s, tile_dtype):
    """sum_c a_ic b_jc e^(Gl_ic - Gl_jc) per diagonal tile as ONE GEMM with `tile_dtype` (bf16) operands
    (a e^Gl 2^s)(b e^-Gl 2^-s)^T and fp32 accumulation; entries j > i are finite and unused.

    a, b: fp32 (or fp64) [..., nt, tile, K]; Gl [..., nt, tile, K]: G minus the tile's causal anchor
    (<= 0, >= 16 lower_bound); s: centre_exponent. Returns a.dtype [..., nt, tile, tile].
    The backward is explicit so that every intermediate stays within e^(+-40) of its inputs
    (centre_exponent): da = (dS (b e^-Gl 2^-s)) e^Gl 2^s, db = (dS^T (a e^Gl 2^s)) e^-Gl 2^-s,
    dGl = a da - b db, from the fp32 operands at HIGHEST precision (differentiating through the bf16
    rounding of the factors put ~5% RMS error into dg; fla 0.6 moved these tiles to bf16x3).
    """
    ea, eb = _centred_factors(Gl, s)
    wide = jnp.dtype(tile_dtype).itemsize >= 4          # fp32 operands stay fp32 (no TF32 on GPU)
    return jnp.einsum("...bik,...bjk->...bij", (a * ea).astype(tile_dtype), (b * eb).astype(tile_dtype),
                      preferred_element_type=a.dtype, precision=_HI if wide else None)


def _centred_factors(Gl, s):
    return jnp.exp(Gl) * (2.0 ** s), jnp.exp(-Gl) * (2.0 ** -s)


def _diag_tile_fwd(a, b, Gl, s, tile_dtype):
    return _diag_tile(a, b, Gl, s, tile_dtype), (a, b, Gl)


def _diag_tile_bwd(s, tile_dtype, res, d):
    a, b, Gl = res
    ea, eb = _centred_factors(Gl, s)
    da = jnp.einsum("...bij,...bjk->...bik", d, b * eb, precision=_HI) * ea
    db = jnp.einsum("...bij,...bik->...bjk", d, a * ea, precision=_HI) * eb
    return da, db, a * da - b * db


_diag_tile.defvjp(_diag_tile_fwd, _diag_tile_bwd)


def _chunk_scores(a, k, G, *, lower_bound, tile_dtype, include_diag: bool, tile: int = TILE):
    """sum_c a_ic k_jc exp(G_ic - G_jc) for j < i (or j <= i), zero elsewhere; fp32 [..., C, C].

    a, k, G: fp32 [..., C, K] (one chunk per leading index). Tiles of `tile` rows with the causal anchor
    "cumsum before the tile"; see the module docstring for the two diagonal paths (lower_bound None:
    exact pairwise; a number: one GEMM per diagonal tile).
    """
    *lead, C, K = G.shape
    nt = C // tile
    at = a.reshape(*lead, nt, tile, K)
    kt = k.reshape(*lead, nt, tile, K)
    Gt = G.reshape(*lead, nt, tile, K)
    # a_b = G at the last row of tile b-1 (0 for the first tile): the cumsum before the tile.
    anchor = jnp.concatenate([jnp.zeros_like(Gt[..., :1, 0, :]), Gt[..., :-1, -1, :]], axis=-2)  # [.., nt, K]
    a_anch = at * jnp.exp(Gt - anchor[..., None, :])                     # exponent <= 0 (g <= 0)

    # Columns in earlier tiles: K factor exp(a_b - G_j), exponent <= 0 for j < tile * b.
    col = jnp.arange(C)
    row_tile = jnp.arange(nt)
    earlier = col[None, :] < (tile * row_tile)[:, None]                   # [nt, C]
    k_off = k[..., None, :, :] * _masked_exp(anchor[..., :, None, :] - G[..., None, :, :],
                                             earlier[:, :, None])        # [..., nt, C, K]
    off = jnp.einsum("...bik,...bjk->...bij", a_anch, k_off, precision=_HI)   # [..., nt, tile, C]

    ti = jnp.arange(tile)
    tri = (ti[None, :] <= ti[:, None]) if include_diag else (ti[None, :] < ti[:, None])  # [i, j]
    if lower_bound is not None:
        # ONE dense GEMM per diagonal tile, its two factors centred by 2^(+-s) (centre_exponent).
        s = centre_exponent(lower_bound, tile) if tile == TILE else 0
        diag = jnp.where(tri, _diag_tile(at, kt, Gt - anchor[..., None, :], s, jnp.dtype(tile_dtype)), 0.0)
    else:
        # Exact pairwise exponents on the kept entries only: exp(G_i - G_j) with G_i - G_j <= 0.
        pair = _masked_exp(Gt[..., :, None, :] - Gt[..., None, :, :], tri[:, :, None])   # [.., nt, i, j, K]
        diag = jnp.sum(at[..., :, None, :] * kt[..., None, :, :] * pair, axis=-1)

    # Assemble [..., nt, tile, C]: the diagonal tile goes to columns tile*b .. tile*b + tile - 1.
    diag_wide = jnp.broadcast_to(diag[..., :, :, None, :], (*lead, nt, tile, nt, tile)).reshape(
        *lead, nt, tile, C)
    in_diag = (col[None, :] // tile) == row_tile[:, None]                 # [nt, C]
    out = jnp.where(in_diag[:, None, :], diag_wide, jnp.where(earlier[:, None, :], off, 0.0))
    return out.reshape(*lead, C, C)


def _unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [..., m, m], by row-wise forward substitution (fp32).

    Row i: Y_i = e_i - sum_j L_ij Y_j (L_ij = 0 for j >= i, so the full row can be used). A fori_loop
    keeps the compiled graph small.
    """
    m = L.shape[-1]
    eye = jnp.eye(m, dtype=L.dtype)

    def row(i, Y):
        L_i = jax.lax.dynamic_index_in_dim(L, i, axis=-2, keepdims=False)          # [..., m]
        y_i = jax.lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=False) - jnp.einsum(
            "...j,...jk->...k", L_i, Y, precision=_HI)
        return jax.lax.dynamic_update_index_in_dim(Y, y_i, i, axis=-2)

    return jax.lax.fori_loop(1, m, row, jnp.broadcast_to(eye, L.shape))


def _solve_unit_lower(L, rhs, block: int = TILE):
    """X = (I + L)^-1 rhs for strictly lower-triangular L [..., C, C], rhs [..., C, n] (fp32).

    Blockwise forward substitution: the 16x16 diagonal blocks are inverted by substitution, then
    X_b = D_b^-1 (rhs_b - sum_{c<b} L_bc X_c) over the C/16 row blocks. (XLA's batched
    triangular_solve is ~100x slower on CPU for these many small systems.)
    """
    C = L.shape[-1]
    nb = C // block
    diag = jnp.stack([L[..., b * block:(b + 1) * block, b * block:(b + 1) * block] for b in range(nb)], axis=-3)
    Dinv = _unit_lower_inverse(diag)                                        # [..., nb, block, block]
    X = []
    for b in range(nb):
        r = rhs[..., b * block:(b + 1) * block, :]
        if b:
            r = r - jnp.einsum("...ij,...jn->...in", L[..., b * block:(b + 1) * block, :b * block],
                               jnp.concatenate(X, axis=-2), precision=_HI)
        X.append(jnp.einsum("...ij,...jn->...in", Dinv[..., b, :, :], r, precision=_HI))
    return jnp.concatenate(X, axis=-2)


def _intra_chunk(q, k, v, g, beta, run, run_in, *, scale, lower_bound, tile_dtype, tile=TILE):
    """Everything that does not need the incoming state, for all chunks at once.

    q, k, g: fp32 [B, H, N, C, K]; v [B, H, N, C, V]; beta [B, H, N, C]; run [B, 1, N, C] int32 run
    ids (document index, nondecreasing); run_in [B, 1, N] run id of the incoming state.
    Returns W, U, Aqk, Qg, Kl, decay (see module docstring).
    """
    C, K = q.shape[-2], q.shape[-1]
    G = jnp.cumsum(g, axis=-2)                                            # fp32 inclusive cumsum
    same = run[..., :, None] == run[..., None, :]                          # [B, 1, N, C, C]
    row_in = (run == run_in[..., None])[..., None]                        # rows that see the state
    ii = jnp.arange(C)
    strict = ii[None, :] < ii[:, None]

    kk = _chunk_scores(k, k, G, lower_bound=lower_bound, tile_dtype=tile_dtype, include_diag=False,
                        tile=tile)
    L = jnp.where(strict & same, beta[..., :, None] * kk, 0.0)
    qk = _chunk_scores(q, k, G, lower_bound=lower_bound, tile_dtype=tile_dtype, include_diag=True,
                        tile=tile)
    Aqk = jnp.where((strict | (ii[None, :] == ii[:, None])) & same, scale * qk, 0.0)

    eG = jnp.exp(G)
    rhs = jnp.concatenate([jnp.where(row_in, beta[..., None] * eG * k, 0.0), beta[..., None] * v], axis=-1)
    X = _solve_unit_lower(L, rhs)                                          # (I + L)^-1 rhs, fp32
    W, U = X[..., :K], X[..., K:]
    Qg = jnp.where(row_in, scale * q * eG, 0.0)
    G_last = G[..., -1:, :]
    last_run = run[..., -1:]
    Kl = jnp.where((run == last_run)[..., None], k * jnp.exp(G_last - G), 0.0)
    decay = jnp.where((last_run == run_in[..., None]), jnp.exp(G_last[..., 0, :]), 0.0)   # [B,H,N,K]
    return W, U, Aqk, Qg, Kl, decay


def _state_step(S, xs):
    """One chunk: S [B, H, K, V] fp32 -> (S_next, O [B, H, C, V])."""
    W, U, Aqk, Qg, Kl, decay = xs
    Vp = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=_HI)
    O = jnp.einsum("bhck,bhkv->bhcv", Qg, S, precision=_HI) + jnp.einsum(
        "bhcd,bhdv->bhcv", Aqk, Vp, precision=_HI)
    S = decay[..., None] * S + jnp.einsum("bhck,bhcv->bhkv", Kl, Vp, precision=_HI)
    return S, O


def kda_chunked(
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
    chunk_size: int = 64,
    lower_bound: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA by the chunk form (XLA), equal to `kda_recurrent` up to rounding.

    Args:
      q, k: [B, T, H, K] queries / keys (any float dtype; K need not be a power of two).
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log-decay, natural-log units, g <= 0. With `lower_bound` declared the
        caller promises g >= lower_bound everywhere (e.g. from `kda_gate(..., lower_bound=-5)`).
      beta: [B, T, H] delta-rule step size.
      scale: query scale; None means K ** -0.5.
      initial_state: [B, H, K, V] state before token 0 (fp32); applies to each row's first segment.
      output_final_state: also return the fp32 final state.
      segment_ids: [B, T] integer document ids; the state restarts at every change of id.
      use_qk_l2norm: L2-normalise q and k along K first (fp32).
      chunk_size: tokens per chunk, a power of two >= 16 (T is padded internally with steps that leave
        the state unchanged: g = 0, beta = 0, k = 0).
      lower_bound: None (exact diagonal tiles for any g <= 0) or the declared gate bound in [-5, 0),
        which selects the single-GEMM diagonal tiles (bf16 operands for 16-bit inputs, the input dtype
        otherwise; fp32 accumulation). Gates below a declared bound may overflow to inf/NaN.

    Returns:
      (o, final_state): o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 or None.

    Raises:
      ValueError: mismatched shapes, chunk_size not a power of two >= 16, lower_bound outside [-5, 0).

    Precision: cumsums of g, the triangular solve, the state and every GEMM except the bounded diagonal
    tiles are fp32 (Precision.HIGHEST). Gradients: autodiff; the intra-chunk part and each scan step
    are rematerialised (`jax.checkpoint`), so memory is linear in T.
    Source: Kimi Linear (arXiv 2510.26692) chunk form; fla `chunk_kda` (safe_gate / lower_bound).
    """
    return _kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, segment_ids=segment_ids,
                        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, lower_bound=lower_bound, tile=TILE)


def _kda_chunked(q, k, v, g, beta, *, scale, initial_state, output_final_state, segment_ids, use_qk_l2norm,
                 chunk_size, lower_bound, tile):
    """`kda_chunked` with the diagonal tile length as a parameter (16 in the library). Experiments set
    tile = chunk_size to force one single-GEMM diagonal tile per chunk (gate_stability.py)."""
    validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids, scale)
    validate_chunk_size(chunk_size)
    validate_lower_bound(lower_bound)
    if tile not in (TILE, chunk_size) or chunk_size % tile:
        raise ValueError(f"tile must be {TILE} or chunk_size={chunk_size}; got {tile=}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    scale = K ** -0.5 if scale is None else float(scale)
    tile_dtype = _tile_operand_dtype(q.dtype)
    f32 = jnp.promote_types(jnp.float32, q.dtype)   # fp32 (fp64 when the inputs are fp64)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)

    N = -(-T // C)
    pad = N * C - T
    restart = segment_restarts(segment_ids, B, T)
    run = jnp.cumsum(restart.astype(jnp.int32), axis=1)                    # [B, T] document index
    run = jnp.pad(run, [(0, 0), (0, pad)], mode="edge")                    # padding joins the last doc
    run = run.reshape(B, 1, N, C)
    run_in = jnp.concatenate([jnp.zeros((B, 1, 1), jnp.int32), run[..., :-1, -1]], axis=-1)  # [B, 1, N]

    def to_chunks(x):  # [B, T, H, ...] -> fp32 [B, H, N, C, ...], zero padded
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape((B, H, N, C) + x.shape[3:])

    # The barrier keeps XLA from folding the bf16 -> fp32 converts into the fp32 dots (on CPU that turns
    # them into slow bf16 dots; the math here is meant to be fp32).
    qc, kc, vc, gc, bc = jax.lax.optimization_barrier(tuple(to_chunks(x) for x in (q, k, v, g, beta)))
    intra = jax.checkpoint(functools.partial(_intra_chunk, scale=scale, lower_bound=lower_bound,
                                             tile_dtype=tile_dtype, tile=tile))
    xs = intra(qc, kc, vc, gc, bc, run, run_in)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in xs)                        # chunk axis first for the scan
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    S_T, O = jax.lax.scan(jax.checkpoint(_state_step), S0, xs)           # O [N, B, H, C, V]
    o = jnp.moveaxis(O, 0, 2).reshape(B, H, N * C, V)[:, :, :T]
    o = jnp.moveaxis(o, 1, 2).astype(v.dtype)
    return o, (S_T if output_final_state else None)
