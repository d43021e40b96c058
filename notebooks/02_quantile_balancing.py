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
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Quantile Balancing for MoE routing
#
# K3's Quantile Balancing (QB; Su, kexue.fm/archives/11619; Kimi K3 report §2.3.3, see
# `shared/ANCHORS.md` §2) sets each expert's selection bias to a quantile of the routing margins, so
# that at the next step every expert admits about `N k / E` tokens. The bias is computed from the
# PREVIOUS step's scores, so a token's routing never depends on later tokens (causal).
# This notebook: K3's worked example, a tiny MoE language model trained with three balancing methods
# (MaxVio curves), and the seed article's literal "same-step threshold" variant with its causal leakage.

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:  # Colab: install k3jax from the repository; elsewhere do nothing
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           os.environ.get("K3JAX_PIP_SPEC", "k3jax @ git+https://github.com/<org>/k3jax")])

# %%
import contextlib
import io
import sysconfig
import tempfile

import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules or os.environ.get("MPLBACKEND") == "Agg":
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from k3jax.ops import balance_metrics as M
from k3jax.ops import balancing as B
from k3jax.ops import quantile as Q
from k3jax.ops import routing as R
from k3jax.ops import threshold_routing as T
from k3jax.train.config import run_config_from_dict
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import train

SMALL = os.environ.get("K3JAX_NOTEBOOK_SMALL", "1") == "1"
print(f"{SMALL=}")

# %% [markdown]
# ## 1. K3's worked example: 8 tokens, 4 experts, top-1
# Plain top-1 on these scores gives loads (4, 3, 1, 0). QB computes the margins
# `r_ij = s_i,(k) + b_(k) - s_ij` (how far expert j's score is below the token's k-th choice), takes
# per expert the `k/E` quantile of its margins, centres it, and routes the next step with that bias.

# %%
scores = jnp.asarray([
    [0.90, 0.20, 0.10, 0.30],
    [0.85, 0.15, 0.25, 0.35],
    [0.60, 0.10, 0.20, 0.55],
    [0.62, 0.05, 0.15, 0.58],
    [0.20, 0.90, 0.30, 0.10],
    [0.25, 0.80, 0.35, 0.15],
    [0.10, 0.60, 0.57, 0.20],
    [0.30, 0.20, 0.80, 0.40],
], jnp.float32)
E, TOP_K = scores.shape[1], 1
zero = jnp.zeros(E, jnp.float32)
before = R.route(scores, zero, TOP_K)
loads_before = np.asarray(M.expert_loads(before.expert_ids, E))
out = B.balance(B.QuantileBalancing(), scores, before, zero)
after = R.route(scores, out.next_bias, TOP_K)
loads_after = np.asarray(M.expert_loads(after.expert_ids, E))
print("margins r_ij:\n", np.round(np.asarray(Q.quantile_margins(scores, before, zero)), 3))
print("QB bias:", np.round(np.asarray(out.next_bias), 4))
print(f"loads before {loads_before}, MaxVio {float(M.max_vio(jnp.asarray(loads_before))):.2f}")
print(f"loads after  {loads_after}, MaxVio {float(M.max_vio(jnp.asarray(loads_after))):.2f}")
print("experts after:", np.asarray(after.expert_ids[:, 0]))
assert loads_before.tolist() == [4, 3, 1, 0]
assert loads_after.tolist() == [2, 2, 2, 2]

# %% [markdown]
# ## 2. A tiny MoE language model, three balancing methods
# The trainer (`k3jax.train.trainer.train`) on a small byte corpus (the stdlib `json` package),
# 2 layers of softmax attention + MoE (E = 8, k = 2). Each train step logs `moe/<layer>/max_vio`
# = `max_j (load_j - mean load) / mean load` on that step's batch. Methods: Switch auxiliary loss
# (`aux_loss`, alpha = 1e-2), DeepSeek-V3 loss-free bias (`loss_free`, gamma = 1e-3) and QB
# (`quantile`). Short runs: the curves are illustrative, not a benchmark
# (`experiments/moe_balance.py` is the experiment).

