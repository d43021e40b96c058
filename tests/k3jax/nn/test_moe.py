"""Tests for k3jax.nn.moe.MoEFeedForward: wiring vs the ops, bias protocol, padding, optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.nn.moe import BalancingState, MoEFeedForward, RouterBias
from k3jax.ops import balance_metrics, balancing
from k3jax.ops import routing as R
from tests.repo import REPO

B, T, D, F, E, K = 2, 8, 16, 24, 8, 2


def _module(method="quantile", **kw):
    kw.setdefault("dtype", jnp.float32)
    return MoEFeedForward(D, F, E, K, balancing=balancing.balancing_config(method), rngs=nnx.Rngs(0), **kw)


def _x(seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))


def test_router_bias_is_not_a_param():
    assert issubclass(RouterBias, nnx.Variable) and not issubclass(RouterBias, nnx.Param)
    assert not issubclass(BalancingState, nnx.Param)
    m = _module("quantile_threshold")
    params = jax.tree.leaves(nnx.state(m, nnx.Param))
    assert len(params) == 4  # router, w_gate, w_up, w_down
    assert m.router_bias.get_value().dtype == jnp.float32
    assert m.balancing_state is not None


@pytest.mark.parametrize("score_func,shared", [("softmax", 0), ("sigmoid", 2)])
def test_module_equals_ops_composition(score_func, shared):
    m = _module(score_func=score_func, num_shared_experts=shared, routed_scaling_factor=2.0)
    m.router_bias.set_value(jnp.linspace(-0.05, 0.05, E))
    x = _x()
    y, aux = m(x)
    xf = x.reshape(-1, D)
    scores = R.router_scores(xf @ m.router.get_value(), score_func)
    r = R.route(scores, m.router_bias.get_value(), K, score_func=score_func, routed_scaling_factor=2.0)
    ref = np.zeros((B * T, D), np.float32)
    wg, wu, wd = (np.asarray(v.get_value()) for v in (m.w_gate, m.w_up, m.w_down))
    for i in range(B * T):
        for s in range(K):
            e = int(r.expert_ids[i, s])
            h = jax.nn.silu(xf[i] @ wg[e]) * (xf[i] @ wu[e])
            ref[i] += float(r.weights[i, s]) * np.asarray(h @ wd[e])
    if shared:
        g, u, d = (v.get_value() for v in (m.shared_gate, m.shared_up, m.shared_down))
        ref += np.asarray((jax.nn.silu(xf @ g) * (xf @ u)) @ d)
    np.testing.assert_allclose(y.reshape(-1, D), ref, rtol=2e-5, atol=2e-5)
    expected = balancing.balance(balancing.QuantileBalancing(), scores, r, m.router_bias.get_value())
    np.testing.assert_allclose(aux["next_bias"], expected.next_bias, atol=1e-7)
    np.testing.assert_array_equal(aux["stats"]["loads"], balance_metrics.expert_loads(r.expert_ids, E))
    assert set(aux["stats"]) == {
        "loads", "max_vio", "cv", "dropped_fraction", "dead_experts", "entropy", "diverted_fraction"}


def test_eval_does_not_move_bias_and_call_never_mutates():
    m = _module("quantile")
    b0 = jnp.linspace(-0.1, 0.1, E)
    m.router_bias.set_value(b0)
    _, aux_eval = m(_x(), train=False)
    np.testing.assert_array_equal(aux_eval["next_bias"], b0)
    np.testing.assert_array_equal(m.router_bias.get_value(), b0)
    _, aux_train = m(_x(), train=True)
    assert float(jnp.max(jnp.abs(aux_train["next_bias"] - b0))) > 1e-4  # train proposes a new bias
    np.testing.assert_array_equal(m.router_bias.get_value(), b0)  # ... but the module keeps its own


def test_padding_tokens_do_not_count():
    m = _module("aux_loss")
    x = _x(3)
    seg = jnp.ones((B, T), jnp.int32).at[:, 5:].set(0)
    _, aux = m(x, segment_ids=seg)
    _, aux_valid = m(x[:, :5])
    np.testing.assert_array_equal(aux["stats"]["loads"], aux_valid["stats"]["loads"])
    assert float(jnp.sum(aux["stats"]["loads"])) == B * 5 * K
    np.testing.assert_allclose(aux["loss"], aux_valid["loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="segment_ids"):
        m(x, segment_ids=seg[:, :4])


def test_capacity_factor_reports_drops_and_zero_output_for_dropped():
    m = _module("none", capacity_factor=0.5)
    y, aux = m(_x(4))
    assert 0.0 < float(aux["stats"]["dropped_fraction"]) < 1.0
    m_dropless = _module("none")
    y_full, aux_full = m_dropless(_x(4))
    assert float(aux_full["stats"]["dropped_fraction"]) == 0.0
    assert not np.allclose(y, y_full)


def test_train_step_writes_bias_optimizer_never_touches_it():
    m = _module("quantile", dtype=jnp.bfloat16)
    opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
    x = _x(5)

    @nnx.jit
    def step(m, opt, x):
        def loss_fn(m):
            y, aux = m(x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux["loss"], aux

        (_, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m)
        opt.update(m, grads)
        m.router_bias.set_value(aux["next_bias"])  # the train step's job, not the module's
        return aux["stats"]["max_vio"]

    w0 = m.w_gate.get_value()
    vios = [float(step(m, opt, x)) for _ in range(4)]
    assert not np.allclose(m.w_gate.get_value(), w0)  # params trained
    assert abs(float(jnp.sum(m.router_bias.get_value()))) < 1e-5  # QB bias is zero-mean
    assert float(jnp.max(jnp.abs(m.router_bias.get_value()))) > 0
    assert vios[-1] < vios[0]


def test_constructor_validation():
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward(D, F, E, E + 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dispatch_implementation"):
        MoEFeedForward(D, F, E, K, dispatch_implementation="triton", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs top_k < num_experts"):
        MoEFeedForward(D, F, 4, 4, balancing=balancing.QuantileBalancing(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "method,options", [("quantile", {"quantile_estimator": "histogram"}), ("aux_loss", {}), ("quantile_threshold", {})])
def test_expert_parallel_equals_single_device(method, options):
    """Mesh (data=2, expert=4) on 8 CPU devices: output, aux (loss, next bias, stats) and gradients
    w.r.t. every parameter and the input equal the single-device module (same init)."""
    from k3jax import sharding as S

    mesh = S.make_mesh(2, 4)
    kw = dict(balancing=balancing.balancing_config(method, **options), dtype=jnp.float32,
              num_shared_experts=1)
    ref = MoEFeedForward(D, F, E, K, rngs=nnx.Rngs(0), **kw)
    ep = MoEFeedForward(D, F, E, K, rngs=nnx.Rngs(0), mesh=mesh, **kw)
    for name in ("w_gate", "w_up", "w_down"):
        v = getattr(ep, name)
        v.set_value(jax.device_put(v.get_value(), S.expert_sharding(mesh, 3)))
    for name in ("router", "router_bias", "shared_gate", "shared_up", "shared_down"):
        v = getattr(ep, name)
        v.set_value(jax.device_put(v.get_value(), S.replicated(mesh)))
    if ep.balancing_state is not None:
        ep.balancing_state.set_value(jax.device_put(ep.balancing_state.get_value(), S.replicated(mesh)))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 6, D))
    seg = jnp.ones((8, 6), jnp.int32).at[3, 4:].set(0)
    cot = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def loss(m, x, seg):
        y, aux = m(x, segment_ids=seg)
        return jnp.sum(y * cot) + aux["loss"], aux

    vg = nnx.jit(lambda m, x, seg: nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x, seg))
    (l0, a0), g0 = vg(ref, x, seg)
    (l1, a1), g1 = vg(ep, jax.device_put(x, S.token_sharding(mesh, 3)), jax.device_put(seg, S.token_sharding(mesh, 2)))
    # a float32 sum of 768 products: summation order alone moves it by ~1e-6 relative (the routing
    # itself is compared exactly through the stats below)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(a1["loss"], a0["loss"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(a1["next_bias"], a0["next_bias"], atol=1e-7)
    for key in a0["stats"]:
        np.testing.assert_allclose(a1["stats"][key], a0["stats"][key], rtol=1e-6, err_msg=key)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1) == 8  # 7 params + x
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))


# One MoE training loop (quantile histogram balancing, bias written back every step) on a (data=2,
# expert=4) mesh. Run by 2 processes x 4 CPU devices (gloo) and by this process (8 devices).
_TRAIN_SRC = '''
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from k3jax import sharding as S
from k3jax.nn.moe import MoEFeedForward
from k3jax.ops import balancing

def _global(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

def train_losses(mesh, steps=5):
    m = MoEFeedForward(16, 24, 8, 2, num_shared_experts=1, dtype=jnp.float32, mesh=mesh, rngs=nnx.Rngs(0),
                       balancing=balancing.QuantileBalancing(quantile_estimator="histogram"))
    for name in ("w_gate", "w_up", "w_down"):
        getattr(m, name).set_value(_global(getattr(m, name).get_value(), S.expert_sharding(mesh, 3)))
    for name in ("router", "router_bias", "shared_gate", "shared_up", "shared_down"):
        getattr(m, name).set_value(_global(getattr(m, name).get_value(), S.replicated(mesh)))
    rng = np.random.default_rng(0)
    x = _global(rng.normal(size=(8, 6, 16)).astype(np.float32), S.token_sharding(mesh, 3))
    target = _global(rng.normal(size=(8, 6, 16)).astype(np.float32), S.token_sharding(mesh, 3))
    seg = _global(np.ones((8, 6), np.int32), S.token_sharding(mesh, 2))

    @nnx.jit
    def step(m, x, seg, target):
        def loss_fn(m):
            y, aux = m(x, segment_ids=seg)
            return jnp.mean((y - target) ** 2) + aux["loss"], aux
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m)
        params = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
        m.router_bias.set_value(aux["next_bias"])
        return loss, aux["stats"]["max_vio"]

    return [tuple(float(v) for v in step(m, x, seg, target)) for _ in range(steps)]
'''

_WORKER = '''
import sys, json
import jax
jax.config.update("jax_num_cpu_devices", 4)
from k3jax import sharding as S
S.initialize_distributed(f"127.0.0.1:{sys.argv[1]}", 2, int(sys.argv[2]))
exec(compile(sys.argv[3], "train_src", "exec"))
assert jax.process_count() == 2 and jax.device_count() == 8
print("LOSSES", json.dumps(train_losses(S.make_mesh(2, 4))))
'''


def test_two_processes_match_one_process():
    """2 local processes (coordinator on 127.0.0.1, 4 CPU devices each, gloo collectives) run 5
    expert-parallel train steps with the same losses (and MaxVio) as this single 8-device process."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from k3jax import sharding as S

    scope = {}
    exec(compile(_TRAIN_SRC, "train_src", "exec"), scope)
    single = scope["train_losses"](S.make_mesh(2, 4))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = REPO
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(port), str(i), _TRAIN_SRC], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.split("LOSSES", 1)[1]))
    assert outs[0] == outs[1]
    np.testing.assert_allclose(np.array(outs[0]), np.array(single), rtol=1e-6, atol=1e-7)
    assert single[-1][0] < single[0][0]  # it trains


