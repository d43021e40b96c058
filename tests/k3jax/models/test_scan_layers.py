"""model.scan_layers: the scanned stack equals the unrolled one (loss, every parameter's gradient, AttnRes
depth weights, MoE aux, a train step), with and without remat; config checks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models.config import AttentionConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.models.lm import LanguageModel

# 2 periods of "KA"; 3 blocks of sublayers do not line up with the period
BASE = ModelConfig(d_model=32, num_layers=4, num_heads=2, head_dim=16, d_ff=48, mixer_pattern="KA", ffn="moe",
                   moe=MoEConfig(num_experts=4, d_ff=32), residual=ResidualConfig(kind="block_attnres", blocks=3),
                   attention=AttentionConfig(rope=False))
TOKENS = jax.random.randint(jax.random.key(0), (2, 33), 0, 259)
SEGMENTS = jnp.concatenate([jnp.ones((2, 20), jnp.int32), 2 * jnp.ones((2, 12), jnp.int32)], axis=1)


def _loss(model):
    logits, aux = model(TOKENS[:, :-1], segment_ids=SEGMENTS)
    ce = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, TOKENS[:, 1:, None], -1)[..., 0])
    return ce + sum((a["loss"] for a in aux["moe"]), 0.0), aux


def _run(cfg, diagnostics=True):
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    (loss, aux), grads = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))(model)
    diag = nnx.jit(lambda m: m.diagnostics(TOKENS[:, :-1], segment_ids=SEGMENTS))(model) if diagnostics else None
    return loss, aux, nnx.to_pure_dict(grads), diag


@pytest.mark.parametrize("changes", [
    dict(remat="none"),  # remat "full": test_scanned_train_step_equals_unrolled
    # attention only: the scan of a KDA layer is the first case's; here it would only add compile time
    dict(remat="dots_saveable", residual=ResidualConfig(kind="prenorm"), mixer_pattern="AA"),
    # remat "full" with AttnRes: residual_ops.scan_source_buffer (Block AttnRes: the train-step test below)
    dict(remat="full", residual=ResidualConfig(kind="full_attnres"), ffn="mlp", mixer_pattern="AA"),
])
def test_scanned_model_equals_unrolled(changes, monkeypatch):
    from k3jax.ops import residuals as residual_ops
    unrolled = dataclasses.replace(BASE, **{k: v for k, v in changes.items() if k != "remat"})
    scanned = dataclasses.replace(unrolled, scan_layers=True, remat=changes["remat"])
    calls = []
    library_scan = residual_ops.scan_source_buffer
    monkeypatch.setattr(residual_ops, "scan_source_buffer", lambda *a: calls.append(1) or library_scan(*a))
    loss0, aux0, grads0, diag0 = _run(unrolled)
    loss1, aux1, grads1, diag1 = _run(scanned)
    # AttnRes with remat "full" runs scan_source_buffer; the other cases the checkpointed lax.scan
    assert bool(calls) == (scanned.remat == "full" and scanned.residual.kind != "prenorm")
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    leaves0, leaves1 = jax.tree.leaves_with_path(grads0), jax.tree.leaves_with_path(grads1)
    assert [p for p, _ in leaves0] == [p for p, _ in leaves1]
    for (path, g0), (_, g1) in zip(leaves0, leaves1):
        scale = float(np.max(np.abs(g0))) or 1.0  # fp32 rounding relative to the leaf's largest entry
        np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))
    assert sum(float(jnp.abs(g).sum()) > 0 for _, g in leaves0) > len(leaves0) // 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), aux0, aux1)
    assert set(diag0) == set(diag1)
    for name in diag0:  # hidden RMS, cosine and the AttnRes depth-weight matrix
        np.testing.assert_allclose(diag1[name], diag0[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if unrolled.residual.kind != "prenorm":
        assert diag0["depth_weights"].shape == (unrolled.num_sublayers + 1, unrolled.block_layout().max_sources)


def _depth_kernels_match_xla(implementation, **changes):
    """`implementation` for the depth mixes equals "xla": unrolled (a sequence of sources per mix) and
    scanned with remat full (the carried buffer, whose cotangent the kernel's backward updates in place)."""
    xla = dataclasses.replace(BASE, ffn="mlp", mixer_pattern="AA",  # attention only: a KDA layer only adds compile time
                              residual=dataclasses.replace(BASE.residual, implementation="xla"), **changes)
    loss0, _, grads0, diag0 = _run(xla)
    kernel = dataclasses.replace(xla.residual, implementation=implementation)
    for cfg in (dataclasses.replace(xla, residual=kernel),
                dataclasses.replace(xla, residual=kernel, scan_layers=True, remat="full")):
        loss1, _, grads1, diag1 = _run(cfg, diagnostics=cfg.scan_layers)  # the scan stacks the weights
        np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
        for (path, g0), (_, g1) in zip(jax.tree.leaves_with_path(grads0), jax.tree.leaves_with_path(grads1)):
            scale = float(np.max(np.abs(g0))) or 1.0
            np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))
        if diag1 is not None:
            np.testing.assert_allclose(diag1["depth_weights"], diag0["depth_weights"], rtol=1e-5, atol=1e-6)


