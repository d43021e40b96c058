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

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import common, fwd, hopper
from tests.kda_testing import assert_rms_close


def _inputs(B, H, T, K, V, seed=0, scale=0.08):
    # kd, w at 0.08 N(0, 1): the per-chunk map Diag(gl) - Kd^T W keeps S of order 10 over 64 chunks
    # (at 0.2 it grows ~4.7x per chunk and nears the fp32 range by T = 4096).
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    kd = (scale * jax.random.normal(ks[0], (B, H, T, K))).astype(jnp.bfloat16)
    w = (scale * jax.random.normal(ks[1], (B, H, T, K))).astype(jnp.bfloat16)
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


def _check_matches_triton(shape, interpret, tol):
    """hopper.state_fwd vs fwd.state_fwd_vp (bf16 operands) on the same inputs: RMS ratios <= tol."""
    args = _inputs(*shape)
    out = jax.jit(lambda *a: hopper.state_fwd(*a, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: _triton(*a, interpret=interpret))(*args)
    for name, o, r in zip(("vp", "h", "ht"), out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        assert_rms_close(f"hopper {name} {shape}", r, o, tol)


class TestHopperStateFwd:
    """Mosaic GPU interpret mode on CPU."""

    @pytest.mark.parametrize("B, H, T, K, V, tol", [(1, 2, 192, 128, 128, 1e-3), (2, 1, 128, 64, 64, 1e-6)])
    def test_matches_triton_state_pass(self, B, H, T, K, V, tol):
        # Same math and operand rounding; only the fp32 accumulation order of the dots differs, which
        # can flip a bf16 rounding of S (one ulp) that then carries on. Measured (interpret, RMS
        # ratios): (1, 2, 192, 128, 128) vp 1.6e-5, h 2.3e-5, ht 1.3e-4; (2, 1, 128, 64, 64) vp 2.4e-8,
        # h 0, ht 2.5e-8; at (1, 1, 1024, 128, 64) the flips add up to vp 2.3e-4, h 3.0e-4, ht 4.2e-4.
        # A wrong operand rounding (fp32 operands, S or V' not rounded) gives >= 2e-3.
        _check_matches_triton((B, H, T, K, V), True, tol)

    def test_recurrence_chunk_by_chunk(self):
        # Against the recurrence written out: h_c = bf16(S_c), V'_c = U_c - W_c bf16(S_c),
        # S_{c+1} = gl_c S_c + Kd_c^T bf16(V'_c) (fp32 accumulation), every chunk; and with kd = 0
        # the state only decays: h_c = bf16(h0 prod_{j<c} gl_j).
        kd, w, u, gl, h0 = _inputs(1, 1, 192, 64, 64, seed=3)
        vp, h, ht = hopper.state_fwd(kd, w, u, gl, h0, interpret=True)
        S = h0[0, 0]
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        for c in range(3):
            rows = slice(64 * c, 64 * (c + 1))
            Sb = S.astype(jnp.bfloat16)
            np.testing.assert_allclose(f32(h[0, 0, c]), f32(Sb), rtol=1e-2, atol=1e-2)   # within 1 bf16 ulp
            want = u[0, 0, rows] - jnp.dot(w[0, 0, rows], Sb, preferred_element_type=jnp.float32)
            np.testing.assert_allclose(f32(vp[0, 0, rows]), f32(want), rtol=1e-4, atol=1e-4)
            S = gl[0, 0, c][:, None] * S + jnp.dot(kd[0, 0, rows].T, want.astype(jnp.bfloat16),
                                                     preferred_element_type=jnp.float32)
        np.testing.assert_allclose(f32(ht[0, 0]), f32(S), rtol=1e-4, atol=1e-4)
        vp, h, ht = hopper.state_fwd(jnp.zeros_like(kd), w, u, gl, h0, interpret=True)
        decayed = h0[0, 0]
        for c in range(3):
            np.testing.assert_array_equal(f32(h[0, 0, c]), f32(decayed.astype(jnp.bfloat16)))
            decayed = decayed * gl[0, 0, c][:, None]
        np.testing.assert_allclose(f32(ht[0, 0]), f32(decayed), rtol=1e-5, atol=1e-6)

    def test_no_smem_races(self):
        # The interpreter's race detector (one block: it supports a single block in the grid):
        # every read of a loaded SMEM buffer is fenced before the next chunk's TMA writes into it.
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc   # private API
        args = _inputs(1, 1, 192, 128, 64)
        jax.block_until_ready(hopper.state_fwd(*args, interpret=plgpu.InterpretGPUParams(detect_races=True)))
        assert not ipc.get_races().races_found


class TestHopperStateFwdCPU:
    def test_bad_input_raises(self):
        kd, w, u, gl, h0 = _inputs(1, 1, 128, 64, 64)
        with pytest.raises(ValueError, match="T = 100"):
            hopper.state_fwd(kd[:, :, :100], w[:, :, :100], u[:, :, :100], gl, h0, interpret=True)
        with pytest.raises(ValueError, match="bf16"):
            hopper.state_fwd(kd.astype(jnp.float32), w, u, gl, h0, interpret=True)
        with pytest.raises(ValueError, match="fp32"):
            hopper.state_fwd(kd, w, u.astype(jnp.bfloat16), gl, h0, interpret=True)
        with pytest.raises(ValueError, match="K = 32"):
            hopper.state_fwd(kd[..., :32], w[..., :32], u, gl[..., :32], h0[:, :, :32], interpret=True)
        with pytest.raises(ValueError, match="V = 32"):
            hopper.state_fwd(kd, w, u[..., :32], gl, h0[..., :32], interpret=True)
        with pytest.raises(ValueError, match="shapes"):
            hopper.state_fwd(kd, w, u, gl[:, :, :1], h0, interpret=True)

    @pytest.mark.parametrize("K", [64, 128])
    def test_lowers_for_cuda(self, K):
        # The benchmark's shape lowers to one Mosaic GPU custom call on a CPU host (the lowering checks
        # the wgmma / TMA transforms and the 227 KiB shared-memory limit; the compile to SASS needs
        # the GPU).
        sd = jax.ShapeDtypeStruct
        B, H, T = 8, 16, 4096
        args = (sd((B, H, T, K), jnp.bfloat16), sd((B, H, T, K), jnp.bfloat16), sd((B, H, T, K), jnp.float32),
                sd((B, H, T // 64, K), jnp.float32), sd((B, H, K, K), jnp.float32))
        text = jax.jit(hopper.state_fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
class TestHopperStateFwdGPU:
    """Compiled on the H200 against the compiled Triton kernel (bf16 operands), up to the benchmark's
    8x4096x16x128. A consistency check of two kernels with the same bf16-operand error budget (their
    accumulation orders differ, so bf16 flips of S add up over 16 / 64 chunks: ~4e-4 at 16 chunks in
    interpret mode); the exact checks are the interpret-mode ones above."""

    @pytest.mark.parametrize("shape, tol", [((2, 4, 1024, 128, 128), 2e-3), ((8, 16, 4096, 128, 128), 5e-3)])
    def test_matches_triton_state_pass(self, shape, tol):
        _check_matches_triton(shape, False, tol)
