"""The Hopper (Mosaic GPU) forward state pass, pallas_kernels.kda.hopper.state_fwd, and its dispatch
(ops.KernelOptions.hopper_state_fwd).

Held to the Triton kernel it replaces (fwd.state_fwd_vp with bf16 operands, the default op's
rounding, same layouts) in Mosaic GPU interpret mode on CPU, per segment too, lowered for CUDA on
CPU, bad input refused; through the op against hopper_state_fwd=False; the `gpu` class runs it
compiled on the H200 against the compiled Triton kernel.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import common, fwd, hopper, ops
from tests.kda_testing import assert_rms_close
from tests.test_kda_pallas import GRAD_NAMES, _fake_h200, option_ab_inputs, pallas_outputs


def _inputs(B, H, T, K, V, seed=0, scale=0.08, segments=None):
    # kd, w at 0.08 N(0, 1): the per-chunk map Diag(gl) - Kd^T W keeps S of order 10 over 64 chunks
    # (at 0.2 it grows ~4.7x per chunk and nears the fp32 range by T = 4096).
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    kd = (scale * jax.random.normal(ks[0], (B, H, T, K))).astype(jnp.bfloat16)
    w = scale * jax.random.normal(ks[1], (B, H, T, K))                  # fp32, as the op saves it
    u = jax.random.normal(ks[2], (B, H, T, V))
    gl = jnp.exp(-jax.random.uniform(ks[3], (B, H, T // 64, K)))         # e^{G_last} in (e^-1, 1]
    h0 = jax.random.normal(ks[4], (B, H, V, K) if segments is None else (B, H, segments, V, K))  # S^T
    return kd, w, u, gl, h0


def _triton(kd, w, u, gl, h0, interpret):
    """fwd.state_fwd_vp with bf16 operands (the default op's state pass)."""
    return fwd.state_fwd_vp(kd, w, u, gl, h0, chunk_size=64, block_v=64, interpret=interpret,
                            precision=common.BF16_OPERANDS, state_dtype=jnp.bfloat16, vp_dtype=jnp.float32)


def _check_matches_triton(shape, interpret, tol, segments=None):
    """hopper.state_fwd vs fwd.state_fwd_vp (bf16 operands) on the same inputs: RMS ratios <= tol."""
    args = _inputs(*shape, segments=segments)
    out = jax.jit(lambda *a: hopper.state_fwd(*a, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: _triton(*a, interpret=interpret))(*args)
    for name, o, r in zip(("vp", "h", "ht"), out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        assert_rms_close(f"hopper {name} {shape}", r, o, tol)


class TestHopperStateFwd:
    """Mosaic GPU interpret mode on CPU."""

    @pytest.mark.parametrize("B, H, T, K, V, segments, tol", [(1, 2, 192, 128, 128, None, 1e-3),
                                                              (2, 1, 128, 64, 64, None, 1e-6),
                                                              (1, 1, 256, 128, 64, 2, 1e-6)])
    def test_matches_triton_state_pass(self, B, H, T, K, V, segments, tol):
        # Same math and operand rounding; only the fp32 accumulation order of the dots differs, which
        # can flip a bf16 rounding of S (one ulp) that then carries on. Measured (interpret, RMS
        # ratios): (1, 2, 192, 128, 128) vp 8.7e-6, h 1.2e-5, ht 2.2e-5; (2, 1, 128, 64, 64) vp 2.8e-8,
        # h 2.9e-8, ht 2.5e-8; two segments of two chunks (the sequence split's per-segment starts)
        # vp 5.1e-8, h 0, ht 3.7e-8. A wrong operand rounding (fp32 operands, S or V' not rounded)
        # gives >= 2e-3; a segment started from the wrong h0 or chunk gives O(1).
        _check_matches_triton((B, H, T, K, V), True, tol, segments=segments)

    def test_recurrence_chunk_by_chunk(self):
        # Against the recurrence written out with S [K, V] (the kernel holds and stores S^T):
        # h_c = bf16(S_c)^T, V'_c = U_c - bf16(W_c) bf16(S_c), S_{c+1} = gl_c S_c + Kd_c^T bf16(V'_c)
        # (fp32 accumulation), every chunk; and with kd = 0 the state only decays:
        # h_c = bf16(h0 prod_{j<c} gl_j).
        kd, w, u, gl, h0 = _inputs(1, 1, 192, 64, 128, seed=3)
        vp, h, ht = hopper.state_fwd(kd, w, u, gl, h0, interpret=True)
        S = h0[0, 0].T
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        for c in range(3):
            rows = slice(64 * c, 64 * (c + 1))
            Sb = S.astype(jnp.bfloat16)
            np.testing.assert_allclose(f32(h[0, 0, c].T), f32(Sb), rtol=1e-2, atol=1e-2)  # within 1 bf16 ulp
            want = u[0, 0, rows] - jnp.dot(w[0, 0, rows].astype(jnp.bfloat16), Sb,
                                           preferred_element_type=jnp.float32)
            np.testing.assert_allclose(f32(vp[0, 0, rows]), f32(want), rtol=1e-4, atol=1e-4)
            S = gl[0, 0, c][:, None] * S + jnp.dot(kd[0, 0, rows].T, want.astype(jnp.bfloat16),
                                                     preferred_element_type=jnp.float32)
        np.testing.assert_allclose(f32(ht[0, 0].T), f32(S), rtol=1e-4, atol=1e-4)
        vp, h, ht = hopper.state_fwd(jnp.zeros_like(kd), w, u, gl, h0, interpret=True)
        decayed = h0[0, 0]
        for c in range(3):
            np.testing.assert_array_equal(f32(h[0, 0, c]), f32(decayed.astype(jnp.bfloat16)))
            decayed = decayed * gl[0, 0, c][None, :]
        np.testing.assert_allclose(f32(ht[0, 0]), f32(decayed), rtol=1e-5, atol=1e-6)

    def test_no_smem_races(self):
        # The interpreter's race detector (one block: it supports a single block in the grid):
        # every read of a loaded SMEM buffer is fenced before the TMA load two chunks on writes into
        # it (four chunks: both buffers reused).
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc   # private API
        args = _inputs(1, 1, 256, 128, 64)
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
            hopper.state_fwd(kd, w.astype(jnp.bfloat16), u, gl, h0, interpret=True)
        with pytest.raises(ValueError, match="K = 32"):
            hopper.state_fwd(kd[..., :32], w[..., :32], u, gl[..., :32], h0[..., :32], interpret=True)
        with pytest.raises(ValueError, match="V = 32"):
            hopper.state_fwd(kd, w, u[..., :32], gl, h0[:, :, :32], interpret=True)
        with pytest.raises(ValueError, match="shapes"):
            hopper.state_fwd(kd, w, u, gl[:, :, :1], h0, interpret=True)
        with pytest.raises(ValueError, match="NS = 3"):                  # 2 chunks in 3 segments
            hopper.state_fwd(kd, w, u, gl, jnp.stack([h0] * 3, axis=2), interpret=True)

    @pytest.mark.parametrize("K", [64, 128])
    def test_lowers_for_cuda(self, K):
        # The benchmark's shape lowers to one Mosaic GPU custom call on a CPU host (the lowering checks
        # the wgmma / TMA transforms and the 227 KiB shared-memory limit: 217 KiB at K = 128 with
        # two buffers per input; the compile to SASS needs the GPU).
        sd = jax.ShapeDtypeStruct
        B, H, T = 8, 16, 4096
        args = (sd((B, H, T, K), jnp.bfloat16), sd((B, H, T, K), jnp.float32), sd((B, H, T, K), jnp.float32),
                sd((B, H, T // 64, K), jnp.float32), sd((B, H, K, K), jnp.float32))
        text = jax.jit(hopper.state_fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


class TestHopperStateFwdOption:
    """ops.KernelOptions.hopper_state_fwd (on by default): where it applies the op runs
    hopper.state_fwd (in Mosaic GPU interpret mode under interpret=True), elsewhere the Triton pass."""

    @staticmethod
    def _count_calls(monkeypatch):
        calls = []
        real = hopper.state_fwd

        def counting(*a, **kw):
            calls.append(a[0].shape)
            return real(*a, **kw)
        monkeypatch.setattr(hopper, "state_fwd", counting)
        return calls

    @pytest.mark.parametrize("segments, lower_bound, sequence_split", [(True, -5.0, 0), (False, None, 1)])
    def test_op_matches_triton_pass(self, monkeypatch, segments, lower_bound, sequence_split):
        # bf16 at K = V = 64 (the smallest head the kernel takes): bounded gates with segment_ids in
        # one serial pass, and unbounded gates through the sequence split (segments of one chunk,
        # per-segment starts). Same rounding as the Triton pass: measured o, dq..dh0 identical, ht
        # 2.5e-8 (fp32 accumulation order).
        calls = self._count_calls(monkeypatch)
        x, seg, do, dht = option_ab_inputs(70, "bfloat16", segments=segments, lower_bound=lower_bound,
                                           V=64, K=64)
        on = ops.KernelOptions()
        off = dataclasses.replace(on, hopper_state_fwd=False)
        kw = dict(segment_ids=seg, lower_bound=lower_bound, sequence_split=sequence_split)
        o, ht, grads = pallas_outputs(x, do, dht, on, **kw)
        assert calls == [(2, 1, 256, 64)]                   # [B, H, Tp, Kp]: the Hopper pass ran
        o0, ht0, g0 = pallas_outputs(x, do, dht, off, **kw)
        assert len(calls) == 1
        assert_rms_close("hopper option o", o0, o, 1e-5)
        assert_rms_close("hopper option ht", ht0, ht, 1e-5)
        for name in GRAD_NAMES:
            assert_rms_close(f"hopper option {name}", g0[name], grads[name], 1e-5)

    def test_not_used_where_it_does_not_apply(self, monkeypatch):
        # Traced only: fp32 inputs, K = 32 (padded 32), V = 32 and a compiled call on this CPU host
        # (not a Hopper GPU) take the Triton pass; the bf16 K = V = 64 interpret call takes Hopper.
        calls = self._count_calls(monkeypatch)
        sd = jax.ShapeDtypeStruct

        def trace(K, V, dtype, interpret):
            q, v = sd((1, 128, 1, K), dtype), sd((1, 128, 1, V), dtype)
            g, beta = sd((1, 128, 1, K), jnp.float32), sd((1, 128, 1), dtype)
            jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=interpret)[0]).trace(q, q, v, g, beta)
        for K, V, dtype, interpret in [(64, 64, jnp.float32, True), (32, 64, jnp.bfloat16, True),
                                       (64, 32, jnp.bfloat16, True), (64, 64, jnp.bfloat16, False)]:
            trace(K, V, dtype, interpret)
        assert calls == []
        trace(64, 64, jnp.bfloat16, True)
        assert len(calls) == 1
        assert not hopper.is_hopper()                       # this CPU host

    def test_op_lowers_for_cuda_on_hopper(self, monkeypatch):
        # With the device taken for an sm_90 GPU the op's gradient lowers with the Mosaic GPU state
        # pass next to the Triton kernels; hopper_state_fwd=False lowers without it.
        from tests.test_kda_pallas import lowered_grad_text
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: True)
        on = lowered_grad_text(ops.KernelOptions())
        off = lowered_grad_text(dataclasses.replace(ops.KernelOptions(), hopper_state_fwd=False))
        assert "mosaic_gpu" in on and "mosaic_gpu" not in off
        assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton") - 1


@pytest.mark.gpu
class TestHopperStateFwdGPU:
    """Compiled on the H200 against the compiled Triton kernel (bf16 operands), up to the benchmark's
    8x4096x16x128. A consistency check of two kernels with the same bf16-operand error budget (their
    accumulation orders differ, so bf16 flips of S add up over 16 / 64 chunks: ~4e-4 at 16 chunks in
    interpret mode); the exact checks are the interpret-mode ones above."""

    @pytest.mark.parametrize("shape, tol", [((2, 4, 1024, 128, 128), 2e-3), ((8, 16, 4096, 128, 128), 5e-3)])
    def test_matches_triton_state_pass(self, shape, tol):
        _check_matches_triton(shape, False, tol)
