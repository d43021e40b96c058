"""Block Attention Residuals: depth attention, block bookkeeping, references, article variant, NNX."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.nn.residuals import BlockScale, DepthMix
from k3jax.ops import residuals as R

B, T, D = 2, 3, 16


def _np_mix(sources, w, gamma, eps=1e-6, num_valid=None):
    """Per-source float64 loop: softmax_s(w · RMSNorm_γ(x_s)) weighted sum of the raw sources."""
    sources = [np.asarray(s, np.float64) for s in sources]
    if num_valid is not None:
        sources = sources[:num_valid]
    w, gamma = np.asarray(w, np.float64), np.asarray(gamma, np.float64)
    logits = []
    for x in sources:
        key = gamma * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        logits.append(np.sum(key * w, axis=-1))
    logits = np.stack(logits)
    weights = np.exp(logits - logits.max(0))
    weights /= weights.sum(0)
    out = sum(weights[s][..., None] * x for s, x in enumerate(sources))
    return out, weights


def _rmsnorm(h, eps=0.0):
    h32 = h.astype(jnp.float32)
    return h32 / jnp.sqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)


def _np_sublayer(h, W, scale=0.5):
    """float64 twin of `_sublayers`' functions."""
    h = np.asarray(h, np.float64)
    return scale * np.tanh((h / np.sqrt(np.mean(h * h, -1, keepdims=True))) @ np.asarray(W, np.float64))


def _sublayers(seed, num, d=D, scale=0.5):
    """Random PreNorm sublayers f_l(h) = scale · tanh(RMSNorm(h) W_l) (scale-invariant: eps = 0); the
    product in IEEE fp32 on every backend (a GPU's default is TF32), as their float64 twins expect."""
    ws = _randn(seed, (num, d, d)) / np.sqrt(d)
    return [(lambda h, W=ws[l]: (scale * jnp.tanh(jnp.matmul(_rmsnorm(h), W, precision="highest"))).astype(h.dtype))
            for l in range(num)], ws


def _randn(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


_depth_attention = jax.jit(R.depth_attention, static_argnames=("eps", "return_weights"))


def _jit_forward(fn, fs, layout, **kw):
    """jit a reference forward (one compile per test instead of one per eager op)."""
    return jax.jit(lambda *args: fn(args[0], fs, layout, *args[1:], **kw))


# --------------------------------------------------------------------------------------------------
# depth_attention
# --------------------------------------------------------------------------------------------------
def test_zero_pseudo_query_gives_uniform_weights_and_the_mean():
    x = _randn(0, (5, B, T, D), 3.0)
    gamma = 1.0 + _randn(1, (D,), 0.5)  # any key scale: the logits are still 0
    out, w = _depth_attention(x, np.zeros(D, np.float32), gamma, return_weights=True)
    np.testing.assert_allclose(w, np.full((5, B, T), 0.2), rtol=0, atol=1e-7)
    np.testing.assert_allclose(out, np.mean(x, axis=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, B, T, D), (4, B, T, D), (3, 1, 5, 24)])
def test_depth_attention_matches_per_source_loop(shape):
    s, d = shape[0], shape[-1]
    # sources of very different magnitudes: RMSNorm on keys makes the logits magnitude-free
    x = _randn(2, shape) * (10.0 ** np.arange(s, dtype=np.float32) / 10.0)[:, None, None, None]
    w, gamma = _randn(3, (d,), 2.0), 1.0 + _randn(4, (d,), 0.3)
    ref_out, ref_w = _np_mix(list(x), w, gamma)
    for sources in (x, list(x)):  # stacked array and sequence give the same result
        out, weights = _depth_attention(sources, w, gamma, return_weights=True)
        chex.assert_shape(out, shape[1:])
        chex.assert_shape(weights, shape[:-1])
        np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5 * float(np.abs(ref_out).max()))
        np.testing.assert_allclose(np.sum(weights, axis=0), 1.0, atol=1e-6)


def test_weights_sum_to_one_and_values_are_not_normalised():
    x = _randn(5, (3, B, T, D))
    x[1] *= 100.0
    out, w = _depth_attention(x, _randn(6, (D,), 3.0), np.ones(D, np.float32), return_weights=True)
    np.testing.assert_allclose(np.sum(w, axis=0), 1.0, atol=1e-6)
    assert np.all(np.asarray(w) > 0)
    # raw values: the output is the weighted sum of the unnormalised sources
    np.testing.assert_allclose(out, np.einsum("sbt,sbtd->btd", np.asarray(w, np.float64), x), rtol=1e-5, atol=1e-4)


