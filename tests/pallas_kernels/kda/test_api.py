"""Pallas KDA kernels (pallas_kernels.kda) through the op, both backends, against the fp32 recurrence.

`PallasKDATests` subclasses the shared `KDAImplementationTests` (tests/kda_shared_tests.py): the same
comparisons with fla's tolerances (bf16: o and final state 0.005, dq/dk/dv/dh0 0.008, dg/dbeta 0.02;
fp32: FP32_TOLERANCE), including every gradient at loss scales 2^-27 .. 2^20 with gates at the bound,
and adds the kernels' own: unbounded gates, packed documents through the sequence split, at the
tile and chunk edges and at every loss scale, a state carried across all chunks. One subclass per
backend in interpret mode on CPU: `TestTritonInterpret` and `TestMosaicGPUInterpret` (Mosaic GPU
interpret mode: bf16, K and V padded to 64 or 128), each naming the cases CI leaves to `make test-full`
(`full_tier`, tests/conftest.py); `TestTritonGPU` and `TestMosaicGPU` (marker gpu) run compiled on the
H200 at K = V = 128 and T up to 8192. `TestSupported` / `TestPlan`: what is refused and why, which kernel runs each
stage. `TestLowering`: forward and gradient lower for CUDA on a CPU host with a faked H200 (kernel
names and counts). Per-stage kernel tests: test_stages.py.
"""
import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.kda as pk
from k3jax.ops.kda import kda, kda_recurrent
from k3jax.ops.kda_reference import l2_normalize
from pallas_kernels.kda import plan as plan_lib
from tests.kda_testing import (FLA_BF16_TOLERANCES, FLA_SHAPES, FP32_TOLERANCE, GRAD_NAMES, assert_rms_close,
                               kda_loss_and_grads, make_kda_inputs, rms_ratio, fp32_tolerance)
from tests.kda_shared_tests import KDAImplementationTests

INTERPRET_SHAPES = [FLA_SHAPES[0], FLA_SHAPES[1]]          # (1, 63, 1, 64), (2, 500, 3, 60)
GPU_SHAPES = [FLA_SHAPES[4], (1, 8192, 2, 128)]            # (4, 1024, 4, 128), bf16
# Packed documents for (B, T) = (2, 250), 4 chunks of 64 (the last one padded), as cut points: row 0:
# several documents inside chunk 0 (one of length 1), a document starting on each chunk boundary,
# one of length 1 at a chunk's last token (127), a whole chunk alone (128-192), the last document
# ending in the padded chunk; row 1: the first document (the one that reads initial_state) crossing
# two chunk boundaries, a start mid-tile (150), a length-1 document, the last one into the final state.
SEGMENT_CUTS = [[0, 5, 6, 40, 64, 100, 127, 128, 192, 200, 250], [0, 150, 151, 250]]
# Packed documents at the kernels' edges for (B, T) = (3, 256), 4 chunks: row 0: length-1 documents
# either side of a 16-token tile edge (15, 16) and of two chunk edges (63, 64; 127, 128), a start
# mid-tile (100) and one at a chunk start (192); row 1 (None): a document per token; row 2: a
# document starting at every chunk start and nowhere else.
EDGE_CUTS = [[0, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 192, 256], None, [0, 64, 128, 192, 256]]


def _args(x):
    return [x[n] for n in ("q", "k", "v", "g", "beta")]


def segment_ids_of(cuts_per_row, T):
    """[B, T] int32 segment ids with documents [cuts[i], cuts[i + 1]) per row; a row None: a
    document per token."""
    seg = np.zeros((len(cuts_per_row), T), np.int32)
    for b, cuts in enumerate(cuts_per_row):
        if cuts is None:
            seg[b] = np.arange(T) % 3 + 1
            continue
        for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[b, s:e] = (5 * i) % 3 + 1              # consecutive ids differ; ids repeat later
    return jnp.asarray(seg)