# %%
CORPUS = "text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
STEPS = 60 if SMALL else 600
METHODS = ("aux_loss", "loss_free", "quantile")
cache_dir = os.environ.get("K3JAX_CACHE", "")
curves = {}
for method in METHODS:
    workdir = tempfile.mkdtemp(prefix=f"k3jax_nb02_{method}_")
    cfg = run_config_from_dict({
        "workdir": workdir, "seed": 0,
        "model": dict(d_model=32 if SMALL else 128, num_layers=2, num_heads=2 if SMALL else 4,
                      head_dim=16 if SMALL else 32, d_ff=32 if SMALL else 128,
                      ffn="moe", moe=dict(num_experts=8, top_k=2, balancing=dict(method=method))),
        "data": dict(source=CORPUS, seq_len=64, batch_size=4 if SMALL else 16, cache_dir=cache_dir),
        "train": dict(steps=STEPS, learning_rate=3e-3, warmup_steps=2, eval_every=STEPS, eval_batches=1,
                      log_every=1, checkpoint_every=STEPS, keep_checkpoints=1, sample_tokens=0),
    })
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the trainer prints its config and a summary
        train(cfg, show_progress=False)
    print(f"{method:10s}", log.getvalue().strip().splitlines()[-1])
    rows = [r for r in read_metrics(workdir) if "moe/0/max_vio" in r]
    curves[method] = {
        "step": np.array([r["step"] for r in rows]),
        "max_vio": np.array([np.mean([r[f"moe/{i}/max_vio"] for i in range(2)]) for r in rows]),
        "ce": np.array([r["ce"] for r in rows]),
    }

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for method, c in curves.items():
    axes[0].plot(c["step"], c["max_vio"], label=method)
    axes[1].plot(c["step"], c["ce"], label=method)
axes[0].set(xlabel="step", ylabel="MaxVio (batch, mean of layers)", title="load imbalance")
axes[1].set(xlabel="step", ylabel="train CE (nats/token)", title="loss")
axes[0].legend()
plt.tight_layout()
plt.show()
tail = max(1, STEPS // 3)
for method, c in curves.items():
    print(f"{method:10s} mean MaxVio over the last {tail} steps = {c['max_vio'][-tail:].mean():.3f}, "
          f"final CE = {c['ce'][-1]:.3f}")
assert all(np.all(np.isfinite(c["ce"])) and len(c["step"]) == STEPS for c in curves.values())

# %% [markdown]
# ## 3. The seed article's literal variant and its causal leakage
# The seed article describes "quantile balancing" as same-step diversion: measure this step's loads,
# flag experts above the 95th / below the 5th load percentile, boost the underloaded and shed the
# overloaded (`T.threshold_route`). Because it reads the whole step's loads, an earlier token's expert
# can change when only LATER tokens change: information flows backwards in the sequence.
# `T.causal_leakage` routes two sequences that share a prefix and counts the prefix tokens whose
# experts differ. One deterministic example (E = 4, k = 1, 8 tokens; the prefix t0..t3 is shared):

# %%
PREFIX = [[0.90, 0.10, 0.20, 0.30], [0.60, 0.10, 0.20, 0.58], [0.10, 0.50, 0.20, 0.47], [0.10, 0.20, 0.60, 0.40]]
LATER_A = [[0.1, 0.8, 0.2, 0.3], [0.1, 0.2, 0.8, 0.3], [0.1, 0.2, 0.3, 0.8], [0.2, 0.1, 0.3, 0.8]]
LATER_B = [[0.8, 0.1, 0.2, 0.3], [0.8, 0.2, 0.1, 0.3], [0.8, 0.3, 0.2, 0.1], [0.8, 0.1, 0.3, 0.2]]
seq_a = jnp.asarray([PREFIX + LATER_A], jnp.float32)   # [B=1, T=8, E=4]
seq_b = jnp.asarray([PREFIX + LATER_B], jnp.float32)
threshold_cfg = B.QuantileThreshold()
window = B.init_balancing_state(threshold_cfg, 4)


def seed_literal(s):
    """The seed article's same-step threshold routing of [B, T, E] scores -> expert ids [B, T, 1]."""
    b, t, e = s.shape
    r, _ = T.threshold_route(s.reshape(b * t, e), 1, window, high_percentile=threshold_cfg.high_percentile,
                             low_percentile=threshold_cfg.low_percentile, tolerance=threshold_cfg.tolerance,
                             priority_boost=threshold_cfg.priority_boost)
    return r.expert_ids.reshape(b, t, -1)


qb_bias = jnp.asarray([0.01, -0.02, 0.03, -0.02])   # any bias from the previous step


def quantile_balanced(s):
    """QB routing: top-1 with a bias fixed before this step."""
    b, t, e = s.shape
    return R.route(s.reshape(b * t, e), qb_bias, 1).expert_ids.reshape(b, t, -1)


print("seed-literal experts, A:", np.asarray(seed_literal(seq_a))[0, :, 0])
print("seed-literal experts, B:", np.asarray(seed_literal(seq_b))[0, :, 0])
leak_seed = float(T.causal_leakage(seed_literal, seq_a, seq_b, prefix_length=4))
leak_qb = float(T.causal_leakage(quantile_balanced, seq_a, seq_b, prefix_length=4))
print(f"causal leakage: seed-literal {leak_seed:.2f}, QB {leak_qb:.2f}")
assert leak_seed > 0.0
assert leak_qb == 0.0
