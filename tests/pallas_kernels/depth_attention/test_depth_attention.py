"""Pallas depth-attention kernels (pallas_kernels.depth_attention) against the XLA depth mix.

The reference is the XLA op (`k3jax.ops.residuals` "xla", itself tested against a float64 loop in
test_residuals.py) on the inputs upcast to fp32, forward and every gradient (the sources, the
pseudo-query, the key-norm scale, and the cotangent of the returned weights), with fla's metric
RMS(ref − out)/RMS(ref): bf16 inputs out 0.005, gradients 0.008 or 1.5× XLA's own bf16 error if larger;
fp32 inputs 2e-5. Both call forms: a sequence of sources (unrolled stacks) and a
buffer with a static or traced num_valid, also threaded through a `lax.scan` with pass_through as the
scanned model does. Loss scales 2^-24, 2^-12, 2^16 (bf16, sequence form), saturated softmax, all-zero sources, token counts that
are not a multiple of the tile, hidden sizes that are not a power of two.
`TestInterpret` runs the kernel bodies in interpret mode on CPU (CI: all but its `full_tier`); `TestGPU`
(marker gpu) compiled on the H200 at the model's sizes (D 768 and 2048). `TestLowering`: CUDA lowering on a CPU host.
"""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import residuals as R
from pallas_kernels.depth_attention import Tuning, depth_attention_pallas, supported
from tests.kda_testing import assert_rms_close, rms_ratio
from tests.pallas_kernels.kda.test_api import fake_h200

TOL = {jnp.bfloat16: {"out": 0.005, "grad": 0.008}, jnp.float32: {"out": 2e-5, "grad": 2e-5}}


