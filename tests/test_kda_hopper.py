"""The Hopper (Mosaic GPU) serial state passes, pallas_kernels.kda.hopper.state_fwd /
state_output_fwd / state_bwd, and their dispatch (ops.KernelOptions.hopper_state_fwd /
hopper_fused_output / hopper_state_bwd).

Each is held to the Triton kernels it replaces (fwd.state_fwd_vp (+ fwd.output_fwd) / bwd.state_bwd
with bf16 operands, the default op's rounding, same layouts) in Mosaic GPU interpret mode on CPU, per segment too, with
the interpreter's race detector, lowered for CUDA on CPU, bad input refused; through the op against
the options off; the `gpu` classes run them compiled on the H200 against the compiled Triton kernels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import bwd, common, fwd, hopper, ops
from tests.kda_testing import assert_all_equal, assert_rms_close
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


def _bwd_inputs(B, H, T, K, V, seed=0, scale=0.08, segments=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    bf = lambda i: (scale * jax.random.normal(ks[i], (B, H, T, K))).astype(jnp.bfloat16)  # noqa: E731
    aqk = jnp.tril(0.1 * jax.random.normal(ks[3], (B, H, T // 64, 64, 64)))
    return (bf(0), bf(1), scale * jax.random.normal(ks[2], (B, H, T, K)),          # qg, kd, w (fp32)
            aqk.reshape(B, H, T, 64).astype(jnp.bfloat16),
            jnp.exp(-jax.random.uniform(ks[4], (B, H, T // 64, K))),              # e^{G_last}
            jax.random.normal(ks[5], (B, T, H, V)).astype(jnp.bfloat16),          # dO, token-major
            jax.random.normal(ks[6], (B, H, V, K) if segments is None else (B, H, segments, V, K)))


def _check_bwd_matches_triton(shape, interpret, tol, segments=None):
    """hopper.state_bwd vs bwd.state_bwd (bf16 operands) on the same inputs: RMS ratios <= tol."""
    args = _bwd_inputs(*shape, segments=segments)
    out = jax.jit(lambda *a: hopper.state_bwd(*a, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: bwd.state_bwd(*a, chunk_size=64, block_v=64, interpret=interpret,
                                           precision=common.BF16_OPERANDS, state_dtype=jnp.bfloat16))(*args)
    for name, o, r in zip(("du", "dh", "dh0"), out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        assert_rms_close(f"hopper bwd {name} {shape}", r, o, tol)


def _no_races(fn, args):
    """The interpreter's race detector over one run of fn (a single block: it supports one block in
    the grid)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc   # private API
    jax.block_until_ready(fn(*args, interpret=plgpu.InterpretGPUParams(detect_races=True)))
    return not ipc.get_races().races_found


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
        # Every read of a loaded SMEM buffer is fenced before the TMA load two chunks on writes into
        # it (four chunks: both buffers reused).
        assert _no_races(hopper.state_fwd, _inputs(1, 1, 256, 128, 64))


