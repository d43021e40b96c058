"""Quantile Balancing histogram estimator with a second refinement pass (`histogram_passes=2`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import balancing as B
from k3jax.ops import quantile as Q
from k3jax.ops import routing as R

# One jit per configuration (eager op-by-op dispatch would compile every primitive separately).
_quantile_bias = jax.jit(Q.quantile_bias, static_argnames=("top_k", "estimator", "histogram_bins",
                                                           "histogram_passes", "center", "axis_names"))


def _margins(seed: int, n: int, e: int, k: int, score_func: str):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    scores = R.router_scores(1.5 * jax.random.normal(k1, (n, e)), score_func)
    bias = 0.02 * jax.random.normal(k2, (e,))
    return _margins_jit(scores, bias, k), bias


@jax.jit(static_argnames="k")
def _margins_jit(scores, bias, k):
    return Q.quantile_margins(scores, R.route(scores, bias, k))


def _bracket(margins: np.ndarray, level: float):
    """Order statistics around the exact (linear-interpolation) quantile position level·(N−1)."""
    srt = np.sort(margins, 0)
    pos = level * (margins.shape[0] - 1)
    return srt[int(np.floor(pos))], srt[int(np.ceil(pos))]


def test_two_passes_within_one_fine_bin_of_exact_quantile():
    # Dense margins (sample spacing << fine bin): the estimate is within one fine bin of the exact value.
    n, e, k, bins = 4096, 8, 2, 24
    m, bias = _margins(0, n, e, k, "sigmoid")
    kw = dict(bias=bias, center=False, estimator="histogram", histogram_bins=bins)
    exact = np.asarray(_quantile_bias(m, top_k=k, bias=bias, center=False))
    one = np.asarray(_quantile_bias(m, top_k=k, **kw))
    two = np.asarray(_quantile_bias(m, top_k=k, **kw, histogram_passes=2))
    width = (float(bias.max()) - float(bias.min()) + 2.0) / bins
    fine = width / bins
    assert np.max(np.abs(two - exact)) <= fine
    assert np.max(np.abs(one - exact)) > fine  # the first pass alone is coarser (the test can fail)
    assert np.max(np.abs(one - exact)) <= width
    # Realistic case, E = 32 softmax with 1000 bins (margins ~0.01 wide): inside one fine bin around
    # the exact bracket [r_(floor pos), r_(ceil pos)].
    n, e, k, bins = 2048, 32, 4, 1000
    m, bias = _margins(1, n, e, k, "softmax")
    two = np.asarray(_quantile_bias(m, top_k=k, bias=bias, center=False, estimator="histogram", histogram_bins=bins,
                                     histogram_passes=2))
    fine = (float(bias.max()) - float(bias.min()) + 2.0) / bins**2
    lo, hi = _bracket(np.asarray(m), k / e)
    assert np.all(two >= lo - fine - 1e-7) and np.all(two <= hi + fine + 1e-7)


def test_two_passes_sharded_equals_pooled():
    """8 fake devices: both histograms psum'ed over the batch axis give the pooled b̂ (same counts;
    the only difference left is fp32 rounding of the final formula, far below one fine bin ~2e-6)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    P = jax.sharding.PartitionSpec
    n, e, k = 1024, 16, 2
    m, bias = _margins(2, n, e, k, "softmax")
    kw = dict(bias=bias, estimator="histogram", histogram_passes=2, center=False)
    pooled = np.asarray(_quantile_bias(m, top_k=k, **kw))

    def local(m_shard, b):
        return Q.quantile_bias(m_shard, k, **dict(kw, bias=b), axis_names=("data",))[None]

    per_device = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))(
        jax.device_put(m, jax.sharding.NamedSharding(mesh, P("data"))),
        jax.device_put(bias, jax.sharding.NamedSharding(mesh, P())))
    per_device = np.asarray(per_device)
    assert per_device.shape == (8, e)
    np.testing.assert_array_equal(per_device, np.broadcast_to(per_device[0], (8, e)))  # replicated result
    np.testing.assert_allclose(per_device[0], pooled, rtol=0, atol=1e-7)
    one = np.asarray(_quantile_bias(m, top_k=k, **dict(kw, histogram_passes=1)))
    assert np.max(np.abs(one - pooled)) > 1e-5  # the second pass moved the estimate


def test_two_passes_through_balance_and_padding():
    n, e, k = 512, 8, 2
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    scores = R.router_scores(jax.random.normal(k1, (n, e)), "softmax")
    bias = 0.01 * jax.random.normal(k2, (e,))
    cfg = B.QuantileBalancing(quantile_estimator="histogram", histogram_passes=2)

    @jax.jit
    def run(scores, mask):
        return B.balance(cfg, scores, R.route(scores, bias, k), bias, token_mask=mask).next_bias

    padded = run(scores, jnp.arange(n) < 400)
    valid = run(scores[:400], jnp.ones(400, bool))
    np.testing.assert_array_equal(padded, valid)
    direct = _quantile_bias(_margins_jit(scores[:400], bias, k), top_k=k, bias=bias, estimator="histogram",
                            histogram_passes=2)
    np.testing.assert_array_equal(valid, direct)


def test_histogram_passes_validation():
    with pytest.raises(ValueError, match="histogram_passes"):
        B.QuantileBalancing(histogram_passes=3)
    m, bias = _margins(4, 64, 4, 1, "softmax")
    with pytest.raises(ValueError, match="histogram_passes"):
        Q.quantile_bias(m, 1, bias=bias, estimator="histogram", histogram_passes=0)


def test_model_config_plumbs_histogram_passes():
    from k3jax.models.config import ModelConfig, model_config_from_dict  # noqa: PLC0415

    cfg = model_config_from_dict({"ffn": "moe", "moe": {"balancing": {
        "method": "quantile", "quantile_estimator": "histogram", "histogram_passes": 2}}})
    assert cfg.moe.balancing.histogram_passes == 2
    assert ModelConfig(ffn="moe").moe.balancing.histogram_passes == 1  # K3's single pass by default
    with pytest.raises(ValueError, match=r"model\.moe\.balancing\.histogram_passes"):
        model_config_from_dict({"ffn": "moe", "moe": {"balancing": {"histogram_passes": 3}}})


@pytest.mark.parametrize("field,value", [("histogram_passes", True), ("histogram_passes", 2.0),
                                         ("histogram_bins", True), ("histogram_bins", 2.5)])
def test_counts_must_be_ints_not_bools_or_floats(field, value):
    with pytest.raises(ValueError, match=field):
        B.QuantileBalancing(quantile_estimator="histogram", **{field: value})
