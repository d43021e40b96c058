"""The Pallas chunk-cumsum kernel (pallas_kernels.kda.cumsum, ops.KernelOptions.pallas_cumsum).

The kernel against XLA's chunk cumsum (common.chunk_cumsum) in both directions, the option through the
op (o, ht and every gradient vs the same options without it, bounded with segment_ids and unbounded),
its Triton lowering for a faked H200, and bad input. Interpret mode on CPU; the `gpu` class compiles it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import common, cumsum, ops
from tests.kda_testing import GRAD_NAMES, assert_rms_close
from tests.test_kda_pallas import lowered_grad_text, option_ab_inputs, pallas_outputs

C = 64


def _inputs(shape, seed):
    # Log-decays (g <= 0, as the forward sees) and signed gradients (as the backward's dG).
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(k1, shape))
    dG = 3.0 * jax.random.normal(k2, shape)
    return g, dG


class TestPallasCumsum:
    interpret = True
    shape = (2, 256, 3, 32)

    @pytest.mark.parametrize("reverse", [False, True])
    def test_matches_xla(self, reverse):
        # Measured (interpret, this shape): forward bit-equal to XLA's; reverse (total - prefix + x)
        # 3.1e-5 absolute where the sums reach 184 (1.7e-7 relative: fp32 rounding of the prefix).
        for x in _inputs(self.shape, 0):
            ref = common.chunk_cumsum(x, C, reverse=reverse)
            out = jax.jit(lambda x: cumsum.chunk_cumsum(x, C, reverse=reverse, interpret=self.interpret))(x)
            assert out.dtype == jnp.float32 and out.shape == x.shape
            scale = float(jnp.max(jnp.abs(ref)))
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=2e-6 * max(scale, 1.0))
        # the sums are chunk-local: the first row of every chunk is x itself (forward), the last
        # row (reverse)
        x = _inputs(self.shape, 1)[1]
        out = cumsum.chunk_cumsum(x, C, reverse=reverse, interpret=self.interpret)
        row = C - 1 if reverse else 0
        np.testing.assert_array_equal(np.asarray(out[:, row::C]), np.asarray(x[:, row::C]))

    def test_bf16_input(self):
        x = _inputs(self.shape, 2)[0].astype(jnp.bfloat16)
        out = cumsum.chunk_cumsum(x, C, interpret=self.interpret)
        ref = common.chunk_cumsum(x.astype(jnp.float32), C)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-4)

    def test_bad_input_raises(self):
        with pytest.raises(ValueError, match="chunk_size"):
            cumsum.chunk_cumsum(jnp.zeros((1, 100, 2, 8)), C, interpret=True)
        with pytest.raises(ValueError, match="B, T, H, K"):
            cumsum.chunk_cumsum(jnp.zeros((128, 2, 8)), C, interpret=True)


class TestPallasCumsumOption:
    @pytest.mark.parametrize("dtype, segments, lower_bound", [("bfloat16", True, -5.0),
                                                              ("float32", False, None)])
    def test_op_matches_xla_cumsum(self, dtype, segments, lower_bound):
        # o, ht and every gradient with pallas_cumsum (the default) vs the XLA cumsum (the default
        # options, UNBOUNDED_OPTIONS for lower_bound=None, with pallas_cumsum=False); T = 250 (padded
        # to 256), segment_ids with bf16 (mild gates), softplus gates with fp32.
        # The forward cumsum is bit-equal to XLA's here, so o and ht are; dg differs by the reverse
        # cumsum's rounding only (measured 1.7e-5 with the mild gates: the suffix sums of dG are
        # small next to the chunk total they are formed from; the other gradients <= 1e-5).
        x, seg, do, dht = option_ab_inputs(50, dtype, segments=segments, lower_bound=lower_bound, V=64)
        base = dataclasses.replace(ops.KernelOptions() if lower_bound is not None else ops.UNBOUNDED_OPTIONS,
                                   pallas_cumsum=False)
        kw = dict(lower_bound=lower_bound, segment_ids=seg)
        o0, ht0, g0 = pallas_outputs(x, do, dht, base, **kw)
        o, ht, grads = pallas_outputs(x, do, dht, dataclasses.replace(base, pallas_cumsum=True), **kw)
        assert_rms_close("pallas_cumsum o", o0, o, 1e-6)
        assert_rms_close("pallas_cumsum ht", ht0, ht, 1e-6)
        for name in GRAD_NAMES:
            assert_rms_close(f"pallas_cumsum {name}", g0[name], grads[name], 1e-4 if name == "dg" else 1e-5)

    def test_unbounded_accepts_it(self):
        assert ops.KernelOptions().pallas_cumsum and ops.UNBOUNDED_OPTIONS == ops.KernelOptions()
        for pc in (False, True):
            opts = dataclasses.replace(ops.UNBOUNDED_OPTIONS, pallas_cumsum=pc)
            assert opts in ops.UNBOUNDED_OPTION_SETS
            assert dataclasses.replace(opts, tile_state_bwd=True) in ops.UNBOUNDED_OPTION_SETS

    def test_lowers_for_cuda(self):
        # One more Triton call in the forward (the cumsum) and one more in the backward (the reverse
        # cumsum) than with the XLA cumsum.
        def count(options):
            text = lowered_grad_text(options, T=1024)
            return text.count("__gpu$xla.gpu.triton"), text.count("kda_chunk_cumsum")
        n0, c0 = count(dataclasses.replace(ops.KernelOptions(), pallas_cumsum=False))
        n1, c1 = count(ops.KernelOptions())
        assert (n1, c0) == (n0 + 2, 0) and c1 >= 2


@pytest.mark.gpu
class TestPallasCumsumGPU(TestPallasCumsum):
    interpret = False
    shape = (8, 4096, 4, 128)
