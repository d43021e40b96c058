"""The QB convergence study's measured properties (experiments/qb_convergence.py, issue 5).

One fast test (small shapes, a few jits): on one batch of a peaked synthetic softmax router (E = 32,
top-4) a single Quantile Balancing step from b = 0 is NOT exact (all biases move at once, so the
cutoffs move); iterating the update on the same batch converges (exact estimator); the 1000-bin
histogram estimator stalls at a MaxVio far above the exact one; and on a stationary stream the
next-batch MaxVio falls well below the no-bias MaxVio but stays above the binomial sampling floor.
"""
import jax
import numpy as np

from experiments import qb_convergence as Q


def test_qb_fixed_point_and_stationary_stream():
    E, k, d, n = 32, 4, 64, 4096
    key = jax.random.PRNGKey(0)
    router = Q.Router(jax.random.fold_in(key, 0), d, E, scale=1.5, popularity=1.0)
    fp = Q.fixed_point(router, jax.random.fold_in(key, 2), n, k, iters=8, resolution=False)
    exact, hist = fp["exact/zero"], fp["histogram/zero"]
    assert exact[0] > 3.0                      # the unbiased router is strongly imbalanced
    assert 0.2 < exact[1] < 0.5 * exact[0]     # one step helps a lot but is not exact
    assert exact[-1] < 0.1                     # the fixed-point iteration converges on the batch
    assert min(hist[4:]) > 2.0 * exact[-1]     # the 1000-bin histogram stalls above the exact quantile
    assert fp["per_expert_margins/zero"][-1] < exact[-1]  # per-expert cutoffs converge faster
    lo, hi = fp["admitted_at_fixed_cutoffs_min_max"]
    assert hi == fp["q"] and lo < fp["q"]      # tie group of (k+1)-th experts at r = b_j = 0 straddles q
    floor = Q.binomial_floor(n, E, k, trials=2000)
    st = Q.stream(router, jax.random.fold_in(key, 3), n, k, steps=24, warmup=8)
    assert floor < st["next_batch_max_vio"] < 0.5
    np.testing.assert_allclose(floor, 0.092, atol=0.01)
