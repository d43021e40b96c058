"""Jitted train and eval steps (flax NNX). Loss in nats per predicted token; fp32 cross-entropy.

`loss_chunk_size` (static; 0 = the plain loss on the model's logits) computes the cross-entropy from the
final hidden states and the head matrix in chunks of that many tokens (`k3jax.ops.cross_entropy`), so the
[tokens, vocab] fp32 logits are never all live (the model's unused logits are dead code under jit).

The train step also returns where a non-finite value first appeared (one bool per sublayer output and
per parameter group, names from `finiteness_names`), so that a skipped step can say which layer
produced it (`nonfinite_report`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax.models.config import MIXERS
from k3jax.models.lm import LanguageModel
from k3jax.ops.cross_entropy import chunked_cross_entropy


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


def _all_finite(x) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(x)] or [jnp.bool_(True)]))


def _forward_loss(model: LanguageModel, batch, train: bool, loss_chunk_size: int = 0):
    logits, aux, depth = model.forward(batch["inputs"], segment_ids=batch["segment_ids"],
                                       positions=batch["positions"], train=train)
    if loss_chunk_size:
        hidden, weight = model.head_inputs(depth.hidden)
        nats, count = chunked_cross_entropy(hidden, weight, batch["targets"], batch["loss_mask"],
                                            chunk_size=loss_chunk_size, dtype=hidden.dtype)
        logits = hidden  # the head's probe: its input (the logits are never built)
    else:
        nats, count = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    ce = nats / jnp.maximum(count, 1.0)
    balance = sum((a["loss"] for a in aux["moe"]), jnp.zeros((), jnp.float32))
    loss = ce + balance
    # One bool per probe, in forward order: the stream after the embedding (= sublayer 0's input), after
    # each sublayer, the logits, the loss (the activation names of `finiteness_names`).
    # The scanned stack reduced its sublayer inputs to flags inside the scan (`sublayer_finite`).
    scanned = depth.sublayer_finite is not None
    probes = (*(() if scanned else depth.sublayer_inputs), depth.hidden, logits, loss)
    finite = jnp.stack([_all_finite(jax.lax.stop_gradient(x)) for x in probes])
    if scanned:
        finite = jnp.concatenate([depth.sublayer_finite, finite])
    return loss, (ce, nats, count, aux, finite)


def _param_groups(params: dict) -> dict:
    """Parameter pure dict -> {"embed": ..., "mixers/0": ..., "ffns/1": ...}: top-level modules, list
    entries one by one (names sorted, the order of the train step's `finite_grads`)."""
    groups = {}
    for top, sub in params.items():
        if isinstance(sub, dict) and sub and all(str(k).isdigit() for k in sub):
            groups.update({f"{top}/{i}": v for i, v in sub.items()})
        else:
            groups[str(top)] = sub
    return dict(sorted(groups.items()))


def finiteness_names(model: LanguageModel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the train step's `finite_activations` and `finite_grads` entries.

    Activations: entry i says the stream was finite after module i ran: "embed", then each sublayer
    ("mixers/0 (kda)", "ffns/0 (mlp)", ...), then "final_norm/head" (the logits) and "loss" (cross-entropy
    plus balance losses). Gradients: the parameter groups of `_param_groups`, sorted by name.
    """
    cfg = model.cfg
    sublayers = []
    for layer, letter in enumerate(cfg.layer_mixers):
        sublayers += [f"mixers/{layer} ({MIXERS[letter]})", f"ffns/{layer} ({cfg.ffn})"]
    activations = ("embed", *sublayers, "final_norm/head", "loss")
    grads = tuple(_param_groups(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    return activations, grads


def _depth_rank(group: str, num_layers: int) -> float:
    """Forward position of a parameter group (embed first, head last) for ordering a report."""
    top, _, index = group.partition("/")
    within = {"mixer_norms": 0.1, "mixers": 0.2, "ffn_norms": 0.6, "ffns": 0.7}
    if top == "embed":
        return -1.0
    if top in within and index.isdigit():
        return int(index) + within[top]
    if top == "depth_mixes" and index.isdigit():  # mix i feeds sublayer i (2L: the final mix)
        return int(index) / 2
    if top in ("final_norm", "head"):
        return num_layers + (0.5 if top == "final_norm" else 0.6)
    return float(num_layers)


def nonfinite_report(model: LanguageModel, metrics: dict) -> str:
    """One line saying where the non-finite values of a train step came from.

    The first module after which the forward stream was non-finite ("first non-finite activation after
    mixers/1 (kda); non-finite gradients in 11 of 11 parameter groups"); if the forward was finite, the
    parameter groups whose gradients were not, deepest first (a NaN born in the backward pass spreads to
    every layer below it, so the deepest one is where it started). `metrics`: the train step's output
    on the host.
    """
    activations, groups = finiteness_names(model)
    acts = np.asarray(metrics["finite_activations"], bool)
    grads = np.asarray(metrics["finite_grads"], bool)
    bad_groups = sorted((g for g, ok in zip(groups, grads) if not ok),
                        key=lambda g: -_depth_rank(g, model.cfg.num_layers))
    counted = f"non-finite gradients in {len(bad_groups)} of {len(groups)} parameter groups"
    if not acts.all():  # then the backward spreads it everywhere: the gradients only get counted
        return f"first non-finite activation after {activations[int(np.argmin(acts))]}; {counted}"
    if not bad_groups:
        return "forward finite; gradients finite"
    shown = ", ".join(bad_groups[:4]) + (", ..." if len(bad_groups) > 4 else "")
    return f"forward finite; {counted}, deepest first: {shown}"


def _moe_layers(model: LanguageModel):
    return [f for f in model.ffns if hasattr(f, "router_bias")]


@functools.partial(nnx.jit, static_argnames=("loss_chunk_size",))
def train_step(model: LanguageModel, optimizer: nnx.Optimizer, batch, *, loss_chunk_size: int = 0):
    """One optimizer step (`loss_chunk_size`: the module docstring). Returns fp32 metrics: loss (total), ce (nats/token), grad_norm, finite flag,
    consecutive non-finite count, per-MoE-layer balance statistics, and where non-finite values appeared:
    `finite_activations` bool [2L + 3] and `finite_grads` bool [parameter groups] (names:
    `finiteness_names`; `nonfinite_report` turns them into a line).

    MoE router biases (non-trainable `RouterBias` variables) receive the `next_bias` the layers return,
    only when the step was finite; the optimizer never touches them (it updates `nnx.Param` only).
    """
    grad_fn = nnx.value_and_grad(lambda m: _forward_loss(m, batch, True, loss_chunk_size), has_aux=True)
    (loss, (ce, _, _, aux, finite_activations)), grads = grad_fn(model)
    optimizer.update(model, grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    for ffn, layer_aux in zip(_moe_layers(model), aux["moe"]):
        ffn.router_bias.set_value(jnp.where(finite, layer_aux["next_bias"], ffn.router_bias.get_value()))
        if layer_aux.get("next_state") is not None and ffn.balancing_state is not None:
            ffn.balancing_state.set_value(jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                                       layer_aux["next_state"], ffn.balancing_state.get_value()))
    finite_grads = jnp.stack([_all_finite(g) for g in _param_groups(nnx.to_pure_dict(grads)).values()])
    metrics = {"loss": loss, "ce": ce, "grad_norm": optax.global_norm(grads), "finite": finite,
               "nonfinite_count": optimizer.opt_state.notfinite_count.get_value(),
               "finite_activations": finite_activations, "finite_grads": finite_grads}
    for i, layer_aux in enumerate(aux["moe"]):
        for name, value in layer_aux.get("stats", {}).items():
            if jnp.ndim(value) == 0:
                metrics[f"moe/{i}/{name}"] = value
    return metrics


def bind_train_step(model: LanguageModel, optimizer: nnx.Optimizer, *, loss_chunk_size: int = 0):
    """`train_step` with `model` and `optimizer` bound: `step(batch) -> metrics`, the same step and metrics.

    Built on `flax.nnx.cached_partial`: the graph traversal that `nnx.jit` does on every call (flatten
    and re-merge the model and optimizer) is done once here, so the per-step host work no longer grows
    with the number of variables. The bound step updates the same `Variable`s, so `model` and
    `optimizer` stay current for eval, checkpoints and reports; bind again after replacing variables
    (e.g. restoring a checkpoint into new objects). The module structure must not change between steps
    (flax raises if it does).
    """
    bound = nnx.cached_partial(train_step, model, optimizer)
    return lambda batch: bound(batch, loss_chunk_size=loss_chunk_size)


@functools.partial(nnx.jit, static_argnames=("loss_chunk_size",))
def eval_step(model: LanguageModel, batch, byte_lengths=None, *, loss_chunk_size: int = 0):
    """Summed nats, predicted-token count and the UTF-8 bytes of the predicted targets on one batch (no
    state changes).

    `byte_lengths`: int32 [>= vocab] bytes each id stands for (`Tokenizer.token_byte_lengths()` padded
    with zeros); None = byte ids (1 byte for ids < 256, 0 for the specials), the byte tokenizer's.
    """
    _, (_, nats, count, aux, _) = _forward_loss(model, batch, False, loss_chunk_size)
    if byte_lengths is None:
        nbytes = jnp.sum(((batch["targets"] < 256) & batch["loss_mask"]).astype(jnp.float32))
    else:
        per_target = jnp.take(jnp.asarray(byte_lengths, jnp.int32), batch["targets"], mode="clip")
        nbytes = jnp.sum(jnp.where(batch["loss_mask"], per_target, 0)).astype(jnp.float32)
    loads = [a["stats"]["loads"] for a in aux["moe"] if "loads" in a.get("stats", {})]
    return {"nats": nats, "count": count, "bytes": nbytes, "loads": loads}


def bits_per_byte(nats: float, num_bytes: float) -> float:
    """Total nats over every predicted token (text tokens and the EOS ids, which stand for no byte) divided
    by ln 2 per UTF-8 byte those targets stand for. The bytes are the text's whatever the tokenizer, so
    runs with different tokenizers compare (a tokenizer with longer tokens has more nats per token and
    as many bytes)."""
    return float(nats) / (math.log(2.0) * max(float(num_bytes), 1.0))
