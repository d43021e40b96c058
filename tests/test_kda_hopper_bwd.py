"""Kernel a of the intra-chunk backward on Hopper, pallas_kernels.kda.hopper_bwd.intra_bwd_a, and its
dispatch (ops.KernelOptions.hopper_intra_bwd).

Held to the Triton kernel it replaces (bwd.intra_bwd_a with the op's default options: bf16 operands,
gate cumsum outside, whole states) in Mosaic GPU interpret mode on CPU, with the interpreter's race
detector, lowered for CUDA on CPU, bad input refused; through the op against the option off; the
`gpu` class runs it compiled on the H200 against the compiled Triton kernel.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import bwd, hopper_bwd, ops
from tests.kda_testing import assert_all_equal, assert_rms_close
from tests.test_kda_hopper import _no_races
from tests.test_kda_pallas import GRAD_NAMES, _fake_h200, lowered_grad_text, option_ab_inputs, pallas_outputs

NAMES = ("dv", "dbeta", "dq", "dk", "dG", "dG_last", "dM", "dAqk")


def _inputs(B, T, H, K, V, seed=0):
    """Kernel a's inputs with the op's dtypes and plausible structure: G the chunk-local cumsum of
    g = -5 sigmoid(N(0, 1)); A unit lower-triangular, M strictly lower (per chunk); states of order 1."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 13)
    n = lambda i, shape, s=1.0: s * jax.random.normal(ks[i], shape)   # noqa: E731
    bf = jnp.bfloat16
    NT = T // 64
    g = -5 * jax.nn.sigmoid(n(3, (B, T, H, K)))
    G = jnp.cumsum(g.reshape(B, NT, 64, H, K), axis=2).reshape(B, T, H, K)
    tri = lambda i: jnp.tril(n(i, (B, H, NT, 64, 64), 0.2), -1)      # noqa: E731
    return (n(0, (B, T, H, K)).astype(bf), (n(1, (B, T, H, K)) / np.sqrt(K)).astype(bf),
            n(2, (B, T, H, V)).astype(bf), G, jax.nn.sigmoid(n(4, (B, T, H))).astype(bf),
            n(5, (B, T, H, V)).astype(bf), n(6, (B, H, T, V)),
            n(7, (B, H, NT, V, K)).astype(bf), n(8, (B, H, NT, V, K)).astype(bf),
            n(9, (B, H, T, K), 0.1), n(10, (B, H, T, V)),
            (tri(11) + jnp.eye(64)).reshape(B, H, T, 64), tri(12).reshape(B, H, T, 64))


