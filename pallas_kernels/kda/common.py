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

Unbounded gates (no lower_bound; ops.kda_pallas with lower_bound=None): the own-block factor
exp(anc_r - G_j) is not bounded and overflows (g can be -50 or less per token). The unbounded path
keeps the row-block GEMMs for the columns of the blocks BEFORE r only (their column operand is zero,
not inf, on the rows of blocks >= r: `Gate.eb_before`) and computes the own-block (diagonal 16x16
tile) entries exactly with `own_block_scores`: sum_c a_ic b_jc exp(min(G_ic - G_jc, 0)), elementwise
[C, K] products reduced over K, one loop step per column offset inside the block, inserted with
selects. Every exp argument on that path is <= 0. The other forward factors need no bound: qg
(exp(G)), kd (exp(G_last - G)), e^{G_last}, X = beta e^G k and the anchored row factor
ea = exp(G - anc) all take exp of a non-positive number up to rounding (G is a running sum of
g <= 0; a sequential fp32 cumsum never rises, and a reordered parallel scan can leave at most a
few ulps of |G| above zero, whose exp is ~1), and the state passes only multiply by those stored
factors.
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

# Triton lowering parameters. num_stages=1: no software pipelining of the chunk loops; with the
# default 3 stages the staged [64, 128] fp32 tiles of the state passes exceed the H200's 227 KiB of
# shared memory (measured: 272 KiB requested at K = V = 128). The intra-chunk kernels hold several
# [64, 128] fp32 values at once: 8 warps halve the registers per thread for each of them.
# Module attributes so that the benchmark can sweep them; ignored in interpret mode.
STATE_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)
INTRA_PARAMS = pltriton.CompilerParams(num_warps=8, num_stages=1)
# cumsum.chunk_cumsum: one [C, K] fp32 block in, one out, no loop.
CUMSUM_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)
# fwd.output_fwd (o from the saved states; 2 dots per program); pipelining left at Triton's default.
OUTPUT_PARAMS = pltriton.CompilerParams(num_warps=4)


def split_kernel_flags(dtype, *, bf16_dots: bool, gate_cumsum: bool, segmented: bool,
                       unbounded: bool) -> frozenset:
    """The static flags of the two-kernel intra passes (fwd.intra_fwd_split, bwd.intra_bwd_split):
    "bf16_dots" (only for bf16 inputs), "gate_cumsum", "segmented", "unbounded"."""
    bf16 = bf16_dots and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    named = {"bf16_dots": bf16, "gate_cumsum": gate_cumsum, "segmented": segmented, "unbounded": unbounded}
    return frozenset(name for name, on in named.items() if on)


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


class _Bf16Operands:
    """Type of BF16_OPERANDS (a precision token understood by dot, dot_nt, dot_tn)."""

    def __repr__(self):
        return "BF16_OPERANDS"


# Precision token: round both operands to bf16 and run one bf16 tensor-core dot with fp32
# accumulation (what fla's Triton kernels do for every dot of a bf16 call). Used by the profiling
# ablation "bf16_dots" and the opt-in bf16 state dots; not a lax precision.
BF16_OPERANDS = _Bf16Operands()


def _dot_general(a, b, dims, precision):
    if precision is BF16_OPERANDS:
        a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=F32)


def dot(a, b, precision=None):
    """a [m, k] @ b [k, n] with fp32 accumulation (precision: a lax precision or BF16_OPERANDS)."""
    return _dot_general(a, b, ((1,), (0,)), precision)


def dot_nt(a, b, precision=None):
    """a [m, k] @ b[n, k]^T with fp32 accumulation (precision as dot)."""
    return _dot_general(a, b, ((1,), (1,)), precision)


def dot_tn(a, b, precision=None):
    """a[k, m]^T @ b [k, n] with fp32 accumulation (precision as dot)."""
    return _dot_general(a, b, ((0,), (0,)), precision)


def row_sums(x):
    """[m, n] -> [m, 1] fp32 row sums (a cheap data-dependent stand-in used by the ablations)."""
    return jnp.sum(x, axis=1, keepdims=True)


