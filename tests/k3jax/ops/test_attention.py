"""Causal softmax attention with document masks: every implementation against an fp32 softmax written
out by hand (forward and the three gradients, at loss scales of order 1 and 1/tokens), dispatch and
errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attention as A


def _reference(q, k, v, segment_ids):
    """fp32 softmax(q k^T * Dh^-1/2 + mask) v, materialised (the oracle)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    T = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _segments(B, T, seed=0):
    """Packed documents with boundaries at a random place, at the 32-token tile edges and one of length 1."""
    rng = np.random.default_rng(seed)
    cuts = np.zeros((B, T), np.int32)
    for b in range(B):
        points = {31, 32, 33, int(rng.integers(1, T))}
        cuts[b, sorted(p for p in points if p < T)] = 1
    return jnp.asarray(np.cumsum(cuts, axis=1) + 1, jnp.int32)


def _inputs(B, T, H, Dh, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (B, T, H, Dh), jnp.float32).astype(dtype) for kk in ks[:3])
    do = jax.random.normal(ks[3], (B, T, H, Dh), jnp.float32)
    return q, k, v, do


INTERPRET = jax.default_backend() != "gpu"  # compiled kernels on a GPU, Pallas interpret mode elsewhere


def _check(implementation, B, T, H, Dh, dtype, segments, cotangent_scale, interpret=INTERPRET):
    if not A.supported(implementation, *(jax.ShapeDtypeStruct((B, T, H, Dh), dtype),) * 3, interpret=interpret)[0]:
        pytest.skip(f"{implementation} does not run {dtype} here")
    q, k, v, do = _inputs(B, T, H, Dh, dtype)
    seg = _segments(B, T) if segments else None
    do = do * cotangent_scale

    def run(fn, *xs):
        out, vjp = jax.vjp(fn, *xs)
        return (out, *vjp(do.astype(out.dtype)))

    got = run(lambda q, k, v: A.causal_attention(q, k, v, segment_ids=seg, implementation=implementation,
                                                 interpret=interpret), q, k, v)
    want = run(lambda q, k, v: _reference(q, k, v, seg), *(x.astype(jnp.float32) for x in (q, k, v)))
    # fla's style: error RMS relative to the reference RMS; bf16 inputs round every operand once
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ratio = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))
        assert ratio < tol, (implementation, name, ratio)


