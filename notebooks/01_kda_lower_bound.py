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
# # 01 · KDA with a lower-bounded decay gate
#
# Kimi Delta Attention (KDA, Kimi Linear arXiv 2510.26692 Eq. 1) decays its state per channel by
# `exp(g)`, with a log-decay `g <= 0` in nats. Two gates produce `g` from the gate projection
# (`k3jax.ops.kda.kda_gate`, see `shared/ANCHORS.md` §1):
#
# * Kimi Linear: `g = -exp(A_log) * softplus(g_raw + dt_bias)`, range `(-inf, 0)`;
# * K3 (bounded): `g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`, range `(lower_bound, 0)`.
#
# The chunk form needs `exp(-G)` (G = cumulative sum of g inside a diagonal tile) as a GEMM operand.
# With `g >= -5` a 16-token tile has `-G <= 80 < 88.72 = ln(max fp32)`, so the whole tile is ONE bf16
# GEMM (bf16 has fp32's exponent range). With the unbounded gate nothing caps `-G`.
# This notebook shows the two ranges, the tile exponents, the overflow, the accuracy of the chunked
# op against the recurrence, and timings.

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:  # Colab: install k3jax from the repository; elsewhere do nothing
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           os.environ.get("K3JAX_PIP_SPEC", "k3jax @ git+https://github.com/<org>/k3jax")])

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules or os.environ.get("MPLBACKEND") == "Agg":
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from k3jax.ops.kda import IMPLEMENTATIONS, kda, kda_gate, kda_gate_init, kda_recurrent
from k3jax.ops.kda_chunked import _kda_chunked

SMALL = os.environ.get("K3JAX_NOTEBOOK_SMALL", "1") == "1"
LOWER_BOUND = -5.0
OVERFLOW_NATS = float(np.log(np.finfo(np.float32).max))  # 88.72: bf16 and fp32 share the exponent range
B, T, H, K = (1, 256, 2, 32) if SMALL else (2, 2048, 4, 64)
print(f"{jax.default_backend()=}, {SMALL=}, shape (B, T, H, K) = {(B, T, H, K)}")

# %% [markdown]
# ## Inputs
# Gate parameters initialised as fla does (`A_log = log U(1, 16)`, `dt_bias = softplus^-1(dt)`,
# `dt ~ logU(1e-3, 1e-1)`), gate projections `g_raw ~ N(mean, std^2)`: "trained" N(0, 1) and a
# "strong decay" setting N(4, 2^2) that pushes decays toward (and for softplus past) the bound.

# %%
SETTINGS = {"trained": (0.0, 1.0), "strong": (4.0, 2.0)}


def make_inputs(key, setting, gate):
    """bf16 q, L2-normalised k, v, beta; fp32 g from `kda_gate` with the given gate."""
    ks = jax.random.split(key, 7)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, K))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    A_log, dt_bias = kda_gate_init(ks[4], ks[5], H, K)
    mean, std = SETTINGS[setting]
    g_raw = mean + std * jax.random.normal(ks[6], (B, T, H, K))
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound=LOWER_BOUND if gate == "bounded" else None)
    bf = jnp.bfloat16
    return q.astype(bf), k.astype(bf), v.astype(bf), g, beta.astype(bf)


inputs = {(s, gate): make_inputs(jax.random.PRNGKey(i), s, gate)
          for i, s in enumerate(SETTINGS) for gate in ("bounded", "softplus")}

# %% [markdown]
# ## 1. The two gates' ranges (same gate inputs)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for ax, setting in zip(axes, SETTINGS):
    for gate, color in (("softplus", "tab:red"), ("bounded", "tab:blue")):
        g = np.asarray(inputs[(setting, gate)][3]).ravel()
        ax.hist(np.maximum(g, -60), bins=120, alpha=0.6, color=color, label=f"{gate}: min {g.min():.1f}")
    ax.axvline(LOWER_BOUND, color="k", ls="--", lw=1)
    ax.set_title(f"g (nats), g_raw {setting} (clipped at -60)")
    ax.set_yscale("log")
    ax.legend()
plt.tight_layout()
plt.show()
for (setting, gate), x in inputs.items():
    print(f"{setting:8s} {gate:9s} g in [{float(x[3].min()):8.2f}, {float(x[3].max()):.2e}]")
assert all(float(inputs[(s, "bounded")][3].min()) >= LOWER_BOUND for s in SETTINGS)

# %% [markdown]
# ## 2. Tile exponents per chunk size
# Inside a C-token diagonal tile anchored at the tile start, the single-GEMM operand holds
# `exp(-G_j)`; its largest exponent `max(-G)` must stay below 88.72 nats. The bound caps it at
# `C * 5` nats, which is safe for C = 16 only: with strong decays even the bounded gate overflows a
# 32-token tile, which is why the library's single-GEMM tiles are 16 tokens long.

# %%
def tile_stats(q, k, g, C):
    """(max -G over C-token tiles [nats], inf/NaN fraction of the kept entries of the bf16 tile GEMM)."""
    n = T // C
    f32 = jnp.float32
    G = jnp.cumsum(g[:, :n * C].reshape(B, n, C, H, K), axis=2)
    qa = (q[:, :n * C].reshape(B, n, C, H, K).astype(f32) * jnp.exp(G)).astype(jnp.bfloat16)
    ka = (k[:, :n * C].reshape(B, n, C, H, K).astype(f32) * jnp.exp(-G)).astype(jnp.bfloat16)
    P = jnp.einsum("bnihk,bnjhk->bnhij", qa, ka, preferred_element_type=f32)
    causal = jnp.tril(jnp.ones((C, C), bool))
    bad = jnp.sum(jnp.where(causal, ~jnp.isfinite(P), False)) / (B * n * H * int(causal.sum()))
    return float(jnp.max(-G)), float(bad)