def errors_vs_recurrent(x, seg, dtype, keys, **kda_pallas_kw):
    """o, final state and every gradient of kda_pallas(**kda_pallas_kw) on x against the fp32
    recurrence with the same segment_ids (cotangents from PRNG keys `keys`); asserts fla's bf16
    tolerances (FP32_TOLERANCE for fp32); returns ({name: RMS ratio}, the reference o)."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
    do = jax.random.normal(jax.random.PRNGKey(keys[0]), (B, T, H, V))
    dht = jax.random.normal(jax.random.PRNGKey(keys[1]), (B, H, K, V))
    kw = dict(output_final_state=True, segment_ids=seg, **kda_pallas_kw)
    o, ht, grads = jax.jit(lambda x: kda_loss_and_grads(
        lambda q, k, v, g, b, h0: pk.kda_pallas(q, k, v, g, b, initial_state=h0, **kw), x, do, dht))(x)
    o_ref, ht_ref, g_ref = jax.jit(lambda x: kda_loss_and_grads(
        lambda q, k, v, g, b, h0: kda_recurrent(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                segment_ids=seg), x, do, dht))(x32)
    tol = fp32_tolerance if dtype == "float32" else FLA_BF16_TOLERANCES.get
    errs = {"o": assert_rms_close("o", o_ref, o, tol("o")), "ht": assert_rms_close("ht", ht_ref, ht, tol("ht"))}
    for name in GRAD_NAMES:
        errs[name] = assert_rms_close(name, g_ref[name], grads[name], tol(name))
    return errs, o_ref


class PallasKDATests(KDAImplementationTests):
    """The shared comparisons and the kernels' own, for one backend (subclasses set it)."""

    implementation = "pallas"
    backend = "triton"
    interpret = True
    head_dims = (20, 12)            # (K, V) of the shared tests that pick their own small shape
    dtypes = ("float32", "bfloat16")

    def run(self, q, k, v, g, beta, use_qk_l2norm=False, chunk_size=64, **kwargs):
        if use_qk_l2norm:                   # in XLA before the kernels, as k3jax's kda does
            q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
        return pk.kda_pallas(q, k, v, g, beta, chunk_size=chunk_size, backend=self.backend,
                             interpret=self.interpret, **kwargs)

    def inputs(self, seed, B, T, H, K, V=None, **kw):
        """make_kda_inputs in the backend's dtype (fp32, or bf16 where the backend takes only bf16)."""
        kw.setdefault("dtype", jnp.dtype(self.dtypes[0]))
        return make_kda_inputs(jax.random.PRNGKey(seed), B, T, H, K, V, **kw)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("shape", INTERPRET_SHAPES)
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        if dtype not in self.dtypes:
            pytest.skip(f"{self.backend} takes {self.dtypes}")
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_gradients_at_every_loss_scale(self, dtype):
        if dtype not in self.dtypes:
            pytest.skip(f"{self.backend} takes {self.dtypes}")
        KDAImplementationTests.test_gradients_at_every_loss_scale(self, dtype)

    @pytest.mark.parametrize("gate_scale, segments, sequence_split", [(1.0, False, None), (30.0, False, None),
                                                                      (0.05, True, 1)])
    def test_unbounded_gates_match_recurrent(self, gate_scale, segments, sequence_split):
        # lower_bound=None: the exact diagonal tiles. Softplus gates (Kimi Linear's, unbounded) times
        # gate_scale: 1 (min g ~ -90), 30 (g ~ -2700 .. -1e-3 per token: the bounded anchoring
        # overflows, checked below), 0.05 with packed documents and every chunk its own segment of
        # the sequence split. The second dtype of the backend (bf16) takes the x30 case.
        dtype = self.dtypes[-1] if gate_scale >= 30 else self.dtypes[0]
        K, V = self.head_dims if segments else (max(32, self.head_dims[0]),) * 2
        B, T, H = (2, 250, 1) if segments else (1, 130, 2)
        x = self.inputs(21, B, T, H, K, V, gate="softplus", dtype=jnp.dtype(dtype))
        x["g"] = (gate_scale * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        seg = segment_ids_of(SEGMENT_CUTS, T) if segments else None
        errs, _ = errors_vs_recurrent(x, seg, dtype, (22, 23), lower_bound=None, interpret=self.interpret,
                                      sequence_split=sequence_split, backend=self.backend)
        print(f"\nKDA_ERRORS {self.backend} unbounded x{gate_scale} {(B, T, H, K, V)} {dtype} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
        if gate_scale >= 30:
            # The gates really are beyond any bound: g < -50 on ~15% of the entries, and the bounded
            # kernels (lower_bound=-5, a broken promise here) overflow on the same inputs.
            assert float(jnp.mean((x["g"].astype(jnp.float32) < -50).astype(jnp.float32))) > 0.1
            o_bounded, _ = jax.jit(lambda a: self.run(*a, lower_bound=-5.0))(_args(x))
            assert not bool(jnp.all(jnp.isfinite(o_bounded.astype(jnp.float32))))

    @pytest.mark.parametrize("sequence_split", [1, None])
    def test_segment_ids_match_recurrent(self, sequence_split):
        # o, final state and all gradients against the fp32 recurrence with the same segment_ids
        # (SEGMENT_CUTS). Gates 0.01x the usual so that the state really crosses chunk boundaries.
        # sequence_split=1: every chunk is its own segment of the split state passes; None: one
        # serial pass (this shape leaves the automatic split off).
        dtype = self.dtypes[0] if sequence_split == 1 else self.dtypes[-1]
        B, T, H = 2, 250, 2
        K, V = (max(32, self.head_dims[0]), self.head_dims[1] + 4)
        x = self.inputs(18, B, T, H, K, V, dtype=jnp.dtype(dtype))
        x["g"] = (0.01 * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        seg = segment_ids_of(SEGMENT_CUTS, T)
        errs, o_ref = errors_vs_recurrent(x, seg, dtype, (19, 20), lower_bound=-5.0, interpret=self.interpret,
                                          sequence_split=sequence_split, backend=self.backend)
        tol = FP32_TOLERANCE if dtype == "float32" else FLA_BF16_TOLERANCES["o"]
        x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
        o_joined, _ = jax.jit(lambda x: kda_recurrent(*_args(x), initial_state=x["h0"]))(x32)
        assert rms_ratio(o_ref, o_joined) > 20 * tol          # the documents matter here
        print(f"\nKDA_ERRORS {self.backend} segment_ids {(B, T, H, K, V)} {dtype} split={sequence_split} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))

    def test_segment_edges_match_recurrent(self):
        # o, final state and all gradients against the fp32 recurrence with documents at the
        # kernels' edges (EDGE_CUTS: length 1 at tile and chunk edges, one per token, a start at
        # every chunk start). Gates 0.1x the usual: strong enough for the anchored tiles, weak
        # enough that the state crosses the chunk boundaries inside a document.
        dtype = self.dtypes[0]
        B, T, H = 3, 256, 1
        K, V = (max(32, self.head_dims[0]), self.head_dims[1] + 4)
        x = self.inputs(40, B, T, H, K, V, dtype=jnp.dtype(dtype))
        x["g"] = (0.1 * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        seg = segment_ids_of(EDGE_CUTS, T)
        errs, _ = errors_vs_recurrent(x, seg, dtype, (41, 42), lower_bound=-5.0, interpret=self.interpret,
                                      backend=self.backend)
        print(f"\nKDA_ERRORS {self.backend} segment edges {(B, T, H, K, V)} {dtype} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))

    def test_segment_ids_at_every_loss_scale(self):
        # test_gradients_at_every_loss_scale with packed documents: length-1 documents either side of
        # a tile edge (16) and of the chunk edge (63, 64), a start mid-tile (100), for all four gate
        # cases and the five loss scales 2^-27 .. 2^20 (the selects must keep the centred tiles'
        # invariance); the recurrence restarts at the same tokens.
        B, T = self.loss_scale_shape[:2]
        seg = segment_ids_of([[0, 16, 17, 63, 64, 65, 100, T]] * B, T)
        self.check_every_loss_scale(self.dtypes[-1], segment_ids=seg)

    @pytest.mark.parametrize("gate", ["bounded", "softplus"])
    def test_check_grads_fp64(self, gate):
        # fp64 is outside the kernels: the call must refuse, naming the dtypes.
        with jax.enable_x64(True):
            x = make_kda_inputs(jax.random.PRNGKey(7), 1, 21, 2, 5, 3, gate=gate)
            x = {n: a.astype(jnp.float64) for n, a in x.items()}
            with pytest.raises(ValueError, match="dtype"):
                self.run(*_args(x), lower_bound=-5.0 if gate == "bounded" else None)

    def test_odd_sizes_and_options(self):
        # K, V not powers of two, T not a multiple of the chunk, explicit scale, no initial state,
        # use_qk_l2norm in XLA first; another chunk_size is refused.
        B, T, H = 2, 45, 3
        K, V = (12, 7) if self.backend == "triton" else (60, 33)
        x = self.inputs(8, B, T, H, K, V)
        tol = FP32_TOLERANCE if self.dtypes[0] == "float32" else FLA_BF16_TOLERANCES["o"]
        x32 = [a.astype(jnp.float32) for a in _args(x)]
        kw = dict(scale=0.37, output_final_state=True)
        o_ref, ht_ref = jax.jit(lambda a: kda_recurrent(*a, **kw))(x32)
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, **kw))(_args(x))
        assert rms_ratio(o_ref, o) < tol and rms_ratio(ht_ref, ht) < tol
        o_none, ht_none = self.run(*_args(x), lower_bound=-5.0)
        assert ht_none is None and o_none.shape == (B, T, H, V)
        with pytest.raises(ValueError, match="chunk_size"):
            self.run(*_args(x), lower_bound=-5.0, chunk_size=32)
        args = [x["q"] * 3, x["k"] * 0.5] + _args(x)[2:]
        o_ref = kda_recurrent(*[a.astype(jnp.float32) for a in args], use_qk_l2norm=True)[0]
        o = self.run(*args, lower_bound=-5.0, use_qk_l2norm=True)[0]
        assert rms_ratio(o_ref, o) < tol < rms_ratio(o_ref, self.run(*args, lower_bound=-5.0)[0])

    @pytest.mark.parametrize("sequence_split", [0, 2])
    def test_weak_decay_long_memory(self, sequence_split):
        # g = -0.05 sigmoid(N(0,1)): the state carries across all 4 chunks (with g ~ -2.5 per token
        # it is forgotten inside one chunk, so the chunk-to-chunk pass and its split would go
        # unchecked). sequence_split=2: 2 segments of 2 chunks.
        dtype = self.dtypes[0]
        x = self.inputs(12, 1, 256, 2, max(32, self.head_dims[0]), max(16, self.head_dims[1]))
        x["g"] = (0.01 * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        errors_vs_recurrent(x, None, dtype, (13, 14), lower_bound=-5.0, interpret=self.interpret,
                            sequence_split=sequence_split, backend=self.backend)


class TestTritonInterpret(PallasKDATests):
    """The portable kernels in interpret mode (CPU)."""

    # Left to `make test-full`: the second fla shape, fp32 loss scales (bf16 and the chunked op's fp32
    # stay), small k at the bound (q stays), the serial packed pass (the split one stays), x1 unbounded
    # gates (x30 and x0.05 stay), the serial long memory (the split one stays).
    full_tier = ("test_matches_recurrent_on_fla_shapes[shape1-float32]",
                 "test_matches_recurrent_on_fla_shapes[shape1-bfloat16]",
                 "test_gradients_at_every_loss_scale[float32]", "test_small_inputs_at_the_bound[k]",
                 "test_segment_ids_match_recurrent[None]", "test_unbounded_gates_match_recurrent[1.0-False-None]",
                 "test_weak_decay_long_memory[0]", "test_segment_ids_equal_each_document_alone[softplus]")

    def test_fp32_under_x64_matches(self):
        # jax_enable_x64 must not change the kernels (typed int32 constants in the index arithmetic).
        x = make_kda_inputs(jax.random.PRNGKey(9), 1, 70, 1, 16)

        def run():
            return jax.jit(jax.value_and_grad(lambda a: jnp.sum(self.run(*a, lower_bound=-5.0)[0]),
                                              argnums=0))(_args(x))
        base = run()
        with jax.enable_x64(True):
            wide = run()
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(wide)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    def test_gates_at_lower_bound_forward(self):
        # g = -5 on every channel: the diagonal tiles' masked entries reach e^75 before the select.
        x = make_kda_inputs(jax.random.PRNGKey(2), 1, 128, 1, 32)
        x["g"] = jnp.full_like(x["g"], -5.0)
        kw = dict(initial_state=x["h0"], output_final_state=True)
        o_ref, ht_ref = kda_recurrent(*_args(x), **kw)
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, **kw))(_args(x))
        assert_rms_close("o", o_ref, o, FP32_TOLERANCE)
        assert_rms_close("ht", ht_ref, ht, FP32_TOLERANCE)


class TestMosaicGPUInterpret(PallasKDATests):
    """The sm_90 kernels in Mosaic GPU interpret mode (CPU), with the Triton ones where the plan
    says (cumsum; intra_fwd and score_bwd for unbounded gates). bf16, K, V -> 64 / 128."""

    backend = "mosaic_gpu"
    head_dims = (64, 60)
    dtypes = ("bfloat16",)
    input_dtype = jnp.bfloat16
    loss_scale_shape = (1, 128, 1, 64)   # one head: the interpreter costs ~2-3x per call with two
    # Left to `make test-full` (the interpreter takes 2-6 s a call): packed loss scales (Triton's run in
    # CI) and packed cuts other than the edge cases, the second fla shape, small k at the bound (q stays),
    # softplus causality (bounded stays), unbounded gates other than the packed case, the serial long memory.
    full_tier = ("test_segment_ids_at_every_loss_scale", "test_segment_ids_match_recurrent",
                 "test_segment_ids_equal_each_document_alone", "test_matches_recurrent_on_fla_shapes[shape1-bfloat16]",
                 "test_small_inputs_at_the_bound[k]", "test_future_gates_do_not_change_past_outputs[softplus]",
                 "test_unbounded_gates_match_recurrent[1.0-False-None]",
                 "test_unbounded_gates_match_recurrent[30.0-False-None]", "test_weak_decay_long_memory[0]")

    def test_explicit_backend_refuses_what_it_cannot_run(self):
        x = make_kda_inputs(jax.random.PRNGKey(3), 1, 64, 1, 32, dtype=jnp.bfloat16)
        with pytest.raises(ValueError, match="padded to"):
            self.run(*_args(x), lower_bound=-5.0)
        x = make_kda_inputs(jax.random.PRNGKey(3), 1, 64, 1, 64)
        with pytest.raises(ValueError, match="bf16" if self.interpret else "float32 inputs"):
            self.run(*_args(x), lower_bound=-5.0)


@pytest.mark.gpu
class TestTritonGPU(TestTritonInterpret):
    """The portable kernels compiled (Triton lowering) on the H200."""

    interpret = False
    loss_scale_shape = (1, 8192, 2, 128)
    dtypes = ("float32", "bfloat16")
    full_tier = ()

    @pytest.mark.parametrize("dtype", ["bfloat16"])
    @pytest.mark.parametrize("shape", GPU_SHAPES)
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    @pytest.mark.parametrize("dtype", ["bfloat16"])   # compiled fp32 is refused above K = 32
    def test_gradients_at_every_loss_scale(self, dtype):
        KDAImplementationTests.test_gradients_at_every_loss_scale(self, dtype)


@pytest.mark.gpu
class TestMosaicGPU(TestMosaicGPUInterpret):
    """The sm_90 kernels compiled on the H200, and the automatic dispatch that runs them."""

    interpret = False
    loss_scale_shape = (1, 8192, 2, 128)
    full_tier = ()

    @pytest.mark.parametrize("dtype", ["bfloat16"])
    @pytest.mark.parametrize("shape", GPU_SHAPES)
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    def test_default_implementation_is_the_kernel(self):
        # On the H200 (compute capability 9.0) implementation=None runs the kernels (backend auto:
        # Mosaic GPU): bit-equal to this backend's explicit call, and not the chunked op.
        if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
            pytest.skip("implementation=None picks the kernels only on compute capability 9.0")
        x = make_kda_inputs(jax.random.PRNGKey(11), 1, 256, 2, 128, dtype=jnp.bfloat16)
        for lb in (-5.0, None):
            o_default, _ = jax.jit(lambda a: kda(*a, lower_bound=lb))(_args(x))
            o_backend, _ = jax.jit(lambda a: self.run(*a, lower_bound=lb))(_args(x))
            o_chunked, _ = jax.jit(lambda a: kda(*a, lower_bound=lb, implementation="chunked"))(_args(x))
            np.testing.assert_array_equal(np.asarray(o_default, np.float32), np.asarray(o_backend, np.float32))
            assert not np.array_equal(np.asarray(o_default, np.float32), np.asarray(o_chunked, np.float32))

    def test_million_tokens_finite(self):
        T, W = 1 << 20, 4096
        x = make_kda_inputs(jax.random.PRNGKey(6), 1, T, 1, 128, dtype=jnp.bfloat16)
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, output_final_state=True))(_args(x))
        assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(ht)))
        # The state forgets (gates <= 0, delta rule): the last W tokens from a zero state agree with
        # the full run after a 1024-token burn-in.
        o_tail, _ = kda_recurrent(*(a[:, T - W:] for a in _args(x)))
        assert_rms_close("o", o_tail[:, 1024:], o[:, T - W + 1024:], FLA_BF16_TOLERANCES["o"])