def test_num_valid_masking_equals_slicing_static_traced_and_stale_slots():
    x = _randn(7, (5, B, T, D))
    w, gamma = _randn(8, (D,), 2.0), 1.0 + _randn(9, (D,), 0.2)
    masked_fn = jax.jit(lambda x, n: R.depth_attention(x, w, gamma, num_valid=n, return_weights=True))
    for n in range(1, 6):
        ref_out, ref_w = _np_mix(list(x[:n]), w, gamma)
        results = [masked_fn(x, jnp.int32(n))]
        if n in (1, 5):  # the static-int path too (eager, two values keep the test fast)
            results.append(R.depth_attention(x, w, gamma, num_valid=n, return_weights=True))
        for out, weights in results:
            np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(weights[:n], ref_w, rtol=1e-5, atol=1e-6)
            assert np.all(np.asarray(weights[n:]) == 0.0)
        # huge finite garbage in the masked slots changes nothing
        stale = x.copy()
        stale[n:] = 1e30
        np.testing.assert_array_equal(masked_fn(stale, jnp.int32(n))[0], results[0][0])


def test_bf16_sources_keep_fp32_softmax():
    x16 = jnp.asarray(_randn(10, (4, B, T, D))).astype(jnp.bfloat16)
    # a pseudo-query big enough that bf16 logits/softmax would be off by ~1e-2
    w, gamma = _randn(11, (D,), 4.0), np.ones(D, np.float32)
    out, weights = _depth_attention(x16, w, gamma, return_weights=True)
    assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.float32
    x_up = np.asarray(x16.astype(jnp.float32))
    ref_out, ref_w = _np_mix(list(x_up), w, gamma)  # the same bf16 values, float64 math
    np.testing.assert_allclose(weights, ref_w, rtol=2e-5, atol=2e-6)
    # output: the fp32 result rounded once to bf16 (≤ 1/2 bf16 ulp = 2^-9 relative)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, rtol=2 ** -8, atol=1e-6)
    # the same weights computed from bf16 keys/logits are far worse: the fp32 path is what runs
    key16 = (x_up / np.sqrt(np.mean(x_up ** 2, -1, keepdims=True))).astype(jnp.bfloat16)
    logits16 = (key16 * jnp.asarray(w, jnp.bfloat16)).sum(-1, dtype=jnp.bfloat16)
    w16 = np.asarray(jax.nn.softmax(logits16, axis=0).astype(jnp.float32))
    assert np.max(np.abs(w16 - ref_w)) > 50 * np.max(np.abs(np.asarray(weights) - ref_w))