@pytest.mark.full  # `make test-full` only (the kernels' interpret tests run in CI; the _gpu test below is compiled)
def test_depth_kernels_in_the_model_match_xla(monkeypatch):
    """residual.implementation=None takes the Pallas depth kernels (interpret mode, as if on an H200)."""
    import pallas_kernels.depth_attention as pda
    from k3jax.ops import residuals as residual_ops
    kernel = pda.depth_attention_pallas
    calls = []

    def interpreted(*args, **kw):
        calls.append(kw.get("pass_through", False))
        return kernel(*args, **{**kw, "interpret": True})
    monkeypatch.setattr(residual_ops, "_pallas_covers", lambda *a: True)
    monkeypatch.setattr(pda, "depth_attention_pallas", interpreted)
    _depth_kernels_match_xla(None)
    assert any(calls) and not all(calls)  # the unrolled stack passes sequences, the scanned one a carried buffer


@pytest.mark.gpu
def test_depth_kernels_in_the_model_match_xla_gpu():
    with jax.default_matmul_precision("highest"):  # no TF32 rounding to amplify fp32 summation-order noise
        _depth_kernels_match_xla("pallas", d_model=256, num_heads=2, head_dim=128)


def test_scanned_train_step_equals_unrolled():
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer
    from k3jax.train.step import bind_train_step, train_step
    batch = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:], "segment_ids": SEGMENTS,
             "positions": jnp.broadcast_to(jnp.arange(32), (2, 32)), "loss_mask": jnp.ones((2, 32), bool)}
    out = []
    for cfg in (BASE, dataclasses.replace(BASE, scan_layers=True, remat="full")):
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, make_optimizer(TrainConfig(warmup_steps=0)), wrt=nnx.Param)
        step = bind_train_step(model, opt) if cfg.scan_layers else (lambda b, m=model, o=opt: train_step(m, o, b))
        metrics = [jax.device_get(step(batch)) for _ in range(2)]  # scanned: the trainer's bound step
        out.append((metrics, nnx.to_pure_dict(nnx.state(model))))
    (m0, s0), (m1, s1) = out
    for a, b in zip(m0, m1):
        assert a["finite_activations"].shape == b["finite_activations"].shape == (2 * BASE.num_layers + 3,)
        np.testing.assert_array_equal(a["finite_activations"], b["finite_activations"])
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    # params and router biases; AdamW's normalised update turns gradient rounding into <= 5% of one
    # step (lr 3e-3) on entries with tiny gradients
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1.5e-4), s0, s1)


@pytest.mark.parametrize("changes, message", [
    (dict(scan_layers=True, num_layers=3), "multiple of len"),
    (dict(scan_layers=True, residual=ResidualConfig(kind="article_block", blocks=2)),
     "scan_layers supports model.residual.kind"),
    (dict(remat="full"), "needs model.scan_layers"),
    (dict(scan_layers=True, remat="offload"), "model.remat must be one of"),
])
def test_scan_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes)
