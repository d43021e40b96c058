"""The training loop: data -> model -> jitted steps -> eval -> checkpoints -> metrics -> a sample.

`train(cfg)` resumes from the latest checkpoint in `cfg.workdir` when there is one (same data position,
same optimizer state), saves every `checkpoint_every` steps, at the end, and when the process gets
SIGTERM, then returns a summary dict. A damaged newest checkpoint is moved aside to `<step>.corrupt`
and the run resumes from the newest readable one, saying so in one warning line
(`Checkpointer.restore_latest`).

Tokenizer (`data.tokenizer`, `run_tokenizer`): the corpus is encoded with it, packing cuts documents at
its EOS, evaluation reports nats per token and bits per byte (total nats over the UTF-8 bytes the
evaluated targets stand for, `Tokenizer.token_byte_lengths`), the sample is decoded with it, and every
checkpoint's meta records it (`tokenizer_record`: spec, identity, content hash, path, vocabulary); a
resume, or loading a model to sample, with a tokenizer of another hash is refused with a ValueError
before any array is read.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from k3jax.data.corpus import load_corpus, load_tokenizer, unigram_entropy_bits
from k3jax.data.pipeline import eval_batches, make_train_loader
from k3jax.data.tokenizer import ByteTokenizer, Tokenizer
from k3jax.models.generate import generate
from k3jax.models.lm import LanguageModel
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config import RunConfig
from k3jax.ops.cross_entropy import auto_chunk_size
from k3jax.train.metrics import MetricsWriter
from k3jax.train.optimizer import learning_rate_schedule, make_optimizer
from k3jax.train.step import bind_train_step, bits_per_byte, eval_step, nonfinite_report

log = logging.getLogger("k3jax")


class NonFiniteError(RuntimeError):
    """Raised when `max_nonfinite_steps` consecutive updates were skipped for inf/NaN gradients; the
    message says which layer first produced a non-finite value (`k3jax.train.step.nonfinite_report`)."""


class _Sigterm:
    """Turns SIGTERM into a flag the loop checks after each step (then it checkpoints and returns)."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _to_device(batch: dict) -> dict:
    """Host batch -> device arrays (an async host-to-device copy; the loop calls it one step ahead)."""
    return jax.device_put(batch)


def _to_host(metrics: dict) -> dict:
    """A step's metrics on the host (waits for that step to finish)."""
    return jax.device_get(metrics)


class _StepClock:
    """Tokens/s of the steps a process ran, the first one (compilation) excluded.

    A step's time runs from the later of its dispatch and the previous step's end (as the host saw it:
    its metrics read) to its own end, so eval, checkpoints and host work between steps are not counted
    while the host stays ahead of the device, and are counted when the host is what the device waits on.
    """

    def __init__(self, start_step: int, tokens_per_step: int):
        self.start_step, self.tokens_per_step = start_step, tokens_per_step
        self.tokens, self.seconds = 0, 0.0
        self._since = None  # start of the step after the last one read
        self.first_end: float | None = None  # when the host saw the process's first step end
        self._dispatch_times: list[float] = []

    def dispatched(self) -> None:
        self._dispatch_times.append(time.perf_counter())

    def paused(self) -> None:
        """Host work between steps (eval, checkpoint) that must not count as step time."""
        self._since = None

    def done(self, step: int) -> float:
        now = time.perf_counter()
        dispatched = self._dispatch_times.pop(0)
        since = dispatched if self._since is None else max(self._since, dispatched)
        if self.first_end is None:
            self.first_end = now
        if step > self.start_step + 1:
            self.tokens, self.seconds = self.tokens + self.tokens_per_step, self.seconds + now - since
        self._since = now
        return self.tokens_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _versions() -> dict:
    import flax
    import grain
    import optax
    import orbax.checkpoint
    return {"python": sys.version.split()[0], "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "orbax-checkpoint": orbax.checkpoint.__version__,
            "grain": getattr(grain, "__version__", "?")}


