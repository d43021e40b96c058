"""Tests for k3jax.ops.routing: top-k routing, balancing methods, metrics, causal leakage."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import balance_metrics as M
from k3jax.ops import balancing as B
from k3jax.ops import quantile as Q
from k3jax.ops import routing as R
from k3jax.ops import threshold_routing as T

# K3's worked example (Kimi K3 §2.3.3): 8 tokens, 4 experts, top-1, loads (4, 3, 1, 0) -> (2, 2, 2, 2).
# Scores in [0, 1] (sigmoid-like), distinct in every row. Tokens 2, 3 prefer expert 0 with expert 3 a
# close second; token 6 prefers expert 1 with expert 2 a close second; everyone else is decided.
K3_EXAMPLE = np.array(
    [
        [0.90, 0.20, 0.10, 0.30],
        [0.85, 0.15, 0.25, 0.35],
        [0.60, 0.10, 0.20, 0.55],
        [0.62, 0.05, 0.15, 0.58],
        [0.20, 0.90, 0.30, 0.10],
        [0.25, 0.80, 0.35, 0.15],
        [0.10, 0.60, 0.57, 0.20],
        [0.30, 0.20, 0.80, 0.40],
    ],
    np.float32,
)


def _random_scores(key, n, e, func="softmax", scale=2.0):
    return R.router_scores(scale * jax.random.normal(key, (n, e)), func)


# --------------------------------------------------------------------------- scores and route


def test_router_scores_softmax_and_sigmoid_fp32():
    logits = jnp.array([[0.0, 1.0, -1.0]], jnp.bfloat16)
    sm = R.router_scores(logits, "softmax")
    sg = R.router_scores(logits, "sigmoid")
    assert sm.dtype == jnp.float32 and sg.dtype == jnp.float32
    e = np.exp([0.0, 1.0, -1.0])
    np.testing.assert_allclose(sm[0], e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(sg[0], 1 / (1 + np.exp(-np.array([0.0, 1.0, -1.0]))), rtol=1e-6)
    with pytest.raises(ValueError, match="score_func"):
        R.router_scores(logits, "relu")
    with pytest.raises(ValueError, match="logits"):
        R.router_scores(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("func", ["softmax", "sigmoid"])
def test_route_selection_biased_weights_unbiased(func):
    scores = _random_scores(jax.random.PRNGKey(0), 32, 8, func)
    bias = jnp.array([0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0])  # forces expert 3 into every top-2
    r = R.route(scores, bias, 2, score_func=func, routed_scaling_factor=2.5)
    assert r.expert_ids.dtype == jnp.int32 and r.weights.dtype == jnp.float32
    chex.assert_shape([r.expert_ids, r.weights], (32, 2))
    assert np.all(np.asarray(r.expert_ids[:, 0]) == 3)
    # second expert = argmax of the unbiased scores excluding expert 3
    s = np.asarray(scores)
    masked = s.copy()
    masked[:, 3] = -np.inf
    np.testing.assert_array_equal(np.asarray(r.expert_ids[:, 1]), masked.argmax(1))
    sel = np.take_along_axis(s, np.asarray(r.expert_ids), 1)
    np.testing.assert_allclose(r.weights, 2.5 * sel / sel.sum(1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.weights).sum(1), 2.5, rtol=1e-6)
    # cutoff = (k+1)-th biased score
    biased = np.sort(s + np.asarray(bias)[None], 1)[:, ::-1]
    np.testing.assert_allclose(r.cutoff, biased[:, 2], rtol=1e-6)


def test_route_softmax_weights_sum_to_one_and_no_bias_gradient():
    logits = jax.random.normal(jax.random.PRNGKey(1), (16, 6))
    bias = jax.random.normal(jax.random.PRNGKey(2), (6,))

    def f(logits, bias):
        r = R.route(R.router_scores(logits), bias, 3)
        return jnp.sum(r.weights * jnp.arange(3.0)), r.weights

    (_, w), (g_logits, g_bias) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(logits, bias)
    np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(g_bias, np.zeros(6))
    assert float(jnp.abs(g_logits).sum()) > 0
    # renormalize=False: the selected softmax probabilities as they are (Switch / DeepSeek-V2)
    s = R.router_scores(logits)
    r = R.route(s, None, 3, renormalize=False)
    np.testing.assert_allclose(r.weights, np.take_along_axis(np.asarray(s), np.asarray(r.expert_ids), 1), rtol=1e-6)


def test_route_rejects_bad_input():
    s = jnp.ones((4, 3)) / 3
    with pytest.raises(ValueError, match="top_k"):
        R.route(s, None, 4)
    with pytest.raises(ValueError, match="bias"):
        R.route(s, jnp.zeros(2), 1)
    assert R.route(s, None, 3).cutoff is None


# --------------------------------------------------------------------------- metrics


def test_metrics_match_numpy():
    loads = jnp.array([4.0, 3.0, 1.0, 0.0])
    st = M.load_stats(loads)
    assert float(st["max_vio"]) == pytest.approx(1.0)
    assert float(st["cv"]) == pytest.approx(np.std([4, 3, 1, 0]) / 2.0, rel=1e-6)
    assert float(st["dead_experts"]) == 1.0
    p = np.array([4, 3, 1]) / 8
    assert float(st["entropy"]) == pytest.approx(-(p * np.log(p)).sum() / math.log(4), rel=1e-6)
    assert float(M.load_entropy(jnp.ones(5))) == pytest.approx(1.0)
    assert float(M.max_vio_global(jnp.array([[2.0, 0.0], [0.0, 2.0]]))) == 0.0
    assert float(M.max_vio(jnp.zeros(3))) == 0.0
    with pytest.raises(ValueError, match="loads"):
        M.max_vio(jnp.ones((2, 3)))
    ids = jnp.array([[0, 1], [1, 2], [1, 3]])
    np.testing.assert_array_equal(M.expert_loads(ids, 4), [1, 3, 1, 1])
    np.testing.assert_array_equal(M.expert_loads(ids, 4, token_mask=jnp.array([1, 0, 1], bool)), [1, 2, 0, 1])


# --------------------------------------------------------------------------- aux losses


@pytest.mark.parametrize("func", ["softmax", "sigmoid"])
def test_aux_losses_equal_alpha_on_uniform_routing(func):
    n, e, k, t = 16, 4, 2, 4
    scores = R.router_scores(jnp.zeros((n, e)), func)  # uniform probabilities
    ids = jnp.stack([jnp.arange(n) % e, (jnp.arange(n) + 1) % e], 1).astype(jnp.int32)  # balanced per seq
    assert float(B.aux_loss(scores, ids, alpha=1.0, score_func=func)) == pytest.approx(1.0, rel=1e-6)
    assert float(B.seq_aux_loss(scores, ids, t, alpha=1.0, score_func=func)) == pytest.approx(1.0, rel=1e-6)
    # collapsed: every token on expert 0 with P_0 = 1 -> the maximum, alpha * E
    collapsed = jnp.zeros((n, e)).at[:, 0].set(1.0)
    ids0 = jnp.zeros((n, 1), jnp.int32)
    assert float(B.aux_loss(collapsed, ids0, alpha=0.5)) == pytest.approx(0.5 * e)


def test_aux_loss_gradient_is_alpha_e_f_over_n():
    n, e = 12, 3
    scores = _random_scores(jax.random.PRNGKey(3), n, e)
    ids = R.route(scores, None, 1).expert_ids
    f = np.asarray(M.expert_loads(ids, e)) / n
    g = jax.grad(lambda s: B.aux_loss(s, ids, alpha=0.1))(scores)
    np.testing.assert_allclose(g, np.broadcast_to(0.1 * e * f / n, (n, e)), rtol=1e-6)


def test_seq_aux_loss_is_mean_of_per_sequence_losses_and_skips_padding():
    scores = _random_scores(jax.random.PRNGKey(4), 12, 4)
    ids = R.route(scores, None, 2).expert_ids
    per = [float(B.aux_loss(scores[i * 4:(i + 1) * 4], ids[i * 4:(i + 1) * 4], alpha=1.0)) for i in range(3)]
    assert float(B.seq_aux_loss(scores, ids, 4, alpha=1.0)) == pytest.approx(np.mean(per), rel=1e-6)
    mask = jnp.ones(12, bool).at[4:8].set(False)  # sequence 1 is all padding
    assert float(B.seq_aux_loss(scores, ids, 4, alpha=1.0, token_mask=mask)) == pytest.approx(
        (per[0] + per[2]) / 2, rel=1e-6
    )
    with pytest.raises(ValueError, match="sequence_length"):
        B.seq_aux_loss(scores, ids, 5)


# --------------------------------------------------------------------------- loss-free


def test_loss_free_update_sums_to_zero_and_matches_paper_up_to_constant():
    for loads in ([4.0, 3.0, 1.0, 0.0], [5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]):
        loads = jnp.array(loads)
        d = np.asarray(B.loss_free_update(loads, 1e-3))
        assert abs(d.sum()) < 1e-9
        paper = 1e-3 * np.sign(np.mean(loads) - np.asarray(loads))
        np.testing.assert_allclose(d - d[0], paper - paper[0], atol=1e-9)  # same routing
    np.testing.assert_allclose(B.loss_free_update(jnp.array([5.0, 1, 1, 1])), 1e-3 * np.array([-1.5, 0.5, 0.5, 0.5]))


def test_balance_loss_free_moves_bias_against_load():
    scores = jnp.asarray(K3_EXAMPLE)
    r = R.route(scores, jnp.zeros(4), 1)
    out = B.balance(B.LossFree(), scores, r, jnp.zeros(4))
    np.testing.assert_allclose(out.next_bias, 1e-3 * np.array([-1.0, -1.0, 1.0, 1.0]))
    assert float(out.loss) == 0.0


# --------------------------------------------------------------------------- quantile balancing


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_quantile_k3_worked_example(estimator):
    scores = jnp.asarray(K3_EXAMPLE)
    cfg = B.QuantileBalancing(quantile_estimator=estimator)
    r = R.route(scores, jnp.zeros(4), 1)
    np.testing.assert_array_equal(M.expert_loads(r.expert_ids, 4), [4, 3, 1, 0])
    out = B.balance(cfg, scores, r, jnp.zeros(4))
    assert abs(float(jnp.sum(out.next_bias))) < 1e-6
    r2 = R.route(scores, out.next_bias, 1)
    np.testing.assert_array_equal(M.expert_loads(r2.expert_ids, 4), [2, 2, 2, 2])
    np.testing.assert_array_equal(r2.expert_ids[:, 0], [0, 0, 3, 3, 1, 1, 2, 2])
    assert float(out.stats["max_vio"]) == pytest.approx(1.0)


@pytest.mark.parametrize("n,e,k,bias_scale", [(64, 8, 2, 0.0), (512, 16, 4, 0.05), (1000, 10, 1, 0.0)])
def test_quantile_bias_admits_exactly_nk_over_e_tokens(n, e, k, bias_scale):
    """Random scores (no ties among scores): at the step's cutoffs α_i, b̂_j admits exactly
    q = N·k/E tokens (#{i: r_ij < b̂_j} = q) whenever r_(q) < r_(q+1). Su's margins have one built-in
    tie: a token whose (k+1)-th expert is j has r_ij = α_i − s_ij = b_j exactly; when that tie group
    straddles position q the quantile sits on it (b̂_j = r_(q)). The "lower"/"higher" order-statistic
    conventions would admit q − 1 / sit on a margin; the linear one is strictly inside the gap."""
    scores = _random_scores(jax.random.PRNGKey(n), n, e)
    bias = bias_scale * jax.random.normal(jax.random.PRNGKey(e), (e,))
    r = R.route(scores, bias, k)
    m = np.asarray(Q.quantile_margins(scores, r))
    b_hat = np.asarray(Q.quantile_bias(jnp.asarray(m), k, bias=bias, center=False))
    q = n * k // e
    srt = np.sort(m, axis=0)
    gap = srt[q - 1] < srt[q]
    admitted = np.sum(m < b_hat[None, :], axis=0)
    at = np.sum(m == b_hat[None, :], axis=0)
    np.testing.assert_array_equal(admitted[gap], q)
    np.testing.assert_array_equal(at[gap], 0)
    np.testing.assert_array_equal(b_hat[~gap], srt[q - 1][~gap])
    assert gap.sum() >= e // 2  # the exact case is the common one
    b = Q.quantile_bias(jnp.asarray(m), k, bias=bias)
    np.testing.assert_allclose(b, b_hat - b_hat.mean(), atol=1e-7)


def test_quantile_iteration_balances_random_scores():
    """Re-routing with all biases moved at once is the one-step dual update, not exact; on this
    fixed draw MaxVio falls 0.0430 -> 0.0137 after one step and stays <= 0.01 from step 3."""
    n, e, k = 4096, 8, 1
    scores = _random_scores(jax.random.PRNGKey(0), n, e)
    cfg = B.QuantileBalancing()
    bias = jnp.zeros(e)
    vios = []
    step = jax.jit(lambda b: B.balance(cfg, scores, R.route(scores, b, k), b))
    for _ in range(5):
        out = step(bias)
        vios.append(float(out.stats["max_vio"]))
        bias = out.next_bias
    assert vios[0] == pytest.approx(0.04296875)
    assert vios[1] < 0.5 * vios[0]
    assert max(vios[3:]) <= 0.01


def test_quantile_histogram_within_one_bin_of_exact():
    n, e, k, bins = 4096, 8, 2, 1000
    scores = _random_scores(jax.random.PRNGKey(7), n, e, "sigmoid")
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(8), (e,))
    r = R.route(scores, bias, k)
    m = Q.quantile_margins(scores, r)
    exact = np.asarray(Q.quantile_bias(m, k, bias=bias, center=False))
    hist = np.asarray(Q.quantile_bias(m, k, bias=bias, estimator="histogram", histogram_bins=bins, center=False))
    width = (float(bias.max()) - float(bias.min()) + 2.0) / bins
    assert np.max(np.abs(hist - exact)) <= width
    # the documented guarantee: inside [r_(q) - w, r_(q+1) + w]
    srt = np.sort(np.asarray(m), 0)
    q = n * k // e
    assert np.all(hist >= srt[q - 1] - width) and np.all(hist <= srt[q] + width)
    # a coarse histogram is further off (the test can fail)
    coarse = np.asarray(Q.quantile_bias(m, k, bias=bias, estimator="histogram", histogram_bins=4, center=False))
    assert np.max(np.abs(coarse - exact)) > width


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_quantile_bias_invariant_to_constant_shift(estimator):
    scores = _random_scores(jax.random.PRNGKey(11), 256, 8, "sigmoid")
    bias = 0.05 * jax.random.normal(jax.random.PRNGKey(12), (8,))
    cfg = B.QuantileBalancing(quantile_estimator=estimator)
    b0 = B.balance(cfg, scores, R.route(scores, bias, 2), bias).next_bias
    shifted = scores + 0.37
    b1 = B.balance(cfg, shifted, R.route(shifted, bias, 2), bias).next_bias
    np.testing.assert_allclose(b0, b1, atol=2e-6)


def test_quantile_padding_excluded_and_ema():
    scores = _random_scores(jax.random.PRNGKey(13), 200, 8)
    mask = jnp.arange(200) < 150
    bias = jnp.zeros(8)
    r = R.route(scores, bias, 2)
    cfg = B.QuantileBalancing()
    with_mask = B.balance(cfg, scores, r, bias, token_mask=mask)
    valid = B.balance(cfg, scores[:150], R.route(scores[:150], bias, 2), bias)
    np.testing.assert_allclose(with_mask.next_bias, valid.next_bias, atol=1e-7)
    np.testing.assert_array_equal(with_mask.stats["loads"], valid.stats["loads"])
    old = jnp.linspace(-0.1, 0.1, 8)
    r = R.route(scores, old, 2)
    new = B.balance(cfg, scores, r, old).next_bias
    ema = B.balance(B.QuantileBalancing(ema=0.9), scores, r, old).next_bias
    np.testing.assert_allclose(ema, 0.9 * old + 0.1 * new, atol=1e-7)


def _sorted_quantile(margins, mask, level):
    """exact_quantile's definition by a sort: linear interpolation between the order statistics at
    floor(level·(n−1)) and the next one (ascending, invalid rows last)."""
    srt = jnp.sort(jnp.where(mask[:, None], margins, jnp.inf), axis=0)
    n = jnp.sum(mask.astype(jnp.int32))
    pos = jnp.float32(level) * (jnp.maximum(n, 1) - 1).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n, 1) - 1)
    return srt[lo] + (pos - lo.astype(jnp.float32)) * (srt[hi] - srt[lo])


@pytest.mark.parametrize("case", ["normal", "ties", "signed_zeros", "tiny_and_huge", "nans", "one_valid",
                                  "two_valid"])
@pytest.mark.parametrize("level", [0.0, 1 / 8, 0.5, 1.0])
def test_exact_quantile_radix_select_equals_sorting_bit_for_bit(case, level):
    """The radix select finds the same order statistics as a sort: equal bits, ties, −0.0 and +0.0,
    subnormals and ±3e38, NaNs of either sign and −inf, padding, one or two valid rows included."""
    n, e = 97, 8
    m = jax.random.normal(jax.random.PRNGKey(30), (n, e))
    mask = jax.random.uniform(jax.random.PRNGKey(31), (n,)) < 0.8
    if case == "ties":
        m = jnp.round(m * 2) / 2
    elif case == "signed_zeros":
        m = jnp.where(m > 0.5, 0.0, jnp.where(m < -0.5, -0.0, m))
    elif case == "tiny_and_huge":
        m = jnp.sign(m) * jnp.where(jnp.abs(m) > 1, 3e38, 1e-40)
    elif case == "nans":  # both signs of NaN (x86's inf - inf has the sign bit set) sort last, and inf
        nan = np.array([0x7FC00000, 0xFFC00000, 0x7FFFFFFF], np.uint32).view(np.float32)
        m = jnp.where(m > 1.2, jnp.asarray(nan)[jnp.arange(n)[:, None] % 3], jnp.where(m < -1.5, -jnp.inf, m))
    elif case == "one_valid":
        mask = jnp.arange(n) == 5
    elif case == "two_valid":
        mask = (jnp.arange(n) == 5) | (jnp.arange(n) == 60)
    got, ok = jax.jit(Q.exact_quantile, static_argnums=2)(m, mask, level)
    want = _sorted_quantile(m, mask, level)
    assert bool(ok)
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # NaN payloads may differ
    np.testing.assert_array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


def test_exact_quantile_with_no_valid_row_says_so():
    _, ok = Q.exact_quantile(jnp.ones((4, 3)), jnp.zeros((4,), bool), 0.25)
    assert not bool(ok)


def test_quantile_histogram_psum_equals_pooled():
    """Inside shard_map over 8 devices the psum'ed histogram gives the pooled single-device bias."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    P = jax.sharding.PartitionSpec
    n, e, k = 512, 8, 2
    scores = _random_scores(jax.random.PRNGKey(14), n, e)
    bias = 0.05 * jax.random.normal(jax.random.PRNGKey(15), (e,))
    r = R.route(scores, bias, k)
    m = Q.quantile_margins(scores, r)
    m_sharded = jax.device_put(m, jax.sharding.NamedSharding(mesh, P("data")))
    b_repl = jax.device_put(bias, jax.sharding.NamedSharding(mesh, P()))
    for est in ("histogram", "exact"):
        pooled = Q.quantile_bias(m, k, bias=bias, estimator=est)

        def local(m_shard, b):
            return Q.quantile_bias(m_shard, k, bias=b, estimator=est, axis_names=("data",))[None]

        per_device = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(m_sharded, b_repl)
        assert per_device.shape == (8, e)  # every device's own result
        np.testing.assert_allclose(per_device, np.broadcast_to(pooled, (8, e)), atol=1e-6)


def test_balancing_config_validation():
    with pytest.raises(ValueError, match="method"):
        B.balancing_config("sinkhorn")
    with pytest.raises(ValueError, match="quantile_estimator"):
        B.QuantileBalancing(quantile_estimator="tdigest")
    with pytest.raises(ValueError, match="ema"):
        B.QuantileBalancing(ema=1.0)
    assert B.AuxLoss().alpha == 1e-2
    assert B.SeqAuxLoss().alpha == 1e-4
    scores = jnp.asarray(K3_EXAMPLE)
    with pytest.raises(ValueError, match="top_k < E"):
        Q.quantile_margins(scores, R.route(scores, None, 4))


# --------------------------------------------------------------------------- seed-literal method

# Leakage example (E = 4, k = 1, one sequence of 8 tokens, empty window, defaults 95/5, tolerance
# 0.05, boost 0.05). Prefix t0..t3 is shared; A and B differ only in t4..t7.
PREFIX = [
    [0.90, 0.10, 0.20, 0.30],  # t0 -> 0, decided
    [0.60, 0.10, 0.20, 0.58],  # t1 -> 0, expert 3 only 0.02 behind
    [0.10, 0.50, 0.20, 0.47],  # t2 -> 1, expert 3 only 0.03 behind
    [0.10, 0.20, 0.60, 0.40],  # t3 -> 2, expert 3 0.20 behind
]
LATER_A = [[0.1, 0.8, 0.2, 0.3], [0.1, 0.2, 0.8, 0.3], [0.1, 0.2, 0.3, 0.8], [0.2, 0.1, 0.3, 0.8]]
LATER_B = [[0.8, 0.1, 0.2, 0.3], [0.8, 0.2, 0.1, 0.3], [0.8, 0.3, 0.2, 0.1], [0.8, 0.1, 0.3, 0.2]]


def _threshold_fn(cfg, e):
    state = B.init_balancing_state(cfg, e)

    def fn(scores_bte):
        b, t, _ = scores_bte.shape
        r, _ = T.threshold_route(
            scores_bte.reshape(b * t, e), 1, state, high_percentile=cfg.high_percentile,
            low_percentile=cfg.low_percentile, tolerance=cfg.tolerance, priority_boost=cfg.priority_boost,
        )
        return r.expert_ids.reshape(b, t, -1)

    return fn


def test_threshold_route_causal_leakage_exact_value():
    """Derivation. A: demand (2,2,2,2) -> u = 1 everywhere -> nothing flagged -> plain top-1.
    B: demand (6,1,1,0), u = (3, .5, .5, 0); P95(u) = .5 + .85·2.5 = 2.625 -> expert 0 overloaded
    (cap floor(2.625·8/4) = 5 >= its 5 remaining rows, so nothing is shed); P5(u) = .075 -> expert 3
    underloaded, +0.05: t1 (0.58 + .05 > 0.60) and t2 (0.47 + .05 > 0.50) move to expert 3, t0/t3 do
    not. Two of the four earlier tokens change although only later tokens differ: leakage = 0.5."""
    cfg = B.QuantileThreshold()
    a = jnp.asarray([PREFIX + LATER_A], jnp.float32)
    b = jnp.asarray([PREFIX + LATER_B], jnp.float32)
    fn = _threshold_fn(cfg, 4)
    np.testing.assert_array_equal(fn(a)[0, :, 0], [0, 0, 1, 2, 1, 2, 3, 3])
    np.testing.assert_array_equal(fn(b)[0, :, 0], [0, 3, 3, 2, 0, 0, 0, 0])
    assert float(T.causal_leakage(fn, a, b, 4)) == 0.5
    # the causal methods: a bias from the previous step cannot leak
    bias = jnp.array([0.01, -0.02, 0.03, -0.02])
    plain = lambda s: R.route(s.reshape(-1, 4), bias, 1).expert_ids.reshape(1, 8, 1)  # noqa: E731
    assert float(T.causal_leakage(plain, a, b, 4)) == 0.0
    with pytest.raises(ValueError, match="agree"):
        T.causal_leakage(plain, a, b, 5)


def test_threshold_route_tolerance_and_shedding():
    """Near balance (101, 100, 100, 99 of 400, top-1): a rank percentile alone flags expert 0
    (tolerance 0 -> cap floor(1.0085·100) = 100 -> its 101st row, t100, is shed to its next best,
    expert 1, which then holds 101 > cap and sheds its own last row, t200, to expert 3: loads
    (100, 100, 100, 100), 2/400 diverted); the absolute tolerance 0.05 diverts nothing; exact balance
    diverts nothing either."""
    rng = np.random.default_rng(0)
    top = np.repeat(np.arange(4), [101, 100, 100, 99])
    s = rng.uniform(0.0, 0.4, (400, 4)).astype(np.float32)
    s[np.arange(400), top] = 0.9
    scores = jnp.asarray(s)

    def diverted(tol, sc):
        cfg = B.QuantileThreshold(tolerance=tol)
        state = B.init_balancing_state(cfg, 4)
        r, demand = T.threshold_route(sc, 1, state, tolerance=tol)
        out = B.balance(cfg, sc, r, jnp.zeros(4), state, demand_loads=demand)
        return float(out.stats["diverted_fraction"]), r, out

    frac0, r0, out0 = diverted(0.0, scores)
    assert frac0 == pytest.approx(2 / 400)
    last0 = np.where(top == 0)[0][-1]  # the shed row is expert 0's last in token order
    last1 = np.where(top == 1)[0][-1]  # expert 1's last row, shed once t100 arrived
    changed = np.where(np.asarray(r0.expert_ids[:, 0]) != top)[0]
    np.testing.assert_array_equal(changed, [last0, last1])
    np.testing.assert_array_equal(np.asarray(r0.expert_ids[changed, 0]), [1, 3])
    np.testing.assert_array_equal(out0.stats["loads"], [100, 100, 100, 100])
    frac, _, out = diverted(0.05, scores)
    assert frac == 0.0
    np.testing.assert_allclose(out.next_state["window_loads"][0], np.array([101, 100, 100, 99]) / 400)
    assert int(out.next_state["filled"]) == 1
    balanced = jnp.asarray(s[:400])
    balanced = balanced.at[np.arange(400), top].set(0.0).at[np.arange(400), np.arange(400) % 4].set(0.9)
    assert diverted(0.0, balanced)[0] == 0.0


def test_threshold_window_smoothing():
    """With a window full of balanced history, a skewed step is smoothed to u = (1 + 4·f)/2 and
    flags nothing, while the same step alone diverts."""
    cfg = B.QuantileThreshold(window=1)
    s = np.full((8, 4), 0.1, np.float32)
    s[np.arange(8), [0, 0, 0, 0, 0, 1, 2, 3]] = 0.9
    s[:, 1] += 0.05
    scores = jnp.asarray(s)
    fresh = B.init_balancing_state(cfg, 4)
    r_fresh, _ = T.threshold_route(scores, 1, fresh)
    full = {"window_loads": jnp.full((1, 4), 0.25), "filled": jnp.array(1, jnp.int32)}
    r_full, _ = T.threshold_route(scores, 1, full)
    # alone: u = (2.5, .5, .5, .5), P95 = 2.2 -> expert 0 over, cap floor(2.2·2) = 4: t4 shed to 1
    np.testing.assert_array_equal(r_fresh.expert_ids[:, 0], [0, 0, 0, 0, 1, 1, 2, 3])
    # smoothed: u = (1.75, .75, .75, .75) -> cap floor(1.6·2) = 3: t3, t4 shed to expert 1
    np.testing.assert_array_equal(r_full.expert_ids[:, 0], [0, 0, 0, 1, 1, 1, 2, 3])


# --------------------------------------------------------------------------- malformed calls (issue 23)


def _k3_routing(n=8, k=1):
    scores = jnp.asarray(K3_EXAMPLE[:n])
    return scores, R.route(scores, None, k)


@pytest.mark.parametrize("top_k", [2.5, 1.0, True, "2"])
def test_route_non_int_top_k_is_a_value_error(top_k):
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=4\]"):
        R.route(jnp.asarray(K3_EXAMPLE), None, top_k)


