"""Pallas KDA kernels (pallas_kernels.kda) through `kda(..., implementation="pallas")`.

`TestPallasInterpret` subclasses the shared `KDAImplementationTests` (tests/test_kda_ops.py): the same
comparisons against `kda_recurrent` with fla's tolerances (bf16: o and final state 0.005, dq/dk/dv/dh0
0.008, dg/dbeta 0.02; fp32: FP32_TOLERANCE), run in Pallas interpret mode on CPU (CI, small shapes).
Options the kernel does not implement (other chunk sizes, fp64, unbounded gates with any option set
but the default) are asserted to RAISE with the reason instead of being compared (fail-closed).
Unbounded gates (lower_bound=None, the exact diagonal tiles of the default kernels) and segment_ids
(packed documents) are compared like everything else, including gradients, initial and final states.
`TestTritonLowering` lowers the forward and the gradient for CUDA on CPU with a faked H200
(`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`): it catches "cannot lower to Triton"
errors without a GPU (it does not compile the Triton IR, so shared-memory or register limits are only
seen on the GPU). `TestPallasGPU` (marker `gpu`) runs the same checks compiled for the H200 (Triton
lowering) at K = V = 128, T up to 8192, plus a 2^20-token forward with bounded gates.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import kda, kda_recurrent
from pallas_kernels.kda import bwd, ops
from tests.kda_testing import (FLA_BF16_TOLERANCES, FLA_SHAPES, FP32_TOLERANCE, GRAD_NAMES,
                               assert_rms_close, kda_loss_and_grads, make_kda_inputs, rms_ratio)
from tests.test_kda_ops import KDAImplementationTests

INTERPRET_SHAPES = [FLA_SHAPES[0], FLA_SHAPES[1]]          # (1, 63, 1, 64), (2, 500, 3, 60)
# (4, 1024, 4, 128) and (1, 8192, 2, 128) in bf16; compiled fp32 at K = 128 is refused (see
# TestSupported.test_compiled_fp32_above_32_refused), fp32 at K <= 32 runs in the tests above.
GPU_CASES = [(FLA_SHAPES[4], "bfloat16"), ((1, 8192, 2, 128), "bfloat16")]


def _args(x):
    return [x[n] for n in ("q", "k", "v", "g", "beta")]


# Packed documents for (B, T) = (2, 250), 4 chunks of 64 (the last one padded), as cut points:
# row 0: several documents inside chunk 0 (one of length 1), a document starting exactly on each
# chunk boundary (64, 128, 192), one of length 1 at a chunk's last token (127), a whole chunk alone
# (128-192), the last document ending in the padded chunk; row 1: the first document (the one that
# reads initial_state) crossing two chunk boundaries, a start mid-tile (150), a length-1 document,
# the last document crossing a chunk boundary into the final state.
SEGMENT_CUTS = [[0, 5, 6, 40, 64, 100, 127, 128, 192, 200, 250], [0, 150, 151, 250]]


def _segment_ids(cuts_per_row, T):
    seg = np.zeros((len(cuts_per_row), T), np.int32)
    for b, cuts in enumerate(cuts_per_row):
        for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[b, s:e] = (5 * i) % 3 + 1              # consecutive ids differ; ids repeat later
    return jnp.asarray(seg)


def _errors_vs_recurrent(x, seg, dtype, keys, **kda_pallas_kw):
    """o, final state and all gradients of kda_pallas(**kda_pallas_kw) on x against the fp32
    recurrence with the same segment_ids (cotangents from PRNG keys `keys`); asserts fla's bf16
    tolerances (FP32_TOLERANCE for fp32); returns ({name: RMS ratio}, the reference o)."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
    do = jax.random.normal(jax.random.PRNGKey(keys[0]), (B, T, H, V))
    dht = jax.random.normal(jax.random.PRNGKey(keys[1]), (B, H, K, V))
    kw = dict(output_final_state=True, segment_ids=seg, **kda_pallas_kw)
    o, ht, grads = jax.jit(lambda x: kda_loss_and_grads(
        lambda q, k, v, g, b, h0: ops.kda_pallas(q, k, v, g, b, initial_state=h0, **kw), x, do, dht))(x)
    o_ref, ht_ref, g_ref = jax.jit(lambda x: kda_loss_and_grads(
        lambda q, k, v, g, b, h0: kda_recurrent(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                segment_ids=seg), x, do, dht))(x32)
    tol = (lambda name: FP32_TOLERANCE) if dtype == "float32" else FLA_BF16_TOLERANCES.get
    errs = {"o": assert_rms_close("o", o_ref, o, tol("o")), "ht": assert_rms_close("ht", ht_ref, ht, tol("ht"))}
    for name in GRAD_NAMES:
        errs[name] = assert_rms_close(name, g_ref[name], grads[name], tol(name))
    return errs, o_ref