# Profiling ablations (private; timing only, results WRONG): named pieces of the intra-chunk kernel
# bodies replaced by cheap elementwise stand-ins of the same shapes, so that a GPU run can time the
# kernel without each piece. Reached only through fwd.intra_fwd(_ablate=...) /
# bwd.intra_bwd(_ablate=...) / bwd.intra_bwd_a(_ablate=...) (kernel a of the split backward:
# state_products, dXY, dA, dL, exact_dots, compute; bwd.A_ABLATIONS)
# (experiments/bench_kda_kernels.py --ablate), never from ops.kda_pallas.
#   gate      Gate without the cumsum and the anchor / last-row reductions (G = g, anchors 0)
#   cumsum    only the chunk cumsums (forward G; backward also the reverse cumsum of dG)
#   scores    intra_fwd: the 8 anchored row-block score GEMMs (M and Aqk)
#   solve     intra_fwd: the 10 dots of (I + L)^-1 (A = I - L instead)
#   wu        intra_fwd: W = A X and U = A Y (W = X, U = Y)
#   state_products  intra_bwd: V' = U - W S, dQg, dW, dKd, dAqk (5 dots with the saved states)
#   dXY       intra_bwd: dX = A^T dW, dY = A^T dU
#   dA        intra_bwd: dA = dW X^T + dU Y^T
#   dL        intra_bwd: dL = -A^T dA A^T (2 exact dots)
#   score_diag     intra_bwd: the 4 exact diagonal-tile dots of the score backward
#   score_offdiag  intra_bwd: the 12 off-diagonal row-block dots of the score backward
#   exact_dots     intra_bwd: the exact (bf16x3) dots at mm precision instead (one TF32 pass)
#   bf16_dots      the mm-precision (TF32) dots with bf16 operands instead (BF16_OPERANDS); this
#                  one only changes rounding and is also the real option bf16_dots=True of
#                  intra_fwd / intra_bwd (ops.KernelOptions.bf16_intra_dots)
#   compute   all arithmetic: outputs are cheap functions of every input (the I/O + launch floor)
#   output    state_fwd: o = Qg S + Aqk V' (2 dots per chunk; o = V' is stored instead)
FWD_ABLATIONS = ("gate", "cumsum", "scores", "solve", "wu", "bf16_dots", "compute")
BWD_ABLATIONS = ("gate", "cumsum", "state_products", "dXY", "dA", "dL", "score_diag",
                 "score_offdiag", "exact_dots", "bf16_dots", "compute")
STATE_ABLATIONS = ("output", "bf16_dots")


def check_ablate(ablate, allowed, name: str) -> frozenset:
    """frozenset of the ablation names in `ablate` (a tuple of str); ValueError on unknown names."""
    bad = [a for a in ablate if a not in allowed]
    if bad:
        raise ValueError(f"{name}: unknown ablation(s) {bad}; expected names from {allowed}")
    return frozenset(ablate)


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

    row: None, or a function i -> row i [1, K] of the cumsum loaded from the kernel's ref: then g IS
    the chunk-local inclusive cumsum G (computed by XLA outside the kernel, ops.KernelOptions.
    xla_gate_cumsum) and the anchors and G_last are ref loads instead of masked reductions.
    """

    def __init__(self, g, ablate=frozenset(), *, row=None):
        C = g.shape[0]
        self.ns = C // BT
        self.rb = row_block(C)
        simple = "gate" in ablate                 # profiling ablations (see FWD_ABLATIONS)
        cumulative = row is not None or simple or "cumsum" in ablate
        self.G = g if cumulative else jnp.cumsum(g, axis=0)
        pick = (lambda i: row(i).astype(F32)) if row is not None else (lambda i: pick_row(self.G, i))
        if simple:
            self.G_last = jnp.zeros((1, g.shape[1]), F32)
            self.anc = [self.G_last] * self.ns
            self.anc_rows = jnp.zeros_like(self.G)
        else:
            self.G_last = pick(C - 1)
            self.anc = [jnp.zeros_like(self.G_last)] + [pick(r * BT - 1) for r in range(1, self.ns)]
            anc_rows = jnp.zeros_like(self.G)
            for r in range(1, self.ns):
                anc_rows = jnp.where(self.rb == r, self.anc[r], anc_rows)
            self.anc_rows = anc_rows
        self.ea = jnp.exp(self.G - self.anc_rows)

    def eb_own(self):
        """exp(anc - G) with each row's own block anchor [C, K]; <= e^{16|lb|} (diagonal tiles)."""
        return jnp.exp(self.anc_rows - self.G)

    def eb(self, r: int):
        """exp(anc_r - G) on rows of blocks <= r, 1 on later rows (unused) [C, K]; <= e^{16|lb|}."""
        return jnp.exp(jnp.where(self.rb <= r, self.anc[r] - self.G, 0.0))

    def eb_before(self, r: int):
        """exp(anc_r - G) on rows of blocks < r (<= 1 up to rounding: the cumsum falls, G_j >= anc_r
        there) and 0 on rows of blocks >= r [C, K]: the column operand of row block r's GEMM on the
        unbounded path, zero (not inf) where the own block's factor would overflow. Every exp
        argument is <= 0 (up to a rounding residue of the cumsum)."""
        before = self.rb < r
        return jnp.where(before, jnp.exp(jnp.where(before, self.anc[r] - self.G, 0.0)), 0.0)