def _inputs(seed, num, shape, dtype, query_scale=0.5):
    """num sources [*shape] of growing scale, a pseudo-query w and a key-norm scale γ near 1."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    srcs = [jnp.asarray(rng.standard_normal(shape) * (1 + s), dtype) for s in range(num)]
    w = jnp.asarray(rng.standard_normal(d) * query_scale / np.sqrt(d) * 4, jnp.float32)
    gamma = jnp.asarray(1 + 0.2 * rng.standard_normal(d), jnp.float32)
    return srcs, w, gamma


def _loss(mix, ct, ct_w, scale):
    """A loss of both outputs with cotangents of order `scale` (the realistic 1/tokens regime and up)."""
    def loss(*args):
        out, weights = mix(*args)
        return scale * (jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(weights * ct_w))
    return loss


class DepthAttentionTests:
    """Shared comparisons; subclasses set `interpret` and the sizes."""

    interpret = True
    shapes = [(2, 37, 48), (1, 5, 64)]
    dtypes = [jnp.float32, jnp.bfloat16]
    buffer_dtypes = dtypes

    def _pallas(self, sources, w, gamma, **kw):
        return R.depth_attention(sources, w, gamma, return_weights=True, implementation="pallas",
                                 interpret=self.interpret, **kw)

    @staticmethod
    def _xla(sources, w, gamma, **kw):
        return R.depth_attention(sources, w, gamma, return_weights=True, implementation="xla", **kw)

    def _check(self, loss_p, loss_x, args, dtype, argnums):
        """Gradients of `loss_p` (Pallas) against the fp32 truth: `loss_x` (XLA) on the inputs upcast to
        fp32. bf16: within fla's tolerance or no worse than 1.5x XLA's own bf16 error (bf16 roundings
        compound through a scanned stack). The scalar losses are not compared (cancellation in the sum)."""
        tol = TOL[dtype]
        up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, t)  # noqa: E731
        grad = lambda f, a: jax.jit(jax.grad(f, argnums=argnums))(*a)  # noqa: E731
        gp, gx, ref = grad(loss_p, args), grad(loss_x, args), grad(loss_x, up(args))
        for i, (a, b, r) in enumerate(zip(jax.tree.leaves(gp), jax.tree.leaves(gx), jax.tree.leaves(ref), strict=True)):
            assert a.dtype == b.dtype, (i, a.dtype, b.dtype)
            xla_err = rms_ratio(r, b)
            assert_rms_close(f"grad leaf {i} (XLA's own error {xla_err:.3g})", r, a, max(tol["grad"], 1.5 * xla_err))

    @pytest.mark.parametrize("num", [1, 5])
    def test_sequence_forward_and_grads(self, num):
        for shape in self.shapes:
            for dtype in self.dtypes:
                srcs, w, gamma = _inputs(num, num, shape, dtype)
                out_p, wp = jax.jit(self._pallas)(srcs, w, gamma)
                out_x, wx = jax.jit(self._xla)([s.astype(jnp.float32) for s in srcs], w, gamma)
                assert out_p.dtype == dtype and out_p.shape == shape and wp.shape == (num, *shape[:-1])
                assert_rms_close("out", out_x, out_p, TOL[dtype]["out"])
                assert_rms_close("weights", wx, wp, TOL[jnp.float32]["out"])
                rng = np.random.default_rng(7)
                ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
                ct_w = jnp.asarray(rng.standard_normal((num, *shape[:-1])), jnp.float32)
                self._check(_loss(self._pallas, ct, ct_w, 1.0), _loss(self._xla, ct, ct_w, 1.0),
                            (srcs, w, gamma), dtype, (0, 1, 2))

    @pytest.mark.parametrize("scale", [2.0 ** -24, 2.0 ** -12, 2.0 ** 16])
    def test_loss_scales(self, scale):
        shape, dtype = self.shapes[0], jnp.bfloat16
        srcs, w, gamma = _inputs(3, 4, shape, dtype)
        rng = np.random.default_rng(3)
        ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        ct_w = jnp.zeros((4, *shape[:-1]), jnp.float32)
        self._check(_loss(self._pallas, ct, ct_w, scale), _loss(self._xla, ct, ct_w, scale), (srcs, w, gamma),
                    dtype, (0, 1, 2))

    @pytest.mark.parametrize("num_valid", [1, 3, 5])
    def test_buffer_static_and_traced_num_valid(self, num_valid):
        """fp32 (the strict tolerance) in interpret mode; bf16 buffers with a static num_valid on the GPU only
        (TestGPU), with a traced one also in test_scan_with_pass_through."""
        shape = self.shapes[0]
        for dtype in self.buffer_dtypes:
            srcs, w, gamma = _inputs(11, 5, shape, dtype)
            buf = jnp.stack(srcs)
            rng = np.random.default_rng(5)
            ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
            ct_w = jnp.asarray(rng.standard_normal((5, *shape[:-1])), jnp.float32)
            for n in (num_valid, jnp.int32(num_valid)):
                def loss_p(b, w, g, n=n):
                    return _loss(lambda *a: self._pallas(*a, num_valid=n), ct, ct_w, 1.0)(b, w, g)

                def loss_x(b, w, g, n=n):
                    return _loss(lambda *a: self._xla(*a, num_valid=n), ct, ct_w, 1.0)(b, w, g)
                self._check(loss_p, loss_x, (buf, w, gamma), dtype, (0, 1, 2))
            _, weights = jax.jit(lambda b: self._pallas(b, w, gamma, num_valid=jnp.int32(num_valid)))(buf)
            assert np.all(np.asarray(weights[num_valid:]) == 0.0)
            np.testing.assert_allclose(np.asarray(weights.sum(0)), 1.0, rtol=1e-5)

    def test_scan_with_pass_through_matches_xla(self):
        """A scanned stack as the model's: each step mixes the first num_valid slots of a carried buffer
        (threaded through depth_attention_carry) and adds a function of the mix to one slot."""
        shape, dtype = self.shapes[0], jnp.bfloat16
        srcs, _, _ = _inputs(21, 4, shape, dtype)
        buf = jnp.stack([srcs[0]] + [jnp.zeros_like(srcs[0])] * 3)
        rng = np.random.default_rng(9)
        d = shape[-1]
        steps = 6
        params = {"w": jnp.asarray(rng.standard_normal((steps, d)) * 0.3, jnp.float32),
                  "g": jnp.asarray(1 + 0.1 * rng.standard_normal((steps, d)), jnp.float32),
                  "W": jnp.asarray(rng.standard_normal((steps, d, d)) / np.sqrt(d), jnp.float32)}
        slots = {"slot": jnp.asarray([1, 1, 2, 2, 3, 3], jnp.int32), "n": jnp.asarray([1, 2, 2, 3, 3, 4], jnp.int32)}

        def run(implementation):
            def f(buf, params):
                xs = {**params, **slots}

                def body(carry, x):
                    h, _, carry = R.depth_attention_carry(carry, x["w"], x["g"], num_valid=x["n"],
                                                          implementation=implementation, interpret=self.interpret)
                    out = jnp.tanh(jnp.dot(h.astype(jnp.float32), x["W"], precision="highest")).astype(carry.dtype)
                    updated = jax.lax.dynamic_index_in_dim(carry, x["slot"], 0, keepdims=False) + out
                    return jax.lax.dynamic_update_index_in_dim(carry, updated, x["slot"], 0), None
                carry, _ = jax.lax.scan(body, buf, xs)
                return jnp.sum(R.depth_attention(carry, xs["w"][0], xs["g"][0], implementation=implementation,
                                                 interpret=self.interpret).astype(jnp.float32) ** 2) * 1e-3
            return f
        self._check(run("pallas"), run("xla"), (buf, params), dtype, (0, 1))

    def test_saturated_softmax_and_zero_source(self):
        """Logits of order 50 (weights down to e^-100) and an all-zero source; fp32, where the two
        implementations' roundings of the logits (~1e-5 relative here) set the tolerance."""
        shape, dtype = self.shapes[0], jnp.float32
        srcs, w, gamma = _inputs(31, 3, shape, dtype, query_scale=12.0)
        srcs[1] = jnp.zeros_like(srcs[1])                                  # RMS 0: logit 0, r = eps^-1/2
        rng = np.random.default_rng(4)
        ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        ct_w = jnp.asarray(rng.standard_normal((3, *shape[:-1])), jnp.float32)
        _, weights = jax.jit(self._pallas)(srcs, w, gamma)
        assert float(jnp.mean(jnp.max(weights, axis=0))) > 0.95
        with mock.patch.dict(TOL, {jnp.float32: {"out": 1e-4, "grad": 1e-4}}):
            self._check(_loss(self._pallas, ct, ct_w, 1.0), _loss(self._xla, ct, ct_w, 1.0), (srcs, w, gamma),
                        dtype, (0, 1, 2))


