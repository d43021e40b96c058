"""In-kernel building blocks of the portable (pl.pallas_call; Triton on GPU) KDA kernels.

All helpers run inside a kernel body on values loaded from refs. The Triton lowering cannot slice or
concatenate values, so every chunk quantity is one whole-chunk value ([C, K], [C, V] or [C, C],
C = 64) and the 16-token structure (diagonal tiles, row-block anchors) is written with iota masks
and selects. Gates are in nats, fp32; G is the chunk-local inclusive cumsum of g (the cumsum stage's
output), exp(G) the decay since the chunk start.

Anchoring (docs/kda_kernels.md): for a row i in the 16-row block r and a column j <= i,
  sum_c a_ic b_jc exp(G_ic - G_jc) = [(a e^{G - anc_r} 2^s) (b e^{anc_r - G} 2^-s)^T]_ij
with the causal anchor anc_r = G just before block r (0 for r = 0) and the centre exponent s
(plan.centre_exponent: 58 at lower_bound -5, 2^58 ~ e^40; 0 for unbounded gates). For columns of
block r both factors lie within e^{+-40}; for earlier columns the column factor is <= 2^-s. Columns
after block r are masked with a select (never a multiply). Unbounded gates: the own block is
computed exactly instead (own_block_scores, every exp argument <= 0).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BT = 16  # diagonal tile / row-block length (tokens): the unit the lower_bound argument is made for
F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
BF16X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def compiler_params(num_warps: int, num_stages: int | None = 1):
    """Triton compiler parameters (ignored in interpret mode). num_stages=1: no software pipelining
    of the chunk loops (with 3 stages the staged [64, 128] fp32 tiles of the state passes need
    272 KiB of shared memory, more than the H200's 227 KiB)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


class _Bf16Operands:
    def __repr__(self):
        return "BF16_OPERANDS"


# Precision token: both operands rounded to bf16, one tensor-core dot, fp32 accumulation (what fla's
# Triton kernels do for every dot of a bf16 call).
BF16_OPERANDS = _Bf16Operands()


def precisions(dtype):
    """(bulk, exact) dot precisions for inputs of `dtype`. fp32 inputs: IEEE fp32 (HIGHEST) for both.
    bf16 inputs: BF16_OPERANDS for the bulk dots; BF16_BF16_F32_X3 (three bf16 dots on split operands,
    ~2^-16 relative; fla 0.6 uses bf16x3 for the backward diagonal tiles) for the error-sensitive
    ones (dL = -A^T dA A^T, the diagonal tiles of the score backward, the sequence split's
    transitions). XLA:CPU (interpret mode) runs the x3 preset as an fp32 dot."""
    if jnp.dtype(dtype) == jnp.dtype(F32):
        return HIGHEST, HIGHEST
    return BF16_OPERANDS, BF16X3


def _dot_general(a, b, dims, precision):
    if precision is BF16_OPERANDS:
        a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=F32)


def dot(a, b, precision=None):
    """a [m, k] @ b [k, n] with fp32 accumulation (precision: a lax precision or BF16_OPERANDS)."""
    return _dot_general(a, b, ((1,), (0,)), precision)


def dot_nt(a, b, precision=None):
    """a [m, k] @ b [n, k]^T with fp32 accumulation."""
    return _dot_general(a, b, ((1,), (1,)), precision)


def dot_tn(a, b, precision=None):
    """a [k, m]^T @ b [k, n] with fp32 accumulation."""
    return _dot_general(a, b, ((0,), (0,)), precision)


def iotas(m: int, n: int):
    """(row index, column index) int32 iotas of shape [m, n]."""
    return lax.broadcasted_iota(jnp.int32, (m, n), 0), lax.broadcasted_iota(jnp.int32, (m, n), 1)


def row_block(n_rows: int):
    """[n_rows, 1] int32: the 16-row block index of each row."""
    return lax.div(lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0), jnp.int32(BT))