rows = []
for (setting, gate), (q, k, v, g, beta) in inputs.items():
    for C in (16, 32, 64):
        max_neg, bad = tile_stats(q, k, g, C)
        rows.append(dict(setting=setting, gate=gate, C=C, max_neg_G=max_neg, nonfinite=bad))
print(f"{'setting':8s} {'gate':9s} {'C':>3s} {'max -G':>9s} {'overflow':>8s} {'inf/NaN frac':>12s}")
for r in rows:
    print(f"{r['setting']:8s} {r['gate']:9s} {r['C']:3d} {r['max_neg_G']:9.1f} "
          f"{str(r['max_neg_G'] > OVERFLOW_NATS):>8s} {r['nonfinite']:12.4f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
for (setting, gate), marker in zip(inputs, "os^v"):
    sel = [r for r in rows if r["setting"] == setting and r["gate"] == gate]
    ax.plot([r["C"] for r in sel], [r["max_neg_G"] for r in sel], marker=marker, label=f"{gate}, {setting}")
ax.axhline(OVERFLOW_NATS, color="k", ls="--", lw=1, label="ln(max bf16) = 88.7")
ax.set_xlabel("diagonal tile length C (tokens)")
ax.set_ylabel("max -G in a tile (nats)")
ax.set_yscale("log")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The single-GEMM path overflows with the unbounded gate
# Claim: with the bounded gate a 16-token bf16 tile is always finite (`-G <= 16 * 5 = 80`); with
# softplus and strong decays the same tile holds inf/NaN. We check both the bare tile GEMM and the
# op's output when the single-GEMM 16-token path is forced on softplus gates (declaring a bound the
# gate does not honour).

# %%
bounded16 = [r for r in rows if r["gate"] == "bounded" and r["C"] == 16]
softplus16_strong = [r for r in rows if r["gate"] == "softplus" and r["C"] == 16 and r["setting"] == "strong"][0]
assert all(r["max_neg_G"] <= 16 * -LOWER_BOUND < OVERFLOW_NATS and r["nonfinite"] == 0.0 for r in bounded16)
assert softplus16_strong["max_neg_G"] > OVERFLOW_NATS and softplus16_strong["nonfinite"] > 0.0


def forced_single_gemm(q, k, v, g, beta, C=16):
    """The op with one single-GEMM bf16 diagonal tile of C tokens per chunk (what a bound allows)."""
    return _kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        segment_ids=None, use_qk_l2norm=False, chunk_size=max(C, 16),
                        lower_bound=LOWER_BOUND, tile=C)[0]


for gate in ("bounded", "softplus"):
    o = forced_single_gemm(*inputs[("strong", gate)])
    frac = float(jnp.mean(~jnp.isfinite(o.astype(jnp.float32))))
    print(f"strong decays, {gate:9s}: forced 16-token single-GEMM output non-finite fraction = {frac:.4f}")
    if gate == "bounded":
        assert frac == 0.0

# %% [markdown]
# ## 4. Chunked vs recurrent (bf16 inputs)
# The library's chunked op (`kda`, default implementation) against the fp32 recurrence, both gates,
# with the bound declared for the bounded gate (16-token single-GEMM tiles) and the exact path for
# softplus. Error = RMS(o - o_ref) / RMS(o_ref).

# %%
def rms_ratio(ref, out):
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((ref - out) ** 2)) / np.sqrt(np.mean(ref ** 2)))


errors = {}
for (setting, gate), (q, k, v, g, beta) in inputs.items():
    v32, beta32 = v.astype(jnp.float32), beta.astype(jnp.float32)
    ref = jax.jit(lambda *a: kda_recurrent(*a)[0])(q, k, v32, g, beta32)
    lb = LOWER_BOUND if gate == "bounded" else None
    out = jax.jit(lambda *a: kda(*a, lower_bound=lb, chunk_size=64)[0])(q, k, v32, g, beta32)
    errors[(setting, gate)] = rms_ratio(ref, out)
    print(f"{setting:8s} {gate:9s} chunked vs recurrent RMS ratio = {errors[(setting, gate)]:.2e}")
assert max(errors.values()) < 5e-3, errors

# %% [markdown]
# ## 5. Timings on the current backend
# Tiny shape, after one compile; printed only (CPU numbers say nothing about accelerators).

# %%
q, k, v, g, beta = inputs[("trained", "bounded")]
available = [impl for impl in IMPLEMENTATIONS if impl != "pallas" or jax.default_backend() in ("gpu", "tpu")]
for impl in available:
    fn = jax.jit(lambda *a: kda(*a, lower_bound=LOWER_BOUND, implementation=impl)[0])
    try:
        jax.block_until_ready(fn(q, k, v, g, beta))
    except Exception as e:  # e.g. a Pallas kernel this backend cannot lower
        print(f"{impl:10s} unavailable: {type(e).__name__}: {str(e)[:120]}")
        continue
    reps = 3 if SMALL else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(q, k, v, g, beta))
    print(f"{impl:10s} {(time.perf_counter() - t0) / reps * 1e3:8.2f} ms / call  (B, T, H, K) = {(B, T, H, K)}")
