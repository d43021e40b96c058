"""The KDA kernel stages one by one: each Mosaic GPU stage against the Triton stage it stands in for.

On the same random inputs of the layouts api.py passes, in interpret mode on CPU (CI runs one size of
each, the rest are `TestMosaicGPUStages.full_tier`): every output
within fp32-summation-order rounding of the Triton kernel (same bf16 operand rounding); the
interpreter's SMEM race detector over each Mosaic GPU kernel; bad input refused; each kernel lowered
for CUDA. The intra kernels also with packed documents (segments: the Triton kernels' selects) at
the tile and chunk edges, a document per token and a start at every chunk start. The Triton cumsum against XLA's. `TestStagesGPU` (marker gpu) compares the compiled kernels
at benchmark shapes on the H200. Through the op, every stage is held to the recurrence in
test_api.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import mosaic_gpu as mgpu
from pallas_kernels.kda import triton
from pallas_kernels.kda.api import document_offsets
from pallas_kernels.kda.plan import centre_exponent
from tests.kda_testing import assert_rms_close, rms_ratio

BF = jnp.bfloat16
CENTRE = centre_exponent(-5.0)


def no_races(fn, *args, **kw):
    """The interpreter's race detector over one run of fn (it supports one block in the grid)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc   # private API
    jax.block_until_ready(fn(*args, interpret=plgpu.InterpretGPUParams(detect_races=True), **kw))
    return not ipc.get_races().races_found


def compare(name, out, ref, tol):
    """Each output of `out` against `ref` (same shapes and dtypes), RMS ratio <= tol; returns the ratios."""
    errs = {}
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if r is None:
            assert o is None
            continue
        assert o.shape == r.shape and o.dtype == r.dtype, (name, i, o.shape, r.shape, o.dtype, r.dtype)
        assert float(jnp.max(jnp.abs(r.astype(jnp.float32)))) > 0, (name, i)       # not vacuous
        errs[i] = assert_rms_close(f"{name}[{i}]", r, o, tol)
    return errs


