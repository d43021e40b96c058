# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Train K3-tiny: KDA + attention, MoE with Quantile Balancing, Block AttnRes
#
# K3-tiny is the repository's default `make train` model (`experiments/configs/k3_tiny.py`), a
# miniature of the Kimi K3 layout:
#
# * mixers in the pattern `KKKA`: three **KDA** (Kimi Delta Attention, a gated delta-rule linear
#   attention whose per-channel decay is bounded below) layers per full-attention layer, attention
#   without positional encoding;
# * a **mixture-of-experts** FFN whose router is balanced by **Quantile Balancing**;
# * **Block Attention Residuals** instead of the PreNorm residual sum.
#
# We train it with the library's trainer into a temporary folder, plot the loss from
# `metrics.jsonl`, sample text, and reload the checkpoint. With `K3JAX_NOTEBOOK_SMALL=1` (the default)
# the model and data are shrunk so the notebook finishes in about a minute on a laptop CPU; set it to
# `0` for the full default config (400 steps on the Python standard library).

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           os.environ.get("K3JAX_PIP_SPEC", "k3jax @ git+https://github.com/<org>/k3jax")])

# %%
import dataclasses
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from k3jax.data.tokenizer import ByteTokenizer
from k3jax.models.config import AttentionConfig, KDAConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.models.generate import generate
from k3jax.models.lm import LanguageModel
from k3jax.ops.balancing import QuantileBalancing
from k3jax.train.config import DataConfig, RunConfig, TrainConfig
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import evaluate, load_trained_model, sample_text, train

SMALL = os.environ.get("K3JAX_NOTEBOOK_SMALL", "1") == "1"
T0 = time.time()

# %% [markdown]
# ## The config
# The full model below is the one in `experiments/configs/k3_tiny.py` (the `experiments` package is
# not pip-installed, so it is spelled out here and checked against that file when it is importable).
# Each part has its own sub-config: `kda`, `attention`, `residual`, `moe` (with `moe.balancing`, a
# `k3jax.ops.balancing` method config); `docs/config.md` lists the fields.

# %%
FULL = ModelConfig(
    d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=384,
    mixer_pattern="KKKA", attention=AttentionConfig(rope=False), kda=KDAConfig(gate="bounded", lower_bound=-5.0),
    ffn="moe", moe=MoEConfig(num_experts=8, top_k=2, d_ff=192, balancing=QuantileBalancing()),
    residual=ResidualConfig(kind="block_attnres", blocks=4), dtype="float32")
REPO = next((d for d in (".", "..") if os.path.exists(os.path.join(d, "experiments", "configs", "k3_tiny.py"))), None)
if REPO is not None and os.path.abspath(REPO) not in sys.path:
    sys.path.insert(0, os.path.abspath(REPO))  # a repository checkout: make `experiments` importable
try:
    from experiments.configs.k3_tiny import get_config

    from k3jax.train.config import run_config_from_dict
    assert run_config_from_dict(get_config()).model == FULL, "notebook config drifted from k3_tiny.py"
    print("matches experiments/configs/k3_tiny.py")
except ImportError:
    print("experiments/ not on the path (e.g. Colab): using the config above")

if SMALL:
    # Same architecture (KKKA, bounded KDA gate, QB-balanced MoE, Block AttnRes), smaller widths.
    model_cfg = dataclasses.replace(FULL, d_model=64, num_heads=2, head_dim=32, d_ff=128,
                                    moe=dataclasses.replace(FULL.moe, num_experts=4, d_ff=64))
    data_cfg = DataConfig(source="text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"),
                          seq_len=64, batch_size=8)
    steps = 40
else:
    model_cfg = FULL
    data_cfg = DataConfig(source="python-stdlib", seq_len=256, batch_size=16)
    steps = 400