def run_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer of `cfg.data.tokenizer` (train-bpe: trained on first use, then read from the cache).

    Raises:
      ValueError: as `k3jax.data.corpus.load_tokenizer`, or a tokenizer with more ids than
        `cfg.model.vocab_size` (a trained BPE never has: its vocabulary is at most the V asked for).
    """
    tok = load_tokenizer(cfg.data.tokenizer, source=cfg.data.source, cache_dir=cfg.data.cache_dir or None)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r} has {tok.vocab_size} ids, more than "
                         f"model.vocab_size={cfg.model.vocab_size}")
    return tok


def tokenizer_record(cfg: RunConfig, tokenizer: Tokenizer) -> dict:
    """What checkpoints and the run header record of the run's tokenizer."""
    return {"spec": cfg.data.tokenizer, "identity": tokenizer.identity, "hash": tokenizer.hash,
            "path": tokenizer.path, "vocab_size": tokenizer.vocab_size}


def tokenizer_check(cfg: RunConfig, tokenizer: Tokenizer, directory: str):
    """A `check_meta` for `Checkpointer`: refuses a checkpoint written with a tokenizer of another hash
    (checkpoints from before tokenizers were recorded count as bytes)."""
    record = tokenizer_record(cfg, tokenizer)

    def check(step: int, meta: dict) -> None:
        stored = meta.get("tokenizer") or {"spec": "bytes", "identity": ByteTokenizer.identity,
                                            "hash": ByteTokenizer().hash}
        if stored.get("hash") != record["hash"]:
            raise ValueError(
                f"checkpoint step {step} under {directory} was written with tokenizer {stored.get('identity')!r} "
                f"(data.tokenizer={stored.get('spec')!r}, hash {stored.get('hash')}); this run's data.tokenizer="
                f"{record['spec']!r} is {record['identity']!r} (hash {record['hash']}). Ids mean other text under "
                "another tokenizer: resume with the checkpoint's data.tokenizer or use a new workdir")
    return check


def byte_lengths_table(cfg: RunConfig, tokenizer: Tokenizer) -> np.ndarray:
    """int32 [padded vocab]: the tokenizer's `token_byte_lengths()`, zeros past its ids (eval's bytes)."""
    table = np.zeros(cfg.model.padded_vocab_size, np.int32)
    lengths = tokenizer.token_byte_lengths()
    table[:lengths.shape[0]] = lengths
    return table


def loss_chunk_size(cfg: RunConfig) -> int:
    """`train.loss_chunk_size` resolved: None -> `k3jax.ops.cross_entropy.auto_chunk_size` (0 = plain)."""
    if cfg.train.loss_chunk_size is None:
        return auto_chunk_size(cfg.model.padded_vocab_size)
    return cfg.train.loss_chunk_size


def evaluate(model, batches, byte_lengths=None, *, loss_chunk_size: int = 0) -> dict:
    """Validation nats per token (`val_loss`), bits per byte (`val_bpb`: total nats / ln 2 / the UTF-8
    bytes of the evaluated targets), bytes per token and MoE loads, summed over `batches` (no state
    change). `byte_lengths`: as `k3jax.train.step.eval_step` (None = byte ids)."""
    nats = count = nbytes = 0.0
    loads = None
    lengths = None if byte_lengths is None else jnp.asarray(byte_lengths, jnp.int32)
    for batch in batches:
        out = eval_step(model, {k: jnp.asarray(v) for k, v in batch.items()}, lengths,
                        loss_chunk_size=loss_chunk_size)
        nats, count, nbytes = nats + float(out["nats"]), count + float(out["count"]), nbytes + float(out["bytes"])
        if out["loads"]:
            layer_loads = np.stack([np.asarray(x) for x in out["loads"]])
            loads = layer_loads if loads is None else loads + layer_loads
    result = {"val_loss": nats / max(count, 1.0), "val_bpb": bits_per_byte(nats, nbytes),
              "val_bytes_per_token": nbytes / max(count, 1.0)}
    if loads is not None:
        mean = loads.mean(axis=-1, keepdims=True)
        result["val_max_vio_global"] = float(np.mean((loads.max(-1, keepdims=True) - mean) / np.maximum(mean, 1e-9)))
    return result