class TestInterpret(DepthAttentionTests):
    interpret = True
    buffer_dtypes = [jnp.float32]
    # Left to `make test-full`: one source (its weight is 1, its w and gamma gradients 0), one or all five
    # valid slots (3 both mixes and masks), the middle loss scale, one valid slot of a full 32-slot buffer.
    full_tier = ("test_sequence_forward_and_grads[1]", "test_buffer_static_and_traced_num_valid[1]",
                 "test_buffer_static_and_traced_num_valid[5]", "test_loss_scales[0.000244140625]",
                 "test_buffer_of_max_slots[1]")

    def test_tile_edges(self):
        """Token tiles of 4 at D = 16 (64-element tiles), two backward programs: 1 token (a tile of 1),
        3 (tile − 1), 5 (tile + 1: two programs of one tile), 9 (three tiles: one program loops over two,
        the other over one real tile and one past the end); and D = 3 (padded to 4) with 9 tokens."""
        tuning = Tuning(fwd_elems=64, bwd_elems=64, bwd_programs=2)
        for tokens, d in ((1, 16), (3, 16), (5, 16), (9, 16), (9, 3)):
            srcs, w, gamma = _inputs(tokens, 3, (tokens, d), jnp.float32)
            q = w * gamma

            def loss_p(srcs, q):
                out, weights = depth_attention_pallas(tuple(srcs), q, tuning=tuning, interpret=True)
                return jnp.sum(out * (1 + jnp.arange(d))) + jnp.sum(weights[0])

            def loss_x(srcs, q):
                out, weights = R.depth_attention(srcs, q, jnp.ones_like(q), return_weights=True, implementation="xla")
                return jnp.sum(out * (1 + jnp.arange(d))) + jnp.sum(weights[0])
            self._check(loss_p, loss_x, (srcs, q), jnp.float32, (0, 1))

    @pytest.mark.parametrize("num_valid", [1, 17, 32])
    def test_buffer_of_max_slots(self, num_valid):
        """A [MAX_SLOTS, ...] buffer with a traced num_valid, the scanned model's call: the unrolled slot loop
        at its largest. Interpret mode only: the compiled kernels at this size have not run on a GPU."""
        from pallas_kernels.depth_attention.api import MAX_SLOTS
        shape, dtype = self.shapes[-1], jnp.float32
        srcs, w, gamma = _inputs(13, MAX_SLOTS, shape, dtype, query_scale=0.05)
        buf = jnp.stack(srcs)
        rng = np.random.default_rng(6)
        ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        ct_w = jnp.asarray(rng.standard_normal((MAX_SLOTS, *shape[:-1])), jnp.float32)
        n = jnp.int32(num_valid)
        out, weights = jax.jit(lambda b: self._pallas(b, w, gamma, num_valid=n))(buf)
        ref_out, ref_weights = self._xla(buf, w, gamma, num_valid=n)
        assert_rms_close("out", ref_out, out, TOL[dtype]["out"])
        assert_rms_close("weights", ref_weights, weights, TOL[dtype]["out"])
        assert np.all(np.asarray(weights[num_valid:]) == 0.0)
        loss_p = _loss(lambda *a: self._pallas(*a, num_valid=n), ct, ct_w, 1.0)
        loss_x = _loss(lambda *a: self._xla(*a, num_valid=n), ct, ct_w, 1.0)
        self._check(loss_p, loss_x, (buf, w, gamma), dtype, (0, 1, 2))

    def test_bad_calls_raise(self):
        srcs, w, gamma = _inputs(0, 2, (2, 3, 8), jnp.float32)
        with pytest.raises(ValueError, match="query must be"):
            depth_attention_pallas(tuple(srcs), w[:4], interpret=True)
        with pytest.raises(ValueError, match="num_valid must be in"):
            depth_attention_pallas(jnp.stack(srcs), w, num_valid=3, interpret=True)
        with pytest.raises(ValueError, match="buffer"):
            depth_attention_pallas(tuple(srcs), w, pass_through=True, interpret=True)
        with pytest.raises(ValueError, match="one shape and dtype"):
            depth_attention_pallas((srcs[0], srcs[1][:, :2]), w, interpret=True)
        with pytest.raises(ValueError, match="dtype"):
            depth_attention_pallas(tuple(s.astype(jnp.int32) for s in srcs), w, interpret=True)
        with pytest.raises(ValueError, match="implementation='pallas' with interpret=False"):
            R.depth_attention(srcs, w, gamma, implementation="pallas")
        with pytest.raises(ValueError, match="implementation must be"):
            R.depth_attention(srcs, w, gamma, implementation="triton")
        with pytest.raises(ValueError, match="sequence"):
            R.depth_attention_carry(srcs, w, gamma)
        assert supported(33, 8, jnp.float32)[0] is False
        assert supported(32, 8, jnp.float32) == (True, "")
        assert supported(4, 9000, jnp.bfloat16)[0] is False
        assert supported(4, 768, jnp.bfloat16) == (True, "")

    def test_default_is_xla_off_gpu(self):
        srcs, w, gamma = _inputs(0, 2, (2, 3, 8), jnp.float32)
        text = str(jax.make_jaxpr(lambda s: R.depth_attention(s, w, gamma))(srcs))
        assert "pallas_call" not in text
        text = str(jax.make_jaxpr(lambda s: R.depth_attention(s, w, gamma, implementation="pallas",
                                                              interpret=True))(srcs))
        assert "pallas_call" in text