def intra_inputs(B, T, H, K, V, seed=0):
    """q, k, v (bf16), G (fp32), beta (bf16), token-major; G the chunk cumsum of g = -5 sigmoid(N(0, 1))
    on the first half of the channels (strong decays: the diagonal tiles span up to 80 nats) and 0.02x
    that on the second (so that e^{G_last} and the state terms are not all zero)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    g = -5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K))) * jnp.where(jnp.arange(K) < K // 2, 1.0, 0.02)
    G = jnp.cumsum(g.reshape(B, T // 64, 64, H, K), axis=2).reshape(B, T, H, K)
    k = jax.random.normal(ks[1], (B, T, H, K))
    return (jax.random.normal(ks[0], (B, T, H, K)).astype(BF), (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(BF),
            jax.random.normal(ks[2], (B, T, H, V)).astype(BF), G, jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(BF))


def state_inputs(B, H, T, K, V, seed=0, scale=0.08, segments=None):
    """kd, w, u (bf16), gl = e^{G_last}, h0 (transposed, per segment with segments): the
    serial passes' inputs. kd, w at 0.08 N(0, 1) keep S of order 10 over 64 chunks."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    kd = (scale * jax.random.normal(ks[0], (B, H, T, K))).astype(BF)
    w = (scale * jax.random.normal(ks[1], (B, H, T, K))).astype(BF)
    u = jax.random.normal(ks[2], (B, H, T, V)).astype(BF)
    gl = jnp.exp(-jax.random.uniform(ks[3], (B, H, T // 64, K)))
    h0 = jax.random.normal(ks[4], (B, H, V, K) if segments is None else (B, H, segments, V, K))
    return kd, w, u, gl, h0


def output_inputs(B, H, T, K, seed=9):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    qg = (0.08 * jax.random.normal(ks[0], (B, H, T, K))).astype(BF)
    aqk = jnp.tril(0.1 * jax.random.normal(ks[1], (B, H, T // 64, 64, 64))).reshape(B, H, T, 64).astype(BF)
    return qg, aqk


def state_bwd_inputs(B, H, T, K, V, seed=0, segments=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    bf = lambda i: (0.08 * jax.random.normal(ks[i], (B, H, T, K))).astype(BF)  # noqa: E731
    aqk = jnp.tril(0.1 * jax.random.normal(ks[3], (B, H, T // 64, 64, 64))).reshape(B, H, T, 64).astype(BF)
    return (bf(0), bf(1), bf(2), aqk, jnp.exp(-jax.random.uniform(ks[4], (B, H, T // 64, K))),
            jax.random.normal(ks[5], (B, T, H, V)).astype(BF),
            jax.random.normal(ks[6], (B, H, V, K) if segments is None else (B, H, segments, V, K)))


def solve_bwd_inputs(B, T, H, K, V, seed=0):
    """solve_bwd's inputs with the op's dtypes (u, du = dV' bf16, as intra_fwd and state_bwd write them): A unit
    lower-triangular, M strictly lower per chunk."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 13)
    n = lambda i, shape, s=1.0: s * jax.random.normal(ks[i], shape)   # noqa: E731
    NT = T // 64
    q, k, v, G, beta = intra_inputs(B, T, H, K, V, seed)
    tri = lambda i: jnp.tril(n(i, (B, H, NT, 64, 64), 0.2), -1)      # noqa: E731
    return (q, k, v, G, beta, n(5, (B, T, H, V)).astype(BF), n(6, (B, H, T, V)).astype(BF),
            n(7, (B, H, NT, V, K)).astype(BF), n(8, (B, H, NT, V, K)).astype(BF),
            n(9, (B, H, T, K), 0.1).astype(BF), n(10, (B, H, T, V)).astype(BF),
            (tri(11) + jnp.eye(64)).reshape(B, H, T, 64), tri(12).reshape(B, H, T, 64))


def score_bwd_inputs(B, T, H, K, seed=0, cotangent_scale=1.0, at_bound=False, cancel=False, bound=-5.0):
    """score_bwd's inputs: q, k, G of intra_inputs (at_bound: g = bound on every channel, so each
    16-token tile spans 16 |bound| nats), fp32 partials dqp, dkp, dgp, dgl and score gradients dM (strictly
    lower per chunk), dAqk (lower), all cotangents at cotangent_scale. cancel: dgp cancels the score
    terms of dG but 1% (as in training, where dG is a small difference of large terms: a kernel
    whose terms are good to bf16 only misses it by ~20%)."""
    q, k, _, G, _ = intra_inputs(B, T, H, K, K, seed)
    if at_bound:
        G = jnp.cumsum(jnp.full((B, T // 64, 64, H, K), bound), axis=2).reshape(B, T, H, K)
    ks = jax.random.split(jax.random.PRNGKey(seed + 7), 6)
    NT = T // 64
    n = lambda i, shape: cotangent_scale * jax.random.normal(ks[i], shape)   # noqa: E731
    dM = jnp.tril(n(0, (B, H, NT, 64, 64)), -1).reshape(B, H, T, 64)
    dAqk = jnp.tril(n(1, (B, H, NT, 64, 64))).reshape(B, H, T, 64)
    args = [q, k, G, n(2, (B, H, T, K)), n(3, (B, H, T, K)), n(4, (B, H, T, K)), n(5, (B, H, NT, K)), dM, dAqk]
    if cancel:
        zero = jnp.zeros_like(args[3])
        terms = score_bwd_exact(q, k, G, zero, zero, zero, jnp.zeros_like(args[6]), dM, dAqk, K ** -0.5)[2]
        args[5] = jnp.asarray(-terms.reshape(B, T // 64, 64, H, K).transpose(0, 3, 1, 2, 4).reshape(B, H, T, K)
                              + 0.01 * np.std(terms) * np.asarray(args[5]) / cotangent_scale, jnp.float32)
        args[6] = jnp.zeros_like(args[6])
    return tuple(args)


def score_bwd_exact(q, k, G, dqp, dkp, dgp, dgl, dM, dAqk, scale):
    """The score backward in float64 numpy, pair by pair (no anchors, no factors):
    da_m_i = sum_j dM_ij k_j e^{G_i - G_j}, da_q_i = sum_j dAqk_ij k_j e^{G_i - G_j},
    sb_j = sum_i (dM_ij k_i + dAqk_ij scale q_i) e^{G_i - G_j}; returns dq, dk, dG [B, T, H, K]."""
    q, k, G, dqp, dkp, dgp, dgl, dM, dAqk = (np.asarray(x, np.float64) for x in (q, k, G, dqp, dkp, dgp, dgl, dM, dAqk))
    B, T, H, K = q.shape
    NT = T // 64
    chunks = lambda x: x.reshape(B, NT, 64, H, K).transpose(0, 3, 1, 2, 4)     # noqa: E731  [B, H, NT, C, K]
    q, k, G = chunks(q), chunks(k), chunks(G)
    dM, dAqk = dM.reshape(B, H, NT, 64, 64), dAqk.reshape(B, H, NT, 64, 64)
    i = np.arange(64)
    causal = (i[:, None] >= i[None, :])[..., None]
    E = np.exp(np.where(causal, G[..., :, None, :] - G[..., None, :, :], -np.inf))  # [..., i, j, K]
    qs = scale * q
    da_m = np.einsum("...ij,...jc,...ijc->...ic", dM, k, E)
    da_q = np.einsum("...ij,...jc,...ijc->...ic", dAqk, k, E)
    sb = np.einsum("...ij,...ic,...ijc->...jc", dM, k, E) + np.einsum("...ij,...ic,...ijc->...jc", dAqk, qs, E)
    hm = lambda x: x.reshape(B, H, NT, 64, K)      # noqa: E731
    dG = hm(dgp) + k * da_m + qs * da_q - k * sb
    dG[..., 63, :] += dgl
    tm = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(B, T, H, K)   # noqa: E731
    return tm(hm(dqp) + scale * da_q), tm(hm(dkp) + da_m + sb), tm(dG)


# Documents of the segmented stage tests, T = 256 (4 chunks), one pattern a row: 0: length-1
# documents either side of a tile edge (15, 16) and of two chunk edges (63, 64; 127, 128), a start
# mid-tile (100) and at a chunk start (192); 1: a document per token; 2: a start at every chunk start
# and nowhere else; 3: one document (the selects are inert: the dense kernel's outputs bit for bit).
STAGE_CUTS = [[0, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 192, 256], None, [0, 64, 128, 192, 256], [0, 256]]


def stage_rel(cuts_per_row, T):
    """rel [B, T] int32 (api.document_offsets) of documents [cuts[i], cuts[i + 1]) per row (None: a
    document per token; cuts of 256 tokens are repeated to T)."""
    seg = np.zeros((len(cuts_per_row), T), np.int32)
    for b, cuts in enumerate(cuts_per_row):
        if cuts is None:
            seg[b] = np.arange(T) % 2
            continue
        for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[b, s:e] = i % 2
        seg[b] = np.tile(seg[b, :256], T // 256) if T > 256 else seg[b]
    return document_offsets(jnp.asarray(seg), 64, T)


def packed_rel(B, T, mean_length=300, seed=0):
    """rel of random packed documents (lengths 1 + geometric, mean ~mean_length; every 7th length 1)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        t, i = 0, 0
        while t < T:
            n = 1 if i % 7 == 3 else 1 + int(rng.geometric(1.0 / mean_length))
            seg[b, t:t + n] = i % 2
            t, i = t + n, i + 1
    return document_offsets(jnp.asarray(seg), 64, T)


def gpu_rel(B, T):
    """rel for the compiled stage tests: the STAGE_CUTS patterns (repeated to T) on the last
    min(4, B - 1) rows, random documents (packed_rel) on the others."""
    n = min(4, B - 1)
    return jnp.concatenate([packed_rel(B - n, T), stage_rel(STAGE_CUTS[:n], T)])


# ------------------------------------------------------------------------------ the stage pairs
def intra_fwd_pair(args, interpret, save_solve=True, segments=None):
    scale = args[0].shape[-1] ** -0.5
    out = jax.jit(lambda *a: mgpu.intra_fwd(*a[:5], scale=scale, centre=CENTRE, save_solve=save_solve,
                                            segments=a[5] if len(a) > 5 else None,
                                            interpret=interpret))(*args, *([] if segments is None else [segments]))
    ref = jax.jit(lambda *a: triton.intra_fwd(*a[:5], scale=scale, centre=CENTRE, unbounded=False, save_solve=True,
                                              segments=a[5] if len(a) > 5 else None,
                                              interpret=interpret))(*args, *([] if segments is None else [segments]))
    ref = ref[:6] + (ref[6:] if save_solve else ())          # Triton: qg, kd, w, u, aqk, gl, A, M
    return out, ref


def state_fwd_pair(args, qg, aqk, interpret, write_states=True):
    o, h, ht = jax.jit(lambda *a: mgpu.state_fwd(*a, write_states=write_states, interpret=interpret))(*args, qg, aqk)

    def tri(kd, w, u, gl, h0, qg, aqk):
        vp, h, ht = triton.state_fwd(kd, w, u, gl, h0, state_dtype=BF, interpret=interpret)
        return triton.output_fwd(qg, aqk, vp, h, out_dtype=BF, interpret=interpret), h, ht
    ref = jax.jit(tri)(*args, qg, aqk)
    return (o, h, ht), (ref[0], ref[1] if write_states else None, ref[2])


def state_bwd_pair(args, interpret):
    out = jax.jit(lambda *a: mgpu.state_bwd(*a, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: triton.state_bwd(*a, state_dtype=BF, interpret=interpret))(*args)
    return out, ref


def solve_bwd_pair(args, interpret, segments=None):
    scale = args[0].shape[-1] ** -0.5
    extra = [] if segments is None else [segments]
    out = jax.jit(lambda *a: mgpu.solve_bwd(*a[:13], scale=scale, segments=a[13] if len(a) > 13 else None,
                                            interpret=interpret))(*args, *extra)
    ref = jax.jit(lambda *a: triton.solve_bwd(*a[:13], scale=scale, segments=a[13] if len(a) > 13 else None,
                                              interpret=interpret))(*args, *extra)
    return out, ref


def score_bwd_pair(args, interpret, centre=CENTRE):
    scale = args[0].shape[-1] ** -0.5
    out = jax.jit(lambda *a: mgpu.score_bwd(*a, scale=scale, centre=centre, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: triton.score_bwd(*a, scale=scale, centre=centre, unbounded=False,
                                              interpret=interpret))(*args)
    return out, ref


def assert_score_bwd_exact(name, args, out, tol_dqk, tol_dG):
    """out (dq, dk bf16, dG fp32) against the float64 math: dq, dk within their bf16 rounding
    (tol_dqk), dG within tol_dG (RMS ratios)."""
    exact = score_bwd_exact(*args, args[0].shape[-1] ** -0.5)
    return [assert_rms_close(f"{name}[{i}]", e, np.asarray(o, np.float64), tol)
            for i, (e, o, tol) in enumerate(zip(exact, out, (tol_dqk, tol_dqk, tol_dG), strict=True))]


def assert_masks_matter(out, dense, single_rows, name, tol=1e-6):
    """The segmented outputs equal the dense kernel's on the rows with one document (single_rows;
    within tol: XLA may contract a product into an FMA on one side of a select and not the other)
    and differ from them by more than fla's o tolerance on the others (the selects are not inert).
    Outputs are [B, ...] token-major or [B, H, ...] head-major: both lead with B."""
    rows = np.asarray(single_rows)
    others = np.setdiff1d(np.arange(out[0].shape[0]), rows)
    for i, (o, d) in enumerate(zip(out, dense, strict=True)):
        o, d = np.asarray(o, np.float32), np.asarray(d, np.float32)
        assert_rms_close(f"{name}[{i}] one-document rows", d[rows], o[rows], tol)
        assert rms_ratio(d[others], o[others]) > 5e-3, f"{name}[{i}]: the documents changed nothing"


class TestTritonCumsum:

    @pytest.mark.parametrize("reverse", [False, True])
    def test_matches_xla(self, reverse):
        x = jax.random.normal(jax.random.PRNGKey(0), (2, 192, 3, 32))
        want = jax.lax.cumsum(x.reshape(2, 3, 64, 3, 32), axis=2, reverse=reverse).reshape(x.shape)
        got = triton.chunk_cumsum(x, 64, reverse=reverse, interpret=True)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)

    def test_bf16_input_and_bad_input(self):
        x = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 1, 16)).astype(BF)
        np.testing.assert_allclose(triton.chunk_cumsum(x, 64, interpret=True),
                                   jnp.cumsum(x.astype(jnp.float32), axis=1), rtol=1e-6, atol=1e-5)
        with pytest.raises(ValueError, match="chunk_size"):
            triton.chunk_cumsum(x[:, :48], 64, interpret=True)
        with pytest.raises(ValueError, match="B, T, H, K"):
            triton.chunk_cumsum(x[0], 64, interpret=True)


class TestSavedDtypes:
    """U and dV' are stored in the input dtype (bf16 inputs: bf16, as fla and jla store U; every dot that
    reads dV' rounds it to bf16, so storing it bf16 is exact), fp32 for fp32 inputs; a revert to fp32 would
    be bit-identical at the op level and only cost HBM traffic, so the dtypes are asserted here."""

    @pytest.mark.parametrize("dtype", [BF, jnp.float32])
    def test_triton(self, dtype):
        B, T, H, K, V = 1, 128, 2, 64, 64
        sd = jax.ShapeDtypeStruct
        tok_k, tok_v = sd((B, T, H, K), dtype), sd((B, T, H, V), dtype)
        outs = jax.eval_shape(
            lambda *a: triton.intra_fwd(*a, scale=0.1, centre=CENTRE, unbounded=False, interpret=True),
            tok_k, tok_k, tok_v, sd((B, T, H, K), jnp.float32), sd((B, T, H), dtype))
        assert outs[3].shape == (B, H, T, V) and outs[3].dtype == dtype            # u
        hm_k = sd((B, H, T, K), dtype)
        du = jax.eval_shape(lambda *a: triton.state_bwd(*a, state_dtype=dtype, interpret=True), hm_k, hm_k, hm_k,
                            sd((B, H, T, 64), dtype), sd((B, H, T // 64, K), jnp.float32), tok_v,
                            sd((B, H, V, K), jnp.float32))[0]
        assert du.shape == (B, H, T, V) and du.dtype == dtype

    def test_mosaic_gpu(self):
        B, T, H, K, V = 1, 128, 2, 64, 64
        sd = jax.ShapeDtypeStruct
        tok_k, tok_v = sd((B, T, H, K), BF), sd((B, T, H, V), BF)
        outs = jax.eval_shape(lambda *a: mgpu.intra_fwd(*a, scale=0.1, centre=CENTRE, interpret=True),
                              tok_k, tok_k, tok_v, sd((B, T, H, K), jnp.float32), sd((B, T, H), BF))
        assert outs[3].dtype == BF                                                 # u
        hm_k = sd((B, H, T, K), BF)
        du = jax.eval_shape(lambda *a: mgpu.state_bwd(*a, interpret=True), hm_k, hm_k, hm_k, sd((B, H, T, 64), BF),
                            sd((B, H, T // 64, K), jnp.float32), tok_v, sd((B, H, V, K), jnp.float32))[0]
        assert du.dtype == BF


class TestMosaicGPUStages:
    """Mosaic GPU interpret mode on CPU, against the Triton stages (interpret)."""

    # Left to `make test-full`: the second size of each stage (CI keeps K = 128 or V = 128, the trained shape).
    full_tier = ("test_intra_fwd[shape1]", "test_intra_fwd_segments[64-64]", "test_solve_bwd_segments[64-64]",
                 "test_lowers_for_cuda[64]", "test_solve_bwd[2-64-1-64-128]", "test_solve_bwd[1-128-1-128-64]",
                 "test_state_fwd[2-1-128-64-128-None-False-1e-05]", "test_state_bwd[2-1-128-64-64-None-1e-05]",
                 "test_score_bwd[2-64-1-64]")

    @pytest.mark.parametrize("shape", [(1, 128, 2, 128, 128), (2, 128, 1, 64, 128)])
    def test_intra_fwd(self, shape):
        # The same products with the same bf16 operand rounding (W stored bf16 by both); measured:
        # qg, kd, gl identical, the rest <= 1e-6 (fp32 summation order).
        for save_solve in (True, False):
            out, ref = intra_fwd_pair(intra_inputs(*shape), True, save_solve)
            assert len(out) == (8 if save_solve else 6)
            compare(f"intra_fwd {shape} save_solve={save_solve}", out, ref, 1e-5)

    @pytest.mark.parametrize("K, V", [(64, 64), (128, 64)])
    def test_intra_fwd_segments(self, K, V):
        # Packed documents (STAGE_CUTS): the same selects as the Triton kernels; measured (RMS ratio,
        # K = 128) qg, kd, w, gl identical, aqk, A, M <= 6e-8, u 7e-6 (bf16: an fp32 summation-order
        # difference flips a rounding).
        # The one-document row is the dense kernel's output; the others differ from it.
        args = intra_inputs(4, 256, 1, K, V)
        rel = stage_rel(STAGE_CUTS, 256)
        out, ref = intra_fwd_pair(args, True, segments=rel)
        compare(f"intra_fwd segments K={K} V={V}", out, ref, 1e-4)
        dense, _ = intra_fwd_pair(args, True)
        assert_masks_matter(out, dense, [3], "intra_fwd")

    @pytest.mark.parametrize("K, V", [(64, 64), (64, 128)])
    def test_solve_bwd_segments(self, K, V):
        # As test_intra_fwd_segments for the state products and the W / U / solve backward; measured
        # dv identical, the rest <= 6.2e-6 (fp32 summation order; the split-bf16 dL against the
        # interpreter's fp32 dot for bf16x3).
        args = solve_bwd_inputs(4, 256, 1, K, V)
        rel = stage_rel(STAGE_CUTS, 256)
        out, ref = solve_bwd_pair(args, True, segments=rel)
        compare(f"solve_bwd segments K={K} V={V}", out, ref, 1e-4)
        dense, _ = solve_bwd_pair(args, True)
        # dv = beta A^T dU reads no factor the documents mask (A, M are inputs here): the dense dv
        assert_masks_matter(out[1:], dense[1:], [3], "solve_bwd")
        np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(dense[0], np.float32))

    @pytest.mark.parametrize("B, T, H, K", [(1, 128, 2, 128), (2, 64, 1, 64)])
    def test_score_bwd(self, B, T, H, K):
        # Every product with split-bf16 operands (bf16x3) against the float64 math: at the bound
        # (every tile spans 80 nats), at cotangent scales 1 and 2^-20 (about 1 / tokens of a batch),
        # and with dG a 1% difference of its terms (cancel). Measured (interpret; the Triton kernel's
        # diagonal tiles fp32 here, bf16 off them): dq, dk 1.7e-3 (their bf16 rounding); dG 1.5e-7,
        # cancelling 4.4e-4 (Triton 0.15) and 4.2e-4 at the bound (Triton 0.038). Caught: bf16
        # factors (dG 1.6e-2 cancelling); e^{G - anc} 2^s formed as one exp for the rows of later
        # blocks (it underflows: 0.11 at the bound); dAqk's diagonal through the products (its dG
        # terms cancel: 0.038 at the bound); the cotangents unscaled (at 2^-60 the lo products are
        # subnormal, which XLA:CPU flushes as GPUs do: dG 12); an odd centre (lower_bound -2, s = 23)
        # split wrongly into the two half-exponent factors.
        base = None
        for at_bound, c, cancel in ((False, 1.0, False), (True, 1.0, False), (True, 2.0 ** -20, False),
                                    (False, 1.0, True), (True, 2.0 ** -20, True), (True, 2.0 ** -60, True)):
            args = score_bwd_inputs(B, T, H, K, cotangent_scale=c, at_bound=at_bound, cancel=cancel)
            out, ref = score_bwd_pair(args, True)
            name = f"score_bwd {(B, T, H, K)} at_bound={at_bound} scale={c} cancel={cancel}"
            assert_score_bwd_exact(name, args, out, 3e-3, 1e-3 if cancel else 1e-6)
            if not cancel:
                compare(name + " vs triton", out, ref, 3e-3)
            base = (args, out) if (c, cancel) == (2.0 ** -20, True) else base
        # the same products at any loss scale: cotangents times 2^-60 give the outputs times 2^-60, bit for bit
        args, out = base
        tiny = [x * 2.0 ** -60 if i >= 3 else x for i, x in enumerate(args)]
        for o, t in zip(out, score_bwd_pair(tiny, True)[0], strict=True):
            np.testing.assert_array_equal(np.asarray(t, np.float32) * 2.0 ** 60, np.asarray(o, np.float32))
        args = score_bwd_inputs(B, T, H, K, at_bound=True, cancel=True, bound=-2.0)
        assert_score_bwd_exact(f"score_bwd {(B, T, H, K)} lower_bound -2", args,
                               score_bwd_pair(args, True, centre=centre_exponent(-2.0))[0], 3e-3, 1e-3)

    @pytest.mark.parametrize("B, H, T, K, V, segments, write_states, tol", [
        (1, 2, 192, 128, 128, None, True, 1e-3), (2, 1, 128, 64, 128, None, False, 1e-5),
        (1, 1, 256, 128, 64, 2, True, 1e-5)])
    def test_state_fwd(self, B, H, T, K, V, segments, write_states, tol):
        # Same math and operand rounding; only the fp32 accumulation order differs, which can flip a
        # bf16 rounding of S (one ulp) that then carries on (1e-5 .. 4e-5 at 3 chunks of K = V = 128).
        # Two segments of two chunks: the sequence split's per-segment starts.
        args = state_inputs(B, H, T, K, V, segments=segments)
        out, ref = state_fwd_pair(args, *output_inputs(B, H, T, K), True, write_states)
        compare(f"state_fwd {(B, H, T, K, V)}", out, ref, tol)

    def test_state_fwd_is_the_recurrence(self):
        # Against the recurrence written out with S [K, V] (the kernel holds and stores S^T), chunk by
        # chunk: h_c = bf16(S_c)^T, V'_c = U_c - W_c bf16(S_c), S_{c+1} = gl_c S_c + Kd_c^T bf16(V'_c);
        # o_c = Qg_c bf16(S_c) + Aqk_c bf16(V'_c).
        kd, w, u, gl, h0 = state_inputs(1, 1, 192, 64, 64, seed=3)
        qg, aqk = output_inputs(1, 1, 192, 64)
        o, h, ht = mgpu.state_fwd(kd, w, u, gl, h0, qg, aqk, interpret=True)
        S = h0[0, 0].T
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        dot = lambda a, b: jnp.dot(a.astype(BF), b.astype(BF), preferred_element_type=jnp.float32)  # noqa: E731
        for c in range(3):
            rows = slice(64 * c, 64 * (c + 1))
            np.testing.assert_allclose(f32(h[0, 0, c].T), f32(S.astype(BF)), rtol=1e-2, atol=1e-2)   # 1 bf16 ulp
            vp = u[0, 0, rows] - dot(w[0, 0, rows], S)
            np.testing.assert_allclose(f32(o[0, rows, 0]), f32(dot(qg[0, 0, rows], S) + dot(aqk[0, 0, rows], vp)),
                                       rtol=2e-2, atol=2e-2)
            S = gl[0, 0, c][:, None] * S + dot(kd[0, 0, rows].T, vp)
        np.testing.assert_allclose(f32(ht[0, 0].T), f32(S), rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("B, H, T, K, V, segments, tol", [(1, 2, 192, 128, 128, None, 1e-3),
                                                              (2, 1, 128, 64, 64, None, 1e-5),
                                                              (1, 1, 256, 128, 64, 2, 1e-5)])
    def test_state_bwd(self, B, H, T, K, V, segments, tol):
        out, ref = state_bwd_pair(state_bwd_inputs(B, H, T, K, V, segments=segments), True)
        compare(f"state_bwd {(B, H, T, K, V)}", out, ref, tol)

    @pytest.mark.parametrize("B, T, H, K, V", [(1, 128, 2, 128, 128), (2, 64, 1, 64, 128), (1, 128, 1, 128, 64)])
    def test_solve_bwd(self, B, T, H, K, V):
        # Same bf16 operands (the two dL products split-bf16 as the Triton bf16x3 dots). Measured:
        # dv, dq identical, the rest <= 2e-5 (fp32 summation order).
        out, ref = solve_bwd_pair(solve_bwd_inputs(B, T, H, K, V), True)
        compare(f"solve_bwd {(B, T, H, K, V)}", out, ref, 1e-4)

    def test_no_smem_races(self):
        # Every read of a TMA-loaded buffer is fenced before the load that refills it (the serial
        # passes: four chunks, both buffers reused), the RefUnion groups and the solve's buffers in
        # the intra kernels. wgmma reads against later writes rest on review and the compiled GPU
        # tests (the interpreter runs wgmma synchronously).
        args = state_inputs(1, 1, 256, 128, 64)
        assert no_races(mgpu.state_fwd, *args, *output_inputs(1, 1, 256, 128))
        assert no_races(mgpu.state_bwd, *state_bwd_inputs(1, 1, 256, 128, 64))
        assert no_races(mgpu.intra_fwd, *intra_inputs(1, 64, 1, 128, 128), scale=0.1, centre=CENTRE, save_solve=True)
        assert no_races(mgpu.solve_bwd, *solve_bwd_inputs(1, 64, 1, 128, 128), scale=0.1)
        assert no_races(mgpu.score_bwd, *score_bwd_inputs(1, 64, 1, 128), scale=0.1, centre=CENTRE)
        rel = stage_rel([[0, 15, 16, 17, 40, 64]], 64)       # documents: the selects read seg from HBM only
        assert no_races(mgpu.intra_fwd, *intra_inputs(1, 64, 1, 128, 128), scale=0.1, centre=CENTRE, save_solve=True,
                        segments=rel)
        assert no_races(mgpu.solve_bwd, *solve_bwd_inputs(1, 64, 1, 128, 128), scale=0.1, segments=rel)

    def test_bad_input_raises(self):
        q, k, v, G, beta = intra_inputs(1, 64, 1, 64, 64)
        run = lambda *a: mgpu.intra_fwd(*a, scale=0.1, centre=CENTRE, interpret=True)   # noqa: E731
        for args, match in [((q.astype(jnp.float32), k, v, G, beta), "must be bfloat16"),
                            ((q, k, v, G.astype(BF), beta), "G must be fp32"),
                            ((q, k, v, G, beta.astype(jnp.int32)), "beta must be a float"),
                            ((q, k, v[..., :32], G, beta), "v must be bf16"),
                            ((q, k, v, G, beta[:, :32]), "shapes do not match"),
                            ((q[:, :32], k[:, :32], v[:, :32], G[:, :32], beta[:, :32]), "multiple of 64")]:
            with pytest.raises(ValueError, match=match):
                run(*args)
        kd, w, u, gl, h0 = state_inputs(1, 1, 128, 64, 64)
        qg, aqk = output_inputs(1, 1, 128, 64)
        with pytest.raises(ValueError, match="must be bfloat16"):
            mgpu.state_fwd(kd, w.astype(jnp.float32), u, gl, h0, qg, aqk, interpret=True)
        with pytest.raises(ValueError, match="aqk"):
            mgpu.state_fwd(kd, w, u, gl, h0, qg, aqk[..., :32], interpret=True)
        with pytest.raises(ValueError, match="segment count"):
            mgpu.state_fwd(kd, w, u, gl, jnp.zeros((1, 1, 3, 64, 64)), qg, aqk, interpret=True)
        bw = list(state_bwd_inputs(1, 1, 128, 64, 64))
        bw[5] = bw[5].astype(jnp.float32)
        with pytest.raises(ValueError, match="must be bfloat16"):
            mgpu.state_bwd(*bw, interpret=True)
        sb = list(solve_bwd_inputs(1, 64, 1, 64, 64))
        with pytest.raises(ValueError, match="shapes do not match"):
            mgpu.solve_bwd(*sb, scale=0.1, segments=jnp.zeros((1, 128), jnp.int32), interpret=True)
        with pytest.raises(ValueError, match="shapes do not match"):
            mgpu.intra_fwd(q, k, v, G, beta, scale=0.1, centre=CENTRE, segments=jnp.zeros((2, 64), jnp.int32),
                           interpret=True)
        sb[9] = sb[9].astype(jnp.float32)
        with pytest.raises(ValueError, match="must be bfloat16"):
            mgpu.solve_bwd(*sb, scale=0.1, interpret=True)
        sc = list(score_bwd_inputs(1, 64, 1, 64))
        with pytest.raises(ValueError, match="dgl"):
            mgpu.score_bwd(*sc[:6], sc[6][..., :32], *sc[7:], scale=0.1, centre=CENTRE, interpret=True)
        with pytest.raises(ValueError, match="dM"):
            mgpu.score_bwd(*sc[:7], sc[7].astype(BF), sc[8], scale=0.1, centre=CENTRE, interpret=True)
        with pytest.raises(ValueError, match="'k'"):
            mgpu.score_bwd(sc[0], jnp.concatenate([sc[1], sc[1]], axis=2), *sc[2:], scale=0.1, centre=CENTRE,
                           interpret=True)

    @pytest.mark.parametrize("K", [64, 128])
    def test_lowers_for_cuda(self, K):
        # Lowering checks the shared-memory limit (227 KiB: intra_fwd 98 KiB, state_fwd 209 KiB,
        # solve_bwd 224 KiB, score_bwd 101 KiB at K = V = 128) and the layouts; each kernel by its profile name.
        sd = jax.ShapeDtypeStruct
        B, H, T, V = 2, 4, 1024, 128
        f32 = jnp.float32

        def text(fn, *args):
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        tok_k, tok_v = sd((B, T, H, K), BF), sd((B, T, H, V), BF)
        hm_k, hm_v, hm_c = sd((B, H, T, K), BF), sd((B, H, T, V), BF), sd((B, H, T, 64), BF)
        gl, h0 = sd((B, H, T // 64, K), f32), sd((B, H, V, K), f32)
        st = sd((B, H, T // 64, V, K), BF)
        rel = sd((B, T), jnp.int32)
        for save_solve in (False, True):
            assert "kda_intra_fwd_mgpu" in text(lambda *a: mgpu.intra_fwd(*a, scale=0.1, centre=CENTRE, save_solve=save_solve),
                                                tok_k, tok_k, tok_v, sd((B, T, H, K), f32), sd((B, T, H), BF))
            # documents: rel in the ROW and COL layouts of the accumulator (layout inference)
            assert "kda_intra_fwd_mgpu" in text(
                lambda *a: mgpu.intra_fwd(*a[:5], segments=a[5], scale=0.1, centre=CENTRE, save_solve=save_solve),
                tok_k, tok_k, tok_v, sd((B, T, H, K), f32), sd((B, T, H), BF), rel)
        for write_states in (False, True):
            assert "kda_state_fwd_mgpu" in text(lambda *a: mgpu.state_fwd(*a, write_states=write_states),
                                                hm_k, hm_k, hm_v, gl, h0, hm_k, hm_c)
        assert "kda_state_bwd_mgpu" in text(mgpu.state_bwd, hm_k, hm_k, hm_k, hm_c, gl, tok_v, h0)
        assert "kda_intra_bwd_solve_mgpu" in text(
            lambda *a: mgpu.solve_bwd(*a, scale=0.1), tok_k, tok_k, tok_v, sd((B, T, H, K), f32), sd((B, T, H), BF),
            tok_v, hm_v, st, st, hm_k, hm_v, sd((B, H, T, 64), f32), sd((B, H, T, 64), f32))
        assert "kda_intra_bwd_solve_mgpu" in text(
            lambda *a: mgpu.solve_bwd(*a[:13], segments=a[13], scale=0.1), tok_k, tok_k, tok_v, sd((B, T, H, K), f32),
            sd((B, T, H), BF), tok_v, hm_v, st, st, hm_k, hm_v, sd((B, H, T, 64), f32),
            sd((B, H, T, 64), f32), rel)
        hm_f = sd((B, H, T, K), f32)
        assert "kda_intra_bwd_scores_mgpu" in text(
            lambda *a: mgpu.score_bwd(*a, scale=0.1, centre=CENTRE), tok_k, tok_k, sd((B, T, H, K), f32), hm_f, hm_f,
            hm_f, sd((B, H, T // 64, K), f32), sd((B, H, T, 64), f32), sd((B, H, T, 64), f32))


@pytest.mark.gpu
class TestStagesGPU:
    """Compiled on the H200: each Mosaic GPU stage against the compiled Triton stage."""

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128, 128), (2, 1024, 4, 64, 64)])
    def test_intra_fwd(self, shape):
        out, ref = intra_fwd_pair(intra_inputs(*shape), False)
        print(shape, compare(f"intra_fwd {shape}", out, ref, 1e-3))

    @pytest.mark.parametrize("shape, segments, tol", [((8, 16, 4096, 128, 128), None, 5e-3),
                                                      ((2, 4, 1024, 64, 128), 4, 2e-3)])
    def test_state_fwd_and_bwd(self, shape, segments, tol):
        # Two kernels with the same bf16-operand budget and different accumulation orders: bf16 flips
        # of S add up over the chunks (~2e-3 at 64 chunks); the exact checks are the interpret ones.
        B, H, T, K, V = shape
        out, ref = state_fwd_pair(state_inputs(*shape, segments=segments), *output_inputs(B, H, T, K), False)
        print(shape, compare(f"state_fwd {shape}", out, ref, tol))
        out, ref = state_bwd_pair(state_bwd_inputs(*shape, segments=segments), False)
        print(shape, compare(f"state_bwd {shape}", out, ref, tol))

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128, 128), (2, 1024, 4, 64, 64)])
    def test_solve_bwd(self, shape):
        out, ref = solve_bwd_pair(solve_bwd_inputs(*shape), False)
        print(shape, compare(f"solve_bwd {shape}", out, ref, 1e-3))

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128), (2, 1024, 4, 64)])
    def test_score_bwd(self, shape):
        # Compiled: against the compiled Triton kernel (bf16x3 diagonal tiles) and the float64 math
        # on two heads' worth of chunks, at the bound, cancelling, at cotangent scale 2^-20; and the
        # same outputs (times 2^-60) for cotangents times 2^-60 (GPUs flush subnormals).
        out, ref = score_bwd_pair(score_bwd_inputs(*shape), False)
        print(shape, compare(f"score_bwd {shape}", out, ref, 3e-3))
        small = score_bwd_inputs(1, 512, 2, shape[-1], cotangent_scale=2.0 ** -20, at_bound=True, cancel=True)
        out = score_bwd_pair(small, False)[0]
        print(shape, assert_score_bwd_exact(f"score_bwd {shape} exact", small, out, 3e-3, 1e-3))
        # the same products at any loss scale: the cotangents (and so the outputs) times 2^-60, exactly
        # (unscaled, the lo parts of the products would be subnormal there, and flushed)
        tiny = [x * 2.0 ** -60 if i >= 3 else x for i, x in enumerate(small)]
        out_tiny = score_bwd_pair(tiny, False)[0]
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(out_tiny[i], np.float32) * 2.0 ** 60, np.asarray(out[i], np.float32))

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128, 128), (32, 2048, 6, 128, 128), (2, 1024, 4, 64, 64)])
    def test_intra_fwd_segments(self, shape):
        # Packed documents (gpu_rel): random lengths and the edge patterns, against Triton compiled.
        out, ref = intra_fwd_pair(intra_inputs(*shape), False, segments=gpu_rel(*shape[:2]))
        print(shape, compare(f"intra_fwd segments {shape}", out, ref, 1e-3))

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128, 128), (32, 2048, 6, 128, 128), (2, 1024, 4, 64, 64)])
    def test_solve_bwd_segments(self, shape):
        out, ref = solve_bwd_pair(solve_bwd_inputs(*shape), False, segments=gpu_rel(*shape[:2]))
        print(shape, compare(f"solve_bwd segments {shape}", out, ref, 1e-3))
