"""The comparisons every KDA implementation must pass (`KDAImplementationTests`), shared by the op
tests (tests/k3jax/ops/test_kda_ops.py) and the kernel tests (tests/pallas_kernels/kda/test_api.py): forward and every
gradient against the fp32 recurrence with fla's tolerances on fla's shapes, at loss scales
2^-27 .. 2^20 with gates near / at the bound, packed documents against each document alone (an fp64
loop), causality of the anchors, fp64 check_grads, odd sizes. Not collected itself (no test_ prefix).
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from k3jax.ops.kda import kda, kda_recurrent
from tests.kda_testing import (FLA_BF16_TOLERANCES, FLA_SHAPES, FP32_TOLERANCE, GRAD_NAMES, LOSS_SCALE_GATES,
                               LOSS_SCALES, RUN_BOUND, assert_rms_close, kda_loss_and_grads, loss_scale_gates,
                               make_kda_inputs, rms_ratio, fp32_tolerance)


def numpy_kda(q, k, v, g, beta, h0, segment_ids, scale):
    """Plain fp64 loop over tokens (decay, delta rule, output), one head at a time."""
    q, k, v, g, beta, h0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
    B, T, H, K = q.shape
    o = np.zeros(v.shape)
    S_all = h0.copy()
    for b in range(B):
        for h in range(H):
            S = S_all[b, h].copy()
            for t in range(T):
                if t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                    S = np.zeros_like(S)
                S = S * np.exp(g[b, t, h])[:, None]
                S = S + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - k[b, t, h] @ S)
                o[b, t, h] = (scale * q[b, t, h]) @ S
            S_all[b, h] = S
    return o, S_all


@functools.partial(jax.jit, compiler_options=RUN_BOUND)
def _oracle_loss_and_grads(inputs, do, dht):
    """One compile per shape, shared by both gate kinds."""
    return kda_loss_and_grads(
        lambda q, k, v, g, beta, h0: kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True),
        inputs, do, dht)


@functools.lru_cache(maxsize=None)
def _fla_case(shape, gate):
    """Inputs (bf16-representable), upstream grads and the fp32 oracle's (o, ht, grads); cached so the
    fp32 and bf16 tests of one shape share the oracle run."""
    B, T, H, K = shape
    key = jax.random.PRNGKey(zlib.crc32(repr((shape, gate)).encode()))
    x = make_kda_inputs(key, B, T, H, K, gate=gate, dtype=jnp.bfloat16)
    x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
    kd, kh = jax.random.split(jax.random.fold_in(key, 1))
    do = jax.random.normal(kd, (B, T, H, K))
    dht = jax.random.normal(kh, (B, H, K, K))

    return x, x32, do, dht, jax.device_get(_oracle_loss_and_grads(x32, do, dht))


_SLOW_T = 1000
# (shape, gate, dtype) of test_matches_recurrent_on_fla_shapes: every gate and dtype at fla's shapes with
# T < 1000; at the five longer ones (each ~25 s of CPU time a case), each shape at least once, each (gate,
# dtype) pair at least once; the longest shape in both gates at bf16, the training dtype. Of the long
# cases, CI (`make test`) runs one per gate (True below); the others are in the `full` tier.
_LONG_FLA_CASES = {(2, 1000, 3, 64): [("softplus", "float32", True)],
                   (3, 1024, 4, 100): [("bounded", "float32", False)],
                   (4, 1024, 4, 128): [("softplus", "bfloat16", False)],
                   (2, 1500, 4, 128): [("bounded", "bfloat16", True)],
                   (4, 2048, 8, 64): [("bounded", "bfloat16", False), ("softplus", "bfloat16", False)]}
assert set(_LONG_FLA_CASES) == {s for s in FLA_SHAPES if s[1] >= _SLOW_T}
FLA_CASES = [pytest.param(s, gate, dtype, id="x".join(map(str, s)) + f"-{gate}-{dtype}",
                          marks=[] if in_ci else [pytest.mark.full])
             for s in FLA_SHAPES
             for gate, dtype, in_ci in _LONG_FLA_CASES.get(s, [(g, d, True) for g in ("bounded", "softplus")
                                                               for d in ("float32", "bfloat16")])]


class KDAImplementationTests:
    """Comparisons every KDA implementation must pass; subclass and set `implementation`.

    `run(q, k, v, g, beta, **kwargs)` calls the implementation under test with `kda`'s keywords.
    """

    implementation: str = ""
    chunk_size: int = 64
    head_dims = (20, 12)            # (K, V) of the tests that pick their own small shape
    input_dtype = jnp.float32       # their input dtype (bf16 for implementations that take only bf16)

    def _assert_doc_close(self, out, ref):
        """out against an fp64 reference: to fp32 rounding for fp32 inputs, fla's o tolerance (RMS
        ratio over the whole tensor) for bf16."""
        if jnp.dtype(self.input_dtype) == jnp.dtype(jnp.float32):
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
        else:
            assert_rms_close("document", ref, out, FLA_BF16_TOLERANCES["o"])

    def run(self, q, k, v, g, beta, **kwargs):
        kwargs.setdefault("chunk_size", self.chunk_size)
        return kda(q, k, v, g, beta, implementation=self.implementation, **kwargs)

    @staticmethod
    def _lower_bound(gate):
        return -5.0 if gate == "bounded" else None

    @pytest.mark.parametrize("shape, gate, dtype", FLA_CASES)
    def test_matches_recurrent_on_fla_shapes(self, shape, gate, dtype):
        x, x32, do, dht, (o_ref, ht_ref, g_ref) = _fla_case(shape, gate)
        inputs = x32 if dtype == "float32" else x
        lb = self._lower_bound(gate)

        @functools.partial(jax.jit, compiler_options=RUN_BOUND if shape[1] >= _SLOW_T else None)
        def under_test(inputs):
            return kda_loss_and_grads(
                lambda q, k, v, g, beta, h0: self.run(q, k, v, g, beta, initial_state=h0,
                                                      output_final_state=True, lower_bound=lb),
                inputs, do, dht)
        o, ht, grads = under_test(inputs)
        assert o.dtype == jnp.dtype(dtype) and ht.dtype == jnp.float32
        tol = fp32_tolerance if dtype == "float32" else FLA_BF16_TOLERANCES.get
        errs = {"o": assert_rms_close("o", o_ref, o, tol("o")), "ht": assert_rms_close("ht", ht_ref, ht, tol("ht"))}
        for name in GRAD_NAMES:
            errs[name] = assert_rms_close(name, g_ref[name], grads[name], tol(name))
        print(f"\nKDA_ERRORS {self.implementation} {shape} {gate} {dtype} "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))

    @pytest.mark.parametrize("gate", ["bounded", "softplus"])
    def test_segment_ids_equal_each_document_alone(self, gate):
        B, T, H = 2, 157, 2
        K, V = self.head_dims
        x = make_kda_inputs(jax.random.PRNGKey(5), B, T, H, K, V, gate=gate, dtype=self.input_dtype)
        bounds = [[0, 16, 17, 64, 100, 157], [0, 3, 130, 157]]          # tile/chunk edges and mid-tile
        seg = np.zeros((B, T), np.int32)
        for b, cuts in enumerate(bounds):
            for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
                seg[b, s:e] = i % 2                                      # ids repeat: a change is a restart
        o, ht = jax.jit(lambda x, seg: self.run(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
            segment_ids=seg, lower_bound=self._lower_bound(gate)))(x, jnp.asarray(seg))
        o_ref, ht_ref = np.zeros(o.shape), np.zeros(ht.shape)
        for b, cuts in enumerate(bounds):
            for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):        # each document alone, fp64 loop
                h0 = x["h0"][b:b + 1] if i == 0 else np.zeros((1, H, K, V))
                o_ref[b:b + 1, s:e], ht_ref[b:b + 1] = numpy_kda(
                    *(x[n][b:b + 1, s:e] for n in ("q", "k", "v", "g", "beta")), h0, np.zeros((1, e - s), np.int32),
                    K ** -0.5)
        self._assert_doc_close(o, o_ref)
        self._assert_doc_close(ht, ht_ref)

    @pytest.mark.parametrize("gate", ["bounded", "softplus"])
    def test_future_gates_do_not_change_past_outputs(self, gate):
        B, T, H, K = 1, 150, 2, self.head_dims[0]
        x = make_kda_inputs(jax.random.PRNGKey(6), B, T, H, K, gate=gate, dtype=self.input_dtype)
        lb = self._lower_bound(gate)
        fn = jax.jit(lambda g: self.run(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"],
                                        lower_bound=lb)[0])
        for t in (0, 40, 70, 127):                                        # tile start, mid-tile, chunk edge
            g2 = x["g"].at[:, t + 1:].set(jnp.minimum(x["g"][:, t + 1:] * 0.3 - 1.0, 0.0).clip(-5.0))
            o1, o2 = fn(x["g"]), fn(g2)
            np.testing.assert_array_equal(o1[:, :t + 1], o2[:, :t + 1])
            assert not np.array_equal(o1[:, t + 1:], o2[:, t + 1:])

    @pytest.mark.parametrize("gate", ["bounded", "softplus"])
    def test_check_grads_fp64(self, gate):
        with jax.enable_x64(True):
            x = make_kda_inputs(jax.random.PRNGKey(7), 1, 21, 2, 5, 3, gate=gate)
            x = {n: a.astype(jnp.float64) for n, a in x.items()}
            seg = jnp.asarray([[0] * 13 + [1] * 8], jnp.int32)
            lb = self._lower_bound(gate)

            def f(q, k, v, g, beta, h0):
                o, ht = self.run(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg,
                                 use_qk_l2norm=True, lower_bound=lb)
                return o, ht
            f = jax.jit(f)
            o, _ = f(*x.values())
            assert o.dtype == jnp.float64
            check_grads(f, tuple(x.values()), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)

    # (B, T, H, K = V) of the loss-scale tests: two chunks of 64, two heads.
    loss_scale_shape = (1, 128, 2, 32)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_gradients_at_every_loss_scale(self, dtype):
        """grad(c L) / c against the fp32 recurrence within fla's tolerances for every c in LOSS_SCALES
        and gates near / at lower_bound = -5, and equal across c up to fp32 rounding. L = c (sum(o w)
        + sum(ht w_h)) with fixed order-1 cotangents w, w_h; c is traced (one compile)."""
        self.check_every_loss_scale(dtype)

    def check_every_loss_scale(self, dtype, segment_ids=None, gate_cases=LOSS_SCALE_GATES):
        """test_gradients_at_every_loss_scale's body, also with packed documents (segment_ids
        [B, T] for the loss_scale_shape, the same ids for the recurrence) and a subset of the gate
        cases."""
        B, T, H, K = self.loss_scale_shape
        x = make_kda_inputs(jax.random.PRNGKey(31), B, T, H, K, dtype=jnp.dtype(dtype))
        kd, kh, kg = jax.random.split(jax.random.PRNGKey(32), 3)
        do = jax.random.normal(kd, (B, T, H, K))
        dht = jax.random.normal(kh, (B, H, K, K))

        def scaled(fn):
            def grads(inputs, c):
                _, _, gr = kda_loss_and_grads(fn, inputs, c * do, c * dht)
                return {n: gr[n].astype(jnp.float32) / c for n in GRAD_NAMES}
            return jax.jit(grads)

        docs = {} if segment_ids is None else dict(segment_ids=segment_ids)
        under_test = scaled(lambda q, k, v, g, beta, h0: self.run(q, k, v, g, beta, initial_state=h0,
                                                                   output_final_state=True, lower_bound=-5.0, **docs))
        oracle = scaled(lambda q, k, v, g, beta, h0: kda_recurrent(q, k, v, g, beta, initial_state=h0,
                                                                    output_final_state=True, **docs))
        tol = fp32_tolerance if dtype == "float32" else FLA_BF16_TOLERANCES.get
        for case in gate_cases:
            x["g"] = loss_scale_gates(kg, (B, T, H, K), case)
            ref = oracle({n: a.astype(jnp.float32) for n, a in x.items()}, 1.0)
            got = {c: under_test(x, c) for c in LOSS_SCALES}
            for c in LOSS_SCALES:
                for name in GRAD_NAMES:
                    assert_rms_close(f"{case} c={c:.1e} {name}", ref[name], got[c][name], tol(name))
                    # scale invariance, directly
                    assert rms_ratio(got[1.0][name], got[c][name]) <= 1e-6, (case, c, name)
                if case == "one_fast_channel":   # the fast channel's own gate gradient
                    assert_rms_close(f"{case} c={c:.1e} dg[..., 0]", ref["dg"][..., 0], got[c]["dg"][..., 0],
                                     tol("dg"))

    @pytest.mark.parametrize("operand", ["q", "k"])
    def test_small_inputs_at_the_bound(self, operand):
        """Forward and gradients with q or k scaled by 2^-20 and every gate at lower_bound = -5: the
        bounded diagonal tile multiplies them by e^-80 (a 16-token tile spans 80 nats)."""
        B, T, H, K = self.loss_scale_shape
        x = make_kda_inputs(jax.random.PRNGKey(33), B, T, H, K, dtype=jnp.bfloat16)
        x["g"] = jnp.full((B, T, H, K), -5.0)
        x[operand] = (x[operand].astype(jnp.float32) * 2.0 ** -20).astype(jnp.bfloat16)
        x32 = {n: a.astype(jnp.float32) for n, a in x.items()}
        kd, kh = jax.random.split(jax.random.PRNGKey(34))
        do = jax.random.normal(kd, (B, T, H, K))
        dht = jax.random.normal(kh, (B, H, K, K))
        o, ht, grads = jax.jit(lambda x: kda_loss_and_grads(
            lambda q, k, v, g, beta, h0: self.run(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  lower_bound=-5.0), x, do, dht))(x)
        o_ref, ht_ref, g_ref = jax.jit(lambda x: kda_loss_and_grads(
            lambda q, k, v, g, beta, h0: kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True),
            x, do, dht))(x32)
        tol = FLA_BF16_TOLERANCES
        # With k tiny the state is h0 decayed to nothing and o too: compare o only against its own size.
        assert_rms_close("o", o_ref, o, tol["o"])
        assert_rms_close("ht", ht_ref, ht, tol["ht"])
        for name in GRAD_NAMES:
            assert_rms_close(name, g_ref[name], grads[name], tol[name])

    def test_odd_sizes_and_options(self):
        B, T, H, K, V = 2, 45, 3, 12, 7
        x = make_kda_inputs(jax.random.PRNGKey(8), B, T, H, K, V)
        args = [x[n] for n in ("q", "k", "v", "g", "beta")]
        kw = dict(scale=0.37, use_qk_l2norm=True, output_final_state=True)
        o_ref, ht_ref = jax.jit(lambda a: kda_recurrent(*a, **kw))(args)
        for lb, cs in ((-5.0, 16), (None, 32)):                           # both diagonal paths, other chunks
            o, ht = jax.jit(lambda a: self.run(*a, lower_bound=lb, chunk_size=cs, **kw))(args)
            assert rms_ratio(o_ref, o) < FP32_TOLERANCE and rms_ratio(ht_ref, ht) < FP32_TOLERANCE
        o_none, ht_none = self.run(*args)
        assert ht_none is None and o_none.shape == (B, T, H, V)
