"""Pallas KDA kernels (pallas_kernels.kda) against a token-by-token fp32 recurrence.

Interpret-mode tests run on CPU in CI (small shapes); `gpu`-marked tests run on the H200 machine.
Error metric: RMS(ref - out) / RMS(ref) (fla's); bf16 tolerances are fla's: o and final state 0.005,
dq/dk/dv/dh0 0.008, dg/dbeta 0.02.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import ops

BF16_TOL = dict(o=0.005, final_state=0.005, q=0.008, k=0.008, v=0.008, h0=0.008, g=0.02, beta=0.02)
FP32_TOL = {name: 1e-4 for name in BF16_TOL}
NAMES = ("q", "k", "v", "g", "beta", "h0")


def recurrent(q, k, v, g, beta, h0, scale):
    """fp32 oracle (Kimi Linear Eq. 1, decay first as fla's naive): [B,T,H,*] -> (o, final state)."""
    def step(S, x):
        qt, kt, vt, gt, bt = x
        S = S * jnp.exp(gt)[..., None]
        pred = jnp.einsum("bhk,bhkv->bhv", kt, S, precision="highest")
        S = S + bt[..., None, None] * kt[..., None] * (vt - pred)[..., None, :]
        return S, jnp.einsum("bhk,bhkv->bhv", qt * scale, S, precision="highest")

    xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    S, o = jax.lax.scan(step, h0.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), S


def make_inputs(key, B, T, H, K, V, dtype, gate="random"):
    """ANCHORS.md recipe: q ~ N(0,1), k L2-normalised, v ~ N(0,1), g = -5 sigmoid(N(0,1)), beta = sigmoid(N)."""
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (B, T, H, K)).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V)).astype(dtype)
    if gate == "random":
        g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    else:                                   # every gate at the declared bound: the worst tiles
        g = jnp.full((B, T, H, K), -5.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(dtype)
    h0 = jax.random.normal(ks[5], (B, H, K, V))
    do = jax.random.normal(ks[6], (B, T, H, V))
    dht = jax.random.normal(ks[7], (B, H, K, V))
    return (q, k, v, g, beta, h0), (do, dht)


def rms_ratio(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def pallas_fn(interpret):
    def f(q, k, v, g, beta, h0):
        return ops.kda_pallas(q, k, v, g, beta, lower_bound=-5.0, initial_state=h0,
                              output_final_state=True, interpret=interpret)
    return f


def check_against_oracle(f, inputs, cts, tol, grads=True):
    """Forward (o, final state) and every gradient of <o, do> + <S_T, dS_T> vs the oracle."""
    q, k, v, g, beta, h0 = inputs
    scale = q.shape[-1] ** -0.5
    ref = lambda *a: recurrent(*a, scale)                                     # noqa: E731
    do, dht = cts

    def loss(fn):
        def L(*a):
            o, S = fn(*a)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dht)
        return L

    o, S = jax.jit(f)(*inputs)
    ro, rS = ref(*inputs)
    assert o.dtype == v.dtype and S.dtype == jnp.float32
    errors = {"o": rms_ratio(o, ro), "final_state": rms_ratio(S, rS)}
    if grads:
        got = jax.jit(jax.grad(loss(f), argnums=range(6)))(*inputs)
        want = jax.grad(loss(ref), argnums=range(6))(*inputs)
        for name, a, b in zip(NAMES, got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            errors[name] = rms_ratio(a, b)
    bad = {n: (e, tol[n]) for n, e in errors.items() if not e <= tol[n]}
    assert not bad, f"errors above tolerance: {bad}; all: {errors}"
    return errors


class TestKDAPallasInterpret:
    """Kernel bodies in interpret mode on CPU (the CI run)."""

    interpret = True
    fp32_tol = FP32_TOL

    def test_fp32_ragged_shapes(self):
        # T not a multiple of the chunk (64), K and V not powers of two: padding paths.
        inputs, cts = make_inputs(jax.random.PRNGKey(0), 1, 100, 2, 24, 40, jnp.float32)
        check_against_oracle(pallas_fn(self.interpret), inputs, cts, self.fp32_tol)

    def test_bf16_fla_tolerances(self):
        inputs, cts = make_inputs(jax.random.PRNGKey(1), 1, 192, 1, 64, 64, jnp.bfloat16)
        check_against_oracle(pallas_fn(self.interpret), inputs, cts, BF16_TOL)

    def test_gates_at_lower_bound(self):
        # g = -5 on every channel: diagonal tiles reach exp(+75) before the select mask.
        inputs, cts = make_inputs(jax.random.PRNGKey(2), 1, 128, 1, 32, 32, jnp.float32,
                                  gate="bound")
        check_against_oracle(pallas_fn(self.interpret), inputs, cts, self.fp32_tol, grads=False)

    def test_no_initial_state_no_final_state(self):
        (q, k, v, g, beta, _), _ = make_inputs(jax.random.PRNGKey(3), 2, 64, 1, 16, 16, jnp.float32)
        o, S = ops.kda_pallas(q, k, v, g, beta, lower_bound=-5.0, interpret=self.interpret)
        ro, _ = recurrent(q, k, v, g, beta, jnp.zeros((2, 1, 16, 16)), 16 ** -0.5)
        assert S is None
        assert rms_ratio(o, ro) < self.fp32_tol["o"]


class TestSupported:
    def _inputs(self, K=32, V=32, dtype=jnp.bfloat16):
        q = jax.ShapeDtypeStruct((1, 64, 2, K), dtype)
        v = jax.ShapeDtypeStruct((1, 64, 2, V), dtype)
        g = jax.ShapeDtypeStruct((1, 64, 2, K), jnp.float32)
        beta = jax.ShapeDtypeStruct((1, 64, 2), dtype)
        return q, q, v, g, beta

    def test_supported_call(self):
        assert ops.supported(*self._inputs(), lower_bound=-5.0) == (True, "")

    @pytest.mark.parametrize("kwargs, word", [
        (dict(lower_bound=None), "lower_bound"),
        (dict(lower_bound=-6.0), "lower_bound"),
        (dict(lower_bound=-5.0, segment_ids=np.zeros((1, 64), np.int32)), "segment_ids"),
        (dict(lower_bound=-5.0, use_qk_l2norm=True), "use_qk_l2norm"),
        (dict(lower_bound=-5.0, chunk_size=32), "chunk_size"),
    ])
    def test_unsupported_options(self, kwargs, word):
        ok, why = ops.supported(*self._inputs(), **kwargs)
        assert not ok and word in why

    def test_unsupported_shapes_and_dtypes(self):
        assert not ops.supported(*self._inputs(K=256), lower_bound=-5.0)[0]
        q, k, v, g, beta = self._inputs()
        v16 = jax.ShapeDtypeStruct(v.shape, jnp.float16)
        assert "dtype" in ops.supported(q, k, v16, g, beta, lower_bound=-5.0)[1]

    def test_kda_pallas_raises_with_reason(self):
        (q, k, v, g, beta, _), _ = make_inputs(jax.random.PRNGKey(4), 1, 16, 1, 16, 16, jnp.float32)
        with pytest.raises(ValueError, match="lower_bound"):
            ops.kda_pallas(q, k, v, g, beta, lower_bound=-8.0, interpret=True)


@pytest.mark.gpu
class TestKDAPallasGPU(TestKDAPallasInterpret):
    """The same checks compiled for the GPU (Triton lowering), plus long sequences at K = V = 128."""

    interpret = False
    fp32_tol = {name: 2e-3 for name in BF16_TOL}   # fp32 dots at default precision are TF32 on GPU

    @pytest.mark.parametrize("B, T, H", [(2, 1000, 4), (1, 8192, 2)])
    def test_bf16_long(self, B, T, H):
        inputs, cts = make_inputs(jax.random.PRNGKey(5), B, T, H, 128, 128, jnp.bfloat16)
        errors = check_against_oracle(pallas_fn(False), inputs, cts, BF16_TOL)
        print(f"\nGPU bf16 B={B} T={T} H={H} K=V=128 errors: {errors}")

    def test_million_tokens_finite(self):
        T = 1 << 20
        (q, k, v, g, beta, h0), _ = make_inputs(jax.random.PRNGKey(6), 1, T, 1, 128, 128,
                                                jnp.bfloat16)
        o, S = jax.jit(pallas_fn(False))(q, k, v, g, beta, h0)
        assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(S)))
        # the tail depends only on the recent past (decay), so a window of it matches the oracle
        W = 4096
        sl = lambda x: x[:, T - W:]                                           # noqa: E731
        ro, _ = recurrent(sl(q), sl(k), sl(v), sl(g), sl(beta), jnp.zeros_like(h0), 128 ** -0.5)
        assert rms_ratio(o[:, T - W + 512:], ro[:, 512:]) < BF16_TOL["o"]