def _shapes(K=32, V=32, dtype=jnp.bfloat16, T=64):
    q = jax.ShapeDtypeStruct((1, T, 2, K), dtype)
    v = jax.ShapeDtypeStruct((1, T, 2, V), dtype)
    return q, q, v, jax.ShapeDtypeStruct((1, T, 2, K), jnp.float32), jax.ShapeDtypeStruct((1, T, 2), dtype)


class TestSupported:
    """`supported` names the reason for every refused call; `kda_pallas` raises it."""

    def test_supported_call(self):
        assert pk.supported(*_shapes(), lower_bound=-5.0) == (True, "")
        assert pk.supported(*_shapes(), lower_bound=None) == (True, "")
        seg = jax.ShapeDtypeStruct((1, 64), jnp.int32)
        assert pk.supported(*_shapes(), lower_bound=-5.0, segment_ids=seg) == (True, "")

    @pytest.mark.parametrize("kwargs, word", [
        (dict(lower_bound=-6.0), "lower_bound"),
        (dict(lower_bound=-5.0, segment_ids=np.zeros((2, 64), np.int32)), "segment_ids"),
        (dict(lower_bound=-5.0, segment_ids=np.zeros((1, 64), np.float32)), "segment_ids"),
        (dict(lower_bound=-5.0, use_qk_l2norm=True), "use_qk_l2norm"),
        (dict(lower_bound=-5.0, chunk_size=32), "chunk_size"),
        (dict(lower_bound="-5"), "lower_bound"),
        (dict(lower_bound=jnp.float32(-5.0)), "lower_bound"),
        (dict(lower_bound=True), "lower_bound"),
        (dict(lower_bound=-5.0, backend="cuda"), "backend"),
        (dict(lower_bound=-5.0, backend="mosaic_gpu", interpret=True), "padded to"),
    ])
    def test_unsupported_calls(self, kwargs, word):
        ok, why = pk.supported(*_shapes(), **kwargs)
        assert not ok and word in why

    def test_empty_and_integer_inputs_refused(self):
        q, k, v, g, beta = _shapes()
        empty = jax.ShapeDtypeStruct((1, 0, 2, 32), jnp.bfloat16)
        ok, why = pk.supported(empty, empty, empty, jax.ShapeDtypeStruct((1, 0, 2, 32), jnp.float32),
                               jax.ShapeDtypeStruct((1, 0, 2), jnp.bfloat16), lower_bound=-5.0)
        assert not ok and "positive" in why
        ok, why = pk.supported(q, k, v, g, jax.ShapeDtypeStruct(beta.shape, jnp.int32), lower_bound=-5.0)
        assert not ok and "beta" in why
        ints = jax.ShapeDtypeStruct(q.shape, jnp.int32)
        ok, why = pk.supported(ints, ints, jax.ShapeDtypeStruct(v.shape, jnp.int32), g, beta, lower_bound=-5.0)
        assert not ok and "dtype" in why

    def test_unsupported_shapes_and_dtypes(self):
        ok, why = pk.supported(*_shapes(K=256), lower_bound=-5.0)
        assert not ok and "head dims" in why
        q, k, v, g, beta = _shapes()
        assert "dtype" in pk.supported(q, k, jax.ShapeDtypeStruct(v.shape, jnp.float16), g, beta, lower_bound=-5.0)[1]

    def test_compiled_fp32_above_32_refused(self):
        # fp32 at K = V = 128 exceeded the H200's shared memory in the backward (2026-11-30).
        ok, why = pk.supported(*_shapes(128, 128, jnp.float32), lower_bound=-5.0)
        assert not ok and "shared memory" in why
        assert pk.supported(*_shapes(128, 128, jnp.float32), lower_bound=-5.0, interpret=True)[0]
        assert pk.supported(*_shapes(128, 128), lower_bound=-5.0)[0]
        assert pk.supported(*_shapes(32, 32, jnp.float32), lower_bound=-5.0)[0]

    def test_compiled_call_off_gpu_raises_with_reason(self):
        if jax.default_backend() == "gpu":
            pytest.skip("on a GPU interpret=False is the compiled path")
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16)
        with pytest.raises(ValueError, match="interpret=True"):
            kda(*_args(x), lower_bound=-5.0, implementation="pallas")
        with pytest.raises(ValueError, match="sm_90"):
            pk.kda_pallas(*[jnp.zeros(s.shape, s.dtype) for s in _shapes(64, 64)], lower_bound=-5.0,
                          backend="mosaic_gpu")

    def test_kda_pallas_raises_with_reason(self):
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16)
        with pytest.raises(ValueError, match="lower_bound"):
            pk.kda_pallas(*_args(x), lower_bound=-8.0, interpret=True)
        with pytest.raises(ValueError, match="tuning"):
            pk.kda_pallas(*_args(x), lower_bound=-5.0, interpret=True, tuning={"intra_warps": 4})
        with pytest.raises(ValueError, match="Tuning.block_v"):
            pk.Tuning(block_v=48)
        with pytest.raises(ValueError, match="Tuning.intra_warps"):
            pk.Tuning(intra_warps=True)

    def test_default_implementation_rule(self, monkeypatch):
        # implementation=None's rule with the device faked: the kernels only compiled on compute
        # capability 9.0 and only for calls `supported` accepts (no kernel runs here).
        from k3jax.ops import kda as kda_module

        class FakeDevice:
            platform = "gpu"

            def __init__(self, cc):
                self.compute_capability = cc
        q, k, v, g, beta = _shapes(128, 128, T=128)

        def covers(cc, backend="gpu", interpret=False, chunk_size=64, lower_bound=-5.0):
            monkeypatch.setattr(kda_module.jax, "default_backend", lambda: backend)
            monkeypatch.setattr(kda_module.jax, "devices", lambda *a: [FakeDevice(cc)])
            return kda_module._pallas_covers(q, k, v, g, beta, lower_bound=lower_bound, segment_ids=None,
                                             chunk_size=chunk_size, initial_state=None, interpret=interpret)
        assert covers("9.0") and covers("9.0", lower_bound=None)
        assert not covers("8.0") and not covers("10.0") and not covers(None)
        assert not covers("9.0", backend="cpu") and not covers("9.0", interpret=True)
        assert not covers("9.0", chunk_size=32)          # refused by `supported`: the chunked op runs

    def test_default_implementation_off_the_h200_is_the_chunked_op(self):
        if getattr(jax.devices()[0], "compute_capability", None) == "9.0":
            pytest.skip("on an H100/H200 None is the kernel: TestMosaicGPU.test_default_implementation_is_the_kernel")
        x = make_kda_inputs(jax.random.PRNGKey(11), 1, 40, 2, 16)
        o_default, _ = kda(*_args(x), lower_bound=-5.0)
        o_chunked, _ = kda(*_args(x), lower_bound=-5.0, implementation="chunked")
        np.testing.assert_array_equal(o_default, o_chunked)