class Gate:
    """Chunk gate quantities from the ref of G [C, K] (fp32, the chunk-local inclusive cumsum).

    G [C, K]; G_last [1, K]; anc: the ns = C / 16 row-block anchors [1, K] (anc[0] = 0; ref loads of
    rows 15, 31, 47); anc_rows [C, K]: each row's anchor; rb [C, 1] the row block;
    ea = exp(G - anc_rows) 2^centre [C, K]: the row factor of the anchored scores.
    """

    def __init__(self, G_ref, centre: int = 0):
        self.G = G_ref[...].astype(F32)
        C = self.G.shape[0]
        self.ns = C // BT
        self.scale = 2.0 ** int(centre)
        self.rb = row_block(C)
        row = lambda i: G_ref[pl.ds(i, 1), :].astype(F32)       # noqa: E731
        self.G_last = row(C - 1)
        self.anc = [jnp.zeros_like(self.G_last)] + [row(r * BT - 1) for r in range(1, self.ns)]
        anc_rows = jnp.zeros_like(self.G)
        for r in range(1, self.ns):
            anc_rows = jnp.where(self.rb == r, self.anc[r], anc_rows)
        self.anc_rows = anc_rows
        self.ea = jnp.exp(self.G - anc_rows) * self.scale

    def eb(self, r: int):
        """exp(anc_r - G) 2^-centre on rows of blocks <= r (within e^{+-40} on block r, <= 2^-centre
        before it), 2^-centre on later rows (unused) [C, K]."""
        return jnp.exp(jnp.where(self.rb <= r, self.anc[r] - self.G, 0.0)) * (1.0 / self.scale)

    def eb_before(self, r: int):
        """exp(anc_r - G) on rows of blocks < r (<= 1 up to rounding) and 0 on rows of blocks >= r:
        the column operand of row block r on the unbounded path (centre 0), zero, not inf, where
        the own block's factor would overflow."""
        before = self.rb < r
        return jnp.where(before, jnp.exp(jnp.where(before, self.anc[r] - self.G, 0.0)), 0.0)


class Segments:
    """Document masks of one chunk (packed sequences, segment_ids), from rel [C] int32.

    rel_i = (document index of token i) - (document index of the state entering the chunk)
    (api.document_offsets; nondecreasing, >= 0). A document start inside the chunk resets the state
    before that token; the chunk form stays exact with these selects:
      same [C, C]: rel_i == rel_j: the score tiles M and Aqk keep same-document pairs;
      row_in [C, 1]: rel_i == 0: rows that read the incoming state (Qg, X = beta e^G k);
      in_last [C, 1]: rel_i == rel_last: rows whose keys enter the outgoing state (Kd);
      carry [1, 1]: rel_last == 0: the incoming state survives the chunk (e^{G_last}).
    The backward applies the same selects to the gradients of these factors.
    """

    def __init__(self, rel):
        r = rel.astype(jnp.int32)[:, None]                      # [C, 1]
        self.same = r == rel.astype(jnp.int32)[None, :]          # [C, C]
        self.row_in = r == 0
        last = jnp.max(r, axis=0, keepdims=True)                 # [1, 1]
        self.in_last = r == last
        self.carry = last == 0


def segments_of(seg_ref):
    """Segments of the chunk in seg_ref [C] (int32 rel), or None without segment_ids."""
    return None if seg_ref is None else Segments(seg_ref[...])


def keep(x, seg, mask: str):
    """x where seg.<mask> else 0 (a select) when seg is given; x when seg is None."""
    return x if seg is None else jnp.where(getattr(seg, mask), x, 0.0)


