"""The Hopper (Mosaic GPU) forward state pass, pallas_kernels.kda.hopper.state_fwd.

Held to the Triton kernel it would replace (fwd.state_fwd_vp with bf16 operands, the default op's
rounding) in Mosaic GPU interpret mode on CPU, lowered for CUDA on CPU, bad input refused; the `gpu`
class runs it compiled on the H200 against the compiled Triton kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import common, fwd, hopper
from tests.kda_testing import assert_rms_close


def _inputs(B, H, T, K, V, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    kd = (0.2 * jax.random.normal(ks[0], (B, H, T, K))).astype(jnp.bfloat16)
    w = (0.2 * jax.random.normal(ks[1], (B, H, T, K))).astype(jnp.bfloat16)
    u = jax.random.normal(ks[2], (B, H, T, V))
    gl = jnp.exp(-jax.random.uniform(ks[3], (B, H, T // 64, K)))         # e^{G_last} in (e^-1, 1]
    h0 = jax.random.normal(ks[4], (B, H, K, V))
    return kd, w, u, gl, h0


def _triton(kd, w, u, gl, h0, interpret):
    """fwd.state_fwd_vp with bf16 operands (the default op's state pass), in hopper's layouts."""
    vp, h, ht = fwd.state_fwd_vp(kd, w.astype(jnp.float32), u, gl, jnp.swapaxes(h0, -1, -2), chunk_size=64,
                                 block_v=64, interpret=interpret, precision=common.BF16_OPERANDS,
                                 state_dtype=jnp.bfloat16, vp_dtype=jnp.float32)
    return vp, jnp.swapaxes(h, -1, -2), jnp.swapaxes(ht, -1, -2)


class TestHopperStateFwd:
    interpret = True
    cases = [(1, 2, 192, 128, 128), (2, 1, 128, 64, 64)]

    @pytest.mark.parametrize("B, H, T, K, V", cases)
    def test_matches_triton_state_pass(self, B, H, T, K, V):
        # Same math and operand rounding; only the fp32 accumulation order of the dots differs (chunk
        # 0's V' agrees to 2e-6 max abs), which flips a few bf16 roundings of S (4 entries of h at
        # chunk 1, 18 at chunk 2, one ulp each) and those carry on. Measured (interpret, RMS ratios):
        # first case vp 7.1e-5, h 6.3e-5, ht 2.4e-4; second case vp 4e-8, h 0, ht 1.2e-6.
        args = _inputs(B, H, T, K, V)
        out = jax.jit(lambda *a: hopper.state_fwd(*a, interpret=self.interpret))(*args)
        ref = jax.jit(lambda *a: _triton(*a, interpret=self.interpret))(*args)
        for name, o, r in zip(("vp", "h", "ht"), out, ref):
            assert o.shape == r.shape and o.dtype == r.dtype, name
            assert_rms_close(f"hopper {name}", r, o, 1e-3)

    def test_state_carries_across_chunks(self):
        # h of chunk c is the state entering it: chunk 0's is h0 (rounded to bf16), and zeroing the
        # updates (kd = 0) leaves S decaying by e^{G_last} only.
        kd, w, u, gl, h0 = _inputs(1, 1, 192, 64, 64, seed=3)
        vp, h, ht = hopper.state_fwd(jnp.zeros_like(kd), w, u, gl, h0, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(h[0, 0, 0]), np.asarray(h0[0, 0].astype(jnp.bfloat16)))
        decayed = h0[0, 0] * gl[0, 0, 0][:, None] * gl[0, 0, 1][:, None] * gl[0, 0, 2][:, None]
        np.testing.assert_allclose(np.asarray(ht[0, 0]), np.asarray(decayed), rtol=1e-5, atol=1e-6)


class TestHopperStateFwdCPU:
    def test_bad_input_raises(self):
        kd, w, u, gl, h0 = _inputs(1, 1, 128, 64, 64)
        with pytest.raises(ValueError, match="T = 100"):
            hopper.state_fwd(kd[:, :, :100], w[:, :, :100], u[:, :, :100], gl, h0, interpret=True)
        with pytest.raises(ValueError, match="bf16"):
            hopper.state_fwd(kd.astype(jnp.float32), w, u, gl, h0, interpret=True)
        with pytest.raises(ValueError, match="K = 32"):
            hopper.state_fwd(kd[..., :32], w[..., :32], u, gl[..., :32], h0[:, :, :32], interpret=True)
        with pytest.raises(ValueError, match="V = 32"):
            hopper.state_fwd(kd, w, u[..., :32], gl, h0[..., :32], interpret=True)

    def test_lowers_for_cuda(self):
        # The benchmark's shape lowers to one Mosaic GPU custom call on a CPU host (the compile to
        # SASS needs the GPU).
        sd = jax.ShapeDtypeStruct
        B, H, T, K = 8, 16, 4096, 128
        args = (sd((B, H, T, K), jnp.bfloat16), sd((B, H, T, K), jnp.bfloat16), sd((B, H, T, K), jnp.float32),
                sd((B, H, T // 64, K), jnp.float32), sd((B, H, K, K), jnp.float32))
        text = jax.jit(hopper.state_fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
class TestHopperStateFwdGPU(TestHopperStateFwd):
    interpret = False
    cases = [(2, 4, 1024, 128, 128), (8, 16, 4096, 128, 128)]
