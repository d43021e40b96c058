"""Does a lower-bounded log-decay make the single-GEMM diagonal tile safe? (KDA, ANCHORS.md §1)

For both gates (K3's bounded gate with lower_bound = -5, Kimi Linear's unbounded softplus gate), with
gate inputs drawn like a freshly initialised / trained layer ("trained": g_raw ~ N(0, 1), fla init of
A_log and dt_bias), a wider spread ("wide": N(0, 3^2), as in the tests) and a stress setting
("stress": g_raw ~ N(4, 2^2), decays near the bound), and per
chunk size C in {16, 32, 64}, report:
  - max_neg_G: the largest -(G_j - a) inside a C-token diagonal tile anchored at the tile start, in
    nats; exp of it is the largest exp(-G) the single-GEMM operand must hold (bf16/fp32 overflow above
    ln(3.39e38) = 88.72);
  - nonfinite_tile: fraction of kept (causal) entries of the forced single-GEMM bf16 tile product
    (Q e^(G-a))(K e^(a-G))^T that are inf/NaN, when one C-token diagonal tile is forced;
  - nonfinite_o: fraction of the op's outputs that are inf/NaN with that forced path;
  - err_*: RMS(o - o64)/RMS(o64) against an fp64 recurrence, for bf16 inputs, of: the fp32 recurrence,
    the exact chunked path (no bound declared), the library's bounded path (16-token bf16 tiles,
    lower_bound declared) and the forced C-token single-GEMM tile.
Plus a long-sequence run of the chunked op (>= 2^17 tokens on CPU) reporting max |o| and the final
state's norm for each gate.

Run: python -m experiments.gate_stability [--seq_len=1024 --long_seq_len=131072 --out_dir=...]
Writes gate_stability{tag}.{json,png} under --out_dir and renders gate_stability.md there from every
gate_stability*.json in it (one page; a tagged run adds its section).
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import environment, rms_ratio
from k3jax.ops.kda import kda_chunked, kda_gate, kda_gate_init, kda_recurrent
from k3jax.ops.kda_chunked import _kda_chunked

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 1, "batch size of the error runs")
flags.DEFINE_integer("seq_len", 1024, "tokens of the error runs")
flags.DEFINE_integer("heads", 4, "heads")
flags.DEFINE_integer("head_dim", 64, "K = V")
flags.DEFINE_integer("long_seq_len", 2 ** 17, "tokens of the long-sequence run (2^20 on the GPU machine)")
flags.DEFINE_integer("long_heads", 2, "heads of the long-sequence run")
flags.DEFINE_list("chunk_sizes", ["16", "32", "64"], "chunk sizes")
flags.DEFINE_integer("seed", 0, "PRNG seed")
flags.DEFINE_string("out_dir", "/tmp/k3jax_gate_stability", "where to write gate_stability{tag}.{json,png} and "
                    "the page gate_stability.md (the committed result: --out_dir=experiments/results)")
flags.DEFINE_string("tag", "", "suffix of the output file names (e.g. _gpu)")
flags.DEFINE_string("from_json", "", "no run: this earlier JSON output into --out_dir (as gate_stability{tag}.json), "
                    "its plot, and the page")

LOWER_BOUND = -5.0
OVERFLOW_NATS = float(np.log(np.finfo(np.float32).max))   # bf16 has fp32's exponent range: 88.72
SETTINGS = {"trained": (0.0, 1.0), "wide": (0.0, 3.0), "stress": (4.0, 2.0)}  # g_raw ~ N(mean, std^2)


def make_inputs(key, B, T, H, K, gate, setting):
    """bf16 q (N(0,1)), k (L2-normalised), v, beta = sigmoid(N(0,1)); fp32 g from kda_gate."""
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


def tile_stats(q, k, g, C):
    """(max -(G - a) over C-token tiles [nats], inf/NaN fraction of kept entries of the forced bf16 GEMM)."""
    B, T, H, K = q.shape
    n = T // C
    f32 = jnp.float32
    G = jnp.cumsum(g[:, :n * C].reshape(B, n, C, H, K), axis=2)            # anchor a = 0 at tile start
    max_neg = float(jnp.max(-G))
    qa = (q[:, :n * C].reshape(B, n, C, H, K).astype(f32) * jnp.exp(G)).astype(jnp.bfloat16)
    ka = (k[:, :n * C].reshape(B, n, C, H, K).astype(f32) * jnp.exp(-G)).astype(jnp.bfloat16)
    P = jnp.einsum("bnihk,bnjhk->bnhij", qa, ka, preferred_element_type=f32)
    causal = jnp.tril(jnp.ones((C, C), bool))
    bad = jnp.sum(jnp.where(causal, ~jnp.isfinite(P), False)) / (B * n * H * int(causal.sum()))
    return max_neg, float(bad)


def run_grid():
    B, T, H, K = FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.head_dim
    rows = []
    for gi, gate in enumerate(("bounded", "softplus")):
        for si, setting in enumerate(SETTINGS):
            key = jax.random.PRNGKey(FLAGS.seed * 100 + 10 * gi + si)
            q, k, v, g, beta = make_inputs(key, B, T, H, K, gate, setting)
            v, beta = v.astype(jnp.float32), beta.astype(jnp.float32)    # fp32 o: measure the path
            with jax.enable_x64(True):
                args64 = [jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32)), jnp.float64)
                          for x in (q, k, v, g, beta)]
                o64 = np.asarray(jax.jit(lambda a: kda_recurrent(*a)[0])(args64))
            o_rec = jax.jit(lambda a: kda_recurrent(*a)[0])((q, k, v, g, beta))
            for C in (int(c) for c in FLAGS.chunk_sizes):
                max_neg, bad_tile = tile_stats(q, k, g, C)
                exact = jax.jit(lambda a: kda_chunked(*a, chunk_size=C)[0])((q, k, v, g, beta))
                bounded = jax.jit(lambda a: kda_chunked(*a, chunk_size=C, lower_bound=LOWER_BOUND)[0])(
                    (q, k, v, g, beta))
                forced = jax.jit(lambda a: _kda_chunked(
                    *a, scale=None, initial_state=None, output_final_state=False, segment_ids=None,
                    use_qk_l2norm=False, chunk_size=C, lower_bound=LOWER_BOUND, tile=C)[0])((q, k, v, g, beta))
                row = dict(gate=gate, setting=setting, chunk_size=C, g_min=float(g.min()),
                           g_mean=float(g.mean()), max_neg_G=max_neg, overflows=max_neg > OVERFLOW_NATS,
                           nonfinite_tile=bad_tile,
                           nonfinite_o=float(jnp.mean(~jnp.isfinite(forced.astype(jnp.float32)))),
                           err_recurrent_fp32=rms_ratio(o_rec, o64), err_exact=rms_ratio(exact, o64),
                           err_bounded_tile16=rms_ratio(bounded, o64), err_forced_tileC=rms_ratio(forced, o64))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def run_long():
    T, H, K = FLAGS.long_seq_len, FLAGS.long_heads, FLAGS.head_dim
    out = []
    for gate in ("bounded", "softplus"):
        q, k, v, g, beta = make_inputs(jax.random.PRNGKey(FLAGS.seed + 7), 1, T, H, K, gate, "trained")
        lb = LOWER_BOUND if gate == "bounded" else None
        fn = jax.jit(lambda a: kda_chunked(*a, output_final_state=True, lower_bound=lb))
        t0 = time.perf_counter()
        o, ht = jax.block_until_ready(fn((q, k, v, g, beta)))
        sec = time.perf_counter() - t0
        row = dict(gate=gate, tokens=T, heads=H, head_dim=K, path="bounded tile16" if lb else "exact",
                   max_abs_o=float(jnp.max(jnp.abs(o.astype(jnp.float32)))),
                   final_state_norm=float(jnp.linalg.norm(ht)),
                   finite=bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))), seconds_incl_compile=sec)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def to_markdown(env, rows, long_rows, config):
    """One run's section of the page (write_page)."""
    lines = [f"## KDA gate stability ({env['date']})", "",
             f"Machine: {env['platform']}, {env['cpu_count']} CPUs, backend {env['backend']}; python "
             f"{env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, numpy {env['numpy']}.",
             f"Inputs: B={config['batch']}, T={config['seq_len']}, H={config['heads']}, K=V={config['head_dim']}, "
             f"bf16 q/k, "
             f"fp32 g (v, beta passed as fp32 so o is fp32); gate input g_raw ~ N(0,1) (trained), N(0, 3^2) (wide) or "
             f"N(4, 2^2) (stress); fla init of A_log, dt_bias.",
             f"max -G: largest -(G_j - a) in a C-token tile anchored at its start, in nats; overflow above "
             f"{OVERFLOW_NATS:.2f}. Errors: RMS(o - o_fp64)/RMS(o_fp64) vs an fp64 recurrence.", "",
             "| gate | setting | C | min g | max -G (nats) | overflows | inf/NaN forced tile | inf/NaN o (forced) "
             "| err fp32 recurrent | err exact chunked | err bounded tile16 | err forced C-tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['gate']} | {r['setting']} | {r['chunk_size']} | {r['g_min']:.2f} | {r['max_neg_G']:.1f} | "
            f"{'yes' if r['overflows'] else 'no'} | {r['nonfinite_tile']:.2%} | {r['nonfinite_o']:.2%} | "
            f"{r['err_recurrent_fp32']:.1e} | {r['err_exact']:.1e} | {r['err_bounded_tile16']:.1e} | "
            f"{r['err_forced_tileC']:.1e} |")
    b16 = [r for r in rows if r["gate"] == "bounded" and r["chunk_size"] == 16]
    s16 = [r for r in rows if r["gate"] == "softplus" and r["chunk_size"] == 16 and r["overflows"]]
    lines += ["", f"Findings: bounded gate, 16-token tile: max -G = {max(r['max_neg_G'] for r in b16):.1f} nats "
              f"(<= 80 by construction), inf/NaN {max(r['nonfinite_tile'] for r in b16):.2%} in every setting; "
              f"larger bounded tiles overflow once decays approach the bound. Softplus gate, 16-token tile: "
              f"overflows in {len(s16)} of {len(b16)} settings ({', '.join(r['setting'] for r in s16) or 'none'}). "
              f"Worst error of the library's bounded path (bf16 16-token tiles) on bounded gates: "
              f"{max(r['err_bounded_tile16'] for r in rows if r['gate'] == 'bounded'):.1e}; of the exact path: "
              f"{max(r['err_exact'] for r in rows):.1e}."]
    lines += ["", "Long sequence (chunked op, chunk 64, 'trained' gate inputs):", "",
              "| gate | path | tokens | heads | max abs o | final state norm | finite | seconds (incl. compile) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in long_rows:
        lines.append(f"| {r['gate']} | {r['path']} | {r['tokens']} | {r['heads']} | {r['max_abs_o']:.3f} | "
                     f"{r['final_state_norm']:.3f} | {r['finite']} | {r['seconds_incl_compile']:.1f} |")
    lines += ["", "The err of the bounded path on softplus gates is a contract violation (gates below the declared "
              "bound); it is listed to show what happens, not as a supported use."]
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for gate, marker in (("bounded", "o"), ("softplus", "s")):
        for setting, ls in (("trained", "-"), ("wide", ":"), ("stress", "--")):
            rs = [r for r in rows if r["gate"] == gate and r["setting"] == setting]
            cs = [r["chunk_size"] for r in rs]
            axes[0].plot(cs, [r["max_neg_G"] for r in rs], marker=marker, ls=ls, label=f"{gate}/{setting}")
            axes[1].plot(cs, [r["nonfinite_tile"] for r in rs], marker=marker, ls=ls, label=f"{gate}/{setting}")
    axes[0].axhline(OVERFLOW_NATS, color="k", lw=0.8)
    axes[0].text(16, OVERFLOW_NATS * 1.1, "bf16/fp32 overflow (88.7 nats)")
    axes[0].set(xlabel="diagonal tile = chunk size C", ylabel="max -G in a tile (nats)", xscale="log", yscale="log",
                title="largest exp(-G) exponent")
    axes[1].set(xlabel="diagonal tile = chunk size C", ylabel="inf/NaN fraction", xscale="log",
                title="forced single-GEMM bf16 tile")
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks([16, 32, 64], ["16", "32", "64"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_page(out_dir):
    """out_dir/gate_stability.md: one page from every gate_stability*.json there (the untagged run
    first, then the tagged ones by name), so that a run with or without --tag keeps the others'
    sections. Returns the page."""
    runs = {}
    for n in sorted((n for n in os.listdir(out_dir) if n.startswith("gate_stability") and n.endswith(".json")),
                    key=lambda n: (n != "gate_stability.json", n)):
        with open(os.path.join(out_dir, n)) as f:
            saved = json.load(f)
        if isinstance(saved, dict) and {"environment", "config", "grid", "long"} <= set(saved):
            runs[n] = saved
        else:
            print(f"gate_stability: {n} in {out_dir} is not this script's output; left out of the page")
    parts = ["# KDA gate stability", "",
             "One page for `experiments/gate_stability.py`, rendered from its runs' files here: " +
             ", then ".join(f"`{n}`" for n in runs) + ".", ""]
    for saved in runs.values():
        parts.append(to_markdown(saved["environment"], saved["grid"], saved["long"], saved["config"]))
    page = "\n".join(parts)
    with open(os.path.join(out_dir, "gate_stability.md"), "w") as f:
        f.write(page)
    return page


def main(argv):
    del argv
    if FLAGS.from_json:
        with open(FLAGS.from_json) as f:
            saved = json.load(f)
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        base = os.path.join(FLAGS.out_dir, f"gate_stability{FLAGS.tag}")
        if os.path.abspath(FLAGS.from_json) != os.path.abspath(base + ".json"):
            if os.path.exists(base + ".json"):
                with open(base + ".json") as f:
                    if json.load(f) != saved:
                        raise ValueError(f"from_json={FLAGS.from_json!r} would replace another run in {base}.json; "
                                         f"give it its own --tag (e.g. the one in its file name) or another --out_dir")
            with open(base + ".json", "w") as f:
                json.dump(saved, f, indent=1)
        plot(saved["grid"], base + ".png")
        write_page(FLAGS.out_dir)
        return
    env = environment()
    rows = run_grid()
    long_rows = run_long()
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    base = os.path.join(FLAGS.out_dir, f"gate_stability{FLAGS.tag}")
    config = dict(batch=FLAGS.batch, seq_len=FLAGS.seq_len, heads=FLAGS.heads, head_dim=FLAGS.head_dim,
                  long_seq_len=FLAGS.long_seq_len, long_heads=FLAGS.long_heads, seed=FLAGS.seed,
                  lower_bound=LOWER_BOUND, settings=SETTINGS)
    with open(base + ".json", "w") as f:
        json.dump(dict(environment=env, config=config, grid=rows, long=long_rows), f, indent=1)
    plot(rows, base + ".png")
    print(write_page(FLAGS.out_dir))


if __name__ == "__main__":
    app.run(main)
