"""Quantile Balancing with several dual steps per training step (balancing.QuantileBalancing.quantile_iterations)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import balance_metrics as M
from k3jax.ops import balancing as B
from k3jax.ops import quantile as Q
from k3jax.ops import routing as R

N, E, K = 4096, 16, 2


def _scores(seed=0):
    key1, key2 = jax.random.split(jax.random.PRNGKey(seed))
    popularity = 1.5 * jnp.sort(jax.random.normal(key1, (E,)))          # every token prefers the same experts
    return jax.nn.softmax(popularity[None, :] + jax.random.normal(key2, (N, E)), axis=-1)


def _next_bias(scores, bias, iterations):
    cfg = B.QuantileBalancing(quantile_iterations=iterations)
    routing = R.route(scores, bias, K)
    return B.balance(cfg, scores, routing, bias).next_bias


def _same_batch_max_vio(scores, bias):
    loads = M.expert_loads(R.route(scores, bias, K).expert_ids, E)
    return float(M.max_vio(loads))


def test_one_iteration_is_the_k3_step_and_n_iterations_are_n_steps_on_the_batch():
    scores, b0 = _scores(), jnp.zeros((E,), jnp.float32)
    one = _next_bias(scores, b0, 1)
    margins = Q.quantile_margins(scores, R.route(scores, b0, K))
    np.testing.assert_array_equal(one, Q.quantile_bias(margins, K, bias=b0))
    b = b0
    for _ in range(3):                     # three single steps, each re-routing the SAME batch
        b = _next_bias(scores, b, 1)
    np.testing.assert_allclose(_next_bias(scores, b0, 3), b, atol=1e-6)


def test_more_dual_steps_balance_the_batch_they_were_computed_on():
    scores, b0 = _scores(1), jnp.zeros((E,), jnp.float32)
    vio = {n: _same_batch_max_vio(scores, _next_bias(scores, b0, n)) for n in (1, 4, 8)}
    assert _same_batch_max_vio(scores, b0) > 1.0          # the skewed router: strongly unbalanced
    assert vio[8] < vio[4] < vio[1]
    assert vio[8] < 0.1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_quantile_iterations_validated(bad):
    with pytest.raises(ValueError, match="quantile_iterations"):
        B.QuantileBalancing(quantile_iterations=bad)
