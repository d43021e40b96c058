"""Kernel b of the intra-chunk backward on Hopper (the anchored score-tile backward),
pallas_kernels.kda.hopper_score_bwd.intra_bwd_b, and its dispatch (ops.KernelOptions.hopper_score_bwd,
off by default: correct on the H200 but no faster in the op than the Triton kernel b, rounds 14
and 16 of kda_pallas_notes.md).

Held to the Triton kernel b (bwd.intra_bwd_b, bf16 operands, gate cumsum outside; its masked form,
whose sums it computes, and the compact default) in Mosaic GPU interpret mode on CPU, lowered for
CUDA on CPU, bad input refused; through the op against the option off and against the fp32 path;
the `gpu` class runs it compiled against the compiled Triton kernel.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import bwd, hopper_bwd, hopper_score_bwd, ops
from tests.kda_testing import assert_rms_close, rms_ratio
from tests.test_kda_hopper import _no_races
from tests.test_kda_hopper_bwd import _inputs as _a_inputs
from tests.test_kda_pallas import GRAD_NAMES, lowered_grad_text, option_ab_inputs, pallas_outputs


def _inputs(B, T, H, K, seed=0, partials=0.0):
    """Kernel b's inputs: q, k, G as kernel a's test inputs (G a chunk cumsum of -5 sigmoid(N(0, 1)));
    the partials dq', dk', dG', dG_last `partials` N(0, 1) (0: the outputs are the score terms alone,
    so an error in them is not hidden under the partials); dM strictly lower and dAqk lower incl.
    the diagonal per chunk."""
    q, k, _, G, *_ = _a_inputs(B, T, H, K, K, seed)
    ks = jax.random.split(jax.random.PRNGKey(seed + 5), 6)
    NT = T // 64
    n = lambda i, shape, s=1.0: s * jax.random.normal(ks[i], shape)                 # noqa: E731
    tri = lambda i, d: jnp.tril(n(i, (B, H, NT, 64, 64), 0.3), d).reshape(B, H, T, 64)  # noqa: E731
    p = partials
    return (q, k, G, n(0, (B, H, T, K), p), n(1, (B, H, T, K), p), n(2, (B, H, T, K), p),
            n(3, (B, H, NT, K), p), tri(4, -1), tri(5, 0))


def _check_matches_triton(shape, interpret, tol):
    """intra_bwd_b vs the Triton kernel b, its masked and its compact form, on inputs with zero
    partials (the score terms alone); tol: {output name: RMS-ratio bound}. Returns the ratios."""
    args = _inputs(*shape)
    scale = shape[3] ** -0.5
    out = jax.jit(lambda *a: hopper_score_bwd.intra_bwd_b(*a, scale=scale, interpret=interpret))(*args)
    errs = {}
    for compact in (False, True):
        ref = jax.jit(lambda *a: bwd.intra_bwd_b(*a, scale=scale, chunk_size=64, interpret=interpret, bf16_dots=True,
                                                 gate_cumsum=True, compact_offdiag=compact))(*args)
        for name, o, r in zip(("dq", "dk", "dg"), out, ref):
            assert o.shape == r.shape and o.dtype == r.dtype, name
            errs[name, compact] = assert_rms_close(f"hopper kernel b {name} {shape} compact={compact}", r, o,
                                                   tol[name])
    return errs


class TestHopperScoreBwd:

    @pytest.mark.parametrize("B, T, H, K", [(1, 128, 2, 128), (2, 128, 2, 64)])
    def test_matches_triton_kernel_b(self, B, T, H, K):
        # Same sums and operand rounding as the masked Triton kernel b (the compact one groups its
        # column side by a later anchor: rounding). Zero partials, so the outputs are the score
        # terms alone. Measured (RMS ratios, either form): dq 9.5e-5 / 8.1e-5 and dk 1.2e-4 / 1.0e-4
        # (bf16 outputs: rounding flips), dg 1.3e-5 (fp32). A bf16-only diagonal tile (no lo parts)
        # would move dg by ~6e-3.
        _check_matches_triton((B, T, H, K), True, dict(dq=5e-4, dk=5e-4, dg=5e-5))

    @pytest.mark.parametrize("K", [128, 64])
    def test_no_smem_races(self, K):
        # The TMA copies (dM, dAqk; per K half q, k and the partials, the barriers reused by the
        # loop) against the generic reads of their buffers and the RefUnion groups (dM, dAqk vs the
        # partials), one chunk: one block, two loop steps at K = 128. wgmma reads against later
        # writes rest on review and the compiled GPU tests (the interpreter runs wgmma synchronously).
        args = _inputs(1, 64, 1, K, partials=1.0)
        assert _no_races(lambda *a, interpret: hopper_score_bwd.intra_bwd_b(*a, scale=0.1, interpret=interpret), args)

    def test_bad_input_raises(self):
        args = list(_inputs(1, 64, 1, 64))
        run = lambda a: hopper_score_bwd.intra_bwd_b(*a, scale=0.1, interpret=True)   # noqa: E731
        for i, bad, match in [(0, args[0].astype(jnp.float32), "must be bf16"),
                              (2, args[2].astype(jnp.bfloat16), "must be fp32"),
                              (7, args[7][..., :32], "shapes do not match")]:
            a = list(args)
            a[i] = bad
            with pytest.raises(ValueError, match=match):
                run(a)
        with pytest.raises(ValueError, match="must be in"):
            run([jnp.zeros((1, 64, 1, 32), jnp.bfloat16)] * 2 + args[2:])
        with pytest.raises(ValueError, match="multiple of 64"):
            run([x[:, :32] for x in args[:3]] + args[3:])

    @pytest.mark.parametrize("K", [128, 64])
    def test_lowers_for_cuda(self, K):
        f = jax.jit(lambda *a: hopper_score_bwd.intra_bwd_b(*a, scale=0.1))
        text = f.trace(*_inputs(1, 128, 2, K)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


class TestHopperScoreBwdOption:
    """ops.KernelOptions.hopper_score_bwd (off by default): where it applies the op's backward runs
    hopper_score_bwd.intra_bwd_b (Mosaic GPU interpret mode under interpret=True), with either
    kernel a."""

    @staticmethod
    def _count_calls(monkeypatch):
        calls = []
        for mod, name in ((hopper_bwd, "intra_bwd_a"), (hopper_score_bwd, "intra_bwd_b")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
        return calls

    @pytest.mark.parametrize("K, segments, compact, tol", [(64, False, False, 1e-3), (64, True, True, 3e-3)])
    def test_op_matches_option_off(self, monkeypatch, K, segments, compact, tol):
        # Against the same options with the Triton kernel b: with its masked form (compact off) the
        # same sums; with the compact one (the default) rounding only. RMS ratios, on vs off
        # (measured with the compact kernel b as the reference): K = 64 dq 6e-5, dg 2.3e-4; K = 64
        # with segment_ids (Triton kernel a, the Hopper kernel b) dk 1.2e-3, dg 1.2e-3; K = 128 dq
        # 1.3e-4, dg 2.5e-4 (bf16 gradients: the errors vs the fp32 path are equal to three digits,
        # test_errors_vs_fp32_unchanged, which also covers K = 128 through the op).
        calls = self._count_calls(monkeypatch)
        x, seg, do, dht = option_ab_inputs(70, "bfloat16", segments=segments, lower_bound=-5.0, V=K, K=K)
        off = dataclasses.replace(ops.KernelOptions(), compact_offdiag_bwd=compact)
        o, ht, grads = pallas_outputs(x, do, dht, dataclasses.replace(off, hopper_score_bwd=True), segment_ids=seg)
        assert calls == (["intra_bwd_b"] if segments else ["intra_bwd_a", "intra_bwd_b"])
        o0, ht0, g0 = pallas_outputs(x, do, dht, off, segment_ids=seg)
        np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o, np.float32))
        for name in GRAD_NAMES:
            assert_rms_close(f"hopper_score_bwd off: {name}", g0[name], grads[name], tol)

    def test_errors_vs_fp32_unchanged(self):
        # The errors of the bf16 gradients against the fp32 path (the same inputs upcast) are the
        # Triton kernel b's to within 1% (measured: equal to three digits, dq 3.15e-3, dk 3.14e-3,
        # dg 3.13e-3 at K = 128).
        x, _, do, dht = option_ab_inputs(71, "bfloat16", segments=False, lower_bound=-5.0, V=128, K=128)
        _, _, ref = pallas_outputs({n: a.astype(jnp.float32) for n, a in x.items()}, do, dht, ops.KernelOptions())
        _, _, g_off = pallas_outputs(x, do, dht, ops.KernelOptions())
        _, _, g_on = pallas_outputs(x, do, dht, dataclasses.replace(ops.KernelOptions(), hopper_score_bwd=True))
        for name in ("dq", "dk", "dg"):
            e_off, e_on = rms_ratio(ref[name], g_off[name]), rms_ratio(ref[name], g_on[name])
            assert e_on <= 1.01 * e_off + 1e-6, (name, e_on, e_off)

    def test_not_used_where_it_does_not_apply(self, monkeypatch):
        from pallas_kernels.kda import hopper
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: False)       # any host, an H200 too
        calls = self._count_calls(monkeypatch)
        sd = jax.ShapeDtypeStruct

        def trace(K, dtype, interpret, lower_bound=-5.0, **opts):
            q, g, beta = sd((1, 128, 1, K), dtype), sd((1, 128, 1, K), jnp.float32), sd((1, 128, 1), dtype)
            options = dataclasses.replace(ops.KernelOptions(), **{"hopper_score_bwd": True, "hopper_intra_bwd": False,
                                                                  **opts})

            def loss(*a):
                return jnp.sum(ops.kda_pallas(*a, lower_bound=lower_bound, interpret=interpret,
                                              options=options)[0].astype(jnp.float32))
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(q, q, q, g, beta)
        for K, dtype, interpret, lb, opts in [
                (64, jnp.float32, True, -5.0, {}), (32, jnp.bfloat16, True, -5.0, {}),
                (64, jnp.bfloat16, False, -5.0, {}), (64, jnp.bfloat16, True, None, {}),
                (64, jnp.bfloat16, True, -5.0, dict(xla_gate_cumsum=False)),
                (64, jnp.bfloat16, True, -5.0, dict(bf16_intra_dots=False)),
                (64, jnp.bfloat16, True, -5.0, dict(split_intra_bwd=False, compact_offdiag_bwd=False)),
                (64, jnp.bfloat16, True, -5.0, dict(hopper_score_bwd=False))]:
            trace(K, dtype, interpret, lb, **opts)
        assert calls == []
        trace(64, jnp.bfloat16, True)
        assert calls == ["intra_bwd_b"]

    def test_op_lowers_for_cuda_on_hopper(self):
        # With the device taken for an sm_90 GPU and the option on, the gradient lowers with kernel
        # b as a fourth Mosaic GPU call in place of the Triton kernel b.
        base = dataclasses.replace(ops.KernelOptions(), hopper_intra_fwd=False)   # test_kda_hopper_fwd's
        on = lowered_grad_text(dataclasses.replace(base, hopper_score_bwd=True), hopper_passes=True)
        off = lowered_grad_text(base, hopper_passes=True)
        assert on.count("custom_call @mosaic_gpu") == 4 and off.count("custom_call @mosaic_gpu") == 3
        assert "kda_intra_bwd_b_hopper" in on and "kda_intra_bwd_b_hopper" not in off
        assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton") - 1


@pytest.mark.gpu
class TestHopperScoreBwdGPU:
    """Compiled on the H200 against the compiled Triton kernel b (masked and compact forms)."""

    @pytest.mark.parametrize("shape", [(2, 1024, 4, 128), (8, 4096, 16, 128), (2, 1024, 4, 64)])
    def test_matches_triton_kernel_b(self, shape):
        errs = _check_matches_triton(shape, False, dict(dq=1e-3, dk=1e-3, dg=1e-4))
        print(shape, {k: f"{v:.2g}" for k, v in errs.items()})
