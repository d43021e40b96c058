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
# # 03 · Block Attention Residuals vs PreNorm in a deep, narrow model
#
# A PreNorm residual stream adds every sublayer's output with weight 1, so the hidden state's RMS
# grows with depth and each new sublayer changes it relatively less. Block Attention Residuals
# (Kimi, "Attention Residuals") replace that fixed sum: sublayers are grouped into N blocks, each
# completed block is summarised by its output sum `b_n`, and the input of every sublayer is a
# softmax-weighted mix over depth of `b_0` (the embedding), `b_1, ..., b_{n-1}` and the current
# block's partial sum. The weights come from one learned **pseudo-query** per sublayer scored against
# RMS-normalised sources; the queries start at zero, so at initialisation every row of weights is
# uniform.
#
# Here we train the same 8-layer, width-32 model twice on the same data — once with `prenorm`, once
# with `block_attnres` — and look at the depth weights, the cosine between consecutive sublayer inputs,
# and the RMS of each sublayer's input.
#
# Set `K3JAX_NOTEBOOK_SMALL=0` for a longer run on the full Python-stdlib corpus.

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           os.environ.get("K3JAX_PIP_SPEC", "k3jax @ git+https://github.com/<org>/k3jax")])

# %%
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from k3jax.data.corpus import load_corpus
from k3jax.data.pipeline import eval_batches
from k3jax.models.config import ModelConfig, ResidualConfig
from k3jax.models.lm import LanguageModel
from k3jax.train.config import DataConfig, RunConfig, TrainConfig
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import load_trained_model, train

SMALL = os.environ.get("K3JAX_NOTEBOOK_SMALL", "1") == "1"
T0 = time.time()

# SMALL: the stdlib `json` package (~60 KB of Python) as a byte corpus; otherwise the whole stdlib.
SOURCE = "text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py") if SMALL else "python-stdlib"
STEPS = 30 if SMALL else 300
SEQ_LEN, BATCH = (32, 4) if SMALL else (64, 8)
NUM_LAYERS, D_MODEL = 8, 32
WORKDIR = tempfile.mkdtemp(prefix="k3jax_nb03_")
print(f"{SMALL=} {SOURCE=} {STEPS=} {WORKDIR=}")

# %% [markdown]
# Both models are identical except for `residual.kind`. With `residual.blocks=4` the 16 sublayers
# (8 × attention + MLP) form 4 blocks of 4 sublayers.