@pytest.mark.parametrize("method", ["loss_free", "quantile", "aux_loss", "none"])
def test_balance_with_routing_for_other_tokens_names_routing(method):
    scores = jnp.asarray(K3_EXAMPLE)
    _, routing6 = _k3_routing(6)  # routed 6 tokens, balanced against 8
    with pytest.raises(ValueError, match=r"routing\.expert_ids must be \[N, k\] with N=8"):
        B.balance(B.balancing_config(method), scores, routing6, jnp.zeros(4))
    good = B.balance(B.balancing_config(method), scores, R.route(scores, None, 1), jnp.zeros(4))
    np.testing.assert_array_equal(good.stats["loads"], [4, 3, 1, 0])


def test_quantile_margins_with_routing_for_other_tokens_names_routing():
    scores = jnp.asarray(K3_EXAMPLE)
    _, routing6 = _k3_routing(6)
    with pytest.raises(ValueError, match=r"routing\.expert_ids must be \[N, k\] with N=8"):
        Q.quantile_margins(scores, routing6)
    with pytest.raises(ValueError, match=r"routing\.cutoff must be \[N\] with N=8"):
        Q.quantile_margins(scores, R.route(scores, None, 1)._replace(cutoff=jnp.zeros(6)))


@pytest.mark.parametrize("top_k", [0, 4, 5, -1, 1.5])
def test_quantile_bias_top_k_outside_1_to_e(top_k):
    margins = Q.quantile_margins(*_k3_routing())
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=4\)"):
        Q.quantile_bias(margins, top_k, bias=jnp.zeros(4))
    np.testing.assert_allclose(Q.quantile_bias(margins, 1, bias=jnp.zeros(4)).sum(), 0.0, atol=1e-6)


