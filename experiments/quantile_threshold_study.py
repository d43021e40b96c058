"""Why the seed-literal "quantile_threshold" balancing ends worse than no balancing (issue 5).

Two parts, both on CPU:

  python -m experiments.quantile_threshold_study --mode=synthetic   # threshold_route on fixed routers
  python -m experiments.quantile_threshold_study --mode=train       # a small MoE LM, none vs quantile_threshold

`synthetic`: a router whose logits are ``σ·z_j + ε_ij`` (``z`` = 32 sorted standard normals, seed 0,
a per-expert popularity shared by all tokens; ``ε ~ N(0, 1)`` fresh per step), E = 32, top-4, 16,384
tokens per step, softmax scores. σ = 1.75 reproduces the H200 `none` run's loads (MaxVio 5.0, CV 1.68,
1 dead expert, normalised entropy 0.69 vs 5.23 / 1.67 / 0.96 / 0.71). For each σ it runs 10 steps of
``threshold_route`` + ``balance`` (the window fills) and prints, for the last step: the demand loads
(plain top-k), the loads after diversion, which experts were flagged, the capacity, where the diverted
slots went, and the diverted fraction.

`train`: the H200 table's model scaled to CPU (attention-only, 2 layers, d_model 128, E = 32, top-4,
4,096 tokens per step) trained with `none` and with `quantile_threshold`; per logged step it records
the DEMAND MaxVio (plain top-k of the router, what `none` would route) next to the routed MaxVio, so
"the method shed load but the router concentrated" can be told apart from "the method made it worse".
The demand statistic is read by wrapping `k3jax.ops.balancing.balance` inside this script only.

Writes <out>.json (--out, default /tmp/k3jax_quantile_threshold_study/quantile_threshold_study; a run
of one mode keeps the other mode's part of an existing file; the committed one:
--out=experiments/results/quantile_threshold_study). Its page, quantile_threshold_study.md, is written
by hand from that JSON.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.harness import environment
from k3jax.ops import balance_metrics as M
from k3jax.ops import balancing as B
from k3jax.ops import routing as R
from k3jax.ops import threshold_routing as T


def _define_flags():
    """Command-line flags, defined only when run as a script (importing this module defines none)."""
    flags.DEFINE_enum("mode", "synthetic", ["synthetic", "train"], "which part of the study to run")
    flags.DEFINE_string("out", "/tmp/k3jax_quantile_threshold_study/quantile_threshold_study",
                        "output prefix (<out>.json)")
    flags.DEFINE_list("methods", ["none", "quantile_threshold"], "--mode=train: balancing methods")
    flags.DEFINE_integer("steps", 200, "--mode=train: training steps per method")

E, TOP_K, N = 32, 4, 16384


def popularity(num_experts: int = E, seed: int = 0) -> np.ndarray:
    """Sorted (descending) standard normals: the shared per-expert offset of the synthetic router."""
    return np.sort(np.random.default_rng(seed).standard_normal(num_experts))[::-1].astype(np.float32)


def synthetic_scores(sigma: float, step: int, num_tokens: int = N, num_experts: int = E,
                     temperature: float = 1.0) -> jax.Array:
    """Softmax scores of logits ``T·(sigma·z_j + ε_ij)`` (``ε`` fresh per step, seed 1000 + step). The
    temperature T leaves every top-k (the demand) unchanged and only sharpens each token's softmax."""
    eps = jax.random.normal(jax.random.PRNGKey(1000 + step), (num_tokens, num_experts), jnp.float32)
    return R.router_scores(temperature * (jnp.asarray(sigma * popularity(num_experts))[None, :] + eps))


def flags_for(state: dict, demand: np.ndarray, cfg: B.BalancingMethod) -> dict:
    """The over/under flags and capacity threshold_route used at one step (recomputed from the state it
    was given and that step's demand, with the same formulas)."""
    window = np.asarray(state["window_loads"])
    filled = min(int(state["filled"]), window.shape[0])
    frac = demand / max(demand.sum(), 1.0)
    u = len(demand) * (window[:filled].sum(0) + frac) / (filled + 1)
    p_hi, p_lo = np.percentile(u, cfg.high_percentile), np.percentile(u, cfg.low_percentile)
    over = (u >= p_hi) & (u > 1 + cfg.tolerance)
    under = (u <= p_lo) & (u < 1 - cfg.tolerance)
    return {"u": u, "over": over, "under": under, "theta_hi": max(p_hi, 1 + cfg.tolerance)}