def _hopper(is_hopper: bool):
    """The plan's device check answering `is_hopper` (whatever the host)."""
    return mock.patch.object(plan_lib, "is_hopper", lambda device=None: is_hopper)


class TestPlan:
    """Which kernel runs each stage (plan.py's table), the automatic backend and sequence split."""

    def test_stage_table(self):
        M, T = "mosaic_gpu", "triton"
        seg = jax.ShapeDtypeStruct((1, 128), jnp.int32)
        for kw, want in [(dict(lower_bound=-5.0), (M, M, M, M, M)), (dict(lower_bound=-5.0, segment_ids=seg), (M, M, M, M, M)),
                         (dict(lower_bound=None), (T, M, M, M, T)), (dict(lower_bound=None, segment_ids=seg), (T, M, M, M, T))]:
            p = pk.kda_plan(*_shapes(128, 128, T=128), interpret=True, backend="mosaic_gpu", **kw)
            assert (p.intra_fwd, p.state_fwd, p.state_bwd, p.solve_bwd, p.score_bwd) == want, kw
            assert p.stages()["cumsum"] == T and p.stages()["score_bwd"] == p.score_bwd
            t = pk.kda_plan(*_shapes(128, 128, T=128), interpret=True, backend="triton", **kw)
            assert set(t.stages().values()) == {T}
        with fake_h200(True):
            auto = pk.kda_plan(*_shapes(128, 128, T=128), lower_bound=-5.0)
        assert auto.backend == M and auto.solve_bwd == M and auto.score_bwd == M
        p = pk.kda_plan(*_shapes(128, 128, T=128), lower_bound=-5.0, interpret=True, backend="triton")
        assert p.centre == 58 and not p.unbounded                     # 2^58 ~ e^40: half a tile's 80 nats
        assert pk.kda_plan(*_shapes(), lower_bound=-2.0).centre == 23
        assert pk.kda_plan(*_shapes(), lower_bound=None).centre == 0

    def test_auto_backend(self):
        big = _shapes(128, 128, T=128)
        with _hopper(True):
            assert pk.kda_plan(*big, lower_bound=-5.0).backend == "mosaic_gpu"
            assert pk.kda_plan(*big, lower_bound=-5.0, interpret=True).backend == "triton"
            assert pk.kda_plan(*_shapes(32, 32), lower_bound=-5.0).backend == "triton"
            assert pk.kda_plan(*_shapes(128, 128, jnp.float32), lower_bound=-5.0, interpret=True).backend == "triton"
        with _hopper(False):
            assert pk.kda_plan(*big, lower_bound=-5.0).backend == "triton"
            with pytest.raises(ValueError, match="sm_90"):
                pk.kda_plan(*big, lower_bound=-5.0, backend="mosaic_gpu")

    def test_sequence_split(self):
        # Automatic: only below the target program count, into the fewest power-of-two segments of
        # >= 4 chunks that reach it; the Mosaic GPU passes have the lower target (32 programs).
        assert plan_lib.split_chunks(32, None, 4, 256, 4) == 4            # 8 segments (4 x 8 = 32 < 256)
        assert plan_lib.split_chunks(32, None, 256, 256, 4) == 0
        assert plan_lib.split_chunks(1024, None, 16, 32, 4) == 512        # 2 segments reach 32
        assert plan_lib.split_chunks(8, None, 1, 256, 4) == 4
        assert plan_lib.split_chunks(6, None, 1, 256, 4) == 0             # no valid power of two
        assert plan_lib.split_chunks(8, 2, 1000, 256, 4) == 2
        assert plan_lib.split_chunks(8, 3, 1, 256, 4) == 0 and plan_lib.split_chunks(8, 0, 1, 256, 4) == 0
        shapes = _shapes(128, 128, T=2048)                                 # 32 chunks, B H V/64 = 4 programs
        assert pk.kda_plan(*shapes, lower_bound=-5.0, interpret=True, backend="triton").seg_chunks == 4
        assert pk.kda_plan(*shapes, lower_bound=-5.0, interpret=True, backend="mosaic_gpu").seg_chunks == 4
        assert pk.kda_plan(*shapes, lower_bound=-5.0, interpret=True, sequence_split=0).seg_chunks == 0