def test_expert_loads_checks_ids_on_request():
    ids = jnp.array([[0], [3], [4], [-1]], jnp.int32)  # 4 and -1 are outside [0, E=4)
    np.testing.assert_array_equal(M.expert_loads(ids, 4), [1, 0, 0, 1])  # the default: dropped, documented
    with pytest.raises(ValueError, match=r"expert_loads: expert_ids must be in \[0, num_experts=4\); got 2 ids"):
        M.expert_loads(ids, 4, check_values=True)  # eager: JaxRuntimeError, a ValueError
    # under jit, functionalised with checkify; a masked-out bad id does not count
    from jax.experimental import checkify
    f = jax.jit(checkify.checkify(lambda i, m: M.expert_loads(i, 4, token_mask=m, check_values=True)))
    err, loads = f(ids, jnp.array([True, True, True, False]))
    assert "got 1 ids outside it (max id 4)" in err.get()
    err, loads = f(ids, jnp.array([True, True, False, False]))
    assert err.get() is None
    np.testing.assert_array_equal(loads, [1, 0, 0, 1])
    with pytest.raises(ValueError, match="expert_ids must have an integer dtype"):
        M.expert_loads(ids.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        M.expert_loads(ids, 0)


def test_route_checks_nan_scores_on_request():
    scores = jnp.asarray(K3_EXAMPLE).at[2, 1].set(jnp.nan)
    r = R.route(scores, None, 1)  # the default does not look at values
    assert np.isnan(np.asarray(r.weights)).any()
    with pytest.raises(ValueError, match="route: scores must be finite; got 1 NaN/inf values of 32"):
        R.route(scores, None, 1, check_values=True)
    with pytest.raises(ValueError, match="route: bias must be finite; got 1 NaN/inf values of 4"):
        R.route(jnp.asarray(K3_EXAMPLE), jnp.array([0.0, jnp.inf, 0.0, 0.0]), 1, check_values=True)
    from jax.experimental import checkify
    err, _ = jax.jit(checkify.checkify(lambda s: R.route(s, None, 1, check_values=True)))(scores)
    assert "scores must be finite" in err.get()
    with pytest.raises(ValueError, match="checkify"):  # jitted without checkify: fails to trace, loudly
        jax.jit(lambda s: R.route(s, None, 1, check_values=True))(scores)


@pytest.mark.parametrize("gamma", [-1.0, float("nan"), float("inf"), -1e-9])
def test_loss_free_gamma_must_be_finite_and_non_negative(gamma):
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        B.LossFree(gamma=gamma)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        B.loss_free_update(jnp.array([4.0, 3.0, 1.0, 0.0]), gamma)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        B.AuxLoss(alpha=gamma)
    np.testing.assert_allclose(B.loss_free_update(jnp.array([4.0, 3.0, 1.0, 0.0]), 0.5), [-0.5, -0.5, 0.5, 0.5])