def _check_matches_triton(shape, interpret, tol):
    """hopper_bwd.intra_bwd_a vs bwd.intra_bwd_a (bf16 operands, gate cumsum outside): RMS ratios."""
    args = _inputs(*shape)
    scale = shape[3] ** -0.5
    out = jax.jit(lambda *a: hopper_bwd.intra_bwd_a(*a, scale=scale, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: bwd.intra_bwd_a(*a, scale=scale, chunk_size=64, interpret=interpret,
                                             bf16_dots=True, gate_cumsum=True))(*args)
    errs = {}
    for name, o, r in zip(NAMES, out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        errs[name] = assert_rms_close(f"hopper kernel a {name} {shape}", r, o, tol)
    return errs


def _check_bf16_w(shape, interpret):
    """intra_bwd_a with W in bf16 against W in fp32: every output bit-equal."""
    args = list(_inputs(*shape))
    run = jax.jit(lambda *a: hopper_bwd.intra_bwd_a(*a, scale=shape[3] ** -0.5, interpret=interpret))
    ref = run(*args)
    args[9] = args[9].astype(jnp.bfloat16)
    assert_all_equal(NAMES, run(*args), ref)


class TestHopperIntraBwd:

    @pytest.mark.parametrize("B, T, H, K, V", [(1, 128, 2, 128, 128), (2, 64, 1, 64, 128), (1, 128, 1, 128, 64)])
    def test_matches_triton_kernel_a(self, B, T, H, K, V):
        # Same operands and rounding as the Triton kernel; the differences are fp32 accumulation
        # order (and the bf16 flips of V' it causes). Measured (B, T, H, K, V) = (1, 128, 2, 128, 128):
        # dv 8e-10, dq / dk / dG / dG_last 8e-8, dbeta 2.7e-6, dM 4.8e-6, dAqk 1.6e-5.
        _check_matches_triton((B, T, H, K, V), True, 1e-4)

    @pytest.mark.parametrize("K", [128, 64])
    def test_no_smem_races(self, K):
        # The TMA copies of the five phases against the generic reads of their buffers, and the
        # RefUnion groups (the race detector refuses a read through a group other than the one that
        # last wrote), one chunk: one block, both loop lengths (K = 128: two halves, K = 64: one).
        # The interpreter gives each union member its own buffer and runs wgmma synchronously in
        # the issuing thread, so wgmma reads against later writes into aliased SMEM (phase 4 into
        # the states' memory) and the fences before each wgmma rest on review and the compiled
        # GPU tests.
        args = _inputs(1, 64, 1, K, K)
        assert _no_races(lambda *a, interpret: hopper_bwd.intra_bwd_a(*a, scale=0.1, interpret=interpret), args)

    def test_bf16_w(self):
        # W given in bf16 (ops.KernelOptions.hopper_bf16_w) goes by TMA straight into its operand
        # buffer: the same operand values as fp32 W rounded in the kernel, so the same outputs bit for
        # bit; and no SMEM race with the new copy target.
        _check_bf16_w((1, 64, 1, 128, 128), True)
        args = list(_inputs(1, 64, 1, 128, 128))
        args[9] = args[9].astype(jnp.bfloat16)
        assert _no_races(lambda *a, interpret: hopper_bwd.intra_bwd_a(*a, scale=0.1, interpret=interpret), args)

    def test_bad_input_raises(self):
        args = list(_inputs(1, 64, 1, 64, 64))
        ok = lambda a: hopper_bwd.intra_bwd_a(*a, scale=0.1, interpret=True)   # noqa: E731
        for i, bad, match in [(0, args[0].astype(jnp.float32), "must be bf16"),
                              (3, args[3].astype(jnp.bfloat16), "must be fp32"),
                              (6, args[6].astype(jnp.bfloat16), "must be fp32"),
                              (4, args[4].astype(jnp.int32), "beta must be"),
                              (11, args[11][:, :, :, :32], "shapes do not match")]:
            a = list(args)
            a[i] = bad
            with pytest.raises(ValueError, match=match):
                ok(a)
        q = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
        with pytest.raises(ValueError, match="must be in"):
            ok([q, q, *args[2:]])
        with pytest.raises(ValueError, match="multiple of 64"):
            ok([x[:, :32] for x in args[:6]] + args[6:])
        with pytest.raises(ValueError, match="_ablate"):        # the private profiling option
            hopper_bwd.intra_bwd_a(*args, scale=0.1, interpret=True, _ablate=("state_products",))

    @pytest.mark.parametrize("K, V", [(128, 128), (64, 64)])
    def test_lowers_for_cuda(self, K, V):
        # The Mosaic GPU lowering (wgmma operand layouts, the 227 KiB SMEM limit) runs on CPU; W fp32
        # and bf16 (ops.KernelOptions.hopper_bf16_w).
        f = jax.jit(lambda *a: hopper_bwd.intra_bwd_a(*a, scale=0.1))
        args = list(_inputs(1, 128, 2, K, V))
        for w_dtype in (jnp.float32, jnp.bfloat16):
            args[9] = args[9].astype(w_dtype)
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("custom_call @mosaic_gpu") == 1


class TestHopperIntraBwdOption:
    """ops.KernelOptions.hopper_intra_bwd (on by default): where it applies the op's backward runs
    hopper_bwd.intra_bwd_a (Mosaic GPU interpret mode under interpret=True) and the Triton kernel b."""

    @staticmethod
    def _count_calls(monkeypatch):
        calls = []
        real = hopper_bwd.intra_bwd_a
        monkeypatch.setattr(hopper_bwd, "intra_bwd_a", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
        return calls

    @pytest.mark.parametrize("K, lower_bound", [(64, -5.0), (128, None)])
    def test_op_matches_option_off(self, monkeypatch, K, lower_bound):
        # Measured (RMS ratios vs the option off): K = 64 bounded dk 1.2e-6, dg 9.4e-6; K = 128
        # unbounded dk 3.5e-5, dg 3.8e-5; dq, dv, dbeta, dh0 identical (fp32 accumulation order).
        calls = self._count_calls(monkeypatch)
        x, _, do, dht = option_ab_inputs(70, "bfloat16", segments=False, lower_bound=lower_bound, V=K, K=K)
        on = ops.KernelOptions()
        o, ht, grads = pallas_outputs(x, do, dht, on, lower_bound=lower_bound)
        assert calls == [(2, 256, 1, K)]                                  # [B, Tp, H, Kp]
        o0, ht0, g0 = pallas_outputs(x, do, dht, dataclasses.replace(on, hopper_intra_bwd=False),
                                     lower_bound=lower_bound)
        assert len(calls) == 1
        np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o, np.float32))
        for name in GRAD_NAMES:
            assert_rms_close(f"hopper_intra_bwd off: {name}", g0[name], grads[name], 1e-4)

    def test_not_used_where_it_does_not_apply(self, monkeypatch):
        from pallas_kernels.kda import hopper
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: False)       # any host, an H200 too
        calls = self._count_calls(monkeypatch)
        sd = jax.ShapeDtypeStruct

        def trace(K, V, dtype, interpret, segments=False, **opts):
            q, v = sd((1, 128, 1, K), dtype), sd((1, 128, 1, V), dtype)
            g, beta = sd((1, 128, 1, K), jnp.float32), sd((1, 128, 1), dtype)
            seg = jnp.zeros((1, 128), jnp.int32) if segments else None
            options = dataclasses.replace(ops.KernelOptions(), **opts)

            def loss(*a):
                return jnp.sum(ops.kda_pallas(*a, lower_bound=-5.0, interpret=interpret, segment_ids=seg,
                                              options=options)[0].astype(jnp.float32))
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(q, q, v, g, beta)
        for K, V, dtype, interpret, segments, opts in [
                (64, 64, jnp.float32, True, False, {}), (32, 64, jnp.bfloat16, True, False, {}),
                (64, 32, jnp.bfloat16, True, False, {}), (64, 64, jnp.bfloat16, False, False, {}),
                (64, 64, jnp.bfloat16, True, True, {}),
                (64, 64, jnp.bfloat16, True, False, dict(tile_state_bwd=True)),
                (64, 64, jnp.bfloat16, True, False, dict(bf16_intra_dots=False)),
                (64, 64, jnp.bfloat16, True, False, dict(xla_gate_cumsum=False)),
                (64, 64, jnp.bfloat16, True, False, dict(split_intra_bwd=False, compact_offdiag_bwd=False)),
                (64, 64, jnp.bfloat16, True, False, dict(hopper_intra_bwd=False))]:
            trace(K, V, dtype, interpret, segments, **opts)
        assert calls == []
        trace(64, 64, jnp.bfloat16, True)
        assert len(calls) == 1

    def test_op_lowers_for_cuda_on_hopper(self):
        # With the device taken for an sm_90 GPU the op's gradient lowers with kernel a as a third
        # Mosaic GPU call in place of the Triton kernel a (the forward's kernel a, hopper_intra_fwd,
        # off on both sides: test_kda_hopper_fwd).
        base = dataclasses.replace(ops.KernelOptions(), hopper_intra_fwd=False)
        on = lowered_grad_text(base, hopper_passes=True)
        off = lowered_grad_text(dataclasses.replace(base, hopper_intra_bwd=False), hopper_passes=True)
        assert on.count("custom_call @mosaic_gpu") == 3 and off.count("custom_call @mosaic_gpu") == 2
        assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton") - 1


@pytest.mark.gpu
class TestHopperIntraBwdGPU:
    """Compiled on the H200 against the compiled Triton kernel a (bf16 operands). Measured
    (2026-12-01, round 15, kda_round15_h200/v5_gpu_tests.log): dv, dq, dAqk identical, dk <= 7.8e-9,
    dG <= 1.1e-8, dG_last 6.3e-8, dbeta 5.7e-7, dM 9.4e-7 at all three shapes (fp32
    reassociation in dk, dG since round 13's kernel: 4e-31, 7e-9)."""

    @pytest.mark.parametrize("shape", [(2, 1024, 4, 128, 128), (8, 4096, 16, 128, 128), (2, 1024, 4, 64, 64)])
    def test_matches_triton_kernel_a(self, shape):
        errs = _check_matches_triton(shape, False, 1e-3)
        print(shape, {k: f"{v:.2g}" for k, v in errs.items()})

    def test_bf16_w(self):
        _check_bf16_w((8, 4096, 16, 128, 128), False)
