"""Shared in-kernel building blocks for the KDA chunk kernels (forward and backward).

All helpers run INSIDE a Pallas kernel body on values loaded from refs. The Triton lowering cannot
slice or concatenate values, so every chunk quantity is one whole-chunk value ([C, K], [C, V] or
[C, C] with C = 64) and the 16-token structure (diagonal tiles, row-block anchors) is expressed with
iota masks and selects. This keeps the dots 64 wide (tensor-core friendly) and the live set small.

Gate arithmetic is in natural-log units (nats) and fp32 throughout: G is the inclusive cumsum of the
log-decay g inside the chunk, exp(G) the decay since the chunk start.

Anchoring (ANCHORS.md section 1, fla `chunk_kda` with safe_gate): for a row i in the 16-row block r
and a column j <= i, a score is
  sum_c a_ic b_jc exp(G_ic - G_jc) = [(a * exp(G - anc_r)) (b * exp(anc_r - G))^T]_ij
with the CAUSAL anchor anc_r = the cumsum before row block r (row 16 r - 1 of G; 0 for r = 0).
Columns in blocks before r have both exponents <= 0; columns in block r have
exp(anc_r - G_j) <= exp(16 |lower_bound|) <= e^80 < bf16 / fp32 max (e^88.7) when
g >= lower_bound >= -5. Columns after block r are not needed: their exponent is replaced by 0
(a finite, unused value) and the result is masked with a select, never a multiply. One
[C, K] x [K, C] dot per row block r gives the rows of block r ("row-block GEMM"; the other rows of
that dot are discarded by a select).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

BT = 16  # diagonal tile / row-block length (tokens): the unit the lower_bound argument is made for
F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
BF16X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3

# Triton lowering parameters. num_stages=1: no software pipelining of the chunk loops; with the
# default 3 stages the staged [64, 128] fp32 tiles of the state passes exceed the H200's 227 KiB of
# shared memory (measured: 272 KiB requested at K = V = 128). The intra-chunk kernels hold several
# [64, 128] fp32 values at once: 8 warps halve the registers per thread for each of them.
# Module attributes so that the benchmark can sweep them; ignored in interpret mode.
STATE_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)
INTRA_PARAMS = pltriton.CompilerParams(num_warps=8, num_stages=1)


def mm_precision(dtype):
    """Dot precision for the bulk fp32-operand dots of a call with inputs of `dtype`.

    fp32 inputs: Precision.HIGHEST (IEEE fp32 on the Triton lowering; fp32 in, fp32 math).
    bf16 inputs: default (TF32 on GPU for the fp32 intermediates; the error budget is bf16's).
    """
    return HIGHEST if jnp.dtype(dtype) == jnp.dtype(F32) else None


# Precision of the error-sensitive dots for bf16 inputs (see exact_precision). A module attribute
# so that experiments/bench_kda_kernels.py can time alternatives (lax.Precision.DEFAULT = one TF32
# pass; lax.DotAlgorithmPreset.TF32_TF32_F32_X3, GPU only); the tests cover the default.
EXACT_BF16 = BF16X3


def exact_precision(dtype):
    """Dot precision for the error-sensitive dots: dL = -A^T dA A^T, the diagonal tiles of the
    score backward (whose dG terms cancel in the reverse cumsum) and the sequence split's
    transitions and segment scan.

    fp32 inputs: Precision.HIGHEST (IEEE fp32). bf16 inputs: EXACT_BF16, by default
    DotAlgorithmPreset.BF16_BF16_F32_X3 (three bf16 tensor-core dots on split operands, ~2^-16
    relative, fp32 accumulate; fla 0.6 uses bf16x3 for the backward diagonal tiles). XLA:CPU
    (interpret mode) runs this preset as an fp32 dot, so the CPU tests cannot see its rounding; the
    GPU tests can.
    """
    return HIGHEST if jnp.dtype(dtype) == jnp.dtype(F32) else EXACT_BF16


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


def iotas(m: int, n: int):
    """(row index, column index) int32 iotas of shape [m, n]."""
    return (lax.broadcasted_iota(jnp.int32, (m, n), 0), lax.broadcasted_iota(jnp.int32, (m, n), 1))


def row_block(n_rows: int):
    """[n_rows, 1] int32: the 16-row block index of each row."""
    return lax.div(lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0), jnp.int32(BT))


def pick_row(x, i: int):
    """Row i of x [m, n] as [1, n] (a masked reduction: exact, no value slicing)."""
    rows = lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0, keepdims=True)


class Gate:
    """Chunk gate quantities from g [C, K] fp32 (nats).

    G: inclusive cumsum [C, K]; G_last: [1, K]; anc: list of the ns = C / 16 row-block anchors
    [1, K] (anc[0] = 0); anc_rows [C, K]: each row's block anchor; rb: [C, 1] row-block index;
    ea = exp(G - anchor of the row's block) [C, K] (<= 1).
    """

    def __init__(self, g):
        C = g.shape[0]
        self.ns = C // BT
        self.G = jnp.cumsum(g, axis=0)
        self.G_last = pick_row(self.G, C - 1)
        self.rb = row_block(C)
        self.anc = [jnp.zeros_like(self.G_last)] + [pick_row(self.G, r * BT - 1)
                                                   for r in range(1, self.ns)]
        anc_rows = jnp.zeros_like(self.G)
        for r in range(1, self.ns):
            anc_rows = jnp.where(self.rb == r, self.anc[r], anc_rows)
        self.anc_rows = anc_rows
        self.ea = jnp.exp(self.G - anc_rows)

    def eb_own(self):
        """exp(anc - G) with each row's own block anchor [C, K]; <= e^{16|lb|} (diagonal tiles)."""
        return jnp.exp(self.anc_rows - self.G)

    def eb(self, r: int):
        """exp(anc_r - G) on rows of blocks <= r, 1 on later rows (unused) [C, K]; <= e^{16|lb|}."""
        return jnp.exp(jnp.where(self.rb <= r, self.anc[r] - self.G, 0.0))


def anchored_scores(a, b, gate: Gate, *, dtype):
    """S_ij = sum_c a_ic b_jc exp(G_ic - G_jc) for j in blocks <= block(i), as [C, C] fp32.

    a, b: [C, K] fp32. Operands are cast to `dtype` (bf16 inputs: bf16 tensor-core dots, fp32
    accumulate); one [C, K] x [K, C] dot per row block. Entries right of the row's block are
    unspecified (finite): the caller masks.
    """
    at = (a * gate.ea).astype(dtype)
    prec = mm_precision(dtype)
    out = None
    for r in range(gate.ns):
        s = dot_nt(at, (b * gate.eb(r)).astype(dtype), prec)
        out = s if out is None else jnp.where(gate.rb == r, s, out)
    return out


def unit_lower_inverse(L, precision):
    """(I + L)^-1 for a strictly lower-triangular [C, C] fp32 L (C a power of two), no loop.

    Recursive blocked forward substitution, all blocks of one size at once: D starts as the inverse
    on 2x2 diagonal blocks (I minus the sub-diagonal pairs, exact). Merging two diagonal blocks of
    size s into one of size 2 s uses
      [[I + L11, 0], [L21, I + L22]]^-1 = [[D1, 0], [-D2 L21 D1, D2]],
    i.e. D <- D - (D Loff_s) D with Loff_s the L21 parts of every 2s-block (masked with a select).
    log2(C) - 1 levels of two [C, C] dots at `precision` (C = 64: 10 dots). Same algebra as fla's
    `solve_tril` merges (16 -> 32 -> 64), applied from 2 upwards instead of a row loop.
    """
    C = L.shape[0]
    rows, cols = iotas(C, C)
    D = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
    D = D - jnp.where((lax.div(rows, 2) == lax.div(cols, 2)) & (rows > cols), L, 0.0)
    s = 2
    while s < C:
        rs, cs = lax.div(rows, jnp.int32(s)), lax.div(cols, jnp.int32(s))
        same = lax.div(rs, 2) == lax.div(cs, 2)
        N = dot(D, jnp.where(same & (rs > cs), L, 0.0), precision)
        D = D - dot(N, D, precision)
        s *= 2
    return D


def chunk_factors(q, k, v, beta, gate: Gate, *, scale: float, dtype):
    """The chunk factors from whole-chunk values (fp32 q, k [C, K], v [C, V], beta [C, 1]).

    Returns dict: M [C, C] (k.k anchored scores, strictly lower, unweighted by beta), A = (I + L)^-1
    with L = beta M, X = beta e^G k [C, K], Y = beta v [C, V], W = A X, U = A Y (fp32), and
    Aqk [C, C] = scale q.k anchored scores, lower triangle including the diagonal.
    """
    C = k.shape[0]
    rows, cols = iotas(C, C)
    prec = mm_precision(dtype)
    M = jnp.where(rows > cols, anchored_scores(k, k, gate, dtype=dtype), 0.0)
    # The solve runs at mm precision (TF32 for bf16 inputs): A only enters W = A X, U = A Y (TF32
    # dots themselves) and the backward. Emulated on CPU (TF32-rounded operands, 64x64 L from the
    # ANCHORS recipe, 20 draws): A's RMS error 1.4e-6, W's 2.03e-4 with either a TF32 or an exact
    # solve; with keys correlated 0.9 and gates ~0: A 5.4e-4, W 7.6e-4 vs 5.1e-4. bf16 inputs
    # already cost ~3e-3 (fla tolerance 5e-3).
    A = unit_lower_inverse(beta * M, prec)
    X = beta * jnp.exp(gate.G) * k
    Y = beta * v
    Aqk = jnp.where(rows >= cols, anchored_scores(scale * q, k, gate, dtype=dtype), 0.0)
    return dict(M=M, A=A, X=X, Y=Y, W=dot(A, X, prec), U=dot(A, Y, prec), Aqk=Aqk)
