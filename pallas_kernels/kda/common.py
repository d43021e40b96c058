"""Shared in-kernel building blocks for the KDA chunk kernels (forward and backward).

All helpers run INSIDE a Pallas kernel body on values loaded from refs. They never slice values
(the Triton lowering cannot); a chunk of C tokens is handled as C // BT sub-tiles of BT = 16 tokens
loaded separately with `ref[pl.ds(...)]`, and matrices over the chunk are Python lists of 16x16
tiles (static unrolling).

Gate arithmetic is in natural-log units (nats) and fp32 throughout: G is the inclusive cumsum of the
log-decay g inside the chunk, exp(G) the decay since the chunk start.

Anchoring (ANCHORS.md section 1, fla `chunk_kda` with safe_gate): a score tile (r, s), s <= r, is
  sum_c a_ic b_jc exp(G_ic - G_jc) = [(a * exp(G - anc_r)) (b * exp(anc_r - G))^T]_ij
with the CAUSAL anchor anc_r = cumsum before row tile r. Off-diagonal tiles (s < r) have both
exponents <= 0. Diagonal tiles have exp(anc_r - G_j) <= exp(16 * |lower_bound|) <= e^80 < bf16/fp32
max (e^88.7) when g >= lower_bound >= -5: one dense dot, masked with a select (never a multiply).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BT = 16  # sub-tile length (tokens); the unit of the 16x16 diagonal tiles
F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# Triton lowering parameters for every KDA kernel. num_stages=1: no software pipelining of the
# chunk loops; with the default 3 stages the staged [64, 128] fp32 tiles of the state passes
# exceed the H200's 227 KiB of shared memory (measured: 272 KiB requested at K = V = 128).
# Ignored in interpret mode.
COMPILER_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def mm_precision(dtype):
    """Dot precision for the fp32-operand dots of a call with inputs of `dtype`.

    fp32 inputs: Precision.HIGHEST (IEEE fp32 on the Triton lowering; fp32 in, fp32 math).
    bf16 inputs: default (TF32 on GPU for the fp32 intermediates; the error budget is bf16's).
    """
    return HIGHEST if jnp.dtype(dtype) == jnp.dtype(F32) else None


def mask(strict: bool) -> jax.Array:
    """[BT, BT] bool lower-triangular mask (i > j if strict else i >= j)."""
    i = lax.broadcasted_iota(jnp.int32, (BT, BT), 0)
    j = lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
    return i > j if strict else i >= j


def dot(a, b, precision=None):
    """a [m, k] @ b [k, n] with fp32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def dot_nt(a, b, precision=None):
    """a [m, k] @ b[n, k]^T with fp32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def dot_tn(a, b, precision=None):
    """a[k, m]^T @ b [k, n] with fp32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def load_tiles(ref, ns: int, dtype=None):
    """Rows [BT*r, BT*r + BT) of a [C, ...] ref for r < ns, optionally cast."""
    out = []
    for r in range(ns):
        x = ref[pl.ds(r * BT, BT)]
        out.append(x if dtype is None else x.astype(dtype))
    return out


def gate_cumsum(g_ref, ns: int):
    """Chunk-local inclusive cumsum of g, per sub-tile.

    Returns (G tiles [BT, K] fp32, anchors [1, K] fp32 = cumsum before each tile, G_last [1, K]).
    """
    carry = None
    tiles, anchors = [], []
    for r in range(ns):
        gt = g_ref[pl.ds(r * BT, BT), :].astype(F32)
        if carry is None:
            carry = jnp.zeros((1, gt.shape[1]), F32)
        anchors.append(carry)
        tiles.append(jnp.cumsum(gt, axis=0) + carry)
        carry = carry + jnp.sum(gt, axis=0, keepdims=True)
    return tiles, anchors, carry


def anchored(a, G, anc, sign: float, dtype):
    """a * exp(sign * (G - anc)) computed in fp32, cast to the dot operand dtype."""
    return (a.astype(F32) * jnp.exp(sign * (G - anc))).astype(dtype)


def pair_tiles(a_tiles, b_tiles, G_tiles, anchors, *, strict: bool, dtype):
    """Lower block-triangle of M_ij = sum_c a_ic b_jc exp(G_ic - G_jc) (j < i if strict else j <= i).

    Returns a dict {(r, s): [BT, BT] fp32} for s <= r; diagonal tiles are masked with a select.
    Operands are cast to `dtype` (bf16 inputs: one bf16 tensor-core dot per tile, fp32 accumulate).
    """
    ns = len(a_tiles)
    out = {}
    for r in range(ns):
        a_r = anchored(a_tiles[r], G_tiles[r], anchors[r], 1.0, dtype)
        for s in range(r + 1):
            b_s = anchored(b_tiles[s], G_tiles[s], anchors[r], -1.0, dtype)
            m = dot_nt(a_r, b_s, mm_precision(dtype))
            if s == r:
                m = jnp.where(mask(strict), m, 0.0)
            out[(r, s)] = m
    return out


def unit_lower_inverse(L):
    """(I + L)^-1 for a strictly lower-triangular [BT, BT] fp32 L, by forward substitution.

    Row i of the inverse is e_i - L_i (I + L)^-1 restricted to rows < i, which are final when row i
    is computed. No value slicing: rows/columns are picked with iota masks and reductions.
    """
    rows = lax.broadcasted_iota(jnp.int32, (BT, BT), 0)
    cols = lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
    Lt = L.T
    A = jnp.where(rows == cols, 1.0, 0.0).astype(F32)

    def body(i, A):
        li = jnp.sum(jnp.where(cols == i, Lt, 0.0), axis=1, keepdims=True)   # [BT, 1] = L[i, :]^T
        upd = jnp.sum(li * A, axis=0, keepdims=True)                          # [1, BT] = L[i, :] A
        return A - jnp.where(rows == i, upd, 0.0)

    return lax.fori_loop(1, BT, body, A)


def block_unit_lower_inverse(L):
    """(I + L)^-1 for a strictly lower block-triangular chunk matrix given as {(r, s): tile}, s <= r.

    A_rr = (I + L_rr)^-1;  A_rs = -A_rr sum_{s <= m < r} L_rm A_ms  (fp32, HIGHEST-precision dots).
    """
    ns = max(r for r, _ in L) + 1
    A = {}
    for r in range(ns):
        A[(r, r)] = unit_lower_inverse(L[(r, r)])
        for s in range(r):
            acc = None
            for m in range(s, r):
                t = dot(L[(r, m)], A[(m, s)], HIGHEST)
                acc = t if acc is None else acc + t
            A[(r, s)] = -dot(A[(r, r)], acc, HIGHEST)
    return A


def chunk_factors(q_tiles, k_tiles, v_tiles, b_tiles, G_tiles, anchors, *, scale: float, dtype):
    """Recompute the chunk factors: L (as M and beta), A = (I + L)^-1, W, U and Aqk tiles.

    Returns dict with M (unweighted k.k scores, strict), A, X (beta e^G k), Y (beta v), W, U, Aqk.
    """
    ns = len(k_tiles)
    prec = mm_precision(dtype)
    M = pair_tiles(k_tiles, k_tiles, G_tiles, anchors, strict=True, dtype=dtype)
    L = {rs: b_tiles[rs[0]] * m for rs, m in M.items()}
    A = block_unit_lower_inverse(L)
    X = [b_tiles[s] * jnp.exp(G_tiles[s]) * k_tiles[s].astype(F32) for s in range(ns)]
    Y = [b_tiles[s] * v_tiles[s].astype(F32) for s in range(ns)]
    W, U = [], []
    for r in range(ns):
        w = u = None
        for s in range(r + 1):
            tw, tu = dot(A[(r, s)], X[s], prec), dot(A[(r, s)], Y[s], prec)
            w = tw if w is None else w + tw
            u = tu if u is None else u + tu
        W.append(w)
        U.append(u)
    qs = [q.astype(F32) * scale for q in q_tiles]
    Aqk = pair_tiles(qs, k_tiles, G_tiles, anchors, strict=False, dtype=dtype)
    return dict(M=M, A=A, X=X, Y=Y, W=W, U=U, Aqk=Aqk)
