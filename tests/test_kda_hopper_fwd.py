"""Kernel a of the intra-chunk forward on Hopper (the anchored scores and the solve),
pallas_kernels.kda.hopper_fwd.intra_fwd_a, and its dispatch (ops.KernelOptions.hopper_intra_fwd, on
by default since round 17 of kda_pallas_notes.md); hopper_fwd.intra_fwd, the same kernel with W and U
fused in (hopper_fused_wu, on by default since round 18).

Held to the Triton kernel a (fwd.intra_fwd_a with bf16 operands and the gate cumsum outside) in Mosaic
GPU interpret mode on CPU, with the interpreter's SMEM race detector, lowered for CUDA on CPU, bad
input refused; through the op against the option off and against the fp32 path; the `gpu` class runs
it compiled against the compiled Triton kernel.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import fwd, hopper_fwd, ops
from tests.kda_testing import assert_all_equal, assert_rms_close, rms_ratio
from tests.test_kda_hopper import _no_races
from tests.test_kda_hopper_bwd import _inputs as _a_inputs
from tests.test_kda_pallas import GRAD_NAMES, lowered_grad_text, option_ab_inputs, pallas_outputs

NAMES = ("qg", "kd", "aqk", "gl", "A", "M")


def _inputs(B, T, H, K, seed=0, V=None):
    """q, k (bf16), G (the chunk cumsum of -5 sigmoid(N(0, 1)), fp32), beta (bf16) as the backward
    kernels' tests; with V also v [B, T, H, V] bf16 (after k: intra_fwd's argument order)."""
    q, k, v, G, beta, *_ = _a_inputs(B, T, H, K, V or K, seed)
    return (q, k, G, beta) if V is None else (q, k, v, G, beta)


def _check_matches_triton(shape, interpret, tol):
    """intra_fwd_a (save_solve) vs the Triton kernel a on the same inputs; tol: {name: RMS-ratio
    bound}. Returns the ratios."""
    args = _inputs(*shape)
    scale = shape[3] ** -0.5
    out = jax.jit(lambda *a: hopper_fwd.intra_fwd_a(*a, scale=scale, save_solve=True, interpret=interpret))(*args)
    ref = jax.jit(lambda *a: fwd.intra_fwd_a(*a, scale=scale, chunk_size=64, interpret=interpret,
                                             factor_dtype=ops.factor_dtypes(jnp.bfloat16), save_solve=True,
                                             bf16_dots=True, gate_cumsum=True))(*args)
    errs = {}
    for name, o, r in zip(NAMES, out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        errs[name] = assert_rms_close(f"hopper forward kernel a {name} {shape}", r, o, tol[name])
    return errs


class TestHopperIntraFwd:

    @pytest.mark.parametrize("B, T, H, K", [(1, 128, 2, 128), (2, 128, 2, 64)])
    def test_matches_triton_kernel_a(self, B, T, H, K):
        # The same products with the same bf16 operand rounding: measured in interpret mode, qg, kd,
        # gl identical, aqk <= 1.6e-7, M <= 1.1e-7, A <= 7.5e-10 (RMS ratios; fp32 summation order).
        _check_matches_triton((B, T, H, K), True, dict(qg=1e-6, kd=1e-6, aqk=1e-5, gl=1e-6, A=1e-5, M=1e-5))

    @pytest.mark.parametrize("K", [128, 64])
    def test_no_smem_races(self, K):
        # The TMA copies of q, k, G against the generic reads of their buffers, the column operand
        # (one buffer, fenced after every row block), the RefUnion groups and the solve's; one chunk (the detector supports one block). wgmma reads
        # against later writes rest on review and the compiled GPU tests (the interpreter runs wgmma
        # synchronously).
        assert _no_races(lambda *a, interpret: hopper_fwd.intra_fwd_a(*a, scale=0.1, save_solve=True,
                                                                      interpret=interpret), _inputs(1, 64, 1, K))

    def test_bad_input_raises(self):
        args = list(_inputs(1, 64, 1, 64))
        run = lambda a: hopper_fwd.intra_fwd_a(*a, scale=0.1, interpret=True)   # noqa: E731
        for i, bad, match in [(0, args[0].astype(jnp.float32), "must be bf16"),
                              (2, args[2].astype(jnp.bfloat16), "must be fp32"),
                              (3, args[3].astype(jnp.int32), "beta must be a float"),
                              (3, args[3][:, :32], "shapes do not match")]:
            a = list(args)
            a[i] = bad
            with pytest.raises(ValueError, match=match):
                run(a)
        with pytest.raises(ValueError, match="must be in"):
            run([jnp.zeros((1, 64, 1, 32), jnp.bfloat16)] * 2 + [jnp.zeros((1, 64, 1, 32))] + args[3:])
        with pytest.raises(ValueError, match="multiple of 64"):
            run([x[:, :32] for x in args])

    @pytest.mark.parametrize("K", [128, 64])
    def test_lowers_for_cuda(self, K):
        # Lowering checks the SMEM limit (227 KiB; the kernel takes 98 KiB at K = 128 so that two
        # CTAs share an SM, which this does not check) and the layouts.
        for save_solve in (False, True):
            f = jax.jit(lambda *a: hopper_fwd.intra_fwd_a(*a, scale=0.1, save_solve=save_solve))
            text = f.trace(*_inputs(1, 128, 2, K)).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("custom_call @mosaic_gpu") == 1


class TestHopperFusedWU:
    """hopper_fwd.intra_fwd: kernel a with W = A X, U = A Y in the same kernel."""

    def test_matches_triton_pair(self):
        # Against fwd.intra_fwd_split (the Triton kernel a, then kernel b reading A), K != V.
        # Measured in interpret mode: qg, kd, gl identical, w 8.7e-12, u 2.4e-8, A 4.9e-10 (RMS
        # ratios); without save_solve the same six outputs.
        args = _inputs(2, 128, 2, 64, V=128)
        ref = fwd.intra_fwd_split(*args, scale=0.125, chunk_size=64, interpret=True,
                                  factor_dtype=ops.factor_dtypes(jnp.bfloat16), save_solve=True, bf16_dots=True,
                                  gate_cumsum=True)
        names = ("qg", "kd", "w", "u", "aqk", "gl", "A", "M")
        for save_solve in (True, False):
            out = jax.jit(lambda *a: hopper_fwd.intra_fwd(*a, scale=0.125, save_solve=save_solve,
                                                          interpret=True))(*args)
            assert len(out) == (8 if save_solve else 6)
            for name, o, r in zip(names, out, ref):
                assert o.shape == r.shape and o.dtype == r.dtype, name
                assert_rms_close(f"fused W / U {name} save_solve={save_solve}", r, o, 1e-5)

    def test_no_smem_races(self):
        # v's TMA into the row operands' memory is issued after the fence that ends every read of
        # G (the detector reported it when issued before X was formed: checked).
        assert _no_races(lambda *a, interpret: hopper_fwd.intra_fwd(*a, scale=0.1, save_solve=True, interpret=interpret),
                         _inputs(1, 64, 1, 128, V=128))

    @pytest.mark.parametrize("K, V", [(128, 128), (64, 128), (128, 64)])
    def test_lowers_for_cuda(self, K, V):
        for save_solve, bf16_w in ((False, True), (True, True), (True, False)):
            f = jax.jit(lambda *a: hopper_fwd.intra_fwd(*a, scale=0.1, save_solve=save_solve, bf16_w=bf16_w))
            text = f.trace(*_inputs(1, 128, 2, K, V=V)).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("custom_call @mosaic_gpu") == 1

    def test_bad_v_raises(self):
        q, k, v, G, beta = _inputs(1, 64, 1, 64, V=64)
        for bad, match in [(v.astype(jnp.float32), "v must be bf16"), (v[..., :32], "V in"),
                           (v[:, :, :, :, None], "v must be")]:
            with pytest.raises(ValueError, match=match):
                hopper_fwd.intra_fwd(q, k, bad, G, beta, scale=0.1, interpret=True)

    def test_op_matches_option_off(self, monkeypatch):
        # Through the op (the differentiated forward saves A and M; the forward-only call writes
        # no A): the defaults (hopper_fused_wu on) against hopper_fused_wu off, the same products.
        calls = []
        real = hopper_fwd.intra_fwd
        monkeypatch.setattr(hopper_fwd, "intra_fwd", lambda *a, **kw: calls.append(kw["save_solve"]) or real(*a, **kw))
        x, _, do, dht = option_ab_inputs(74, "bfloat16", segments=False, lower_bound=-5.0, V=64, K=64, T=192)
        on = ops.KernelOptions()
        assert on.hopper_fused_wu
        off = dataclasses.replace(on, hopper_fused_wu=False)
        o, ht, grads = pallas_outputs(x, do, dht, on)
        o0, ht0, g0 = pallas_outputs(x, do, dht, off)
        assert calls == [True]
        assert_rms_close("hopper_fused_wu o", o0, o, 1e-3)
        assert_rms_close("hopper_fused_wu ht", ht0, ht, 1e-4)
        for name in GRAD_NAMES:
            assert_rms_close(f"hopper_fused_wu {name}", g0[name], grads[name], 1e-3)
        o1, _ = jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True, options=on))(
            x["q"], x["k"], x["v"], x["g"], x["beta"])
        assert calls == [True, False]
        o2, _ = jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True, options=off))(
            x["q"], x["k"], x["v"], x["g"], x["beta"])
        assert calls == [True, False]
        assert_rms_close("hopper_fused_wu forward-only o", o2, o1, 1e-3)


class TestHopperBf16W:
    """ops.KernelOptions.hopper_bf16_w (on by default since round 20): the fused forward kernel writes
    W in bf16 and its consumers (the Hopper state passes and backward kernel a) take it as it is."""

    def test_kernel_writes_rounded_w(self):
        args = _inputs(1, 64, 1, 64, V=64)
        ref = hopper_fwd.intra_fwd(*args, scale=0.125, interpret=True)
        out = hopper_fwd.intra_fwd(*args, scale=0.125, bf16_w=True, interpret=True)
        assert out[2].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2].astype(jnp.bfloat16)))
        assert_all_equal(("qg", "kd", "u", "aqk", "gl"), out[:2] + out[3:], ref[:2] + ref[3:])

    def test_op_matches_option_off(self, monkeypatch):
        # Every consumer of W in the default op (the fused state / output pass, the backward state
        # pass, backward kernel a) receives it in bf16, and since each rounded fp32 W to bf16
        # before, o, ht and every gradient are bit-identical (interpret mode).
        from pallas_kernels.kda import hopper, hopper_bwd
        seen = []
        for mod, name, i in ((hopper, "state_output_fwd", 1), (hopper, "state_bwd", 2), (hopper_bwd, "intra_bwd_a", 9)):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, _i=i, **kw: seen.append((_n, a[_i].dtype))
                                or _r(*a, **kw))
        x, _, do, dht = option_ab_inputs(80, "bfloat16", segments=False, lower_bound=-5.0, V=64, K=64, T=128)
        on = ops.KernelOptions()
        assert on.hopper_bf16_w                                # the default since round 20
        off = dataclasses.replace(on, hopper_bf16_w=False)
        o, ht, grads = pallas_outputs(x, do, dht, on)
        assert seen == [("state_output_fwd", jnp.bfloat16), ("state_bwd", jnp.bfloat16),
                        ("intra_bwd_a", jnp.bfloat16)]
        o0, ht0, g0 = pallas_outputs(x, do, dht, off)
        assert [dt for _, dt in seen[3:]] == [jnp.float32] * 3
        assert_all_equal(("o", "ht") + GRAD_NAMES, [o, ht] + [grads[n] for n in GRAD_NAMES],
                         [o0, ht0] + [g0[n] for n in GRAD_NAMES])
        # Without the fused output pass hopper.state_fwd takes the bf16 W, without the Hopper state
        # passes the Triton one (it rounds W to bf16 for its bf16-operand dot anyway): the same o.
        real = hopper.state_fwd
        monkeypatch.setattr(hopper, "state_fwd", lambda *a, **kw: seen.append(("state_fwd", a[1].dtype)) or real(*a, **kw))
        for other, expect in ((dict(hopper_fused_output=False), [("state_fwd", jnp.bfloat16), ("state_fwd", jnp.float32)]),
                              (dict(hopper_state_fwd=False), [])):
            del seen[:]
            o1, o2 = (jax.jit(lambda *a, opts=opts: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True,
                                                                   options=opts))(
                x["q"], x["k"], x["v"], x["g"], x["beta"])[0]
                for opts in (dataclasses.replace(on, **other), dataclasses.replace(off, **other)))
            assert seen == expect
            np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
        # bf16 W only with both bf16-operand state passes: with TF32 state dots W stays fp32
        del seen[:]
        jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True,
                                          options=dataclasses.replace(on, bf16_state_bwd_dots=False))[0]).trace(
            x["q"], x["k"], x["v"], x["g"], x["beta"])
        assert seen == [("state_output_fwd", jnp.float32)]

    def test_sequence_split_with_bf16_w(self):
        # The split's transitions (exact dots, Triton) read the bf16 W upcast: close to fp32 W
        # (they see W rounded as the serial passes do), two chunks in two segments.
        x, _, do, dht = option_ab_inputs(81, "bfloat16", segments=False, lower_bound=-5.0, V=64, K=64, T=128)
        on = ops.KernelOptions()
        off = dataclasses.replace(on, hopper_bf16_w=False)
        o, ht, grads = pallas_outputs(x, do, dht, on, sequence_split=1)
        o0, ht0, g0 = pallas_outputs(x, do, dht, off, sequence_split=1)
        assert_rms_close("bf16 W split o", o0, o, 1e-2)
        assert_rms_close("bf16 W split ht", ht0, ht, 1e-2)
        for name in GRAD_NAMES:
            assert_rms_close(f"bf16 W split {name}", g0[name], grads[name], 1e-2)


class TestHopperIntraFwdOption:
    """ops.KernelOptions.hopper_intra_fwd (on by default): where it applies the op's forward runs
    hopper_fwd.intra_fwd_a (Mosaic GPU interpret mode under interpret=True) and the Triton kernel b;
    ON has hopper_fused_wu off (the fused kernel, the default, is TestHopperFusedWU's and
    test_fused_wu_dispatch's), so that kernel a's own dispatch is what these tests see."""

    ON = dataclasses.replace(ops.KernelOptions(), hopper_fused_wu=False)
    OFF = dataclasses.replace(ops.KernelOptions(), hopper_intra_fwd=False)

    def test_on_by_default(self):
        assert ops.KernelOptions().hopper_intra_fwd and ops.KernelOptions().hopper_fused_wu

    @staticmethod
    def _count_calls(monkeypatch):
        calls = []
        real = hopper_fwd.intra_fwd_a
        monkeypatch.setattr(hopper_fwd, "intra_fwd_a", lambda *a, **kw: calls.append(kw["save_solve"]) or real(*a, **kw))
        return calls

    def test_op_matches_option_off(self, monkeypatch, K=64):
        # Against the same options with the Triton kernel a: the same products, so o, ht and the
        # gradients agree to fp32 summation order (bf16 outputs: a rounding flip at most). K = 128
        # runs through the op in test_errors_vs_fp32_unchanged (CI time).
        calls = self._count_calls(monkeypatch)
        x, _, do, dht = option_ab_inputs(72, "bfloat16", segments=False, lower_bound=-5.0, V=K, K=K, T=192)
        o, ht, grads = pallas_outputs(x, do, dht, self.ON)
        assert calls == [True]                       # the differentiated forward, M saved
        o0, ht0, g0 = pallas_outputs(x, do, dht, self.OFF)
        assert_rms_close("hopper_intra_fwd o", o0, o, 1e-3)
        assert_rms_close("hopper_intra_fwd ht", ht0, ht, 1e-4)
        for name in GRAD_NAMES:
            assert_rms_close(f"hopper_intra_fwd {name}", g0[name], grads[name], 1e-3)
        # the forward-only call (no M)
        jax.block_until_ready(ops.kda_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], lower_bound=-5.0,
                                             interpret=True, options=self.ON))
        assert calls == [True, False]

    def test_errors_vs_fp32_unchanged(self):
        # The bf16 outputs' errors against the fp32 path (the same inputs upcast) are the Triton
        # kernel a's to within 1%.
        x, _, do, dht = option_ab_inputs(73, "bfloat16", segments=False, lower_bound=-5.0, V=128, K=128, T=128)
        ref = pallas_outputs({n: a.astype(jnp.float32) for n, a in x.items()}, do, dht, ops.KernelOptions())
        off = pallas_outputs(x, do, dht, self.OFF)
        on = pallas_outputs(x, do, dht, self.ON)
        for i, name in ((0, "o"), (1, "ht")):
            e_off, e_on = rms_ratio(ref[i], off[i]), rms_ratio(ref[i], on[i])
            assert e_on <= 1.01 * e_off + 1e-6, (name, e_on, e_off)
        for name in GRAD_NAMES:
            e_off, e_on = rms_ratio(ref[2][name], off[2][name]), rms_ratio(ref[2][name], on[2][name])
            assert e_on <= 1.01 * e_off + 1e-6, (name, e_on, e_off)

    def test_not_used_where_it_does_not_apply(self, monkeypatch):
        # (ON has hopper_fused_wu off; the default's fused kernel, hopper_fwd.intra_fwd, is counted too)
        from pallas_kernels.kda import hopper
        monkeypatch.setattr(hopper, "is_hopper", lambda device=None: False)       # any host, an H200 too
        calls = self._count_calls(monkeypatch)
        real_fused = hopper_fwd.intra_fwd
        monkeypatch.setattr(hopper_fwd, "intra_fwd", lambda *a, **kw: calls.append("fused") or real_fused(*a, **kw))
        sd = jax.ShapeDtypeStruct

        def trace(base, K, dtype, interpret, lower_bound=-5.0, segments=False, **opts):
            q, g, beta = sd((1, 128, 1, K), dtype), sd((1, 128, 1, K), jnp.float32), sd((1, 128, 1), dtype)
            options = dataclasses.replace(base, **opts)
            seg = jnp.zeros((1, 128), jnp.int32) if segments else None
            jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=lower_bound, interpret=interpret, options=options,
                                              segment_ids=seg)[0]).trace(q, q, q, g, beta)
        for base, used in ((self.ON, [False]), (ops.KernelOptions(), ["fused"])):
            del calls[:]
            for K, dtype, interpret, lb, segments, opts in [
                    (64, jnp.float32, True, -5.0, False, {}), (32, jnp.bfloat16, True, -5.0, False, {}),
                    (64, jnp.bfloat16, False, -5.0, False, {}), (64, jnp.bfloat16, True, None, False, {}),
                    (64, jnp.bfloat16, True, -5.0, True, {}),
                    (64, jnp.bfloat16, True, -5.0, False, dict(xla_gate_cumsum=False)),
                    (64, jnp.bfloat16, True, -5.0, False, dict(bf16_intra_dots=False)),
                    (64, jnp.bfloat16, True, -5.0, False, dict(split_intra_fwd=False)),
                    (64, jnp.bfloat16, True, -5.0, False, dict(hopper_intra_fwd=False))]:
                trace(base, K, dtype, interpret, lb, segments, **opts)
            assert calls == []
            trace(base, 64, jnp.bfloat16, True)
            assert calls == used

    def test_fused_wu_dispatch(self, monkeypatch):
        # hopper_fused_wu takes hopper_fwd.intra_fwd only where hopper_intra_fwd applies and V is in
        # HEAD_DIMS; V = 32 falls back to intra_fwd_a + the Triton kernel b; hopper_intra_fwd off
        # takes neither Mosaic GPU kernel.
        calls = []
        for name in ("intra_fwd_a", "intra_fwd"):
            real = getattr(hopper_fwd, name)
            monkeypatch.setattr(hopper_fwd, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
        sd = jax.ShapeDtypeStruct

        def trace(V, **opts):
            q, g = sd((1, 128, 1, 64), jnp.bfloat16), sd((1, 128, 1, 64), jnp.float32)
            v, beta = sd((1, 128, 1, V), jnp.bfloat16), sd((1, 128, 1), jnp.bfloat16)
            options = dataclasses.replace(self.ON, hopper_fused_wu=True, **opts)
            jax.jit(lambda *a: ops.kda_pallas(*a, lower_bound=-5.0, interpret=True, options=options)[0]).trace(
                q, q, v, g, beta)
            out = list(calls)
            calls.clear()
            return out
        assert trace(64) == ["intra_fwd"]
        assert trace(32) == ["intra_fwd_a"]
        assert trace(64, hopper_intra_fwd=False) == []

    def test_defaults_lower_for_cuda_on_hopper(self):
        # The default options on a (faked) sm_90 GPU: the gradient lowers with four Mosaic GPU calls
        # (the fused forward kernel with bf16 W, the fused state / output pass, the backward state
        # pass, backward kernel a) and the Triton cumsums and backward kernel b.
        text = lowered_grad_text(ops.KernelOptions(), hopper_passes=True)
        assert text.count("custom_call @mosaic_gpu") == 4
        assert text.count("__gpu$xla.gpu.triton") == 3
        # each Mosaic GPU kernel under its own name (what profilers show: profile_kda_peers)
        for name in ("kda_intra_fwd_hopper", "kda_state_output_fwd_hopper", "kda_state_bwd_hopper",
                     "kda_intra_bwd_a_hopper"):
            assert name in text, name
        for name in ("kda_intra_fwd_a_hopper", "kda_state_fwd_hopper", "kda_intra_bwd_b_hopper"):
            assert name not in text, name

    def test_op_lowers_for_cuda_on_hopper(self):
        # With the device taken for an sm_90 GPU and the option on, the gradient lowers with the
        # forward kernel a as a fourth Mosaic GPU call in place of the Triton kernel a.
        on = lowered_grad_text(self.ON, hopper_passes=True)
        off = lowered_grad_text(self.OFF, hopper_passes=True)
        assert on.count("custom_call @mosaic_gpu") == off.count("custom_call @mosaic_gpu") + 1
        assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton") - 1


@pytest.mark.gpu
class TestHopperIntraFwdGPU:
    """Compiled on the H200 against the compiled Triton kernel a."""

    @pytest.mark.parametrize("shape", [(2, 1024, 4, 128), (8, 4096, 16, 128), (2, 1024, 4, 64)])
    def test_matches_triton_kernel_a(self, shape):
        errs = _check_matches_triton(shape, False, dict(qg=1e-3, kd=1e-3, aqk=1e-3, gl=1e-5, A=1e-3, M=1e-4))
        print(shape, {k: f"{v:.2g}" for k, v in errs.items()})

    @pytest.mark.parametrize("shape", [(8, 4096, 16, 128), (2, 1024, 4, 64)])
    def test_fused_wu_matches_triton_pair(self, shape):
        # hopper_fwd.intra_fwd (W, U fused; round 18) against the compiled Triton kernels a and b.
        B, T, H, K = shape
        args = _inputs(B, T, H, K, V=128)
        ref = jax.jit(lambda *a: fwd.intra_fwd_split(*a, scale=K ** -0.5, chunk_size=64, interpret=False,
                                                     factor_dtype=ops.factor_dtypes(jnp.bfloat16), save_solve=True,
                                                     bf16_dots=True, gate_cumsum=True))(*args)
        out = jax.jit(lambda *a: hopper_fwd.intra_fwd(*a, scale=K ** -0.5, save_solve=True))(*args)
        tol = dict(qg=1e-3, kd=1e-3, w=1e-4, u=1e-4, aqk=1e-3, gl=1e-5, A=1e-3, M=1e-4)
        errs = {name: assert_rms_close(f"fused W / U {name} {shape}", r, o, tol[name])
                for name, o, r in zip(("qg", "kd", "w", "u", "aqk", "gl", "A", "M"), out, ref)}
        print(shape, {k: f"{v:.2g}" for k, v in errs.items()})