@contextlib.contextmanager
def fake_h200(is_hopper: bool):
    """The Pallas Triton lowering targets an H200 (sm_90) on any host, and the plan's device check
    answers `is_hopper`."""
    try:
        from jax._src.pallas.triton import gpu_info          # private API
        info = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90)
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"cannot fake the GPU for the Triton lowering: {e!r}")
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: info), _hopper(is_hopper):
        yield


def lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class TestLowering:
    """Forward and gradient lower for CUDA (bf16 at K = V = 128; fp32 at the largest compiled head
    dim), with the kernels the plan names: Triton custom calls and Mosaic GPU kernels by name."""

    TRITON_FWD = ("kda_cumsum", "kda_intra_fwd_scores", "kda_intra_fwd_wu", "kda_state_fwd", "kda_output_fwd")
    TRITON_BWD = ("kda_state_bwd", "kda_intra_bwd_solve", "kda_intra_bwd_scores", "kda_cumsum_reverse")
    SPLIT = ("kda_split_transitions_fwd", "kda_split_scan")

    @staticmethod
    def _texts(backend, dtype=jnp.bfloat16, sequence_split=0, segments=False, lower_bound=-5.0, T=2048):
        K = 128 if dtype == jnp.bfloat16 else pk.api.MAX_FP32_HEAD_DIM
        shapes = _shapes(K, K, dtype, T=T)
        seg = (jnp.arange(T, dtype=jnp.int32) // 100)[None] if segments else None

        def fwd(*a):
            return pk.kda_pallas(*a, lower_bound=lower_bound, sequence_split=sequence_split, segment_ids=seg,
                                 backend=backend)[0]
        with fake_h200(backend != "triton"):
            return (lowered(fwd, *shapes),
                    lowered(jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4)), *shapes))

    @staticmethod
    def _triton_calls(text):
        return text.count("__gpu$xla.gpu.triton")

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    @pytest.mark.parametrize("sequence_split", [0, None])
    def test_triton(self, dtype, sequence_split):
        # T = 2048 = 32 chunks, 4 programs: the automatic split is on (8 segments) unless 0.
        fwd, grad = self._texts("triton", dtype, sequence_split)
        split = 2 if sequence_split is None else 0
        assert self._triton_calls(fwd) == 5 + split and self._triton_calls(grad) == 9 + 2 * split
        assert "mosaic_gpu" not in grad
        for name in self.TRITON_FWD + self.TRITON_BWD + (self.SPLIT if split else ()):
            assert name in grad, name

    @pytest.mark.parametrize("segments, lower_bound", [(True, -5.0), (False, None)])
    def test_triton_segments_and_unbounded(self, segments, lower_bound):
        # The document masks and the exact diagonal tiles lower too, same kernel count; the flags
        # reach the kernels (the lowered program differs from the dense bounded one).
        fwd, grad = self._texts("triton", segments=segments, lower_bound=lower_bound)
        assert self._triton_calls(grad) == 9
        assert grad != self._texts("triton")[1]

    @pytest.mark.parametrize("segments, lower_bound, mosaic", [
        (False, -5.0, ("kda_intra_fwd_mgpu", "kda_state_fwd_mgpu", "kda_state_bwd_mgpu", "kda_intra_bwd_solve_mgpu",
                       "kda_intra_bwd_scores_mgpu")),
        (True, -5.0, ("kda_intra_fwd_mgpu", "kda_state_fwd_mgpu", "kda_state_bwd_mgpu", "kda_intra_bwd_solve_mgpu",
                      "kda_intra_bwd_scores_mgpu")),
        (True, None, ("kda_state_fwd_mgpu", "kda_state_bwd_mgpu", "kda_intra_bwd_solve_mgpu")),
        (False, None, ("kda_state_fwd_mgpu", "kda_state_bwd_mgpu", "kda_intra_bwd_solve_mgpu"))])
    def test_mosaic_gpu(self, segments, lower_bound, mosaic):
        # The plan's table: Mosaic GPU kernels by name, Triton for the rest; with segment_ids the
        # document selects lower in both intra kernels.
        fwd, grad = self._texts("mosaic_gpu", segments=segments, lower_bound=lower_bound, T=256)
        assert grad.count("custom_call @mosaic_gpu") == len(mosaic)
        for name in mosaic:
            assert name in grad, name
        n_triton = 9 - {5: 7, 3: 4}[len(mosaic)]       # each Mosaic GPU kernel replaces Triton ones
        assert self._triton_calls(grad) == n_triton
        assert ("kda_intra_fwd_mgpu" in fwd) == ("kda_intra_fwd_mgpu" in mosaic)

    def test_layers_share_one_lowering(self):
        # Two calls on the same shapes (two layers of a model), differentiated: each kernel is lowered
        # once (the custom_vjp core is one jit whose traced jaxpr both calls share, forward and backward;
        # before, the Mosaic GPU kernels were lowered per call, ~1.5 s each: ~30 s at K3-small).
        shapes = _shapes(128, 128, T=256)

        def layer(q, k, v, g, beta):
            return pk.kda_pallas(q, k, v, g, beta, lower_bound=-5.0, backend="mosaic_gpu")[0]

        def loss(f):  # the loss value too: with jax.grad alone the last layer's output would be dead code
            return jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
        with fake_h200(True):
            one = lowered(loss(layer), *shapes)
            two = lowered(loss(lambda q, k, v, g, beta: layer(layer(q, k, v, g, beta), k, v, g, beta)), *shapes)
        assert one.count("custom_call @mosaic_gpu") == two.count("custom_call @mosaic_gpu") == 5
        assert self._triton_calls(one) == self._triton_calls(two) == 2   # the two cumsums