class ChunkSpecs(NamedTuple):
    """BlockSpecs of one 64-token chunk for a (batch, head, chunk) grid: the user's token-major
    ``[B, T, H, .]`` inputs (``ik`` K-wide, ``iv`` V-wide, ``ib`` beta ``[B, T, H]``), the head-major
    ``[B, H, T, .]`` factors (``tk``, ``tv``, ``ta`` ``[C, C]``), ``tg`` one ``[K]`` row per chunk of
    ``[B, H, NT, K]``, ``ts`` one ``[V, K]`` state per chunk of ``[B, H, NT, V, K]``, ``seg`` the
    ``[C]`` document offsets of ``[B, T]``."""

    ik: object
    iv: object
    ib: object
    tk: object
    tv: object
    ta: object
    tg: object
    ts: object
    seg: object


def chunk_specs(C: int, K: int, V: int) -> ChunkSpecs:
    return ChunkSpecs(
        ik=pl.BlockSpec((None, C, None, K), lambda b, h, c: (b, c, h, 0)),
        iv=pl.BlockSpec((None, C, None, V), lambda b, h, c: (b, c, h, 0)),
        ib=pl.BlockSpec((None, C, None), lambda b, h, c: (b, c, h)),
        tk=pl.BlockSpec((None, None, C, K), lambda b, h, c: (b, h, c, 0)),
        tv=pl.BlockSpec((None, None, C, V), lambda b, h, c: (b, h, c, 0)),
        ta=pl.BlockSpec((None, None, C, C), lambda b, h, c: (b, h, c, 0)),
        tg=pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, h, c, 0)),
        ts=pl.BlockSpec((None, None, None, V, K), lambda b, h, c: (b, h, c, 0, 0)),
        seg=pl.BlockSpec((None, C), lambda b, h, c: (b, c)),
    )


class SerialLayout(NamedTuple):
    """Grid geometry and BlockSpecs of a serial state pass over (B, H, V/BV, segment) programs.

    ``state``: the state entering (forward) or the gradient leaving (reverse) each segment,
    ``[B, H, NS, V, K]`` (NS = 1 when the caller passed ``[B, H, V, K]``: ``per_segment`` False).
    Each program walks ``Ls`` chunks of one segment. Specs (head-major factors): ``k`` ``[L, K]``,
    ``v`` ``[L, BV]``, ``a`` ``[L, C]``, ``g`` ``[Ls, K]``, ``s`` the segment's ``[BV, K]`` state,
    ``h`` the ``[Ls, BV, K]`` per-chunk states (L = Ls C tokens).
    """

    state: object
    per_segment: bool
    num_segments: int
    chunks_per_segment: int
    k: object
    v: object
    a: object
    g: object
    s: object
    h: object


def serial_layout(state, T: int, K: int, chunk_size: int, block_v: int) -> SerialLayout:
    per_segment = state.ndim == 5
    state = state if per_segment else state[:, :, None]
    NS = state.shape[2]
    Ls = T // chunk_size // NS
    L, C, BV = Ls * chunk_size, chunk_size, block_v
    return SerialLayout(
        state=state, per_segment=per_segment, num_segments=NS, chunks_per_segment=Ls,
        k=pl.BlockSpec((None, None, L, K), lambda b, h, iv, s: (b, h, s, 0)),
        v=pl.BlockSpec((None, None, L, BV), lambda b, h, iv, s: (b, h, s, iv)),
        a=pl.BlockSpec((None, None, L, C), lambda b, h, iv, s: (b, h, s, 0)),
        g=pl.BlockSpec((None, None, Ls, K), lambda b, h, iv, s: (b, h, s, 0)),
        s=pl.BlockSpec((None, None, None, BV, K), lambda b, h, iv, s: (b, h, s, iv, 0)),
        h=pl.BlockSpec((None, None, Ls, BV, K), lambda b, h, iv, s: (b, h, s, iv, 0)),
    )