class TestPallasInterpret(KDAImplementationTests):
    """The shared comparisons on the Pallas kernel bodies in interpret mode (CPU)."""

    implementation = "pallas"
    interpret = True
    options = None            # ops.KernelOptions of the kernel variant under test (None = default)

    def run(self, q, k, v, g, beta, **kwargs):
        return kda(q, k, v, g, beta, implementation="pallas", chunk_size=self.chunk_size,
                   interpret=self.interpret, **kwargs)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("shape", INTERPRET_SHAPES)
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    @pytest.mark.parametrize("dtype, gate_scale, segments, sequence_split", [
        ("float32", 1.0, False, None), ("bfloat16", 30.0, False, None), ("float32", 0.05, True, 1)])
    def test_unbounded_gates_match_recurrent(self, dtype, gate_scale, segments, sequence_split):
        # lower_bound=None: the exact diagonal tiles (common.own_block_scores, bwd._own_block_bwd).
        # o, final state and every gradient against the fp32 recurrence, softplus gates (Kimi
        # Linear's, unbounded) times gate_scale: 1 (min g ~ -90), 30 (g ~ -2700 .. -1e-3 per token:
        # e^{anc - G} of the bounded anchoring overflows, checked below), 0.05 with packed documents
        # (SEGMENT_CUTS; the state crosses chunks) and every chunk its own split segment.
        # Measured (interpret): fp32 x1 <= 2.2e-6 (ht); bf16 x30 o 3.4e-3, dg 4.2e-3 (largest);
        # fp32 x0.05 with segments <= 4.7e-7.
        B, T, H, K, V = (2, 250, 1, 16, 16) if segments else (1, 130, 2, 32, 32)
        x = make_kda_inputs(jax.random.PRNGKey(21), B, T, H, K, V, gate="softplus",
                            dtype=jnp.dtype(dtype))
        x["g"] = (gate_scale * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        seg = _segment_ids(SEGMENT_CUTS, T) if segments else None
        errs, _ = _errors_vs_recurrent(x, seg, dtype, (22, 23), lower_bound=None, interpret=self.interpret,
                                       sequence_split=sequence_split, options=self.options)
        print(f"\nKDA_ERRORS pallas unbounded x{gate_scale} {(B, T, H, K, V)} {dtype} segments={segments} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
        if gate_scale >= 30:
            # The gates really are beyond any bound: g < -50 on ~15% of the entries (every 16-token
            # tile has some), and the bounded kernels (lower_bound=-5, a broken promise here)
            # overflow on the same inputs.
            assert float(jnp.mean((x["g"].astype(jnp.float32) < -50).astype(jnp.float32))) > 0.1
            o_bounded, _ = jax.jit(lambda a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=self.interpret,
                                                            options=self.options))(_args(x))
            assert not bool(jnp.all(jnp.isfinite(o_bounded.astype(jnp.float32))))

    @pytest.mark.parametrize("dtype, sequence_split", [("float32", 1), ("bfloat16", None)])
    def test_segment_ids_match_recurrent(self, dtype, sequence_split):
        # o, final state and all gradients (dh0 included) against the fp32 recurrence with the same
        # segment_ids (SEGMENT_CUTS). Gates 0.01x the usual so that the state really crosses chunk
        # boundaries (else a missing reset at a chunk edge is invisible). sequence_split=1: every
        # chunk is its own segment of the split state passes (transitions, scan, per-segment
        # passes); None: one serial pass (this shape leaves the automatic split off). Dropping any
        # one of the 13 selects (common.Segments; forward factors or backward chain rule) gave an
        # RMS ratio of 1e-1 to 9e-1 (largest over o, ht, grads) with these cuts (fp32, split 1,
        # measured at (2, 250, 1, 16); tolerance 5e-5).
        B, T, H, K, V = 2, 250, 2, 32, 16
        x = make_kda_inputs(jax.random.PRNGKey(18), B, T, H, K, V, dtype=jnp.dtype(dtype))
        x["g"] = (0.01 * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
        seg = _segment_ids(SEGMENT_CUTS, T)
        errs, o_ref = _errors_vs_recurrent(x, seg, dtype, (19, 20), lower_bound=-5.0, interpret=self.interpret,
                                           sequence_split=sequence_split, options=self.options)
        tol = (lambda name: FP32_TOLERANCE) if dtype == "float32" else FLA_BF16_TOLERANCES.get
        x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
        # The documents matter here: without segment_ids the outputs are far off.
        o_joined, _ = jax.jit(lambda x: kda_recurrent(*_args(x), initial_state=x["h0"]))(x32)
        assert rms_ratio(o_ref, o_joined) > 20 * tol("o")
        print(f"\nKDA_ERRORS pallas segment_ids {(B, T, H, K, V)} {dtype} split={sequence_split} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))

    @pytest.mark.parametrize("gate", ["bounded", "softplus"])
    def test_check_grads_fp64(self, gate):
        # fp64 and use_qk_l2norm are outside the kernel: the call must refuse.
        with jax.enable_x64(True):
            x = make_kda_inputs(jax.random.PRNGKey(7), 1, 21, 2, 5, 3, gate=gate)
            x = {n: a.astype(jnp.float64) for n, a in x.items()}
            with pytest.raises(ValueError, match="implementation"):
                self.run(*_args(x), lower_bound=-5.0 if gate == "bounded" else None)

    def test_fp32_under_x64_matches(self):
        # jax_enable_x64 must not change the kernels (typed int32 constants in the index arithmetic):
        # fp32 inputs give the same o and gradients with and without it.
        x = make_kda_inputs(jax.random.PRNGKey(9), 1, 70, 1, 16)

        def run():
            return jax.jit(jax.value_and_grad(lambda a: jnp.sum(self.run(*a, lower_bound=-5.0)[0]),
                                              argnums=0))(_args(x))
        base = run()
        with jax.enable_x64(True):
            wide = run()
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(wide)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    def test_odd_sizes_and_options(self):
        # K, V not powers of two, T not a multiple of the chunk, explicit scale, no initial state.
        B, T, H, K, V = 2, 45, 3, 12, 7
        x = make_kda_inputs(jax.random.PRNGKey(8), B, T, H, K, V)
        kw = dict(scale=0.37, output_final_state=True)
        o_ref, ht_ref = jax.jit(lambda a: kda_recurrent(*a, **kw))(_args(x))
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, **kw))(_args(x))
        assert rms_ratio(o_ref, o) < FP32_TOLERANCE and rms_ratio(ht_ref, ht) < FP32_TOLERANCE
        o_none, ht_none = self.run(*_args(x), lower_bound=-5.0)
        assert ht_none is None and o_none.shape == (B, T, H, V)
        with pytest.raises(ValueError, match="chunk_size"):
            kda(*_args(x), implementation="pallas", lower_bound=-5.0, interpret=self.interpret, chunk_size=32)
        # use_qk_l2norm: XLA normalises q, k before the kernel (as the KDA layer calls it); q, k unnormalised
        args = [x["q"] * 3.0, x["k"] * 0.5] + _args(x)[2:]
        o_ref = kda_recurrent(*args, use_qk_l2norm=True)[0]
        o = self.run(*args, lower_bound=-5.0, use_qk_l2norm=True)[0]
        assert rms_ratio(o_ref, o) < FP32_TOLERANCE < rms_ratio(o_ref, self.run(*args, lower_bound=-5.0)[0])

    @pytest.mark.parametrize("sequence_split", [0, 2])
    def test_weak_decay_long_memory(self, sequence_split):
        # g = -0.05 sigmoid(N(0,1)): the state carries across all 8 chunks (with the default inputs'
        # g ~ -2.5 per token it is forgotten inside one chunk, so the chunk-to-chunk state pass and
        # its sequence split would go unchecked). sequence_split=2: 4 segments of 2 chunks.
        x = make_kda_inputs(jax.random.PRNGKey(12), 1, 512, 2, 32, 16)
        x["g"] = 0.01 * x["g"]
        do = jax.random.normal(jax.random.PRNGKey(13), (1, 512, 2, 16))
        dht = jax.random.normal(jax.random.PRNGKey(14), (1, 2, 32, 16))
        kw = dict(lower_bound=-5.0, interpret=self.interpret, sequence_split=sequence_split,
                  output_final_state=True, options=self.options)
        o, ht, grads = jax.jit(lambda x: kda_loss_and_grads(
            lambda q, k, v, g, b, h0: ops.kda_pallas(q, k, v, g, b, initial_state=h0, **kw), x, do, dht))(x)
        o_ref, ht_ref, g_ref = jax.jit(lambda x: kda_loss_and_grads(
            lambda q, k, v, g, b, h0: kda_recurrent(q, k, v, g, b, initial_state=h0, output_final_state=True),
            x, do, dht))(x)
        assert_rms_close("o", o_ref, o, FP32_TOLERANCE)
        assert_rms_close("ht", ht_ref, ht, FP32_TOLERANCE)
        for name in GRAD_NAMES:
            assert_rms_close(name, g_ref[name], grads[name], FP32_TOLERANCE)

    def test_gates_at_lower_bound(self):
        # g = -5 on every channel: the diagonal tiles reach exp(+75) before the select mask.
        x = make_kda_inputs(jax.random.PRNGKey(2), 1, 128, 1, 32)
        x["g"] = jnp.full_like(x["g"], -5.0)
        kw = dict(initial_state=x["h0"], output_final_state=True)
        o_ref, ht_ref = kda_recurrent(*_args(x), **kw)
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, **kw))(_args(x))
        assert_rms_close("o", o_ref, o, FP32_TOLERANCE)
        assert_rms_close("ht", ht_ref, ht, FP32_TOLERANCE)


