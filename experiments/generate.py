"""Sample from a trained run: load the workdir's latest (or a given) checkpoint and continue a prompt.

  python -m experiments.generate --workdir=runs/k3_tiny --prompt="def " --max_tokens=300 \
      --temperature=0.8 --top_k=40

The model config is read from the workdir's run_header.json; prompt and samples are encoded and decoded
with the run's `data.tokenizer` (a checkpoint written with another tokenizer is refused); decoding uses
each mixer's cache (KV cache for attention, the fp32 recurrent state + conv buffer of `kda_decode_step`
for KDA).
"""
import json
import os

import jax
import numpy as np
from absl import app, flags, logging

from k3jax.models.generate import generate
from k3jax.train.config import run_config_from_dict
from k3jax.train.trainer import load_trained_model, run_tokenizer

_WORKDIR = flags.DEFINE_string("workdir", "runs/k3_tiny", "Run folder (holds run_header.json, checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_PROMPT = flags.DEFINE_string("prompt", "def ", "Text to continue.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 300, "Tokens to sample (bytes with the byte tokenizer).", lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.", lower_bound=0.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all).", lower_bound=0)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def run_config_of(workdir: str):
    """The RunConfig a workdir was trained with (from its run_header.json)."""
    path = os.path.join(workdir, "run_header.json")
    if not os.path.exists(path):
        raise ValueError(f"workdir={workdir!r} has no run_header.json: not a k3jax run folder")
    with open(path) as f:
        config = json.load(f)["config"]
    return run_config_from_dict({**config, "workdir": workdir})


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    cfg = run_config_of(_WORKDIR.value)
    tok = run_tokenizer(cfg)
    model, step = load_trained_model(cfg, step=_STEP.value, tokenizer=tok)
    prompt = tok.encode(_PROMPT.value or "\n")
    prompts = np.repeat(prompt[None], _NUM_SAMPLES.value, axis=0)
    out = generate(model, prompts, max_new_tokens=_MAX_TOKENS.value, rng=jax.random.key(_SEED.value),
                   temperature=_TEMPERATURE.value, top_k=_TOP_K.value, vocab_size=tok.vocab_size)
    for i, row in enumerate(np.asarray(out)):
        print(f"--- sample {i} (checkpoint step {step}) ---\n{tok.decode(row)}")


if __name__ == "__main__":
    app.run(main)