def anchored_scores(a, b, gate: Gate, *, precision, own_block: bool = True):
    """S_ij = sum_c a_ic b_jc exp(G_ic - G_jc) for j in blocks <= block(i), as [C, C] fp32.

    a, b: [C, K] fp32; one [C, K] x [K, C] dot per row block r with the factors of the module
    docstring (gate.ea, gate.eb(r)). Entries right of the row's block are unspecified (finite): the
    caller masks. own_block=False (unbounded gates, centre 0): only the columns of the blocks
    BEFORE the row's block (Gate.eb_before); the caller overwrites the own block (own_block_scores).
    """
    at = a * gate.ea
    out = None
    for r in range(gate.ns) if own_block else range(1, gate.ns):
        eb = gate.eb(r) if own_block else gate.eb_before(r)
        s = dot_nt(at, b * eb, precision)
        out = s if out is None else jnp.where(gate.rb == r, s, out)
    if out is None:                                # own_block=False with a single row block
        out = jnp.zeros((a.shape[0], b.shape[0]), F32)
    return out


def own_block_scores(bases, lhs, gate: Gate, b_row, G_row):
    """Exact own-block (diagonal 16x16 tile) score entries for unbounded gates.

    For a row i in block r and each column j = 16 r + d of that block (d = 0 .. 15):
      S_ij = sum_c a_ic b_jc exp(min(G_ic - G_jc, 0)),
    the score for j <= i (there G_i - G_j <= 0, so the min is inactive up to a rounding residue of
    the cumsum) and a finite unused value for j > i (the caller masks). Every exp argument is <= 0.

    Args: bases: list of [C, C] fp32 score values whose own-block entries are replaced (selects);
      lhs: the matching `a` operands [C, K] fp32; gate: the chunk's Gate; b_row(j), G_row(j): row j
      [1, K] fp32 of the shared `b` operand and of G, loaded from refs.
    Returns: the list of [C, C] fp32 values with exact own-block entries. Work: 16 fori_loop steps
      of elementwise [C, K] fp32 (CUDA cores, no dot). Source: kda_chunked's pairwise diagonal tiles.
    """
    C, K = gate.G.shape
    _, cols = iotas(C, C)
    first = gate.rb * BT                           # [C, 1]: first column of each row's block

    def gather(row, d):                            # [C, K]: row i holds row(16 * block(i) + d)
        out = jnp.broadcast_to(row(d), (C, K))
        for r in range(1, gate.ns):
            out = jnp.where(gate.rb == r, row(r * BT + d), out)
        return out

    def step(d, out):
        bE = gather(b_row, d) * jnp.exp(jnp.minimum(gate.G - gather(G_row, d), 0.0))
        at = cols == first + d
        return tuple(jnp.where(at, jnp.sum(a * bE, axis=1, keepdims=True), s) for s, a in zip(out, lhs))

    return list(lax.fori_loop(0, BT, step, tuple(bases)))


def unit_lower_inverse(L, precision):
    """(I + L)^-1 for a strictly lower-triangular [C, C] fp32 L (C a power of two), no loop.

    Recursive blocked forward substitution, all blocks of one size at once: D starts as the exact
    inverse on 2x2 diagonal blocks; merging two diagonal blocks of size s into one of 2 s uses
      [[I + L11, 0], [L21, I + L22]]^-1 = [[D1, 0], [-D2 L21 D1, D2]],
    i.e. D <- D - (D Loff_s) D. log2(C) - 1 levels of two [C, C] dots (C = 64: 10 dots). The algebra
    of fla's `solve_tril` merges, applied from 2 upwards.
    """
    C = L.shape[0]
    rows, cols = iotas(C, C)
    two = jnp.int32(2)          # typed: a Python 2 would be int64 under jax_enable_x64
    D = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
    D = D - jnp.where((lax.div(rows, two) == lax.div(cols, two)) & (rows > cols), L, 0.0)
    s = 2
    while s < C:
        rs, cs = lax.div(rows, jnp.int32(s)), lax.div(cols, jnp.int32(s))
        same = lax.div(rs, two) == lax.div(cs, two)
        N = dot(D, jnp.where(same & (rs > cs), L, 0.0), precision)
        D = D - dot(N, D, precision)
        s *= 2
    return D