class TestPallasRound2Interpret(TestPallasInterpret):
    """The round-2 kernels (ops.ROUND2_OPTIONS: every ops.KernelOptions field off: fused intra_fwd and
    intra_bwd with the masked [64, 64] score-tile backward, the state pass writing o, TF32 dots, the
    gate cumsums inside the kernels) against the same references and tolerances as the default
    (all-on) kernels of TestPallasInterpret; the option refusals are the default path's and are not
    repeated. Each option is checked on its own against the round-2 kernels in
    test_options_change_only_rounding, including the branches that only run without
    xla_gate_cumsum (intra_fwd_split's own cumsum, G written by intra_bwd_a for the compact kernel)."""

    options = ops.ROUND2_OPTIONS

    def run(self, q, k, v, g, beta, **kwargs):
        kwargs.pop("chunk_size", None)
        return ops.kda_pallas(q, k, v, g, beta, interpret=self.interpret, options=self.options,
                              **kwargs)

    # fp32 across chunks is covered by test_weak_decay_long_memory (fp32, 8 chunks, split 0 and 2).
    @pytest.mark.parametrize("shape, dtype", [(INTERPRET_SHAPES[0], "float32"),
                                              (INTERPRET_SHAPES[0], "bfloat16"),
                                              (INTERPRET_SHAPES[1], "bfloat16")])
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    @pytest.mark.parametrize("dtype, sequence_split", [("bfloat16", 1)])
    def test_segment_ids_match_recurrent(self, dtype, sequence_split):
        TestPallasInterpret.test_segment_ids_match_recurrent(self, dtype, sequence_split)

    test_unbounded_gates_match_recurrent = None      # refused: TestSupported.test_unbounded_gates_need_the_default_options
    test_segment_ids_equal_each_document_alone = None
    test_check_grads_fp64 = None
    test_odd_sizes_and_options = None
    test_future_gates_do_not_change_past_outputs = None

    def test_options_change_only_rounding(self):
        # Every option changes only rounding: bf16 inputs (1, 128, 1, 32) vs the round-2 kernels.
        x = make_kda_inputs(jax.random.PRNGKey(15), 1, 128, 1, 32, dtype=jnp.bfloat16)
        do = jax.random.normal(jax.random.PRNGKey(16), (1, 128, 1, 32)).astype(jnp.bfloat16)
        dht = jax.random.normal(jax.random.PRNGKey(17), (1, 1, 32, 32))

        def run(options):
            return jax.jit(lambda x: kda_loss_and_grads(
                lambda q, k, v, g, b, h0: ops.kda_pallas(q, k, v, g, b, initial_state=h0, lower_bound=-5.0,
                                                         output_final_state=True, interpret=True,
                                                         options=options), x, do, dht))(x)
        o0, ht0, g0 = run(ops.ROUND2_OPTIONS)
        # Measured (interpret): split_intra_bwd is bit-identical; xla_gate_cumsum dg 1.3e-5 (the
        # in-kernel reverse cumsum, total - cumsum + dG, cancels); parallel_output o 2.5e-4 (o reads
        # the bf16-stored state), with bf16_state_dots o 2.8e-3, ht 1.5e-3; bf16_intra_dots o 2.9e-3,
        # dg 4.3e-3 (the rest less); split_intra_fwd bit-identical, compact_offdiag_bwd dg 2-4e-5,
        # dk <= 4e-5 (bf16 rounding of the outputs; fp32 inputs: dg 4e-7). The last group runs
        # the branches that only exist without xla_gate_cumsum (intra_fwd_b's own cumsum, G written
        # by intra_bwd_a for the compact kernel b); with segment_ids and every other option they
        # are compared to the recurrence by this class's shared tests. Options with like
        # tolerances run together (CI time).
        for fields, tol in ((("split_intra_bwd", "xla_gate_cumsum"), 1e-4),
                            (("parallel_output", "bf16_state_dots", "bf16_state_bwd_dots"), 5e-3),
                            (("bf16_intra_dots",), 8e-3),
                            (("split_intra_fwd", "compact_offdiag_bwd"), 1e-4)):
            o, ht, grads = run(dataclasses.replace(ops.ROUND2_OPTIONS, **{f: True for f in fields}))
            assert_rms_close(f"{fields} o", o0, o, tol)
            assert_rms_close(f"{fields} ht", ht0, ht, tol)
            for name in GRAD_NAMES:
                assert_rms_close(f"{fields} {name}", g0[name], grads[name], tol)

    def test_options_type_checked(self):
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16)
        with pytest.raises(ValueError, match="options"):
            ops.kda_pallas(*_args(x), lower_bound=-5.0, interpret=True, options={"parallel_output": True})