@pytest.mark.parametrize("implementation", A.IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("cotangent_scale", [1.0, 1.0 / (2 * 128)])
def test_matches_the_fp32_softmax(implementation, dtype, segments, cotangent_scale):
    _check(implementation, 2, 128, 2, 32, dtype, segments, cotangent_scale)


@pytest.mark.gpu  # K3-small attention shape, compiled on a GPU
@pytest.mark.parametrize("implementation", ["pallas_triton", "cudnn", "jla"])
@pytest.mark.parametrize("segments", [False, True])
def test_gpu_training_shape_matches_the_fp32_softmax(implementation, segments):
    _check(implementation, 2, 2048, 2, 128, jnp.bfloat16, segments, 1.0 / (2 * 2048))


@pytest.mark.gpu
def test_gpu_jla_unsorted_and_repeated_document_ids():
    """jla skips key blocks from the runs of equal ids; ids that recur later in a row (no block may be
    skipped) and unsorted corpus ids must still give the exact document mask."""
    B, T, H, Dh = 2, 1024, 2, 128
    if not A.supported("jla", *(jax.ShapeDtypeStruct((B, T, H, Dh), jnp.bfloat16),) * 3)[0]:
        pytest.skip("jla does not run here")
    q, k, v, do = _inputs(B, T, H, Dh, jnp.bfloat16)
    t = np.arange(T)
    seg = jnp.asarray(np.stack([np.where(t < 300, 8812, np.where(t < 700, 77, 5021)),  # unsorted ids
                                np.where((t // 200) % 2 == 0, 1, 2)]), jnp.int32)     # 1, 2, 1, 2, ...
    out, vjp = jax.vjp(lambda q, k, v: A.causal_attention(q, k, v, segment_ids=seg, implementation="jla"), q, k, v)
    want, vjp_ref = jax.vjp(lambda q, k, v: _reference(q, k, v, seg), *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("o", "dq", "dk", "dv"), (out, *vjp(do.astype(out.dtype) / T)), (want, *vjp_ref(do / T))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("cotangent_scale", [1.0, 1.0 / (2 * 200)])
def test_gpu_jla_head_dim_64_padded_length_and_one_token_documents(cotangent_scale):
    """jla at Dh 64 with T = 200 (padded to 256 inside jla), documents of one token and random cuts."""
    B, T, H, Dh = 2, 200, 2, 64
    if not A.supported("jla", *(jax.ShapeDtypeStruct((B, T, H, Dh), jnp.bfloat16),) * 3)[0]:
        pytest.skip("jla does not run here")
    q, k, v, do = _inputs(B, T, H, Dh, jnp.bfloat16)
    seg = np.array(_segments(B, T))  # a writable copy
    seg[1, 100:110] = np.arange(1000, 1010)  # ten one-token documents, then the row's last document again
    seg = jnp.asarray(seg)
    out, vjp = jax.vjp(lambda q, k, v: A.causal_attention(q, k, v, segment_ids=seg, implementation="jla"), q, k, v)
    want, vjp_ref = jax.vjp(lambda q, k, v: _reference(q, k, v, seg), *(x.astype(jnp.float32) for x in (q, k, v)))
    do = do * cotangent_scale
    for name, a, b in zip(("o", "dq", "dk", "dv"), (out, *vjp(do.astype(out.dtype))), (want, *vjp_ref(do))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)) < 2e-2, name


def test_jla_that_cannot_be_imported_is_refused_not_raised(monkeypatch):
    """A jla that is missing or fails to import (e.g. built for another jax) refuses the call, so
    implementation=None falls back to cuDNN instead of crashing."""
    def broken():
        raise ImportError("jla built against another jaxlib")
    monkeypatch.setattr(A.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(A, "_jla_attention", broken)
    q = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    ok, why = A.supported("jla", q, q, q)
    assert not ok and "could not be imported" in why and "another jaxlib" in why
    assert A.default_implementation(q, q, q) == "cudnn"

    def missing():
        raise ModuleNotFoundError("No module named 'jla'")
    monkeypatch.setattr(A, "_jla_attention", missing)
    ok, why = A.supported("jla", q, q, q)
    assert not ok and why.startswith("jla (jax-linear-attention) is not installed (No module named 'jla'")


def test_one_document_per_token_attends_to_itself_only():
    q, k, v, _ = _inputs(1, 64, 1, 16, jnp.bfloat16)
    seg = jnp.arange(1, 65, dtype=jnp.int32)[None]
    for implementation in A.IMPLEMENTATIONS:
        if A.supported(implementation, q, k, v, segment_ids=seg, interpret=INTERPRET)[0]:
            out = A.causal_attention(q, k, v, segment_ids=seg, implementation=implementation, interpret=INTERPRET)
            np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(v, np.float32), atol=1e-2)


def test_dispatch_and_errors():
    q = jax.ShapeDtypeStruct((2, 100, 2, 32), jnp.bfloat16)
    assert A.supported("xla", q, q, q) == (True, "")
    ok, why = A.supported("pallas_triton", q, q, q, interpret=True)
    assert not ok and "multiple of 128" in why
    ok, why = A.supported("pallas_triton", jax.ShapeDtypeStruct((2, 128, 2, 48), jnp.bfloat16), q, q, interpret=True)
    assert not ok and "power-of-two head dim" in why
    if jax.default_backend() != "gpu":
        assert A.default_implementation(q, q, q) == "xla"
        assert "CUDA GPU" in A.supported("cudnn", q, q, q)[1]
        assert "CUDA GPU" in A.supported("jla", q, q, q)[1]
        with pytest.raises(ValueError, match="pallas_triton.*cannot run this call"):
            A.causal_attention(*(jnp.zeros((1, 128, 1, 16)),) * 3, implementation="pallas_triton")
    with pytest.raises(ValueError, match="implementation must be one of"):
        A.supported("flash", q, q, q)
    x = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="segment_ids must be"):
        A.causal_attention(x, x, x, segment_ids=jnp.ones((1, 63), jnp.int32))


def test_attention_layers_share_one_kernel_lowering():
    # Two attention layers on the same shapes, differentiated: jax's Pallas Triton flash kernels are lowered
    # once (one jit per kernel and shapes; experiments/results/lowering_cpu.md).
    from unittest import mock

    from tests.pallas_kernels.kda.test_api import fake_h200
    q = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

    def layer(x):
        return A.causal_attention(x, x, x, implementation="pallas_triton")

    def loss(f):  # the value too, so that neither layer is dead code
        return jax.value_and_grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))
    with fake_h200(True), mock.patch.object(jax, "default_backend", lambda: "gpu"):
        one, two = (jax.jit(loss(f)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
                    for f in (layer, lambda x: layer(layer(x))))
    calls = [t.count("__gpu$xla.gpu.triton") for t in (one, two)]
    assert calls[0] == calls[1] >= 2, calls


def test_jla_attention_layers_share_one_traced_kernel(monkeypatch):
    # jla's kernels go through their own jit (`_jla_flash`): two layers on the same shapes call one traced
    # function, lowered once (the 32-layer depth model lowered 96 of jla's Mosaic GPU kernels before, 3 after:
    # experiments/results/lowering_cpu.md). A stand-in module plays jla's flash attention.
    import types

    from tests.jaxpr_testing import jit_calls, shared
    stand_in = types.SimpleNamespace(
        supported=lambda q, k, v: None,
        flash_attention=lambda q, k, v, *, segment_ids, scale: _reference(q, k, v, segment_ids).astype(q.dtype))
    monkeypatch.setattr(A, "_jla_attention", lambda: stand_in)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.ones((2, 128, 2, 64), jnp.bfloat16)
    seg = jnp.zeros((2, 128), jnp.int32)

    def two_layers(x):
        return A.causal_attention(A.causal_attention(x, x, x, segment_ids=seg, implementation="jla"), x, x,
                                  segment_ids=seg, implementation="jla")
    calls = jit_calls(jax.make_jaxpr(two_layers)(q), "_jla_flash")
    assert len(calls) == 2 and shared(calls) == 1
