"""Where a model's step time goes: forward+backward time of each sublayer type and of the whole LM loss.

  python -m experiments.profile_layers --config=experiments/configs/k3_small_gpu.py --out=$OUT/layers
  python -m experiments.profile_layers --config=experiments/configs/k3_tiny.py --out=/tmp/layers   # CPU

At the config's shape (batch_size x seq_len tokens, its dtype), each distinct sublayer is built the way
`k3jax.models.lm.LanguageModel` builds it (`_make_mixer`, `_make_ffn`) and
`jax.value_and_grad(sum(out * cot))` with respect to its parameters and its input is jitted and timed;
the whole model's loss + gradients likewise. Reported per sublayer: median ms of `--iters` calls after
`--warmup`, ms per step (x the number of such sublayers in the model) and the share of the whole-model
time. The shares need not sum to 1: the rest is embeddings, norms, residual mixes, the LM head and the
loss. Writes `<out>.json` and `<out>.md` with date, device and versions.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from experiments.runtime import median_ms
from k3jax.models import lm as lm_lib
from k3jax.train import step as step_lib
from k3jax.train.config import run_config_from_dict

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/k3_tiny.py", "Run config.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
_OUT = flags.DEFINE_string("out", "", "Output prefix (.json, .md); '' = print only.")


def _median_ms(fn, *args) -> tuple[float, float]:
    """(median ms after --warmup calls, seconds of the first call, i.e. compilation + one run)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    return median_ms(fn, *args, iters=_ITERS.value, warmup=_WARMUP.value), compile_s


def _time_module(module, x, call):
    """Median ms of value_and_grad of sum(call(module, x) * cot) w.r.t. (params, x)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    cot = jax.random.normal(jax.random.PRNGKey(1), x.shape, jnp.float32).astype(x.dtype)

    def loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        y = call(m, x)
        return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))

    return _median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x)


def profile(cfg) -> tuple[dict, list[dict]]:
    m = cfg.model
    B, T = cfg.data.batch_size, cfg.data.seq_len
    dtype = lm_lib._dtype(m.dtype)  # noqa: SLF001 -- same dtype rule as the model
    x = (jax.random.normal(jax.random.PRNGKey(0), (B, T, m.d_model)) * 0.5).astype(dtype)
    segment_ids = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    pattern = (m.mixer_pattern * m.num_layers)[: m.num_layers]
    rows = []
    for letter in sorted(set(pattern)):
        mixer = lm_lib._make_mixer(m, letter, nnx.Rngs(0))  # noqa: SLF001
        ms, c = _time_module(mixer, x, lambda mod, x: mod(x, segment_ids=segment_ids, positions=positions))
        rows.append(dict(sublayer=f"mixer {letter} ({type(mixer).__name__})", count=pattern.count(letter),
                         ms=ms, compile_s=c))
        print(json.dumps(rows[-1]), flush=True)
    ffn = lm_lib._make_ffn(m, nnx.Rngs(0))  # noqa: SLF001
    if m.ffn == "mlp":
        call = lambda mod, x: mod(x)  # noqa: E731
    else:
        call = lambda mod, x: mod(x, segment_ids=segment_ids, train=True)[0]  # noqa: E731
    ms, c = _time_module(ffn, x, call)
    rows.append(dict(sublayer=f"ffn ({type(ffn).__name__})", count=m.num_layers, ms=ms, compile_s=c))
    print(json.dumps(rows[-1]), flush=True)

    model = lm_lib.LanguageModel(m, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T + 1), 0, m.vocab_size, jnp.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
                 loss_mask=jnp.ones((B, T), bool))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def lm_loss(params):  # the train step's loss: cross-entropy + balancing loss terms
        return step_lib._forward_loss(nnx.merge(graphdef, params, rest), batch, True)[0]  # noqa: SLF001

    ms, c = _median_ms(jax.jit(jax.value_and_grad(lm_loss)), params)
    whole = dict(sublayer="whole model (loss + grads)", count=1, ms=ms, compile_s=c)
    print(json.dumps(whole), flush=True)
    for r in rows:
        r["ms_per_step"] = r["ms"] * r["count"]
        r["share"] = r["ms_per_step"] / ms
    rows.append(dict(whole, ms_per_step=ms, share=1.0))
    import flax
    import jaxlib
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=jax.devices()[0].device_kind, backend=jax.default_backend(), platform=platform.platform(),
               python=sys.version.split()[0], jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax.__version__,
               tokens_per_step=B * T, model=dict(m.__dict__) if hasattr(m, "__dict__") else str(m))
    return env, rows


def render(env: dict, rows: list[dict]) -> str:
    lines = [f"# Step-time breakdown ({env['date']}, {env['device']})", "",
             f"jax {env['jax']}, flax {env['flax']}; {env['tokens_per_step']:,} tokens per call; forward+backward "
             f"medians. ms/step = ms x sublayers of that type; share = of the whole model's time.", "",
             "| sublayer | count | ms each | ms/step | share | compile s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sublayer']} | {r['count']} | {r['ms']:.2f} | {r['ms_per_step']:.2f} | "
                     f"{100 * r['share']:.0f}% | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    cfg = run_config_from_dict(_CONFIG.value.to_dict())
    env, rows = profile(cfg)
    text = render(env, rows)
    print(text)
    if _OUT.value:
        os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
        with open(_OUT.value + ".json", "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1, default=str)
        with open(_OUT.value + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    app.run(main)