class TestSupported:
    """`ops.supported` names the reason for every refused option; `kda_pallas` raises it."""

    def _inputs(self, K=32, V=32, dtype=jnp.bfloat16):
        q = jax.ShapeDtypeStruct((1, 64, 2, K), dtype)
        v = jax.ShapeDtypeStruct((1, 64, 2, V), dtype)
        g = jax.ShapeDtypeStruct((1, 64, 2, K), jnp.float32)
        beta = jax.ShapeDtypeStruct((1, 64, 2), dtype)
        return q, q, v, g, beta

    def test_supported_call(self):
        assert ops.supported(*self._inputs(), lower_bound=-5.0) == (True, "")
        seg = jax.ShapeDtypeStruct((1, 64), jnp.int32)
        assert ops.supported(*self._inputs(), lower_bound=-5.0, segment_ids=seg) == (True, "")

    @pytest.mark.parametrize("kwargs, word", [
        (dict(lower_bound=None, options=ops.ROUND2_OPTIONS), "lower_bound"),
        (dict(lower_bound=-6.0), "lower_bound"),
        (dict(lower_bound=-5.0, segment_ids=np.zeros((2, 64), np.int32)), "segment_ids"),
        (dict(lower_bound=-5.0, segment_ids=np.zeros((1, 64), np.float32)), "segment_ids"),
        (dict(lower_bound=-5.0, use_qk_l2norm=True), "use_qk_l2norm"),
        (dict(lower_bound=-5.0, chunk_size=32), "chunk_size"),
        (dict(lower_bound="-5"), "lower_bound"),
        (dict(lower_bound=jnp.float32(-5.0)), "lower_bound"),
        (dict(lower_bound=True), "lower_bound"),
    ])
    def test_unsupported_options(self, kwargs, word):
        ok, why = ops.supported(*self._inputs(), **kwargs)
        assert not ok and word in why

    def test_empty_and_integer_inputs_refused(self):
        q, k, v, g, beta = self._inputs()
        empty = jax.ShapeDtypeStruct((1, 0, 2, 32), jnp.bfloat16)
        ok, why = ops.supported(empty, empty, empty, jax.ShapeDtypeStruct((1, 0, 2, 32), jnp.float32),
                                jax.ShapeDtypeStruct((1, 0, 2), jnp.bfloat16), lower_bound=-5.0)
        assert not ok and "positive" in why
        ok, why = ops.supported(q, k, v, g, jax.ShapeDtypeStruct(beta.shape, jnp.int32), lower_bound=-5.0)
        assert not ok and "beta" in why

    def test_unbounded_gates_need_the_default_options(self):
        # lower_bound=None runs only with the seven round-3 KernelOptions fields on (the exact diagonal
        # tiles exist in intra_fwd_split + xla_gate_cumsum and the compact backward), tile_state_bwd
        # and pallas_cumsum either way (kernel a needs no bound; the cumsum is the same sum); any other set
        # is refused, naming lower_bound and the options, and kda_pallas raises it.
        assert ops.supported(*self._inputs(), lower_bound=None) == (True, "")
        assert ops.supported(*self._inputs(), lower_bound=None, options=ops.KernelOptions()) == (True, "")
        tiled = dataclasses.replace(ops.UNBOUNDED_OPTIONS, tile_state_bwd=True)
        assert ops.supported(*self._inputs(), lower_bound=None, options=tiled) == (True, "")
        off_one = [dataclasses.replace(opts, **{f.name: False}) for opts in (ops.UNBOUNDED_OPTIONS, tiled)
                   for f in dataclasses.fields(ops.KernelOptions) if f.name not in ops.BOUND_FREE_FIELDS]
        for options in off_one + [ops.ROUND2_OPTIONS]:
            ok, why = ops.supported(*self._inputs(), lower_bound=None, options=options)
            assert not ok and "lower_bound" in why and "options" in why, options
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16, gate="softplus")
        with pytest.raises(ValueError, match="lower_bound=None.*options"):
            ops.kda_pallas(*_args(x), lower_bound=None, interpret=True, options=ops.ROUND2_OPTIONS)
        with pytest.raises(ValueError, match="unbounded"):       # the kernel wrappers refuse too
            from pallas_kernels.kda import fwd
            fwd.intra_fwd(*_args(x), scale=0.25, chunk_size=64, interpret=True, unbounded=True,
                          split=True, gate_cumsum=False)

    def test_unsupported_shapes_and_dtypes(self):
        ok, why = ops.supported(*self._inputs(K=256), lower_bound=-5.0)
        assert not ok and "head dims" in why
        q, k, v, g, beta = self._inputs()
        v16 = jax.ShapeDtypeStruct(v.shape, jnp.float16)
        assert "dtype" in ops.supported(q, k, v16, g, beta, lower_bound=-5.0)[1]

    def test_compiled_fp32_above_32_refused(self):
        # fp32 at K = V = 128 exceeded the H200's shared memory in the backward (2026-11-30): refused
        # compiled, allowed in interpret mode; bf16 at 128 and fp32 at 32 stay supported.
        ok, why = ops.supported(*self._inputs(K=128, V=128, dtype=jnp.float32), lower_bound=-5.0)
        assert not ok and "shared memory" in why
        assert ops.supported(*self._inputs(K=128, V=128, dtype=jnp.float32), lower_bound=-5.0, interpret=True)[0]
        assert ops.supported(*self._inputs(K=128, V=128), lower_bound=-5.0)[0]
        assert ops.supported(*self._inputs(K=32, V=32, dtype=jnp.float32), lower_bound=-5.0)[0]

    def test_compiled_call_off_gpu_raises_with_reason(self):
        if jax.default_backend() == "gpu":
            pytest.skip("on a GPU interpret=False is the compiled path")
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16)
        with pytest.raises(ValueError, match="interpret=True"):
            kda(*_args(x), lower_bound=-5.0, implementation="pallas")

    def test_kda_pallas_raises_with_reason(self):
        x = make_kda_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16)
        with pytest.raises(ValueError, match="lower_bound"):
            ops.kda_pallas(*_args(x), lower_bound=-8.0, interpret=True)

    def test_default_implementation_rule(self, monkeypatch):
        # implementation=None's rule, with the backend faked: the kernel only compiled on compute
        # capability 9.0 and only for calls `supported` accepts (this test does not run a kernel).
        from k3jax.ops import kda as kda_module

        class FakeDevice:
            def __init__(self, cc):
                self.compute_capability = cc
        q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
        beta = jax.ShapeDtypeStruct((1, 128, 2), jnp.bfloat16)
        g = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.float32)

        def covers(cc, backend="gpu", interpret=False, chunk_size=64, lower_bound=-5.0):
            monkeypatch.setattr(kda_module.jax, "default_backend", lambda: backend)
            monkeypatch.setattr(kda_module.jax, "devices", lambda *a: [FakeDevice(cc)])
            return kda_module._pallas_covers(q, q, q, g, beta, lower_bound=lower_bound, segment_ids=None,
                                             chunk_size=chunk_size, initial_state=None, interpret=interpret)
        assert covers("9.0") and covers("9.0", lower_bound=None)
        assert not covers("8.0") and not covers("10.0") and not covers(None)
        assert not covers("9.0", backend="cpu") and not covers("9.0", interpret=True)
        assert not covers("9.0", chunk_size=32)          # refused by `supported`: the chunked op runs

    def test_default_implementation_off_the_h200_is_the_chunked_op(self):
        # None picks the kernel only compiled on a compute-capability-9.0 GPU (where its gpu tests
        # ran); here (CPU, or any other GPU) it is the chunked op.
        if getattr(jax.devices()[0], "compute_capability", None) == "9.0":
            pytest.skip("on an H100/H200 None is the kernel: test_default_implementation_is_the_kernel")
        x = make_kda_inputs(jax.random.PRNGKey(11), 1, 40, 2, 16)
        o_default, _ = kda(*_args(x), lower_bound=-5.0)
        o_chunked, _ = kda(*_args(x), lower_bound=-5.0, implementation="chunked")
        np.testing.assert_array_equal(o_default, o_chunked)