@pytest.mark.gpu
class TestGPU(DepthAttentionTests):
    interpret = False
    shapes = [(4, 2048, 768), (2, 1000, 2048)]


class TestLowering:
    """Both call forms lower for CUDA on a CPU host; the carried buffer's backward aliases it."""

    @pytest.mark.parametrize("d", [768, 2048])
    def test_lowers(self, d):
        buf = jax.ShapeDtypeStruct((5, 2, 256, d), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((d,), jnp.float32)

        def carried(buf, q, n):
            out, _, b = depth_attention_pallas(buf, q, num_valid=n, pass_through=True)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(b.astype(jnp.float32))

        def listed(buf, q):
            out, _ = depth_attention_pallas((buf[0], buf[1], buf[2]), q)
            return jnp.sum(out.astype(jnp.float32))
        with fake_h200(True):
            texts = [jax.jit(jax.grad(carried, argnums=(0, 1))).trace(buf, q, jax.ShapeDtypeStruct((), jnp.int32))
                     .lower(lowering_platforms=("cuda",)).as_text(),
                     jax.jit(jax.grad(listed, argnums=(0, 1))).trace(buf, q).lower(lowering_platforms=("cuda",)).as_text()]
        for text in texts:
            assert text.count("depth_attention_fwd") >= 1 and text.count("depth_attention_bwd") >= 1
        assert "output_operand_alias" in texts[0]

    @pytest.mark.parametrize("form", ["sequence", "buffer"])
    def test_mixes_with_equal_source_counts_share_one_lowering(self, form):
        # Two mixes of three sources each (two sublayers of one block), differentiated: each kernel is
        # lowered once (one jit per source count; the unrolled 32-layer model lowered 130 Triton kernels
        # before, 18 after: experiments/results/lowering_cpu.md).
        src = jax.ShapeDtypeStruct((3, 2, 256, 768), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((768,), jnp.float32)

        def mix(buf, q):
            return depth_attention_pallas((buf[0], buf[1], buf[2]) if form == "sequence" else buf, q)[0]

        def twice(buf, q):
            return mix(jnp.stack([mix(buf, q), buf[1], buf[2]]), q)

        def loss(f):  # the value too, so that neither mix is dead code
            return jax.value_and_grad(lambda buf, q: jnp.sum(f(buf, q).astype(jnp.float32)), argnums=(0, 1))
        with fake_h200(True):
            one, two = (jax.jit(loss(f)).trace(src, q).lower(lowering_platforms=("cuda",)).as_text()
                        for f in (mix, twice))
        calls = [t.count("__gpu$xla.gpu.triton") for t in (one, two)]
        assert calls[0] == calls[1] >= 2, calls