def test_language_model_expert_parallel_equals_single_device():
    """LanguageModel(mesh=(data=2, expert=4), Auto axes) on 8 CPU devices, two MoE layers (loss-free
    bias: loads psum'ed over both token axes) with a padded row: LM loss, next biases and the gradient
    of every parameter equal the single-device model with the same init."""
    from k3jax import sharding as S
    from k3jax.models.config import ModelConfig, MoEConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.ops.balancing import LossFree

    cfg = ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=32, mixer_pattern="A",
                      ffn="moe", moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, balancing=LossFree()))
    mesh = S.make_mesh(2, 4, explicit=False)
    ref = LanguageModel(cfg, rngs=nnx.Rngs(0))
    ep = LanguageModel(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    ep.shard_params()
    assert all(f.mesh is mesh for f in ep.ffns)
    assert ep.ffns[1].w_up.get_value().sharding.spec[0] == S.EXPERT
    tokens = jax.random.randint(jax.random.PRNGKey(2), (8, 12), 0, cfg.vocab_size)
    seg = jnp.ones((8, 12), jnp.int32).at[5, 9:].set(0)

    def loss(model, tokens, seg):
        logits, aux = model(tokens[:, :-1], segment_ids=seg[:, :-1])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        mask = (seg[:, 1:] != 0).astype(jnp.float32)
        return jnp.sum(nll * mask) / jnp.sum(mask), [a["next_bias"] for a in aux["moe"]]

    vg = nnx.jit(lambda m, t, s: nnx.value_and_grad(loss, has_aux=True)(m, t, s))
    (l0, b0), g0 = vg(ref, tokens, seg)
    tok_sh = S.token_sharding(mesh, 2)
    (l1, b1), g1 = vg(ep, jax.device_put(tokens, tok_sh), jax.device_put(seg, tok_sh))
    assert float(l0) > 1.0  # a real loss (near log 259 at init), not a degenerate zero
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    assert len(b0) == len(b1) == 2
    for a, b in zip(b0, b1):
        assert float(jnp.max(jnp.abs(a))) > 0  # the loss-free bias moved
        np.testing.assert_allclose(b, a, atol=1e-7)
    leaves0 = jax.tree_util.tree_leaves_with_path(nnx.state(g0, nnx.Param))
    leaves1 = jax.tree.leaves(nnx.state(g1, nnx.Param))
    assert len(leaves0) == len(leaves1) > 20
    for (path, a), b in zip(leaves0, leaves1):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(a))) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))
