"""Jitted train and eval steps (flax NNX). Loss in nats per predicted token; fp32 cross-entropy."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.models.lm import LanguageModel


def masked_cross_entropy(logits, targets, loss_mask):
    """Summed cross-entropy (nats, fp32) over positions with `loss_mask`, and the count of those positions.

    Args:
      logits: [B, T, V] fp32. targets: [B, T] int32. loss_mask: [B, T] bool.
    Returns:
      (sum_nats fp32 scalar, count fp32 scalar)
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def _forward_loss(model: LanguageModel, batch, train: bool):
    logits, aux = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                        train=train)
    nats, count = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    ce = nats / jnp.maximum(count, 1.0)
    balance = sum((a["loss"] for a in aux["moe"]), jnp.zeros((), jnp.float32))
    return ce + balance, (ce, nats, count, aux)


def _moe_layers(model: LanguageModel):
    return [f for f in model.ffns if hasattr(f, "router_bias")]


@nnx.jit
def train_step(model: LanguageModel, optimizer: nnx.Optimizer, batch):
    """One optimizer step. Returns fp32 metrics: loss (total), ce (nats/token), grad_norm, finite flag,
    consecutive non-finite count, and per-MoE-layer balance statistics.

    MoE router biases (non-trainable `RouterBias` variables) receive the `next_bias` the layers return,
    only when the step was finite; the optimizer never touches them (it updates `nnx.Param` only).
    """
    grad_fn = nnx.value_and_grad(lambda m: _forward_loss(m, batch, True), has_aux=True)
    (loss, (ce, _, _, aux)), grads = grad_fn(model)
    optimizer.update(model, grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    for ffn, layer_aux in zip(_moe_layers(model), aux["moe"]):
        ffn.router_bias.set_value(jnp.where(finite, layer_aux["next_bias"], ffn.router_bias.get_value()))
        if layer_aux.get("next_state") is not None and ffn.balancing_state is not None:
            ffn.balancing_state.set_value(jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                                       layer_aux["next_state"], ffn.balancing_state.get_value()))
    metrics = {"loss": loss, "ce": ce, "grad_norm": optax.global_norm(grads), "finite": finite,
               "nonfinite_count": optimizer.opt_state.notfinite_count}
    for i, layer_aux in enumerate(aux["moe"]):
        for name, value in layer_aux.get("stats", {}).items():
            if jnp.ndim(value) == 0:
                metrics[f"moe/{i}/{name}"] = value
    return metrics


@nnx.jit
def eval_step(model: LanguageModel, batch):
    """Summed nats, predicted-token count and byte-target count on one batch (no state changes)."""
    _, (_, nats, count, aux) = _forward_loss(model, batch, False)
    is_byte = (batch["targets"] < 256) & batch["loss_mask"]
    loads = [a["stats"]["loads"] for a in aux["moe"] if "loads" in a.get("stats", {})]
    return {"nats": nats, "count": count, "bytes": jnp.sum(is_byte.astype(jnp.float32)), "loads": loads}


def bits_per_byte(nats: float, num_bytes: float) -> float:
    """Total nats over every predicted token (bytes and the rare EOS) divided by ln 2 per byte target."""
    return float(nats) / (math.log(2.0) * max(float(num_bytes), 1.0))
