"""Evaluate trained runs on their whole validation split: bits per byte that compare across tokenizers.

  python -m experiments.eval_runs --workdirs=runs/bytes,runs/bpe8k --out=/tmp/k3jax_eval_runs/eval

Each workdir's newest checkpoint (config from its run_header.json, the run's tokenizer; a checkpoint of
another tokenizer is refused) is evaluated on every full batch of `data.batch_size` windows of
`data.seq_len` tokens of the validation split (the trainer's eval uses the first `train.eval_batches`
batches only, i.e. different amounts of text for different tokenizers): the same text for every
tokenizer up to the last partial batch. Per run: nats per token, bits per byte (total nats / ln 2 / the
UTF-8 bytes of the evaluated targets), bytes per token, the evaluated tokens and bytes, and what the
run held: steps, tokens per step, bytes per step (tokens x the train stream's bytes per token),
training FLOPs per step (`k3jax.models.flops.model_flops_per_token`, head included), parameters, and
its own in-run val_bpb. Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import json
import os


def eval_run(workdir: str, max_batches: int = 0) -> dict:
    """The row of one run folder (module docstring); `max_batches` > 0 evaluates only that many batches."""
    import numpy as np  # noqa: PLC0415
    from experiments.generate import run_config_of  # noqa: PLC0415
    from k3jax.data.corpus import load_corpus  # noqa: PLC0415
    from k3jax.data.pipeline import eval_batches, num_windows  # noqa: PLC0415
    from k3jax.data.tokenizer import ByteTokenizer  # noqa: PLC0415
    from k3jax.models.flops import model_flops_per_token  # noqa: PLC0415
    from k3jax.train.metrics import read_metrics  # noqa: PLC0415
    from k3jax.train.trainer import (byte_lengths_table, evaluate, load_trained_model, loss_chunk_size,  # noqa: PLC0415
                                     run_tokenizer)
    cfg = run_config_of(workdir)
    with open(os.path.join(workdir, "run_header.json")) as f:
        header = json.load(f)
    tok = run_tokenizer(cfg)
    model, step = load_trained_model(cfg, tokenizer=tok)
    cache = cfg.data.cache_dir or None
    val = load_corpus(cfg.data.source, "validation", cache_dir=cache, tokenizer=tok)
    train = load_corpus(cfg.data.source, "train", cache_dir=cache, tokenizer=tok)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    batches = eval_batches(val.tokens, batch_size=b, seq_len=t,
                           max_batches=max_batches or num_windows(val.tokens, t) // b + 1, eos_id=tok.eos_id)
    is_bytes = tok.identity == ByteTokenizer.identity
    lengths = byte_lengths_table(cfg, tok)
    ev = evaluate(model, batches, None if is_bytes else lengths, loss_chunk_size=loss_chunk_size(cfg))
    train_bytes = int(np.bincount(np.asarray(train.tokens), minlength=lengths.shape[0])[:lengths.shape[0]] @ lengths)
    in_run = {r["step"]: r["val_bpb"] for r in read_metrics(workdir) if "val_bpb" in r}
    return dict(workdir=workdir, tokenizer=cfg.data.tokenizer, vocab_size=cfg.model.vocab_size, seq_len=t,
                batch_size=b, steps=step, tokens_per_step=b * t, bytes_per_step=b * t * train_bytes / train.num_tokens,
                gflop_per_step=model_flops_per_token(cfg.model, t)["total"] * b * t / 1e9,
                num_params=header.get("num_params"), val_tokens=int(sum(int(x["loss_mask"].sum()) for x in batches)),
                val_bytes=int(sum(int(np.where(x["loss_mask"], lengths[x["targets"]], 0).sum()) for x in batches)),
                val_nats_per_token=ev["val_loss"], val_bpb=ev["val_bpb"], val_bytes_per_token=ev["val_bytes_per_token"],
                in_run_val_bpb=in_run.get(step))


def render(result: dict) -> str:
    from experiments.harness import environment_line, markdown_table  # noqa: PLC0415
    rows = [[r["workdir"], r["tokenizer"], r["seq_len"], r["steps"], r["tokens_per_step"], f"{r['bytes_per_step']:,.0f}",
             f"{r['gflop_per_step']:.1f}", f"{r['num_params'] / 1e6:.2f} M" if r.get("num_params") else "n/a",
             f"{r['val_bpb']:.3f}", f"{r['val_nats_per_token']:.3f}", f"{r['val_bytes_per_token']:.2f}",
             f"{r['val_bytes']:,}"] for r in result["rows"]]
    lines = ["# Runs on their whole validation split", "", environment_line(result["env"]), "",
             "`experiments/eval_runs.py`: each run's newest checkpoint on every full batch of its validation split "
             "(same text whatever the tokenizer); bits/byte = total nats / ln 2 / UTF-8 bytes of the targets; bytes/step "
             "= tokens/step x the train stream's bytes per token; GFLOP/step = training FLOPs (6N with the head, "
             "attention, KDA).", ""]
    lines += markdown_table(["run", "tokenizer", "seq_len", "steps", "tokens/step", "bytes/step", "GFLOP/step", "params",
                             "val bits/byte", "nats/token", "bytes/token", "val bytes"], rows)
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    from absl import flags  # noqa: PLC0415
    from experiments.harness import environment, write_results  # noqa: PLC0415
    rows = []
    for workdir in flags.FLAGS.workdirs:
        rows.append(eval_run(workdir, flags.FLAGS.max_batches))
        print(json.dumps(rows[-1]), flush=True)
    result = {"env": environment(), "rows": rows}
    write_results(flags.FLAGS.out, result, render(result))
    print(render(result))


if __name__ == "__main__":
    from absl import app, flags, logging
    flags.DEFINE_list("workdirs", [], "Run folders (each with run_header.json and checkpoints/).")
    flags.DEFINE_string("out", "/tmp/k3jax_eval_runs/eval", "Output prefix (<out>.json, .md).")
    flags.DEFINE_integer("max_batches", 0, "Evaluate only the first N batches (0 = the whole split).", lower_bound=0)
    logging.set_verbosity(logging.WARNING)
    app.run(main)