train_cfg = TrainConfig(steps=steps, learning_rate=3e-3, warmup_steps=max(1, steps // 10),
                        eval_every=max(1, steps // 4), eval_batches=2 if SMALL else 8, log_every=1,
                        checkpoint_every=steps, keep_checkpoints=1,
                        sample_tokens=64 if SMALL else 200, sample_prompt="def ", sample_temperature=0.0)  # greedy sample
cfg = RunConfig(model=model_cfg, data=data_cfg, train=train_cfg,
                workdir=tempfile.mkdtemp(prefix="k3jax_nb04_"), seed=0)
print(model_cfg)
print(f"{SMALL=} {steps=} workdir={cfg.workdir}")

# %% [markdown]
# ## Train
# `train` writes `metrics.jsonl`, checkpoints (Orbax) and a config snapshot into `cfg.workdir`, and
# returns a summary with the final validation loss and a sample from the trained model.

# %%
summary = train(cfg, show_progress=False)
print(f"val loss {summary['val_loss']:.3f} nats/token = {summary['val_bpb']:.3f} bits/byte "
      f"(unigram entropy {summary['unigram_entropy_bits']:.3f}); {summary['tokens_per_s']:,.0f} tok/s")

# %% [markdown]
# ## Loss curve

# %%
rows = read_metrics(cfg.workdir)
train_rows = [r for r in rows if "ce" in r]
val_rows = [r for r in rows if "val_loss" in r]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([r["step"] for r in train_rows], [r["ce"] for r in train_rows], label="train cross-entropy")
ax.plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation loss")
ax.axhline(summary["unigram_entropy_bits"] * np.log(2), color="gray", ls=":", label="unigram entropy (nats)")
ax.set(xlabel="step", ylabel="nats / token", title="K3-tiny training")
ax.legend()
plt.show()

# %%
first, last = np.mean([r["ce"] for r in train_rows[:5]]), np.mean([r["ce"] for r in train_rows[-5:]])
print(f"train ce: first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
assert last < first - 0.5, (first, last)  # the loss went down
assert val_rows[-1]["val_loss"] < val_rows[0]["val_loss"]

# %% [markdown]
# ## Reload the checkpoint and sample
# `load_trained_model` rebuilds the model from the config and restores the latest checkpoint.

# %%
model, step = load_trained_model(cfg)
print("restored step", step)
tok = ByteTokenizer()
# same prompt length and sample length as the trainer's sample, so the compiled sampler is reused
prompt = tok.encode(cfg.train.sample_prompt)[None]
out = generate(model, prompt, max_new_tokens=cfg.train.sample_tokens, rng=jax.random.key(1), temperature=0.8)
print(tok.decode(np.asarray(out[0])))

# %% [markdown]
# The reloaded model is the trained one: its greedy sample and its validation loss equal what the
# trainer computed from the in-memory model at the end of training, and two independent reloads
# give bit-identical logits on a batch (which differ from an untrained model's).

# %%
assert step == steps
assert sample_text(model, cfg, seed=cfg.seed) == summary["sample"]

# %%
from k3jax.data.corpus import load_corpus
from k3jax.data.pipeline import eval_batches

val = load_corpus(cfg.data.source, "validation")
if val.num_tokens <= cfg.data.seq_len:
    val = load_corpus(cfg.data.source, "train")
batches = eval_batches(val.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                       max_batches=cfg.train.eval_batches)
assert evaluate(model, batches)["val_loss"] == summary["val_loss"]

# %%

@nnx.jit
def logits_of(m, inputs):
    return m(inputs, train=False)[0]


inputs = jnp.asarray(batches[0]["inputs"])
again, _ = load_trained_model(cfg)
np.testing.assert_array_equal(np.asarray(logits_of(model, inputs)), np.asarray(logits_of(again, inputs)))
untrained = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
assert not np.allclose(logits_of(model, inputs), logits_of(untrained, inputs))
print("reload checks passed")
print(f"total: {time.time() - T0:.1f} s")