def gate_of(g_ref, ablate=frozenset(), gate_cumsum: bool = False) -> Gate:
    """Gate of the chunk in g_ref [C, K]: per-token log-decay g, or with gate_cumsum its chunk-local
    inclusive cumsum G (rows of the anchors and G_last then loaded from the ref)."""
    row = (lambda i: g_ref[pl.ds(i, 1), :]) if gate_cumsum else None
    return Gate(g_ref[...].astype(F32), ablate, row=row)


class Segments:
    """Document masks of one chunk (packed sequences, segment_ids), from rel [C] int32.

    rel_i = (document index of token i) - (document index of the state entering the chunk), computed
    by XLA (`document_offsets`); nondecreasing, >= 0. A document start inside the chunk is a reset of
    the state to zero before that token, so the chunk form stays exact if (all selects, no multiply
    by a mask):
      same [C, C]: rel_i == rel_j, the score tiles M (k.k, hence L and a block-diagonal (I + L)^-1)
        and Aqk keep only same-document pairs;
      row_in [C, 1]: rel_i == 0, rows that read the incoming state: Qg and X = beta e^G k (so W = A X)
        are zero elsewhere;
      in_last [C, 1]: rel_i == rel_last, rows whose keys enter the outgoing state: Kd zero elsewhere
        (e^{G_last - G_j} then spans only the last document's gates);
      carry [1, 1]: rel_last == 0, the incoming state survives the chunk: e^{G_last} is 0 otherwise.
    The backward applies the same selects to the gradients of these factors (chain rule through
    constants).
    """

    def __init__(self, rel):
        r = rel.astype(jnp.int32)[:, None]                      # [C, 1]
        self.same = r == rel.astype(jnp.int32)[None, :]          # [C, C]
        self.row_in = r == 0
        last = jnp.max(r, axis=0, keepdims=True)                 # [1, 1]
        self.in_last = r == last
        self.carry = last == 0


class ChunkSpecs(NamedTuple):
    """BlockSpecs of one 64-token chunk for a (batch, head, chunk) grid: the user's token-major
    ``[B, T, H, .]`` inputs (``ik`` K-wide, ``iv`` V-wide, ``ib`` beta ``[B, T, H]``) and the head-major
    ``[B, H, T, .]`` factors (``tk``, ``tv``, ``ta`` ``[C, C]``), ``tg`` one ``[K]`` row per chunk of
    ``[B, H, NT, K]``, ``ts`` one ``[V, K]`` state per chunk of ``[B, H, NT, V, K]``."""

    ik: object
    iv: object
    ib: object
    tk: object
    tv: object
    ta: object
    tg: object
    ts: object