def _check_fused_matches_triton(shape, interpret, tol, segments=None, write_states=True):
    """hopper.state_output_fwd vs fwd.state_fwd_vp + fwd.output_fwd (bf16 operands): RMS ratios <= tol."""
    B, H, T, K, V = shape
    kd, w, u, gl, h0 = _inputs(*shape, segments=segments)
    ks = jax.random.split(jax.random.PRNGKey(9), 2)
    qg = (0.08 * jax.random.normal(ks[0], (B, H, T, K))).astype(jnp.bfloat16)
    aqk = jnp.tril(0.1 * jax.random.normal(ks[1], (B, H, T // 64, 64, 64))).reshape(B, H, T, 64)
    args = (kd, w, u, gl, h0, qg, aqk.astype(jnp.bfloat16))
    o, h, ht = jax.jit(lambda *a: hopper.state_output_fwd(*a, write_states=write_states, interpret=interpret))(*args)

    def triton(kd, w, u, gl, h0, qg, aqk):
        vp, h, ht = _triton(kd, w, u, gl, h0, interpret)
        return fwd.output_fwd(qg, aqk, vp, h, chunk_size=64, out_dtype=jnp.bfloat16, interpret=interpret,
                              precision=common.BF16_OPERANDS), h, ht
    ref = jax.jit(triton)(*args)
    assert (h is None) == (not write_states)
    for name, x, r in zip(("o", "h", "ht"), (o, h, ht), ref):
        if x is not None:
            assert x.shape == r.shape and x.dtype == r.dtype, name
            assert_rms_close(f"hopper fused {name} {shape}", r, x, tol)


class TestHopperStateOutputFwd:
    """hopper.state_output_fwd (the state pass with the output fused in) in Mosaic GPU interpret mode."""

    @pytest.mark.parametrize("B, H, T, K, V, segments, write_states, tol", [
        (1, 2, 192, 128, 128, None, True, 1e-3), (2, 3, 128, 64, 128, None, False, 1e-6),
        (1, 1, 256, 128, 64, 2, True, 1e-6)])
    def test_matches_triton_state_pass_and_output(self, B, H, T, K, V, segments, write_states, tol):
        # Against the two Triton kernels it replaces (same bf16 operands). Measured (interpret, RMS
        # ratios): (1, 2, 192, 128, 128) o 4.0e-5, h 1.2e-5, ht 2.2e-5; (2, 3, 128, 64, 128) without
        # states o 1.1e-7, ht 3.2e-8; two segments o 0, h 0, ht 3.7e-8. Qg S or Aqk V' left out, or
        # o written to the wrong token rows, gives O(1).
        _check_fused_matches_triton((B, H, T, K, V), True, tol, segments=segments, write_states=write_states)

    def test_no_smem_races(self):
        # h0 and ht are staged through W's single buffer, which is refilled after each fence.
        kd, w, u, gl, h0 = _inputs(1, 1, 256, 128, 64)
        aqk = jnp.tril(jnp.ones((1, 1, 4, 64, 64))).reshape(1, 1, 256, 64).astype(jnp.bfloat16)
        assert _no_races(lambda *a, interpret: hopper.state_output_fwd(*a, interpret=interpret),
                         (kd, w, u, gl, h0, kd, aqk))

    def test_bad_input_raises(self):
        kd, w, u, gl, h0 = _inputs(1, 1, 128, 64, 64)
        aqk = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
        with pytest.raises(ValueError, match="qg must be bf16"):
            hopper.state_output_fwd(kd, w, u, gl, h0, kd.astype(jnp.float32), aqk)
        with pytest.raises(ValueError, match="aqk"):
            hopper.state_output_fwd(kd, w, u, gl, h0, kd, aqk[..., :32])
        with pytest.raises(ValueError, match="fp32"):                                # the shared checks
            hopper.state_output_fwd(kd, w.astype(jnp.float16), u, gl, h0, kd, aqk)
        with pytest.raises(ValueError, match="out_dtype"):
            hopper.state_output_fwd(kd, w, u, gl, h0, kd, aqk, out_dtype=jnp.float32)

    @pytest.mark.parametrize("K, write_states", [(64, True), (128, True), (128, False)])
    def test_lowers_for_cuda(self, K, write_states):
        # 193 KiB of shared memory at K = 128 (W's buffer single, also staging h0 / ht).
        sd = jax.ShapeDtypeStruct
        B, H, T, V = 8, 16, 4096, 128
        bf, f32 = jnp.bfloat16, jnp.float32
        args = (sd((B, H, T, K), bf), sd((B, H, T, K), f32), sd((B, H, T, V), f32), sd((B, H, T // 64, K), f32),
                sd((B, H, V, K), f32), sd((B, H, T, K), bf), sd((B, H, T, 64), bf))
        text = jax.jit(lambda *a: hopper.state_output_fwd(*a, write_states=write_states)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


class TestHopperStateBwd:
    """hopper.state_bwd in Mosaic GPU interpret mode on CPU."""

    @pytest.mark.parametrize("B, H, T, K, V, segments, tol", [(1, 2, 192, 128, 128, None, 1e-3),
                                                              (2, 3, 128, 64, 128, None, 1e-3),
                                                              (1, 1, 256, 128, 64, 2, 1e-6)])
    def test_matches_triton_state_pass(self, B, H, T, K, V, segments, tol):
        # Same math and operand rounding (dS, dV', W rounded to bf16 per dot); the fp32 accumulation
        # order differs (two wgmma into one accumulator). Measured (interpret, RMS ratios):
        # (1, 2, 192, 128, 128) du 3.7e-5, dh 4.4e-5, dh0 6.2e-5; (2, 3, 128, 64, 128) du 1.0e-5,
        # dh 1.4e-5, dh0 4.3e-5; two segments of two chunks du 6.4e-8, dh 0, dh0 6.4e-8. Aqk not
        # transposed, a chunk out of order or the wrong segment's dht give O(1).
        _check_bwd_matches_triton((B, H, T, K, V), True, tol, segments=segments)

    def test_no_smem_races(self):
        # Four chunks: both buffers of the two-deep loads reused, and W's single buffer refilled
        # after the fence that follows its last read (issuing that load before the fence is
        # reported as a race: checked by hand on 2026-12-01).
        assert _no_races(hopper.state_bwd, _bwd_inputs(1, 1, 256, 128, 64))

    def test_bad_input_raises(self):
        qg, kd, w, aqk, gl, do, dht = _bwd_inputs(1, 1, 128, 64, 64)
        with pytest.raises(ValueError, match="T = 100"):
            hopper.state_bwd(*(x[:, :, :100] for x in (qg, kd, w, aqk)), gl, do[:, :100], dht)
        with pytest.raises(ValueError, match="bf16"):
            hopper.state_bwd(qg, kd, w, aqk, gl, do.astype(jnp.float32), dht)
        with pytest.raises(ValueError, match="fp32"):
            hopper.state_bwd(qg, kd, w.astype(jnp.float16), aqk, gl, do, dht)
        with pytest.raises(ValueError, match="shapes"):
            hopper.state_bwd(qg, kd, w, aqk, gl, jnp.swapaxes(do, 1, 2), dht)       # dO head-major
        with pytest.raises(ValueError, match="NS = 3"):
            hopper.state_bwd(qg, kd, w, aqk, gl, do, jnp.stack([dht] * 3, axis=2))

    @pytest.mark.parametrize("K", [64, 128])
    def test_lowers_for_cuda(self, K):
        # 217 KiB of shared memory at K = 128 (under the 227 KiB limit the lowering checks).
        sd = jax.ShapeDtypeStruct
        B, H, T, V = 8, 16, 4096, 128
        bf, f32 = jnp.bfloat16, jnp.float32
        args = (sd((B, H, T, K), bf), sd((B, H, T, K), bf), sd((B, H, T, K), f32), sd((B, H, T, 64), bf),
                sd((B, H, T // 64, K), f32), sd((B, T, H, V), bf), sd((B, H, V, K), f32))
        text = jax.jit(hopper.state_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


class TestHopperStateFwdCPU:
    def test_bad_input_raises(self):
        kd, w, u, gl, h0 = _inputs(1, 1, 128, 64, 64)
        with pytest.raises(ValueError, match="T = 100"):
            hopper.state_fwd(kd[:, :, :100], w[:, :, :100], u[:, :, :100], gl, h0, interpret=True)
        with pytest.raises(ValueError, match="bf16"):
            hopper.state_fwd(kd.astype(jnp.float32), w, u, gl, h0, interpret=True)
        with pytest.raises(ValueError, match="fp32"):
            hopper.state_fwd(kd, w.astype(jnp.float16), u, gl, h0, interpret=True)
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


class TestHopperStateOptions:
    """ops.KernelOptions.hopper_state_fwd / hopper_state_bwd (on by default): where they apply the op
    runs hopper.state_fwd / state_bwd (in Mosaic GPU interpret mode under interpret=True), elsewhere
    the Triton passes."""

    @staticmethod
    def _count_calls(monkeypatch):
        calls = []
        for name in ("state_fwd", "state_output_fwd", "state_bwd"):
            real = getattr(hopper, name)

            def counting(*a, _real=real, _name=name, **kw):
                calls.append((_name, a[0].shape))
                return _real(*a, **kw)
            monkeypatch.setattr(hopper, name, counting)
        return calls

    @pytest.mark.parametrize("segments, lower_bound, sequence_split", [(True, -5.0, 0), (False, None, 1)])
    def test_op_matches_triton_pass(self, monkeypatch, segments, lower_bound, sequence_split):
        # bf16 at K = V = 64 (the smallest head the kernels take): bounded gates with segment_ids
        # in one serial pass, and unbounded gates through the sequence split (segments of one chunk,
        # per-segment starts and ends). Same rounding as the Triton kernels (RMS ratios, fp32
        # accumulation order): hopper_state_fwd off: ht 2.5e-8, the rest identical;
        # hopper_state_bwd off: dh0 5e-8, dg 7.3e-6 (unbounded + split), the rest identical;
        # hopper_fused_output off: o 2.7e-7 (bounded + segments), the rest identical.
        calls = self._count_calls(monkeypatch)
        x, seg, do, dht = option_ab_inputs(70, "bfloat16", segments=segments, lower_bound=lower_bound,
                                           V=64, K=64)
        on = ops.KernelOptions()
        kw = dict(segment_ids=seg, lower_bound=lower_bound, sequence_split=sequence_split)
        o, ht, grads = pallas_outputs(x, do, dht, on, **kw)
        assert calls == [("state_output_fwd", (2, 1, 256, 64)), ("state_bwd", (2, 1, 256, 64))]  # [B, H, Tp, Kp]
        expected = {"hopper_fused_output": ["state_fwd", "state_bwd"], "hopper_state_fwd": ["state_bwd"],
                    "hopper_state_bwd": ["state_output_fwd"]}
        for field, names in expected.items():
            del calls[:]
            o0, ht0, g0 = pallas_outputs(x, do, dht, dataclasses.replace(on, **{field: False}), **kw)
            assert [name for name, _ in calls] == names, field
            tol = 1e-5
            assert_rms_close(f"{field} off: o", o0, o, tol)
            assert_rms_close(f"{field} off: ht", ht0, ht, tol)
            for name in GRAD_NAMES:
                assert_rms_close(f"{field} off: {name}", g0[name], grads[name], tol)

    def test_not_used_where_it_does_not_apply(self, monkeypatch):
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: False)       # any host, an H200 too
        # Gradients traced only: fp32 inputs, K = 32 (padded 32), V = 32 and a compiled call on a
        # host that is not a Hopper GPU take the Triton passes; the bf16 K = V = 64 interpret call
        # takes both Hopper passes.
        calls = self._count_calls(monkeypatch)
        sd = jax.ShapeDtypeStruct

        def trace(K, V, dtype, interpret):
            q, v = sd((1, 128, 1, K), dtype), sd((1, 128, 1, V), dtype)
            g, beta = sd((1, 128, 1, K), jnp.float32), sd((1, 128, 1), dtype)
            def loss(*a):
                return jnp.sum(ops.kda_pallas(*a, lower_bound=-5.0, interpret=interpret)[0].astype(jnp.float32))
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(q, q, v, g, beta)
        for K, V, dtype, interpret in [(64, 64, jnp.float32, True), (32, 64, jnp.bfloat16, True),
                                       (64, 32, jnp.bfloat16, True), (64, 64, jnp.bfloat16, False)]:
            trace(K, V, dtype, interpret)
        assert calls == []
        trace(64, 64, jnp.bfloat16, True)
        assert [name for name, _ in calls] == ["state_output_fwd", "state_bwd"]

    def test_automatic_split_with_hopper_passes(self, monkeypatch):
        # With both passes on Hopper the automatic sequence split starts below
        # SPLIT_TARGET_PROGRAMS_HOPPER programs instead of SPLIT_TARGET_PROGRAMS (measured, round 10).
        # Traced only (interpret mode), B * H * V-blocks = 32 programs: one serial pass with the
        # Hopper passes, the split (transitions) with either Hopper option off.
        from pallas_kernels.kda import split
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: False)       # any host, an H200 too
        assert ops.hopper_serial_passes(jnp.bfloat16, 128, 128, 64, True, ops.KernelOptions())
        assert not ops.hopper_serial_passes(jnp.float32, 128, 128, 64, True, ops.KernelOptions())
        assert not ops.hopper_serial_passes(jnp.bfloat16, 128, 128, 64, False, ops.KernelOptions())  # compiled
        assert ops.split_chunks(256, None, 64, ops.SPLIT_TARGET_PROGRAMS_HOPPER) == 0
        assert ops.split_chunks(256, None, 8, ops.SPLIT_TARGET_PROGRAMS_HOPPER) == 64     # 4 segments
        assert ops.split_chunks(256, None, 64) == 64                                    # the Triton rule
        transitions = []
        real = split.transitions_fwd
        monkeypatch.setattr(split, "transitions_fwd", lambda *a, **kw: transitions.append(1) or real(*a, **kw))
        sd = jax.ShapeDtypeStruct
        q, g, beta = sd((1, 512, 16, 128), jnp.bfloat16), sd((1, 512, 16, 128), jnp.float32), sd((1, 512, 16), jnp.bfloat16)
        for field, split_expected in (("hopper_state_fwd", False), ("hopper_state_fwd", True),
                                      ("hopper_state_bwd", True)):
            del transitions[:]
            opts = ops.KernelOptions() if not split_expected else dataclasses.replace(ops.KernelOptions(), **{field: False})
            jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True, options=opts)[0]).trace(
                q, q, q, g, beta)
            assert bool(transitions) == split_expected, (field, split_expected)

    def test_op_lowers_for_cuda_on_hopper(self):
        # With the device taken for an sm_90 GPU the op's gradient lowers with the two Mosaic GPU
        # state passes in place of three Triton kernels (state_fwd_vp + output_fwd, state_bwd);
        # with the three options off, without them.
        from tests.test_kda_pallas import lowered_grad_text
        # (the intra kernels a, hopper_intra_bwd and hopper_intra_fwd, are off on both sides:
        # test_kda_hopper_bwd, test_kda_hopper_fwd)
        on = lowered_grad_text(dataclasses.replace(ops.KernelOptions(), hopper_intra_bwd=False, hopper_intra_fwd=False),
                               hopper_passes=True)
        off = lowered_grad_text(dataclasses.replace(ops.KernelOptions(), hopper_state_fwd=False,
                                                    hopper_state_bwd=False, hopper_fused_output=False,
                                                    hopper_intra_bwd=False, hopper_intra_fwd=False),
                                hopper_passes=True)
        assert on.count("custom_call @mosaic_gpu") == 2 and "mosaic_gpu" not in off
        assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton") - 3


def _check_bf16_w(interpret, fwd_shape=(1, 1, 256, 128, 64), bwd_shape=(1, 1, 256, 128, 64)):
    """state_output_fwd, state_fwd and state_bwd with W given in bf16 (ops.KernelOptions.hopper_bf16_w: copied
    straight into double-buffered operands) against W in fp32 (rounded to bf16 in the kernel): the same
    operand values, so the same outputs bit for bit."""
    kd, w, u, gl, h0 = _inputs(*fwd_shape)
    aqk = jnp.tril(jnp.ones((*fwd_shape[:2], fwd_shape[2] // 64, 64, 64))).reshape(*fwd_shape[:3], 64)
    args = (kd, w, u, gl, h0, kd, (0.1 * aqk).astype(jnp.bfloat16))
    run = jax.jit(lambda *a: hopper.state_output_fwd(*a, interpret=interpret))
    assert_all_equal(("o", "h", "ht"), run(*args[:1], w.astype(jnp.bfloat16), *args[2:]), run(*args))
    run = jax.jit(lambda *a: hopper.state_fwd(*a, interpret=interpret))
    assert_all_equal(("vp", "h", "ht"), run(kd, w.astype(jnp.bfloat16), u, gl, h0), run(kd, w, u, gl, h0))
    qg, kd, w, aqk, gl, do, dht = _bwd_inputs(*bwd_shape)
    run = jax.jit(lambda *a: hopper.state_bwd(*a, interpret=interpret))
    assert_all_equal(("du", "dh", "dh0"), run(qg, kd, w.astype(jnp.bfloat16), aqk, gl, do, dht),
                     run(qg, kd, w, aqk, gl, do, dht))


class TestHopperBf16W:
    """The serial state passes with W in bf16 (ops.KernelOptions.hopper_bf16_w, on by default)."""

    def test_same_outputs_as_fp32_w(self):
        _check_bf16_w(True)

    def test_no_smem_races(self):
        # W joins the two-deep loads (its operand buffer double now, no fp32 buffer refilled
        # after the fence); four chunks so that both buffers are reused.
        kd, w, u, gl, h0 = _inputs(1, 1, 256, 128, 64)
        aqk = jnp.tril(jnp.ones((1, 1, 4, 64, 64))).reshape(1, 1, 256, 64).astype(jnp.bfloat16)
        assert _no_races(lambda *a, interpret: hopper.state_output_fwd(*a, interpret=interpret),
                         (kd, w.astype(jnp.bfloat16), u, gl, h0, kd, aqk))
        assert _no_races(hopper.state_fwd, (kd, w.astype(jnp.bfloat16), u, gl, h0))
        qg, kd, w, aqk, gl, do, dht = _bwd_inputs(1, 1, 256, 128, 64)
        assert _no_races(hopper.state_bwd, (qg, kd, w.astype(jnp.bfloat16), aqk, gl, do, dht))

    def test_lowers_for_cuda(self):
        # SMEM at K = 128: state_output_fwd 209 KiB, state_bwd 202 KiB (under the 227 KiB limit).
        sd = jax.ShapeDtypeStruct
        B, H, T, K, V = 8, 16, 4096, 128, 128
        bf, f32 = jnp.bfloat16, jnp.float32
        args = (sd((B, H, T, K), bf), sd((B, H, T, K), bf), sd((B, H, T, V), f32), sd((B, H, T // 64, K), f32),
                sd((B, H, V, K), f32), sd((B, H, T, K), bf), sd((B, H, T, 64), bf))
        assert "mosaic_gpu" in jax.jit(hopper.state_output_fwd).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        args = (sd((B, H, T, K), bf), sd((B, H, T, K), bf), sd((B, H, T, K), bf), sd((B, H, T, 64), bf),
                sd((B, H, T // 64, K), f32), sd((B, T, H, V), bf), sd((B, H, V, K), f32))
        assert "mosaic_gpu" in jax.jit(hopper.state_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        args = (sd((B, H, T, K), bf), sd((B, H, T, K), bf), sd((B, H, T, V), f32), sd((B, H, T // 64, K), f32),
                sd((B, H, V, K), f32))
        assert "mosaic_gpu" in jax.jit(hopper.state_fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
class TestHopperStateFwdGPU:
    """Compiled on the H200 against the compiled Triton kernel (bf16 operands), up to the benchmark's
    8x4096x16x128. A consistency check of two kernels with the same bf16-operand error budget (their
    accumulation orders differ, so bf16 flips of S add up over 16 / 64 chunks: ~4e-4 at 16 chunks in
    interpret mode); the exact checks are the interpret-mode ones above."""

    @pytest.mark.parametrize("shape, tol", [((2, 4, 1024, 128, 128), 2e-3), ((8, 16, 4096, 128, 128), 5e-3)])
    def test_matches_triton_state_pass(self, shape, tol):
        _check_matches_triton(shape, False, tol)

    @pytest.mark.parametrize("shape, tol", [((2, 4, 1024, 128, 128), 2e-3), ((8, 16, 4096, 128, 128), 5e-3)])
    def test_bwd_matches_triton_state_pass(self, shape, tol):
        _check_bwd_matches_triton(shape, False, tol)

    @pytest.mark.parametrize("shape, tol", [((2, 4, 1024, 128, 128), 2e-3), ((8, 16, 4096, 128, 128), 5e-3)])
    def test_fused_output_matches_triton(self, shape, tol):
        _check_fused_matches_triton(shape, False, tol)

    def test_bwd_per_segment(self):
        _check_bwd_matches_triton((2, 4, 1024, 128, 128), False, 2e-3, segments=4)

    def test_bf16_w_same_outputs(self):
        _check_bf16_w(False, (8, 16, 4096, 128, 128), (8, 16, 4096, 128, 128))