# %%
def run_config(residual: str) -> RunConfig:
    model = ModelConfig(d_model=D_MODEL, num_layers=NUM_LAYERS, num_heads=2, head_dim=16, d_ff=64,
                        mixer_pattern="A", ffn="mlp", residual=ResidualConfig(kind=residual, blocks=4))
    data = DataConfig(source=SOURCE, seq_len=SEQ_LEN, batch_size=BATCH)
    tr = TrainConfig(steps=STEPS, learning_rate=3e-3, warmup_steps=max(1, STEPS // 10), eval_every=STEPS,
                     eval_batches=2, log_every=1, checkpoint_every=STEPS, keep_checkpoints=1, sample_tokens=0)
    return RunConfig(model=model, data=data, train=tr, workdir=os.path.join(WORKDIR, residual), seed=0)


VARIANTS = ("prenorm", "block_attnres")
configs = {v: run_config(v) for v in VARIANTS}

# One fixed batch (the head of the validation stream) for all diagnostics.
val = load_corpus(SOURCE, "validation")
if val.num_tokens <= SEQ_LEN * BATCH:
    val = load_corpus(SOURCE, "train")
batch = {k: jnp.asarray(v) for k, v in eval_batches(val.tokens, batch_size=BATCH, seq_len=SEQ_LEN,
                                                       max_batches=1)[0].items()}


@nnx.jit
def diagnostics(model, inputs, segment_ids, positions):
    return model.diagnostics(inputs, segment_ids=segment_ids, positions=positions)


def diag(model):
    out = diagnostics(model, batch["inputs"], batch["segment_ids"], batch["positions"])
    return {k: np.asarray(v) for k, v in jax.device_get(out).items()}

# %% [markdown]
# ## At initialisation
# The pseudo-queries are zero, so every sublayer attends uniformly over the sources it can see.
# `depth_weights` has one row per sublayer plus a last row for the final mix before the LM head;
# columns are `b_0, b_1, ..., partial sum`, zero-padded beyond each row's sources.

# %%
init = {v: diag(LanguageModel(configs[v].model, rngs=nnx.Rngs(0))) for v in VARIANTS}
w0 = init["block_attnres"]["depth_weights"]
np.set_printoptions(precision=3, suppress=True, linewidth=120)
print(w0)

# %%
np.testing.assert_allclose(w0.sum(-1), 1.0, atol=1e-5)  # each row is a distribution over sources
for row in w0:
    visible = row[row > 0]
    np.testing.assert_allclose(visible, 1.0 / visible.size, rtol=1e-5)  # uniform over what it sees
print("init: rows sum to 1 and are uniform over their sources:", [int((r > 0).sum()) for r in w0])

# %% [markdown]
# ## Train both

# %%
summaries, trained = {}, {}
for v in VARIANTS:
    t = time.time()
    summaries[v] = train(configs[v], show_progress=False)
    trained[v] = diag(load_trained_model(configs[v])[0])
    print(f"{v:14s} val loss {summaries[v]['val_loss']:.3f} nats/token, {summaries[v]['val_bpb']:.3f} bits/byte, "
          f"{time.time() - t:.1f} s")

fig, ax = plt.subplots(figsize=(6, 3.5))
for v in VARIANTS:
    rows = [r for r in read_metrics(configs[v].workdir) if "ce" in r]
    ax.plot([r["step"] for r in rows], [r["ce"] for r in rows], label=v)
ax.set(xlabel="step", ylabel="train loss (nats/token)", title="training loss")
ax.legend()
plt.show()

# %% [markdown]
# ## Depth weights after training
# Each row is where that sublayer reads its input from. Training moves the rows away from uniform:
# sublayers learn which earlier blocks matter.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
for ax, (title, w) in zip(axes, (("init (zero pseudo-queries)", w0),
                                 ("trained", trained["block_attnres"]["depth_weights"]))):
    im = ax.imshow(np.ma.masked_where(w == 0.0, w), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                   interpolation="nearest")
    ax.set(title=title, xlabel="source (b_0 = embedding, ..., partial)",
           ylabel="sublayer (last row = final mix)")
fig.suptitle("block_attnres depth weights (mean over tokens of one batch)")
fig.colorbar(im, ax=axes, fraction=0.03)
plt.show()

w1 = trained["block_attnres"]["depth_weights"]
np.testing.assert_allclose(w1.sum(-1), 1.0, atol=1e-5)
print("largest change from uniform:", float(np.abs(w1 - w0).max()))

# %% [markdown]
# ## Cosine and RMS by depth
# `cosine[l]` compares the input of sublayer l with that of sublayer l+1 (close to 1 = the sublayer
# barely changed the stream); `hidden_rms[l]` is the RMS of sublayer l's input.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for i, v in enumerate(VARIANTS):
    for stage, d, style in (("init", init[v], ":"), ("trained", trained[v], "-")):
        axes[0].plot(d["cosine"], style, color=f"C{i}", label=f"{v} ({stage})")
        axes[1].plot(d["hidden_rms"], style, color=f"C{i}", label=f"{v} ({stage})")
axes[0].set(xlabel="sublayer l", ylabel="cos(input_l, input_{l+1})", title="cosine by depth")
axes[1].set(xlabel="sublayer l", ylabel="RMS", yscale="log", title="hidden RMS by depth")
axes[1].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# PreNorm's stream is a plain sum of all previous outputs, so its RMS keeps climbing with depth.
# Block AttnRes feeds each sublayer a convex combination of its sources (an embedding and block
# sums of at most 4 outputs), so its input grows much less. We measure the growth as the RMS of the
# last sublayer's input over that of the first (the embedding). At this small setting the cosine
# curves of the two schemes are close; the RMS gap is the robust difference.

# %%
growth = {v: float(trained[v]["hidden_rms"][-1] / trained[v]["hidden_rms"][0]) for v in VARIANTS}
print({v: round(g, 2) for v, g in growth.items()})
assert growth["prenorm"] > growth["block_attnres"], growth
print(f"total: {time.time() - T0:.1f} s")