def chunk_specs(C: int, K: int, V: int) -> ChunkSpecs:
    """The :class:`ChunkSpecs` for chunk size ``C`` and head dims ``K``, ``V``."""
    return ChunkSpecs(
        ik=pl.BlockSpec((None, C, None, K), lambda b, h, c: (b, c, h, 0)),
        iv=pl.BlockSpec((None, C, None, V), lambda b, h, c: (b, c, h, 0)),
        ib=pl.BlockSpec((None, C, None), lambda b, h, c: (b, c, h)),
        tk=pl.BlockSpec((None, None, C, K), lambda b, h, c: (b, h, c, 0)),
        tv=pl.BlockSpec((None, None, C, V), lambda b, h, c: (b, h, c, 0)),
        ta=pl.BlockSpec((None, None, C, C), lambda b, h, c: (b, h, c, 0)),
        tg=pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, h, c, 0)),
        ts=pl.BlockSpec((None, None, None, V, K), lambda b, h, c: (b, h, c, 0, 0)),
    )


class SerialLayout(NamedTuple):
    """Grid geometry and BlockSpecs of a serial state pass over (B, H, V/BV, segment) programs.

    ``state``: the state entering (forward) or the gradient leaving (reverse) each segment,
    ``[B, H, NS, V, K]`` (NS = 1 when the caller passed ``[B, H, V, K]``: ``per_segment`` False).
    Each program walks ``Ls`` chunks (``L = Ls·C`` tokens) of one segment. Specs (head-major
    ``[B, H, T, .]`` factors): ``k`` ``[L, K]``, ``v`` ``[L, BV]``, ``a`` ``[L, C]``, ``g`` ``[Ls, K]``
    (one row per chunk), ``s`` the segment's ``[BV, K]`` state, ``h`` the ``[Ls, BV, K]`` per-chunk states.
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
    """The :class:`SerialLayout` of a serial pass over ``T`` tokens (a multiple of ``chunk_size``)."""
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


def segments_of(seg_ref):
    """Segments of the chunk in seg_ref [C] (int32 rel), or None without segment_ids."""
    return None if seg_ref is None else Segments(seg_ref[...])


def keep(x, seg, mask: str):
    """x where seg.<mask> else 0 (a select) when seg (a Segments) is given; x when seg is None."""
    return x if seg is None else jnp.where(getattr(seg, mask), x, 0.0)


def seg_spec(chunk_size: int):
    """BlockSpec of the rel [B, T] int32 document offsets for a (batch, head, chunk) grid: [C]."""
    return pl.BlockSpec((None, chunk_size), lambda b, h, c: (b, c))


def document_offsets(segment_ids, chunk_size: int, padded_length: int):
    """rel [B, Tp] int32 for Segments (XLA, outside the kernels) from segment_ids [B, T] (any int).

    The state restarts at every token whose id differs from the previous token's (token 0 never:
    the initial state belongs to each row's first document), as k3jax's kda_recurrent. run = the
    running count of restarts; padding (T -> padded_length, a multiple of chunk_size) joins the last
    document (its tokens are inert); rel = run - run of the token before the chunk (0 for chunk 0).
    """
    B, T = segment_ids.shape
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    run = jnp.cumsum(jnp.concatenate([jnp.zeros((B, 1), jnp.int32), change], axis=1), axis=1)
    run = jnp.pad(run, ((0, 0), (0, padded_length - T)), mode="edge")
    run = run.reshape(B, padded_length // chunk_size, chunk_size)
    run_in = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), run[:, :-1, -1]], axis=1)   # [B, NT]
    return (run - run_in[:, :, None]).reshape(B, padded_length).astype(jnp.int32)


def chunk_cumsum(g, chunk_size: int, reverse: bool = False):
    """Chunk-local inclusive cumsum over T of g [B, T, H, K] (fp32, XLA; T % chunk_size == 0);
    reverse=True: the suffix sums sum_{j >= i} within each chunk."""
    B, T, H, K = g.shape
    x = g.reshape(B, T // chunk_size, chunk_size, H, K)
    return lax.cumsum(x, axis=2, reverse=reverse).reshape(B, T, H, K)


def anchored_scores(a, b, gate: Gate, *, dtype, own_block: bool = True):
    """S_ij = sum_c a_ic b_jc exp(G_ic - G_jc) for j in blocks <= block(i), as [C, C] fp32.

    a, b: [C, K] fp32. Operands are cast to `dtype` (bf16 inputs: bf16 tensor-core dots, fp32
    accumulate); one [C, K] x [K, C] dot per row block. Entries right of the row's block are
    unspecified (finite): the caller masks.
    own_block=False (unbounded gates): only the columns of the blocks BEFORE the row's block are
    formed (Gate.eb_before; every exponent <= 0; no dot for block 0, which has no such columns);
    the entries of the row's own block and right of it are unspecified (finite): the caller
    overwrites the own block (own_block_scores) and masks.
    """
    at = (a * gate.ea).astype(dtype)
    prec = mm_precision(dtype)
    out = None
    for r in range(gate.ns) if own_block else range(1, gate.ns):
        eb = gate.eb(r) if own_block else gate.eb_before(r)
        s = dot_nt(at, (b * eb).astype(dtype), prec)
        out = s if out is None else jnp.where(gate.rb == r, s, out)
    if out is None:                                # own_block=False with a single row block
        out = jnp.zeros((a.shape[0], b.shape[0]), F32)
    return out


def own_block_scores(bases, lhs, gate: Gate, b_row, G_row):
    """Exact own-block (diagonal 16x16 tile) score entries for unbounded gates.

    For a row i in block r and each column j = 16 r + d of the same block (d = 0 .. 15):
      S_ij = sum_c a_ic b_jc exp(min(G_ic - G_jc, 0)),
    the score for j <= i (there G_i - G_j = g_{j+1} + ... + g_i <= 0, so the min is inactive up
    to a rounding residue of the cumsum) and a finite unused value for j > i (exp(0) = 1; the
    caller masks with a select). Every exp argument is <= 0, so no g <= 0 overflows.

    Args: bases: list of [C, C] fp32 score values (e.g. anchored_scores(..., own_block=False))
      whose own-block entries are replaced (selects); lhs: list of the matching `a` operands
      [C, K] fp32; gate: the chunk's Gate (G [C, K], the row-block index); b_row(j), G_row(j):
      row j of the shared `b` operand and of G as [1, K] fp32, loaded from refs (the Triton
      lowering cannot slice values; G_row must return exactly gate.G's rows).
    Returns: the list of [C, C] fp32 values, bases with their own-block entries exact.
    Work per call, all elementwise fp32 on [C, K] (CUDA cores, no dot): 16 steps (a fori_loop:
    one traced body, smaller programs than a static unroll) of one exp,
    2 (ns - 1) gather selects, 3 + 2 len(lhs) arithmetic ops and len(lhs) row reductions.
    Source: the pairwise form of kda_chunked's unbounded diagonal tiles (k3jax/ops/kda_chunked.py).
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
        return tuple(jnp.where(at, jnp.sum(a * bE, axis=1, keepdims=True), s)
                     for s, a in zip(out, lhs))

    return list(lax.fori_loop(0, BT, step, tuple(bases)))


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
    two = jnp.int32(2)          # typed: a Python 2 would be int64 under jax_enable_x64
    D = D - jnp.where((lax.div(rows, two) == lax.div(cols, two)) & (rows > cols), L, 0.0)
    s = 2
    while s < C:
        rs, cs = lax.div(rows, jnp.int32(s)), lax.div(cols, jnp.int32(s))
        same = lax.div(rs, two) == lax.div(cs, two)
        N = dot(D, jnp.where(same & (rs > cs), L, 0.0), precision)
        D = D - dot(N, D, precision)
        s *= 2
    return D


def chunk_factors(q, k, v, beta, gate: Gate, *, scale: float, dtype, ablate=frozenset(), seg=None):
    """The chunk factors from whole-chunk values (fp32 q, k [C, K], v [C, V], beta [C, 1]).

    Returns dict: M [C, C] (k.k anchored scores, strictly lower, unweighted by beta), A = (I + L)^-1
    with L = beta M, X = beta e^G k [C, K], Y = beta v [C, V], W = A X, U = A Y (fp32), and
    Aqk [C, C] = scale q.k anchored scores, lower triangle including the diagonal.
    ablate: profiling ablations "scores", "solve", "wu", "bf16_dots" (FWD_ABLATIONS; wrong results).
    seg: Segments of the chunk or None: M and Aqk keep same-document pairs, X rows that read the
    incoming state (so A is block-diagonal per document and W = A X is zero on the other rows).
    The two halves are `solve_factors` (M, A, Aqk) and `wu_factors` (X, Y, W, U), which
    fwd.intra_fwd_split runs in two kernels.
    """
    f = solve_factors(q, k, beta, gate, scale=scale, dtype=dtype, ablate=ablate, seg=seg)
    f.update(wu_factors(f["A"], k, v, beta, gate.G, dtype=dtype, ablate=ablate, seg=seg))
    return f


def solve_factors(q, k, beta, gate: Gate, *, scale: float, dtype, ablate=frozenset(), seg=None,
                  own_rows=None):
    """First half of chunk_factors: dict M, A = (I + L)^-1 (L = beta M) and Aqk [C, C] fp32.

    own_rows: None (bounded gates: anchored_scores' own-anchor diagonal tiles), or, for unbounded
    gates, the pair (k_row, G_row) of functions j -> row j [1, K] fp32 of k and of gate.G loaded
    from refs: the scores' off-diagonal tiles are the row-block GEMMs over earlier blocks and the
    diagonal tiles are exact (own_block_scores); every exp argument <= 0.
    """
    C = k.shape[0]
    rows, cols = iotas(C, C)
    prec = BF16_OPERANDS if "bf16_dots" in ablate else mm_precision(dtype)
    ones = jnp.ones((1, C), F32)
    if own_rows is not None and "scores" not in ablate:
        M_all, Aqk_all = own_block_scores(
            [anchored_scores(k, k, gate, dtype=dtype, own_block=False),
             anchored_scores(scale * q, k, gate, dtype=dtype, own_block=False)],
            [k, scale * q], gate, *own_rows)
    if "scores" in ablate:
        M = jnp.where(rows > cols, 1e-2 * row_sums(k) * ones, 0.0)
    elif own_rows is not None:
        M = jnp.where(rows > cols, M_all, 0.0)
    else:
        M = jnp.where(rows > cols, anchored_scores(k, k, gate, dtype=dtype), 0.0)
    M = keep(M, seg, "same")
    # The solve runs at mm precision (TF32 for bf16 inputs): A only enters W = A X, U = A Y (TF32
    # dots themselves) and the backward. Emulated on CPU (TF32-rounded operands, 64x64 L from the
    # ANCHORS recipe, 20 draws): A's RMS error 1.4e-6, W's 2.03e-4 with either a TF32 or an exact
    # solve; with keys correlated 0.9 and gates ~0: A 5.4e-4, W 7.6e-4 vs 5.1e-4. bf16 inputs
    # already cost ~3e-3 (fla tolerance 5e-3).
    if "solve" in ablate:
        A = jnp.where(rows == cols, 1.0, 0.0) - beta * M
    else:
        A = unit_lower_inverse(beta * M, prec)
    if "scores" in ablate:
        Aqk = jnp.where(rows >= cols, scale * row_sums(q) * ones, 0.0)
    elif own_rows is not None:
        Aqk = jnp.where(rows >= cols, Aqk_all, 0.0)
    else:
        Aqk = jnp.where(rows >= cols, anchored_scores(scale * q, k, gate, dtype=dtype), 0.0)
    Aqk = keep(Aqk, seg, "same")
    return dict(M=M, A=A, Aqk=Aqk)


def wu_factors(A, k, v, beta, G, *, dtype, ablate=frozenset(), seg=None):
    """Second half of chunk_factors (fla's recompute_w_u): from A [C, C] fp32, k [C, K], v [C, V],
    beta [C, 1] and the chunk cumsum G [C, K] (all fp32 values), dict X = beta e^G k (rows that read
    the incoming state only, with seg), Y = beta v, W = A X, U = A Y at mm precision (or bf16
    operands with the "bf16_dots" ablation / option)."""
    prec = BF16_OPERANDS if "bf16_dots" in ablate else mm_precision(dtype)
    X = keep(beta * jnp.exp(G) * k, seg, "row_in")
    Y = beta * v
    if "wu" in ablate:
        W, U = X, Y
    else:
        W, U = dot(A, X, prec), dot(A, Y, prec)
    return dict(X=X, Y=Y, W=W, U=U)