def synthetic_study(cases=((1.0, 1.0), (1.75, 1.0), (2.5, 1.0), (3.5, 1.0), (5.0, 1.0), (1.75, 2.0),
                           (1.75, 3.0), (1.75, 4.0), (1.75, 6.0), (1.75, 8.0)),
                    steps: int = 10, cfg: B.BalancingMethod | None = None):
    """``cases``: (sigma, temperature) pairs; 10 steps each (the window fills); the last step reported."""
    cfg = cfg or B.QuantileThreshold()
    mean = N * TOP_K / E
    rows = []
    route = jax.jit(lambda s, st: T.threshold_route(
        s, TOP_K, st, high_percentile=cfg.high_percentile, low_percentile=cfg.low_percentile,
        tolerance=cfg.tolerance, priority_boost=cfg.priority_boost))
    for sigma, temperature in cases:
        state = B.init_balancing_state(cfg, E)
        for step in range(steps):
            scores = synthetic_scores(sigma, step, temperature=temperature)
            routing, demand = route(scores, state)
            out = B.balance(cfg, scores, routing, jnp.zeros(E), state, demand_loads=demand)
            if step == steps - 1:
                d, f = np.asarray(demand), np.asarray(out.stats["loads"])
                fl = flags_for(state, d, cfg)
                gained = f - d  # net change of each expert's load (slots)
                rank = np.argsort(-d)  # experts by demand, most loaded first
                over_ids, under_ids = np.where(fl["over"])[0], np.where(fl["under"])[0]
                second_tier = rank[len(over_ids):len(over_ids) + 6]
                fourth = np.sort(np.asarray(scores), axis=1)[:, -TOP_K]
                row = {
                    "sigma": sigma, "temperature": temperature,
                    "median_4th_score": float(np.median(fourth)),
                    "argmax_expert_flag": "over" if fl["over"][f.argmax()] else (
                        "under" if fl["under"][f.argmax()] else "none"),
                    "demand_max_vio": float(d.max() / mean - 1), "routed_max_vio": float(f.max() / mean - 1),
                    "demand_dead": int((d == 0).sum()), "routed_dead": int((f == 0).sum()),
                    "demand_cv": float(d.std() / d.mean()), "routed_cv": float(f.std() / f.mean()),
                    "diverted_fraction": float(out.stats["diverted_fraction"]),
                    "num_over": int(fl["over"].sum()), "num_under": int(fl["under"].sum()),
                    "theta_hi": float(fl["theta_hi"]),
                    "over_demand_rel": (d[over_ids] / mean).round(3).tolist(),
                    "over_routed_rel": (f[over_ids] / mean).round(3).tolist(),
                    "under_demand_rel": (d[under_ids] / mean).round(3).tolist(),
                    "under_routed_rel": (f[under_ids] / mean).round(3).tolist(),
                    "shed_slots_rel": float(-gained[over_ids].sum() / mean),
                    "boost_gain_rel": float(gained[under_ids].sum() / mean),
                    "next_tier_ids": second_tier.tolist(),
                    "next_tier_demand_rel": (d[second_tier] / mean).round(3).tolist(),
                    "next_tier_routed_rel": (f[second_tier] / mean).round(3).tolist(),
                    "demand_sorted_rel": np.sort(d / mean)[::-1].round(3).tolist(),
                    "routed_sorted_rel": np.sort(f / mean)[::-1].round(3).tolist(),
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if "sorted" not in k}))
            state = out.next_state
    return rows


def train_study(steps: int = 200, seeds=(0,), methods=("none", "quantile_threshold"), workdir="/tmp/qt_study"):
    from experiments import moe_balance as mb
    from experiments.configs import moe_balance_gpu
    import k3jax.train.trainer as trainer_lib
    from k3jax.train.metrics import read_metrics

    original = B.balance

    def balance_with_demand(config, scores, routing, bias, state=None, **kw):
        out = original(config, scores, routing, bias, state, **kw)
        demand = kw.get("demand_loads")
        if demand is None:
            demand = out.stats["loads"]
        stats = dict(out.stats)
        stats["demand_max_vio"] = M.max_vio(demand)
        stats["demand_dead"] = M.dead_experts(demand)
        return out._replace(stats=stats)

    base = moe_balance_gpu.get_config().to_dict()
    base["model"].update(d_model=128, num_heads=2, head_dim=64, d_ff=384, dtype="float32")
    base["model"]["moe"]["d_ff"] = 128
    base["data"].update(seq_len=256, batch_size=16)
    base["train"].update(eval_batches=2)
    B.balance = balance_with_demand
    results = {}
    try:
        for method in methods:
            for seed in seeds:
                cfg = mb.run_config(base, method, seed, num_experts=E, top_k=TOP_K, steps=steps,
                                    workdir_root=workdir)
                trainer_lib.train(cfg, show_progress=False)
                rows = [r for r in read_metrics(cfg.workdir) if "moe/0/max_vio" in r]
                layer = lambda r, s: float(np.mean([r[f"moe/{i}/{s}"] for i in range(2)]))
                res = {s: [layer(r, s) for r in rows] for s in
                       ("max_vio", "demand_max_vio", "diverted_fraction", "dead_experts", "demand_dead")}
                res["steps"] = [int(r["step"]) for r in rows]
                results[f"{method}/seed{seed}"] = res
                print(method, seed, json.dumps({k: np.round(v, 2).tolist() for k, v in res.items()}))
    finally:
        B.balance = original
    return results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; the part to run is --mode=synthetic or --mode=train")
    f = flags.FLAGS
    if not f.out:
        raise ValueError("out must be a path prefix; got ''")
    out = f.out + ".json"
    data = json.load(open(out)) if os.path.exists(out) else {}
    if f.mode == "synthetic":
        data["synthetic"] = synthetic_study()
    else:
        data.setdefault("train", {}).update(train_study(steps=f.steps, methods=tuple(f.methods)))
    data["meta"] = environment()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