def _fake_h200(hopper_passes: bool = False):
    """A context manager that makes the Pallas Triton lowering target an H200 (sm_90) on any host,
    and the op's Hopper dispatch (pallas_kernels.kda.hopper.is_hopper) answer `hopper_passes`
    whatever the host (False: the Triton kernels only, so a lowering test means the same on a CPU
    host and on an H200)."""
    import contextlib
    from unittest import mock

    from pallas_kernels.kda import hopper
    try:
        from jax._src.pallas.triton import gpu_info
        info = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0",
                                compute_capability=90)
    except (ImportError, AttributeError, TypeError) as e:   # private API moved: cannot fake
        pytest.skip(f"cannot fake the GPU for the Triton lowering: {e!r}")
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info", lambda: info))
    stack.enter_context(mock.patch.object(hopper, "is_hopper", lambda device=None: hopper_passes))
    return stack


def pallas_outputs(x, do, dht, options, *, lower_bound=-5.0, segment_ids=None, sequence_split=None):
    """(o, ht, grads) of kda_pallas in interpret mode with an initial state (kda_loss_and_grads), for
    comparing two KernelOptions on the same inputs."""
    kw = dict(lower_bound=lower_bound, interpret=True, output_final_state=True, options=options,
              segment_ids=segment_ids, sequence_split=sequence_split)
    return jax.jit(lambda x: kda_loss_and_grads(
        lambda q, k, v, g, b, h0: ops.kda_pallas(q, k, v, g, b, initial_state=h0, **kw), x, do, dht))(x)


def option_ab_inputs(seed, dtype, *, segments: bool, lower_bound, V, B=2, T=250, H=1, K=32):
    """Inputs for comparing two KernelOptions through the op: (x, segment_ids or None, do, dht).
    Bounded gates with segment_ids are scaled by 0.01 (mild decay: state carried across whole
    documents, so a document-boundary slip would show); lower_bound=None gets softplus gates."""
    x = make_kda_inputs(jax.random.PRNGKey(seed), B, T, H, K, V, dtype=jnp.dtype(dtype),
                        gate="bounded" if lower_bound is not None else "softplus")
    seg = _segment_ids(SEGMENT_CUTS, T) if segments else None
    if segments:
        x["g"] = (0.01 * x["g"].astype(jnp.float32)).astype(x["g"].dtype)
    do = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, T, H, V))
    dht = jax.random.normal(jax.random.PRNGKey(seed + 2), (B, H, K, V))
    return x, seg, do, dht


def lowered_grad_text(options, B=1, T=256, H=2, K=128, hopper_passes=False):
    """The gradient of sum(kda_pallas(...)) (bf16, lower_bound -5, no sequence split) lowered for a
    faked H200 (with or without the Hopper state passes: _fake_h200), as text."""
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16)

    def loss(*a):
        return jnp.sum(ops.kda_pallas(*a, lower_bound=-5.0, sequence_split=0, options=options)[0].astype(jnp.float32))
    with _fake_h200(hopper_passes):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(q, q, q, g, beta).lower(
            lowering_platforms=("cuda",)).as_text()