def sample_text(model, cfg: RunConfig, *, seed: int, tokenizer: Tokenizer | None = None) -> str:
    """Decode `cfg.train.sample_tokens` tokens after `cfg.train.sample_prompt` with the model's caches,
    encoded and decoded with `tokenizer` (default: `run_tokenizer(cfg)`); ids past its vocabulary are
    never sampled."""
    tok = tokenizer if tokenizer is not None else run_tokenizer(cfg)
    prompt = tok.encode(cfg.train.sample_prompt or "\n")[None]
    out = generate(model, prompt, max_new_tokens=cfg.train.sample_tokens, rng=jax.random.key(seed),
                   temperature=cfg.train.sample_temperature, top_k=0, vocab_size=tok.vocab_size)
    return tok.decode(np.asarray(out[0]))


def load_trained_model(cfg: RunConfig, *, step: int | None = None,
                       tokenizer: Tokenizer | None = None) -> tuple[LanguageModel, int]:
    """The model of `cfg.workdir`'s checkpoint `step` (default: the newest readable one) and that step.

    With `step=None` a damaged newest checkpoint is skipped with a warning line and left in place (the
    training run moves it aside when it resumes). With `tokenizer`, a checkpoint written with another
    tokenizer is refused (`tokenizer_check`).

    Raises:
      FileNotFoundError: when the workdir holds no checkpoint.
      ValueError: the checkpoint (or, with step=None, every checkpoint) cannot be read, it was
        written for another model config, or with another tokenizer than `tokenizer`.
    """
    ckpt = Checkpointer(cfg.workdir, keep=cfg.train.keep_checkpoints)
    model = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    check = None if tokenizer is None else tokenizer_check(cfg, tokenizer, ckpt.directory)
    try:
        if step is None:
            meta = ckpt.restore_latest(model, move_aside=False, check_meta=check)
            if meta is None:
                raise FileNotFoundError(f"no checkpoint under {ckpt.directory}")
            step = int(meta["step"])
        else:
            ckpt.restore_model(step, model, check_meta=check)
    finally:
        ckpt.close()
    return model, step