# --------------------------------------------------------------------------------------------------
# Block bookkeeping
# --------------------------------------------------------------------------------------------------
def test_block_layout_fields_and_equal_split_rule():
    lay = R.block_layout(2, 2)  # 4 sublayers in 2 blocks
    assert lay.block_sizes == (2, 2)
    assert lay.block_id == (1, 1, 2, 2)
    assert lay.position_in_block == (1, 2, 1, 2)
    assert lay.closes_block == (False, True, False, True)
    assert lay.starts_block == (True, False, True, False)
    assert lay.num_sources == (1, 2, 2, 3)
    assert lay.max_sources == 3 and lay.final_num_sources == 3 and lay.num_sublayers == 4
    assert R.block_layout(2, 2, unit="layers") == dataclasses.replace(lay, unit="layers")
    # extra units go to the first blocks
    assert R.block_layout(5, 3).block_sizes == (4, 3, 3)
    assert R.block_layout(5, 2, unit="layers").block_sizes == (6, 4)
    assert R.block_layout(4, 3).block_sizes == (3, 3, 2)
    assert R.block_layout(4, 3).closes_block == (False, False, True) * 2 + (False, True)
    scan = R.block_layout(4, 3).scan_inputs()
    np.testing.assert_array_equal(scan["slot"], [1, 1, 1, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(scan["num_valid"], [1, 2, 2, 2, 3, 3, 3, 4])
    assert scan["slot"].dtype == np.int32
    # K3: 93 layers in 8 blocks of whole layers -> 12 layers in the first 5 blocks, 11 in the last 3
    k3 = R.block_layout(93, 8, unit="layers")
    assert k3.block_sizes == (24,) * 5 + (22,) * 3 and k3.max_sources == 9
    hash(k3)  # usable as a jit static argument


def test_two_blocks_four_sublayers_hand_unrolled():
    """L = 4 sublayers, N = 2 blocks of 2, written out by hand from the paper's recursion."""
    e = _randn(12, (B, T, D))
    fs, ws = _sublayers(13, 4)
    W, G = _randn(14, (5, D), 1.5), 1.0 + _randn(15, (5, D), 0.3)
    mix = lambda k, srcs: _np_mix(srcs, W[k], G[k])[0]  # noqa: E731
    f = lambda k, h: _np_sublayer(h, ws[k])  # noqa: E731

    h1 = mix(0, [e])                       # block 1, i = 1: only b_0 (the empty partial is no source)
    v1 = f(0, h1)
    h2 = mix(1, [e, v1])                   # block 1, i = 2: [b_0, b_1^1]
    v2 = f(1, h2)
    b1 = v1 + v2                           # block 1 closes: b_1 = f_1 + f_2
    h3 = mix(2, [e, b1])                   # block 2, i = 1: [b_0, b_1]
    v3 = f(2, h3)
    h4 = mix(3, [e, b1, v3])               # block 2, i = 2: [b_0, b_1, b_2^1]
    v4 = f(3, h4)
    b2 = v3 + v4
    final = mix(4, [e, b1, b2])            # final mix over [b_0, b_1, b_2]

    res = _jit_forward(R.attnres_forward, fs, R.block_layout(2, 2))(e, W, G)
    np.testing.assert_array_equal(res.sublayer_inputs[0], e)
    for got, want in zip(res.sublayer_inputs, (h1, h2, h3, h4)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.hidden, final, rtol=1e-5, atol=1e-5)
    assert [w.shape[0] for w in res.depth_weights] == [1, 2, 2, 3, 3]


def test_full_attnres_is_n_equals_l():
    L = 6
    lay = R.block_layout(L // 2, L)
    assert lay.block_sizes == (1,) * L and all(lay.closes_block)
    assert lay.num_sources == tuple(range(1, L + 1)) and lay.max_sources == L + 1
    e = _randn(16, (B, T, D))
    fs, ws = _sublayers(17, L)
    W, G = _randn(18, (L + 1, D), 1.0), 1.0 + _randn(19, (L + 1, D), 0.2)
    values, inputs = [e.astype(np.float64)], []  # h_l = Σ_{k<l} α_{k→l} v_k, v_0 = e, v_k = f_k(h_k)
    for l in range(L):
        h = _np_mix(values, W[l], G[l])[0]
        inputs.append(h)
        values.append(_np_sublayer(h, ws[l]))
    final = _np_mix(values, W[L], G[L])[0]
    res = _jit_forward(R.attnres_forward, fs, lay)(e, W, G)
    for got, want in zip(res.sublayer_inputs, inputs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.hidden, final, rtol=1e-5, atol=1e-5)


def test_single_block_identity_general_pseudo_queries():
    """N = 1: h_1 = e; h_l = a_l e + (1 − a_l) r_{l−1}, a_l = σ(w_l · (RMSNorm(e) − RMSNorm(r_{l−1})))."""
    L, eps = 6, 1e-6
    e = _randn(20, (B, T, D))
    fs, ws = _sublayers(21, L)
    W, G = _randn(22, (L + 1, D), 1.0), 1.0 + _randn(23, (L + 1, D), 0.2)
    res = _jit_forward(R.attnres_forward, fs, R.block_layout(L // 2, 1), eps=eps)(e, W, G)
    key = lambda x, g: g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)  # noqa: E731
    e64 = e.astype(np.float64)
    np.testing.assert_array_equal(res.sublayer_inputs[0], e)
    r = _np_sublayer(e64, ws[0])
    for l in range(1, L + 1):
        a = 1.0 / (1.0 + np.exp(-np.sum(W[l] * (key(e64, G[l]) - key(r, G[l])), -1)))[..., None]
        want = a * e64 + (1 - a) * r
        got = res.sublayer_inputs[l] if l < L else res.hidden
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if l < L:
            r = r + _np_sublayer(want, ws[l])


def test_single_block_at_init_is_the_plain_prenorm_residual():
    """N = 1, w = 0, scale-invariant sublayers: every h_l (l ≥ 2) = x_{l−1}/2 and hidden = x_L/2."""
    L = 8
    e = _randn(24, (B, T, D))
    fs, _ = _sublayers(25, L)
    lay = R.block_layout(L // 2, 1)
    res = _jit_forward(R.attnres_forward, fs, lay)(e, np.zeros((L + 1, D), np.float32), np.ones((L + 1, D), np.float32))
    plain = jax.jit(lambda e: R.prenorm_forward(e, fs))(e)
    np.testing.assert_array_equal(res.sublayer_inputs[0], plain.sublayer_inputs[0])
    for l in range(1, L):
        np.testing.assert_allclose(res.sublayer_inputs[l], plain.sublayer_inputs[l] / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.hidden, plain.hidden / 2, rtol=1e-5, atol=1e-6)
    # and the final RMSNorm (eps ≪ RMS²) sees the same normalised state
    norm = lambda x: np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)  # noqa: E731
    np.testing.assert_allclose(norm(res.hidden), norm(plain.hidden), rtol=1e-5, atol=1e-5)


def test_scan_over_fixed_source_buffer_matches_reference():
    """Wiring for a scan over sublayers: buffer [N+1, B, T, D], per-sublayer slot and num_valid."""
    num_layers, N = 5, 3
    lay = R.block_layout(num_layers, N)  # blocks of 4, 3, 3 sublayers
    L = lay.num_sublayers
    e = _randn(26, (B, T, D))
    fs, ws = _sublayers(27, L)
    W, G = _randn(28, (L + 1, D), 1.0), 1.0 + _randn(29, (L + 1, D), 0.2)

    @jax.jit
    def scanned(e, ws, W, G):
        buffer = jnp.zeros((lay.max_sources,) + e.shape, e.dtype).at[0].set(e)
        xs = lay.scan_inputs()

        def body(buffer, inp):
            w_l, g_l, W_l, slot, nv = inp
            h = R.depth_attention(buffer, w_l, g_l, num_valid=nv)
            out = 0.5 * jnp.tanh(jnp.matmul(_rmsnorm(h), W_l, precision="highest"))
            return buffer.at[slot].add(out), h

        buffer, hs = jax.lax.scan(body, buffer, (W[:L], G[:L], ws, xs["slot"], xs["num_valid"]))
        return R.depth_attention(buffer, W[L], G[L]), hs

    hidden, hs = scanned(e, ws, W, G)
    ref = _jit_forward(R.attnres_forward, fs, lay)(e, W, G)
    np.testing.assert_allclose(hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hs, np.stack(ref.sublayer_inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_layers, num_blocks, period", [
    (5, 3, 2),   # blocks of 4, 3, 3 sublayers across steps of one layer: partial sums carried over steps
    (3, 6, 2),   # Full AttnRes (N = L)
    (6, 5, 4),   # steps of two layers; blocks of 3, 3, 2, 2, 2 start and are read inside a step
])
def test_scan_source_buffer_equals_the_checkpointed_scan(num_layers, num_blocks, period):
    """scan_source_buffer (the backward rebuilds each step's buffer) gives the same outputs and every
    cotangent as lax.scan over jax.checkpoint(body): the buffer (embedding), the scanned parameters, a
    closed-over float array, with integer xs / ys and a closed-over integer array traced by an inner jit
    (grad of jit, and jit of grad)."""
    lay = R.block_layout(num_layers, num_blocks)
    steps = lay.num_sublayers // period
    per = lambda a: np.asarray(a).reshape(steps, period, *np.shape(a)[1:])  # noqa: E731
    first_slot = per(lay.scan_inputs()["slot"])[:, 0]
    xs = {"w": per(_randn(50, (lay.num_sublayers, D, D), 0.3)), "q": per(_randn(51, (lay.num_sublayers, D), 0.5)),
          "slot": per(lay.scan_inputs()["slot"]), "num_valid": per(lay.scan_inputs()["num_valid"])}
    e, gain = _randn(52, (B, T, D)), 1.0 + _randn(53, (D,), 0.2)
    ids = jnp.arange(T) % 3  # closed over by the body; traced inside loss's jit
    cot = _randn(54, (lay.max_sources, B, T, D)) / (B * T)

    def run(e, xs, gain, ids, fast):
        def body(buffer, x):
            weights = []
            for i in range(period):
                h, w, buffer = R.depth_attention_carry(buffer, x["q"][i], jnp.ones(D), num_valid=x["num_valid"][i])
                out = jnp.tanh(_rmsnorm(h) @ x["w"][i]) * gain + ids[None, :, None]
                buffer = R.add_to_slot(buffer, out, x["slot"][i])
                weights.append(w)
            return buffer, {"w": jnp.stack(weights), "finite": jnp.all(jnp.isfinite(buffer)), "n": x["num_valid"]}
        buffer = jnp.zeros((lay.max_sources, B, T, D)).at[0].set(e)
        if fast:
            return R.scan_source_buffer(body, buffer, xs, first_slot)
        return jax.lax.scan(jax.checkpoint(body), buffer, xs)

    @functools.partial(jax.jit, static_argnums=4)
    def loss(e, f, gain, ids, fast):
        final, ys = run(e, {**xs, **f}, gain, ids, fast)
        return jnp.sum(final * cot) + jnp.sum(ys["w"] ** 3) / (B * T)

    floats = {k: xs[k] for k in ("w", "q")}
    ref = jax.value_and_grad(lambda *a: loss(*a, False), argnums=(0, 1, 2))(e, floats, gain, ids)
    for got in (jax.value_and_grad(lambda *a: loss(*a, True), argnums=(0, 1, 2))(e, floats, gain, ids),
                jax.jit(jax.value_and_grad(lambda *a: loss(*a, True), argnums=(0, 1, 2)))(e, floats, gain, ids)):
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
        for (path, a), (_, b) in zip(jax.tree.leaves_with_path(ref[1]), jax.tree.leaves_with_path(got[1])):
            assert float(jnp.abs(a).max()) > 0, jax.tree_util.keystr(path)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max()),
                                       err_msg=jax.tree_util.keystr(path))
    (f0, y0), (f1, y1) = (jax.jit(run, static_argnums=4)(e, xs, gain, ids, fast) for fast in (False, True))
    np.testing.assert_array_equal(f1, f0)
    jax.tree.map(np.testing.assert_array_equal, y1, y0)


@pytest.mark.parametrize("first_slot, num_slots", [
    ([0, 2, 3], 4),        # jumps of 2 and 1: the window at the buffer's end is clamped
    ([0, 0, 3, 3, 3], 5),  # a jump of 3 after a step that stays; the last step writes every slot above it
    ([1, 1, 1], 3),        # no jump: the window is empty
])
def test_scan_source_buffer_rebuilds_any_slot_pattern(first_slot, num_slots):
    """The backward's step-by-step rebuild (only the slots between two steps' first slots change) gives
    the checkpointed scan's gradients for first-slot patterns beyond the model's layouts, with a body that
    writes every slot the contract allows (those strictly between two first slots too)."""
    steps = len(first_slot)
    nxt = first_slot[1:] + [num_slots - 1]
    xs = {"w": _randn(60, (steps, num_slots, D), 0.5), "v": _randn(65, (steps, num_slots, D), 0.5),
          "a": _randn(61, (steps, D)), "b": _randn(62, (steps, D)),
          "slot": jnp.asarray(first_slot), "next": jnp.asarray(nxt)}
    buffer = _randn(63, (num_slots, B, T, D))
    cot = _randn(64, (num_slots, B, T, D)) / (B * T)

    def read(buf, w, upto):  # the slots up to `upto`, weighted per slot and channel
        w = jnp.where((jnp.arange(num_slots) <= upto)[:, None], w, 0.0)
        return jnp.tanh(jnp.einsum("sbtd,sd->btd", buf, w, precision="highest"))

    def body(buf, x):  # as a period of the model: read, add to a slot, read the slots above it, add again
        h = read(buf, x["w"], x["slot"])
        buf = buf.at[x["slot"]].add(h * x["a"])
        h2 = read(buf, x["v"], x["next"])
        index = jnp.arange(num_slots).reshape(-1, 1, 1, 1)
        written = (index > x["slot"]) & (index <= x["next"])  # up to the next step's first slot (last: the end)
        buf = buf + jnp.where(written, (h2 * x["b"])[None], 0.0)
        return buf, jnp.sum(h ** 2 + h2 ** 2, axis=-1)

    def loss(buf, f, fast):
        xs_ = {**xs, **f}
        final, ys = (R.scan_source_buffer(body, buf, xs_, first_slot) if fast
                     else jax.lax.scan(jax.checkpoint(body), buf, xs_))
        return jnp.sum(final * cot) + jnp.sum(ys) / (B * T)

    floats = {k: xs[k] for k in ("w", "v", "a", "b")}
    ref = jax.jit(jax.value_and_grad(lambda b, f: loss(b, f, False), argnums=(0, 1)))(buffer, floats)
    got = jax.jit(jax.value_and_grad(lambda b, f: loss(b, f, True), argnums=(0, 1)))(buffer, floats)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    for (path, a), (_, b) in zip(jax.tree.leaves_with_path(ref[1]), jax.tree.leaves_with_path(got[1])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_scan_source_buffer_refuses_bad_first_slots():
    body = lambda buffer, x: (buffer, x)  # noqa: E731
    buffer, xs = jnp.zeros((3, 2)), jnp.zeros((4,))
    for bad in ([0, 1, 1], [0, 2, 1, 2], [0, 1, 2, 3], [-1, 0, 0, 0]):
        with pytest.raises(ValueError, match="first_slot"):
            R.scan_source_buffer(body, buffer, xs, bad)
    with pytest.raises(ValueError, match="xs must hold at least one array"):
        R.scan_source_buffer(body, buffer, None, [0])


@pytest.mark.parametrize("slot", [0, 2, 3, 7, -1])  # 7 is clamped to 3; -1 counts from the end (3)
def test_add_to_slot_equals_autodiff_of_index_add_update(slot):
    """add_to_slot's hand-written VJP equals JAX's derivative of index + add + update, forward and both
    cotangents, with the slot traced (as in the scan) and out of range (read as dynamic_index reads it);
    an update that would broadcast is refused by name."""
    buffer = _randn(40, (4, B, T, D)).astype(jnp.bfloat16)
    update = _randn(41, (B, T, D))  # fp32 update into a bf16 buffer, as a sublayer output may be
    cot = (_randn(42, buffer.shape) / (B * T)).astype(jnp.bfloat16)

    def by_autodiff(buffer, update, slot):
        current = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buffer, current + update.astype(buffer.dtype), slot, 0)

    def value_and_cotangents(f):
        out, vjp = jax.vjp(f, buffer, update, jnp.int32(slot))
        return (out, *vjp(cot)[:2])

    got, want = (jax.jit(value_and_cotangents, static_argnums=0)(f) for f in (R.add_to_slot, by_autodiff))
    for name, a, b in zip(("out", "dbuffer", "dupdate"), got, want):
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    with pytest.raises(ValueError, match="update must be buffer.shape"):
        R.add_to_slot(buffer, update[0], jnp.int32(slot))


def test_gradients_reach_every_pseudo_query_after_one_step():
    num_layers, N = 3, 2
    lay = R.block_layout(num_layers, N)  # blocks of 3 and 3 sublayers
    L = lay.num_sublayers
    e = _randn(30, (B, T, D))
    fs, _ = _sublayers(31, L)
    target = _randn(32, (B, T, D))

    def loss(params):
        res = R.attnres_forward(e, fs, lay, params["w"], params["g"])
        return jnp.mean((res.hidden - target) ** 2)

    params = {"w": jnp.zeros((L + 1, D)), "g": jnp.ones((L + 1, D))}
    grad_fn = jax.jit(jax.value_and_grad(loss))
    value, grads = grad_fn(params)
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    gnorm = np.linalg.norm(np.asarray(grads["w"]), axis=-1)
    num_sources = lay.num_sources + (lay.final_num_sources,)
    assert num_sources == (1, 2, 2, 2, 3, 3, 3)
    for l, s in enumerate(num_sources):
        if s == 1:  # sublayer 1 reads the embedding alone: weight 1 whatever w is -> exactly no gradient
            assert gnorm[l] == 0.0, (l, gnorm[l])
        else:
            assert gnorm[l] > 1e-6, (l, gnorm[l])
    # at w = 0 the key scale has no effect (logit = (w ⊙ γ) · x̂ = 0): its gradient is exactly zero
    assert np.all(np.asarray(grads["g"]) == 0.0)
    params = jax.tree.map(lambda p, g: p - 1.0 * g, params, grads)
    value2, grads2 = grad_fn(params)
    assert value2 < value
    moved = np.linalg.norm(np.asarray(params["w"]), axis=-1)
    g2 = np.linalg.norm(np.asarray(grads2["g"]), axis=-1)
    assert all(moved[l] > 0 and g2[l] > 0 for l, s in enumerate(num_sources) if s > 1)


# --------------------------------------------------------------------------------------------------
# Article-literal variant
# --------------------------------------------------------------------------------------------------
def test_article_block_boundary_skips_residual_and_scales_by_alpha():
    lay = R.block_layout(4, 2, unit="layers")  # blocks of 2 layers = 4 sublayers each
    assert R.article_boundaries(lay) == (2,)   # the mixer of block 1's last layer (layer 2)
    e = _randn(33, (B, T, D))
    fs, ws = _sublayers(34, 8)
    alpha = 0.7
    fwd = _jit_forward(R.article_block_forward, fs, lay)
    res = fwd(e, np.array([alpha], np.float32))
    x = [np.asarray(a, np.float64) for a in res.sublayer_inputs]
    f = lambda l: _np_sublayer(x[l], ws[l])  # noqa: E731
    # ordinary sublayers: x_{l+1} = x_l + f_l(x_l)
    for l in (0, 1, 3, 4, 5, 6):
        np.testing.assert_allclose(x[l + 1], x[l] + f(l), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.hidden, x[7] + f(7), rtol=1e-5, atol=1e-5)
    # boundary: x_3 = α · f_2(x_2), the residual add is skipped
    np.testing.assert_allclose(x[3], alpha * f(2), rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(x[3] - (x[2] + alpha * f(2)))) > 0.1
    # α scales the restarted stream linearly; the first block is untouched by α
    res2 = fwd(e, np.array([2 * alpha], np.float32))
    np.testing.assert_allclose(res2.sublayer_inputs[3], 2 * x[3], rtol=1e-6, atol=1e-7)
    for l in range(3):
        np.testing.assert_array_equal(res2.sublayer_inputs[l], res.sublayer_inputs[l])
    # the next block sees the earlier stream only through the boundary attention: a boundary
    # sublayer that ignores its input makes the output independent of the embedding
    const = [f_ if l != 2 else (lambda h: jnp.ones_like(h)) for l, f_ in enumerate(fs)]
    fwd_const = _jit_forward(R.article_block_forward, const, lay)
    out_a = fwd_const(e, np.array([alpha], np.float32)).hidden
    out_b = fwd_const(_randn(35, (B, T, D)), np.array([alpha], np.float32)).hidden
    np.testing.assert_array_equal(out_a, out_b)


def test_article_block_single_block_and_grad_alpha():
    e = _randn(36, (B, T, D))
    fs, _ = _sublayers(37, 6)
    lay1 = R.block_layout(3, 1, unit="layers")
    np.testing.assert_array_equal(_jit_forward(R.article_block_forward, fs, lay1)(e, np.zeros((0,), np.float32)).hidden,
                                  jax.jit(lambda e: R.prenorm_forward(e, fs))(e).hidden)
    lay3 = R.block_layout(3, 3, unit="layers")
    assert R.article_boundaries(lay3) == (0, 2)
    g = jax.jit(jax.grad(lambda a: jnp.sum(R.article_block_forward(e, fs, lay3, a).hidden ** 2)))(jnp.ones(2))
    assert np.all(np.isfinite(g)) and np.all(np.abs(np.asarray(g)) > 1e-4)


# --------------------------------------------------------------------------------------------------
# NNX modules and diagnostics
# --------------------------------------------------------------------------------------------------
def test_nnx_modules():
    mix = DepthMix(D, rngs=nnx.Rngs(0))
    assert mix.pseudo_query[...].shape == (D,) and np.all(np.asarray(mix.pseudo_query[...]) == 0)
    assert np.all(np.asarray(mix.key_norm_scale[...]) == 1)
    x = jnp.asarray(_randn(38, (3, B, T, D))).astype(jnp.bfloat16)
    call = nnx.jit(lambda m, x, nv: m(x, num_valid=nv, return_weights=True))
    out, w = call(mix, x, jnp.int32(3))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(w, np.full((3, B, T), 1 / 3), atol=1e-7)
    q = _randn(39, (D,))
    mix.pseudo_query[...] = q
    out2, _ = call(mix, x, jnp.int32(2))
    np.testing.assert_array_equal(out2, _depth_attention(x[:2], q, np.ones(D, np.float32)))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x.astype(jnp.float32)) ** 2)))(mix)
    assert np.linalg.norm(np.asarray(grads["pseudo_query"][...])) > 0
    assert np.linalg.norm(np.asarray(grads["key_norm_scale"][...])) > 0

    scale = BlockScale(rngs=nnx.Rngs(0))
    assert float(scale.alpha[...]) == 1.0 and scale.alpha[...].dtype == jnp.float32
    y = jnp.asarray(_randn(40, (B, T, D))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(scale(y), y)
    scale.alpha[...] = jnp.float32(0.5)
    assert scale(y).dtype == jnp.bfloat16
    np.testing.assert_array_equal(scale(y), (0.5 * y.astype(jnp.float32)).astype(jnp.bfloat16))


def test_diagnostics_against_numpy():
    xs = [_randn(41 + k, (B, T, D), 1.0 + k) for k in range(4)]
    xs[2] = -3.0 * xs[1]  # cosine exactly -1 between inputs 1 and 2
    rms = R.hidden_rms(xs[3])
    chex.assert_shape(rms, (B, T))
    np.testing.assert_allclose(rms, np.sqrt(np.mean(xs[3].astype(np.float64) ** 2, -1)), rtol=1e-6)
    cos = R.consecutive_cosine(xs)
    a = np.stack(xs).astype(np.float64)
    ref = [np.mean(np.sum(a[k] * a[k + 1], -1) / (np.linalg.norm(a[k], axis=-1) * np.linalg.norm(a[k + 1], axis=-1)))
           for k in range(3)]
    np.testing.assert_allclose(cos, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cos[1], -1.0, atol=1e-6)
    np.testing.assert_allclose(R.consecutive_cosine(np.stack(xs)), cos, rtol=1e-6)
    m = R.depth_weight_matrix([np.ones((1, B, T)), np.full((2, B, T), 0.5), np.array([[0.2], [0.3], [0.5]])])
    np.testing.assert_allclose(m, [[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]], atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------
_ONES = np.ones((2, 1, 1, 4), np.float32)


@pytest.mark.parametrize("call,field", [
    (lambda: R.block_layout(2, 5), "num_blocks"),
    (lambda: R.block_layout(3, 4, unit="layers"), "num_blocks"),
    (lambda: R.block_layout(2, 2, unit="blocks"), "unit"),
    (lambda: R.block_layout(0, 1), "num_layers"),
    (lambda: R.block_layout(2, 0), "num_blocks"),
    (lambda: R.depth_attention(_ONES, np.zeros(3), np.ones(4)), "pseudo_query"),
    (lambda: R.depth_attention(_ONES, np.zeros(4), np.ones(5)), "key_norm_scale"),
    (lambda: R.depth_attention(_ONES, np.zeros(4), np.ones(4), num_valid=0), "num_valid"),
    (lambda: R.depth_attention(_ONES, np.zeros(4), np.ones(4), num_valid=3), "num_valid"),
    (lambda: R.depth_attention([np.ones((1, 4)), np.ones((2, 4))], np.zeros(4), np.ones(4)), "sources"),
    (lambda: R.depth_attention([], np.zeros(4), np.ones(4)), "sources"),
    (lambda: R.article_boundaries(R.block_layout(2, 2)), "layout.unit"),
    (lambda: R.article_block_forward(_ONES[0], [np.tanh] * 4, R.block_layout(2, 2, unit="layers"), np.ones(2)),
     "alphas"),
    (lambda: R.attnres_forward(_ONES[0], [np.tanh] * 4, R.block_layout(2, 2), np.zeros((4, 4)), np.ones((5, 4))),
     "pseudo_queries"),
    (lambda: R.attnres_forward(_ONES[0], [np.tanh] * 3, R.block_layout(2, 2), np.zeros((5, 4)), np.ones((5, 4))),
     "sublayer_fns"),
    (lambda: DepthMix(0, rngs=nnx.Rngs(0)), "d_model"),
])
def test_bad_input_raises_naming_the_field(call, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        call()