class TestTritonLowering:
    """Forward and gradient lower to Triton IR for CUDA (bf16 at K = V = 128, the benchmark's head dim;
    fp32 at the largest head dim supported compiled, ops.MAX_FP32_HEAD_DIM)."""

    @pytest.mark.parametrize("variants", [None, "round2"])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    @pytest.mark.parametrize("sequence_split", [0, None])
    def test_lowers_for_cuda(self, dtype, sequence_split, variants):
        self._check_lowering(dtype, sequence_split, variants, segments=False)

    @pytest.mark.parametrize("variants", [None, "round2", "split_fwd+compact"])
    def test_lowers_for_cuda_with_segment_ids(self, variants):
        # The document masks (an int32 [C] block per chunk, selects in intra_fwd / intra_bwd /
        # intra_bwd_a / intra_fwd_a / intra_fwd_b) lower too; same kernel count as without.
        self._check_lowering(jnp.bfloat16, None, variants, segments=True)

    def test_lowers_for_cuda_split_fwd_compact_bwd(self):
        # The two options without xla_gate_cumsum: intra_fwd_b runs its own cumsum, intra_bwd_a
        # writes G for the compact kernel b ([16, n] ref slices, n = 16, 32, 64); fp32 (IEEE
        # dots) here, bf16 (bf16x3 diagonal tiles) in test_lowers_for_cuda_with_segment_ids.
        self._check_lowering(jnp.float32, 0, "split_fwd+compact", segments=False)

    @pytest.mark.parametrize("dtype, segments", [(jnp.bfloat16, True), (jnp.float32, False)])
    def test_lowers_for_cuda_unbounded(self, dtype, segments):
        # lower_bound=None (default options): the exact diagonal tiles (fori_loops of [C, K] /
        # [16, K] elementwise work with ref row loads pl.ds(j, 1)) lower too, same kernel count,
        # and the flag reaches the kernels (the lowered program differs from the bounded one).
        unbounded = self._check_lowering(dtype, None, None, segments=segments, lower_bound=None)
        assert unbounded != self._check_lowering(dtype, None, None, segments=segments)

    @pytest.mark.parametrize("segments, lower_bound", [(True, -5.0), (False, None)])
    def test_lowers_for_cuda_tile_state_bwd(self, segments, lower_bound):
        # Kernel a's state products over V blocks (ops.KernelOptions.tile_state_bwd; bf16 K = V = 128:
        # 2 blocks of 64 with [64, K] row slices of the state refs and [C, 64] column slices of
        # dO, dV', U, V and the dv output) lower for the faked H200, with segment_ids and for
        # unbounded gates; same Triton call counts, and the option reaches the kernel.
        tiled = self._check_lowering(jnp.bfloat16, None, "base+tile_state", segments=segments,
                                     lower_bound=lower_bound)
        assert tiled != self._check_lowering(jnp.bfloat16, None, None, segments=segments,
                                             lower_bound=lower_bound)

    @staticmethod
    def _check_lowering(dtype, sequence_split, variants, segments, lower_bound=-5.0):
        """Lowers forward and gradient for CUDA, checks the Triton call counts; returns the gradient's
        lowered text."""
        # T = 2048 = 32 chunks, B * H * V-blocks = 4 programs: the automatic sequence split is on
        # (8 segments of 4 chunks) unless sequence_split=0.
        B, T, H = 1, 2048, 2
        K = 128 if dtype == jnp.bfloat16 else ops.MAX_FP32_HEAD_DIM
        q = jax.ShapeDtypeStruct((B, T, H, K), dtype)
        g = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
        beta = jax.ShapeDtypeStruct((B, T, H), dtype)

        # Kernel counts relative to the round-2 kernels (ops.ROUND2_OPTIONS): the default has +3
        # forward calls (output_fwd, intra_fwd_b, the Pallas gate cumsum) and +2 backward
        # (intra_bwd_b, the reverse cumsum); "split_fwd+compact" (round 2 plus those two) +1 forward, +1 backward.
        # "base+tile_state" (the default plus kernel a over V blocks) has the default's counts.
        options = {None: None, "round2": ops.ROUND2_OPTIONS,
                   "split_fwd+compact": dataclasses.replace(ops.ROUND2_OPTIONS, split_intra_fwd=True,
                                                            compact_offdiag_bwd=True),
                   "base+tile_state": dataclasses.replace(ops.KernelOptions(), tile_state_bwd=True)}[variants]
        extra_fwd, extra_bwd = {None: (3, 2), "round2": (0, 0), "split_fwd+compact": (1, 1),
                                "base+tile_state": (3, 2)}[variants]

        seg = (jnp.arange(T, dtype=jnp.int32) // 100)[None] if segments else None

        def fwd(q, k, v, g, beta):
            return ops.kda_pallas(q, k, v, g, beta, lower_bound=lower_bound, sequence_split=sequence_split,
                                  options=options, segment_ids=seg)[0]

        def loss(*a):
            return jnp.sum(fwd(*a).astype(jnp.float32))

        n_fwd, n_bwd = (2, 2) if sequence_split == 0 else (4, 4)
        n_fwd, n_bwd = n_fwd + extra_fwd, n_bwd + extra_bwd
        with _fake_h200():
            for fn, n_calls in ((fwd, n_fwd), (jax.grad(loss, argnums=(0, 1, 2, 3, 4)), n_fwd + n_bwd)):
                text = jax.jit(fn).trace(q, q, q, g, beta).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("__gpu$xla.gpu.triton") == n_calls
        return text


class TestProfilingAblations:
    """The private `_ablate` option of the intra / state kernels (profiling by ablation; timing only).

    Each named ablation must change the kernel (else its GPU row would time the unablated kernel
    under a wrong name) and still lower to one Triton call; unknown names raise; the default `()` is
    the shipped kernel bit for bit. Values of ablated kernels are wrong by design and not compared.
    """

    def test_every_ablation_lowers_and_changes_the_kernel(self):
        from experiments import bench_kda_kernels as bk
        K = 128
        inputs = jax.eval_shape(lambda: bk.profile_inputs(1, 128, 2, K))
        with _fake_h200():
            for kernel, names in bk.ABLATION_NAMES.items():
                texts = {}
                for ablate in ((),) + tuple((n,) for n in names):
                    lowered = jax.jit(bk.profile_fn(kernel, ablate, 4, K, False)).trace(
                        *inputs[kernel]).lower(lowering_platforms=("cuda",))
                    texts[ablate] = lowered.as_text()
                    if kernel in bk.MOSAIC_KERNELS:         # Mosaic GPU, not Triton
                        assert "mosaic_gpu" in texts[ablate] and "xla.gpu.triton" not in texts[ablate]
                        continue
                    n_calls = 2 if "_split" in kernel else 1
                    assert texts[ablate].count("__gpu$xla.gpu.triton") == n_calls, (kernel, ablate)
                unchanged = [a for a in texts if a and texts[a] == texts[()]]
                assert not unchanged, (kernel, unchanged)

    def test_unknown_ablation_raises(self):
        from pallas_kernels.kda import fwd
        x = make_kda_inputs(jax.random.PRNGKey(3), 1, 64, 1, 16)
        with pytest.raises(ValueError, match="_ablate"):
            fwd.intra_fwd(*_args(x), scale=0.25, chunk_size=64, interpret=True, _ablate=("dL",))
        # Kernel a of the split backward takes only its own pieces (bwd.A_ABLATIONS); the split /
        # tiled intra_bwd takes none (they go through intra_bwd_a).
        bwd_in = _args(x) + [None] * 8
        with pytest.raises(ValueError, match="_ablate"):
            bwd.intra_bwd_a(*bwd_in, scale=0.25, chunk_size=64, interpret=True, _ablate=("score_diag",))
        with pytest.raises(ValueError, match="_ablate"):
            bwd.intra_bwd(*bwd_in, scale=0.25, chunk_size=64, interpret=True, state_block_v=16,
                          _ablate=("dL",))

    def test_variant_specs(self):
        # --variants: "base" the defaults, "round2" all off, '+' names on over round 2, "base" then
        # "+name" / "-name" on / off over the defaults; an unknown name raises naming the spec.
        from experiments import bench_kda_kernels as bk
        assert bk.variant_options("base") == ops.KernelOptions()
        assert bk.variant_options("round2") == ops.ROUND2_OPTIONS
        assert bk.variant_options("split_fwd+compact_bwd") == dataclasses.replace(
            ops.ROUND2_OPTIONS, split_intra_fwd=True, compact_offdiag_bwd=True)
        assert bk.variant_options("base+tile_state") == dataclasses.replace(ops.KernelOptions(),
                                                                            tile_state_bwd=True)
        assert bk.variant_options("base+tile_state-pallas_cumsum") == dataclasses.replace(
            ops.KernelOptions(), tile_state_bwd=True, pallas_cumsum=False)
        assert bk.variant_options("base-pallas_cumsum") == dataclasses.replace(ops.KernelOptions(),
                                                                               pallas_cumsum=False)
        with pytest.raises(ValueError, match="base\\+tile"):
            bk.variant_options("base+tile")
        with pytest.raises(ValueError, match="nope"):
            bk.variant_options("base-nope")

    def test_no_ablation_is_the_shipped_kernel(self):
        from pallas_kernels.kda import fwd
        x = make_kda_inputs(jax.random.PRNGKey(3), 1, 64, 1, 16, dtype=jnp.bfloat16)
        x["g"] = x["g"].astype(jnp.float32)
        kw = dict(scale=0.25, chunk_size=64, interpret=True, factor_dtype=jnp.bfloat16)
        shipped = fwd.intra_fwd(*_args(x), **kw)
        explicit = fwd.intra_fwd(*_args(x), _ablate=(), **kw)
        ablated = fwd.intra_fwd(*_args(x), _ablate=("scores",), **kw)
        for a, b in zip(shipped, explicit):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert not np.array_equal(np.asarray(shipped[4], np.float32), np.asarray(ablated[4], np.float32))


class TestTileStateBwd:
    """ops.KernelOptions.tile_state_bwd: the backward's kernel a (bwd.intra_bwd_a) forms its state
    products over V blocks of bwd.STATE_BLOCK_V columns instead of the whole [V, K] states. Same sums
    with the contraction over V split into blocks: equal to the whole-state kernel up to fp32
    rounding (interpret mode), at the kernel (every output of kernel a) and through the op (o, ht and
    every gradient vs the same options without it)."""

    @pytest.mark.parametrize("dtype, segments, blocks", [("float32", True, (bwd.STATE_BLOCK_V,)),
                                                         ("bfloat16", False, (bwd.STATE_BLOCK_V, 32))])
    def test_kernel_a_matches_whole_states(self, dtype, segments, blocks):
        # V = 128: 2 blocks of 64 (and 4 of 32, the bench's tile_state32 row); random inputs of the
        # layouts ops passes (bf16 with bf16 dots and the XLA gate cumsum, the default op's kernel
        # a); every output of kernel a. The other two (dtype, segments) pairs run through the op in
        # test_op_matches_whole_states. Measured (interpret, largest RMS ratio over the 8
        # outputs): fp32 <= 2.6e-7, bf16 <= 1.5e-7 at BV 64 and 32 (fp32 accumulation order).
        from pallas_kernels.kda import common
        B, T, H, K, V, C = 1, 128, 2, 32, 128, 64
        dt = jnp.dtype(dtype)
        x = make_kda_inputs(jax.random.PRNGKey(40), B, T, H, K, V, dtype=dt)
        G = common.chunk_cumsum(x["g"].astype(jnp.float32), C)
        ks = jax.random.split(jax.random.PRNGKey(41), 8)
        nrm = lambda i, shp, s=1.0: s * jax.random.normal(ks[i], shp, jnp.float32)
        sdt = ops.saved_state_dtype(dt)
        rows, cols = np.tril_indices(C, -1)
        A = jnp.tile(jnp.eye(C) + jnp.zeros((C, C)).at[rows, cols].set(0.1 * nrm(0, (rows.size,))),
                     (B, H, T // C, 1)).reshape(B, H, T, C)
        M = nrm(1, (B, H, T, C), 0.3)
        args = (x["q"], x["k"], x["v"], G, x["beta"], nrm(2, (B, T, H, V)).astype(dt),
                nrm(3, (B, H, T, V)), nrm(4, (B, H, T // C, V, K)).astype(sdt),
                nrm(5, (B, H, T // C, V, K)).astype(sdt), nrm(6, (B, H, T, K)), nrm(7, (B, H, T, V)), A, M)
        seg = (common.document_offsets(_segment_ids([[0, 5, 6, 40, 64, 100, 127, 128]], T), C, T)
               if segments else None)
        kw = dict(scale=K ** -0.5, chunk_size=C, interpret=True, bf16_dots=True, gate_cumsum=True,
                  segments=seg)
        whole = jax.jit(lambda *a: bwd.intra_bwd_a(*a, **kw))(*args)
        names = ("dv", "dbeta", "dq", "dk", "dG", "dG_last", "dM", "dAqk")
        for bv in blocks:
            tiled = jax.jit(lambda *a: bwd.intra_bwd_a(*a, state_block_v=bv, **kw))(*args)
            for name, r, t in zip(names, whole, tiled):
                assert float(jnp.max(jnp.abs(r.astype(jnp.float32)))) > 0, name
                assert_rms_close(f"{name} BV={bv}", r, t, 1e-6)
        with pytest.raises(ValueError, match="state_block_v"):
            bwd.intra_bwd_a(*args, state_block_v=48, **kw)

    @pytest.mark.parametrize("dtype, segments, lower_bound", [("bfloat16", True, -5.0),
                                                              ("float32", False, None)])
    def test_op_matches_whole_states(self, dtype, segments, lower_bound):
        # o, ht and every gradient with tile_state_bwd vs the same options without it (the default
        # options; UNBOUNDED_OPTIONS for lower_bound=None): V = 128 (2 blocks), segment_ids
        # (SEGMENT_CUTS) with bf16, unbounded softplus gates with fp32. Measured (interpret): o, ht,
        # dv, dh0 bit-identical (the forward and the state pass are untouched), dq, dk, dbeta <= 2e-7,
        # dg 1e-5 (bf16) / 5e-7 (fp32): fp32 rounding, amplified in dg by the reverse cumsum.
        x, seg, do, dht = option_ab_inputs(42, dtype, segments=segments, lower_bound=lower_bound, V=128)
        base = ops.KernelOptions()
        kw = dict(lower_bound=lower_bound, segment_ids=seg)
        o0, ht0, g0 = pallas_outputs(x, do, dht, base, **kw)
        o, ht, grads = pallas_outputs(x, do, dht, dataclasses.replace(base, tile_state_bwd=True), **kw)
        np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(ht0), np.asarray(ht))
        tol = 1e-4 if dtype == "bfloat16" else 1e-5
        for name in GRAD_NAMES:
            assert_rms_close(f"tile_state {name}", g0[name], grads[name], tol)


class TestBf16StateBwdDots:
    """ops.KernelOptions.bf16_state_bwd_dots: bf16 operands in the backward state pass's four dots
    (bf16 inputs only; on by default since round 6). Rounding only: o and ht untouched, gradients
    within bf16 rounding of the fp32-operand pass (the option off); fp32 inputs and unbounded gates
    ignore / accept it; it reaches the lowered kernel."""

    @pytest.mark.parametrize("segments, lower_bound, sequence_split", [(True, -5.0, 0), (False, None, 1)])
    def test_op_matches_fp32_operand_pass(self, segments, lower_bound, sequence_split):
        # bf16: bounded gates with segment_ids in one serial pass, and unbounded (softplus) gates
        # through the sequence split (segments of one chunk: the exact-precision transitions, then
        # the bf16-operand state_bwd per segment). Measured (interpret, on vs off): o, ht
        # bit-identical; bounded: dq identical (it reads the forward states only), dk 1.9e-3,
        # dv 2.1e-3, dg 1.9e-3, dbeta 2.5e-3, dh0 9.4e-4; unbounded + split: dq identical, dk 6.1e-4,
        # dv 1.0e-3, dg 5.5e-4, dbeta 1.5e-3, dh0 4.4e-4 (bf16 rounding of dS, dV' and W per dot; the
        # op's own error vs the fp32 recurrence is ~3e-3).
        x, seg, do, dht = option_ab_inputs(60, "bfloat16", segments=segments, lower_bound=lower_bound, V=64)
        on = ops.KernelOptions()                                   # the default since round 6
        base = dataclasses.replace(on, bf16_state_bwd_dots=False)
        kw = dict(segment_ids=seg, lower_bound=lower_bound, sequence_split=sequence_split)
        (o0, ht0, g0), (o, ht, grads) = (pallas_outputs(x, do, dht, opts, **kw) for opts in (base, on))
        np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(ht0), np.asarray(ht))
        diffs = {name: assert_rms_close(f"bf16_state_bwd {name}", g0[name], grads[name], 5e-3)
                 for name in GRAD_NAMES}
        assert max(diffs.values()) > 1e-4, diffs            # the option took effect

    def test_fp32_ignores_it(self):
        # fp32 inputs: the same kernels bit for bit, bounded and unbounded (where it is accepted).
        x32 = make_kda_inputs(jax.random.PRNGKey(63), 1, 128, 1, 16, 16, gate="softplus")
        d32 = jax.random.normal(jax.random.PRNGKey(64), (1, 128, 1, 16))
        h32 = jax.random.normal(jax.random.PRNGKey(65), (1, 1, 16, 16))
        off = dataclasses.replace(ops.KernelOptions(), bf16_state_bwd_dots=False)
        for lb in (-5.0, None):
            xi = x32 if lb is None else dict(x32, g=jnp.maximum(x32["g"], -5.0))
            outs = [pallas_outputs(xi, d32, h32, opts, lower_bound=lb) for opts in (off, ops.KernelOptions())]
            for name in GRAD_NAMES:
                np.testing.assert_array_equal(np.asarray(outs[0][2][name]), np.asarray(outs[1][2][name]))

    def test_lowers_and_changes_the_kernel(self):
        off = dataclasses.replace(ops.KernelOptions(), bf16_state_bwd_dots=False)
        base, on = lowered_grad_text(off), lowered_grad_text(ops.KernelOptions())
        assert base == lowered_grad_text(off)                          # control: lowering is deterministic
        assert base != on and base.count("__gpu$xla.gpu.triton") == on.count("__gpu$xla.gpu.triton")


@pytest.mark.gpu
class TestPallasGPU(TestPallasInterpret):
    """The same checks compiled for the GPU (Triton lowering), at K = V = 128 and T up to 8192."""

    interpret = False

    @pytest.mark.parametrize("shape, dtype", GPU_CASES)
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)

    def test_default_implementation_is_the_kernel(self):
        # On the H200 (compute capability 9.0) implementation=None runs the kernel: bit-equal to
        # an explicit "pallas" call, and not the chunked op.
        if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
            pytest.skip("implementation=None picks the kernel only on compute capability 9.0")
        x = make_kda_inputs(jax.random.PRNGKey(11), 1, 256, 2, 128, dtype=jnp.bfloat16)
        for lb in (-5.0, None):      # bounded gates, and the exact path for unbounded ones
            o_default, _ = jax.jit(lambda a: kda(*a, lower_bound=lb))(_args(x))
            o_pallas, _ = jax.jit(lambda a: kda(*a, lower_bound=lb, implementation="pallas"))(_args(x))
            o_chunked, _ = jax.jit(lambda a: kda(*a, lower_bound=lb, implementation="chunked"))(_args(x))
            np.testing.assert_array_equal(np.asarray(o_default, np.float32), np.asarray(o_pallas, np.float32))
            assert not np.array_equal(np.asarray(o_default, np.float32), np.asarray(o_chunked, np.float32))

    def test_million_tokens_finite(self):
        T, W = 1 << 20, 4096
        x = make_kda_inputs(jax.random.PRNGKey(6), 1, T, 1, 128, dtype=jnp.bfloat16)
        o, ht = jax.jit(lambda a: self.run(*a, lower_bound=-5.0, output_final_state=True))(_args(x))
        assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(ht)))
        # The state forgets (gates <= 0, delta rule): the last W tokens run from a zero state agree
        # with the full run after a 1024-token burn-in.
        o_tail, _ = kda_recurrent(*(a[:, T - W:] for a in _args(x)))
        assert_rms_close("o", o_tail[:, 1024:], o[:, T - W + 1024:], FLA_BF16_TOLERANCES["o"])


@pytest.mark.gpu
class TestPallasRound2GPU(TestPallasRound2Interpret):
    """The round-2 kernels (ops.ROUND2_OPTIONS) compiled for the GPU at the first GPU case (bf16,
    K = V = 128)."""

    interpret = False
    test_weak_decay_long_memory = None
    test_gates_at_lower_bound = None
    test_options_change_only_rounding = None
    test_default_implementation_is_the_kernel = None
    test_options_type_checked = None
    test_million_tokens_finite = None

    @pytest.mark.parametrize("shape, dtype", GPU_CASES[:1])
    def test_matches_recurrent_on_fla_shapes(self, shape, dtype):
        KDAImplementationTests.test_matches_recurrent_on_fla_shapes(self, shape, "bounded", dtype)