def train(cfg: RunConfig, *, show_progress: bool = True, stop_at_step: int | None = None,
          time_budget_s: float | None = None) -> dict:
    """Train (or resume) the run described by `cfg`; return a summary (final eval, tokens/s, sample...).

    `stop_at_step` ends this process's part of the run early (checkpoint saved, as on SIGTERM) without
    changing the run itself (the schedule still spans `cfg.train.steps`); a later call resumes.
    `time_budget_s` does the same once this call has trained that many wall-clock seconds after its first
    step ended (that step's compilation is not counted; checked after each step; the summary's "step" says
    where it stopped).

    The host does not wait for a step it has just dispatched: step N's metrics are read (and logged,
    and checked for non-finite values) after step N + 1 is dispatched, and the batch of step N + 1 is
    put on the device while step N runs. The process's first step, eval and checkpoint steps and the
    last step are read at once (eval and checkpoints see the state after their step).

    A skipped (non-finite) update logs one warning line naming the first layer whose output was
    non-finite (or, for a finite forward, the deepest parameter group with non-finite gradients).

    Raises:
      NonFiniteError: after `cfg.train.max_nonfinite_steps` consecutive non-finite steps (a checkpoint
        of the last good state is written first, at the step the loop reached, which may be the one
        after the message's step; the message names the layer as above).
      ValueError: the workdir holds checkpoints but none is readable, they were written for another
        model/optimizer config (`Checkpointer.restore_latest`), or with another tokenizer
        (`tokenizer_check`); a tokenizer that cannot be loaded (`run_tokenizer`).
    """
    t_start = time.time()
    cache_dir = cfg.data.cache_dir or None
    tokenizer = run_tokenizer(cfg)
    # A tokens: stream may use a declared vocabulary larger than the tokenizer's (model.vocab_size).
    declared = (cfg.model.vocab_size if cfg.data.source.startswith("tokens:")
                and cfg.model.vocab_size > tokenizer.vocab_size else None)
    train_corpus = load_corpus(cfg.data.source, "train", cache_dir=cache_dir, tokenizer=tokenizer, vocab_size=declared)
    val_corpus = load_corpus(cfg.data.source, "validation", cache_dir=cache_dir, tokenizer=tokenizer,
                             vocab_size=declared)
    if val_corpus.num_tokens <= cfg.data.seq_len:
        val_corpus = train_corpus  # tiny corpora: evaluate on the head of the train stream
        log.warning("validation split shorter than one sequence; evaluating on training data")
    is_bytes = tokenizer.identity == ByteTokenizer.identity
    byte_lengths = byte_lengths_table(cfg, tokenizer)
    entropy = unigram_entropy_bits(train_corpus.tokens, None if is_bytes else byte_lengths)
    chunk = loss_chunk_size(cfg)

    model = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    data_iter = make_train_loader(train_corpus.tokens, batch_size=cfg.data.batch_size,
                                  seq_len=cfg.data.seq_len, seed=cfg.seed, eos_id=tokenizer.eos_id)
    val_batches = eval_batches(val_corpus.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                               max_batches=cfg.train.eval_batches, eos_id=tokenizer.eos_id)
    ckpt = Checkpointer(cfg.workdir, keep=cfg.train.keep_checkpoints)
    # None: a fresh run; a checkpoint of another tokenizer is refused before any array is read
    meta = ckpt.restore_latest(model, optimizer, data_iter, check_meta=tokenizer_check(cfg, tokenizer, ckpt.directory))
    latest = None if meta is None else int(meta["step"])
    step_fn = bind_train_step(model, optimizer, loss_chunk_size=chunk)  # after the restore: its variables
    start_step = latest or 0
    writer = MetricsWriter(cfg.workdir, resume_step=start_step if latest is not None else None)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))

    header = {"versions": _versions(), "devices": [str(d) for d in jax.devices()], "num_params": num_params,
              "train_tokens": train_corpus.num_tokens, "val_tokens": val_corpus.num_tokens,
              "unigram_entropy_bits": entropy, "resumed_from_step": start_step if latest is not None else None,
              "config": dataclasses.asdict(cfg)}
    header.update(tokenizer=tokenizer_record(cfg, tokenizer), loss_chunk_size=chunk)
    print("k3jax run\n" + json.dumps(header, indent=1, default=str), flush=True)
    with open(f"{cfg.workdir}/run_header.json", "w") as f:
        json.dump(header, f, indent=1, default=str)
    if is_bytes:
        print(f"corpus unigram byte entropy: {entropy:.3f} bits/byte (a model must beat this to have learned "
              "more than byte frequencies)", flush=True)
    else:
        print(f"corpus unigram token entropy: {entropy:.3f} bits/byte ({tokenizer.identity}, "
              f"{tokenizer.vocab_size} ids; a model must beat this to have learned more than token frequencies)",
              flush=True)
    ckpt_meta = {"seed": cfg.seed, "tokenizer": tokenizer_record(cfg, tokenizer)}

    schedule = learning_rate_schedule(cfg.train)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    summary: dict = {"unigram_entropy_bits": entropy, "num_params": num_params, "start_step": start_step}
    clock = _StepClock(start_step, tokens_per_step)
    pending: list[tuple[int, dict]] = []  # dispatched steps whose metrics the host has not read yet
    step = start_step
    stopped_by_signal = False
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not show_progress, dynamic_ncols=True,
               file=sys.stdout, mininterval=1.0)

    last_read: dict = {}  # the metrics of the newest step read so far

    def flush(through: int) -> dict:
        """Read the metrics of the pending steps <= `through` (in order), check them, log; return the newest read."""
        while pending and pending[0][0] <= through:
            done, device_metrics = pending.pop(0)
            metrics = _to_host(device_metrics)
            tok_s = clock.done(done)
            bar.update(1)
            bar.set_postfix(loss=f"{float(metrics['ce']):.3f}", tok_s=f"{tok_s:,.0f}")
            stop = int(metrics["nonfinite_count"]) >= cfg.train.max_nonfinite_steps
            if not bool(metrics["finite"]) or stop:
                where = nonfinite_report(model, metrics)
                log.warning("step %d: non-finite step, update skipped (loss %s, grad_norm %s; %d in a row): %s",
                            done, float(metrics["loss"]), float(metrics["grad_norm"]),
                            int(metrics["nonfinite_count"]), where)
                if stop:  # the state holds `step` updates (the one dispatched after `done` included)
                    ckpt.save(step, model, optimizer, data_iter, {"step": step, **ckpt_meta})
                    raise NonFiniteError(f"{cfg.train.max_nonfinite_steps} consecutive non-finite steps at step "
                                         f"{done}: {where}")
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                scalars = {k: v for k, v in metrics.items() if np.ndim(v) == 0}
                scalars.update(lr=float(schedule(done - 1)), tokens_per_s=tok_s, tokens=done * tokens_per_step)
                writer.write(done, scalars)
            last_read.clear()
            last_read.update(metrics)
        return last_read

    with _Sigterm() as sigterm:
        batch = _to_device(next(data_iter)) if step < cfg.train.steps else None
        while step < cfg.train.steps:
            clock.dispatched()
            step += 1
            pending.append((step, step_fn(batch)))  # async: no host sync on this step
            # the previous step's metrics, read while this one runs; the process's first step (compilation)
            # is read at once: it starts the time budget
            flush(step if step == start_step + 1 else step - 1)
            if stop_at_step is not None and step >= stop_at_step:
                sigterm.received = True
            if time_budget_s is not None and clock.first_end is not None \
                    and time.perf_counter() - clock.first_end >= time_budget_s:
                sigterm.received = True
            evaluate_now = step % cfg.train.eval_every == 0 or step == cfg.train.steps
            save_now = step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps or sigterm.received
            if evaluate_now or save_now:  # eval and checkpoints see the state after this step
                metrics = flush(step)
                if evaluate_now:
                    ev = evaluate(model, val_batches, None if is_bytes else byte_lengths, loss_chunk_size=chunk)
                    writer.write(step, ev)
                    bar.write(f"step {step}: train ce {float(metrics['ce']):.4f} | val loss {ev['val_loss']:.4f} "
                              f"nats/token | val {ev['val_bpb']:.4f} bits/byte | {clock.tokens_per_s:,.0f} tok/s")
                    summary.update(ev)
                if save_now:
                    ckpt.save(step, model, optimizer, data_iter, {"step": step, **ckpt_meta})
                clock.paused()
            if sigterm.received:
                stopped_by_signal = True
                bar.write(f"stopped early: checkpoint saved at step {step}; rerun to resume")
                break
            if step < cfg.train.steps:  # the next batch goes to the device while this step runs
                batch = _to_device(next(data_iter))
        flush(step)
    bar.close()
    summary.update(step=step, tokens_per_s=clock.tokens_per_s, stopped_by_signal=stopped_by_signal)
    if not stopped_by_signal and cfg.train.sample_tokens:
        summary["sample"] = sample_text(model, cfg, seed=cfg.seed, tokenizer=tokenizer)
        print("\n--- sample (prompt + {} sampled {}, temperature {}) ---\n{}\n---".format(
            cfg.train.sample_tokens, "bytes" if is_bytes else "tokens", cfg.train.sample_temperature,
            summary["sample"]), flush=True)
    summary["wall_seconds"] = time.time() - t_start
    writer.close()
    ckpt.close()
    if "val_bpb" in summary:
        print(f"final: val {summary['val_bpb']:.4f} bits/byte (unigram entropy {entropy:.3f}), "
              f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['wall_seconds']:.0f} s", flush=True)
    return summary
