"""Run configuration as frozen dataclasses, validated at construction.

Only `experiments/` parses flags (ml_collections config files); the library takes these dataclasses.
`run_config_from_dict` turns a (Config)dict with keys model/data/train/workdir/seed into a `RunConfig`;
the model section is nested (model.kda, model.attention, model.residual, model.moe, model.moe.balancing:
`k3jax.models.config.model_config_from_dict`, docs/config.md).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from k3jax.data.corpus import check_source
from k3jax.data.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
from k3jax.data.tokenizer import parse_tokenizer_spec, spec_vocab_size
from k3jax.models.config import ModelConfig, model_config_from_dict


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched.

    Attributes:
      source: "python-stdlib" | "text:<glob>" | "tokens:<path>" | "hf:<dataset>[:<field>]"; checked
        when built (`k3jax.data.corpus.check_source`: a glob that matches no file, a missing token
        file or folder raise here, not at the first corpus load).
      seq_len: tokens per training sequence T.
      batch_size: sequences per step B.
      cache_dir: corpus cache folder ("" = $K3JAX_CACHE or ~/.cache/k3jax).
      tokenizer: "bytes" (default: UTF-8 bytes + BOS/EOS/PAD, 259 ids) | "bpe:<path to tokenizer.json>"
        (a Hugging Face `tokenizers` file, read locally) | "train-bpe:<vocab size>" (a byte-level BPE
        trained on the train split of `source`, cached next to the corpus; deterministic). Checked when
        built: the form, that a bpe: file exists, that train-bpe has text to train on (not `tokens:`).
        The model's vocabulary follows it (`RunConfig`). See `k3jax.data.corpus.load_tokenizer`.
    """

    source: str = "python-stdlib"
    seq_len: int = 256
    batch_size: int = 16
    cache_dir: str = ""
    tokenizer: str = "bytes"

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"data.source must be a non-empty string, got {self.source!r}")
        kind = self.source.split(":", 1)[0]
        if self.source != "python-stdlib" and kind not in ("text", "tokens", "hf"):
            raise ValueError(f"data.source: unknown corpus {self.source!r}; expected python-stdlib, "
                             "text:<glob>, tokens:<path> or hf:<dataset>")
        try:
            check_source(self.source)
        except ValueError as e:
            raise ValueError(f"data.source: {e}") from e
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"data.{name} must be a positive int, got {value!r}")
        kind, arg = parse_tokenizer_spec(self.tokenizer)  # its ValueError names data.tokenizer
        if kind == "bpe" and not Path(arg).expanduser().is_file():
            raise ValueError(f"data.tokenizer: tokenizer file not found: {arg!r} (expected "
                             "'bpe:<path to a tokenizer.json>')")
        if kind == "train-bpe" and self.source.startswith("tokens:"):
            raise ValueError(f"data.tokenizer {self.tokenizer!r} trains on the corpus's text; a tokens: source "
                             f"has none ({self.source!r}): give the tokenizer that made the stream as bpe:<path>")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation, logging and checkpoint cadence (all counts in optimizer steps).

    Attributes:
      steps: total optimizer steps.
      learning_rate: peak AdamW learning rate after linear warmup; cosine decay to
        `learning_rate * min_lr_ratio` at `steps`.
      warmup_steps (<= steps), min_lr_ratio, weight_decay (not applied to 1-D params), b1, b2, grad_clip (global norm).
      eval_every: evaluate every N steps (and at the end); eval_batches: batches in the fixed slice.
      log_every: JSONL/TensorBoard cadence.
      checkpoint_every: save every N steps (and at the end and on SIGTERM); keep_checkpoints: last K kept.
      max_nonfinite_steps: stop after this many consecutive skipped (non-finite) updates.
      sample_tokens, sample_prompt, sample_temperature: the sample printed at the end (0 tokens = none).
      loss_chunk_size: tokens per chunk of the LM-head cross-entropy (`k3jax.ops.cross_entropy`: the
        [tokens, vocab] fp32 logits are never all live). None = automatic: the plain loss below 32768
        padded ids (bytes, small BPEs: numerically as before), else 2^27 / vocab tokens (4096 at 32k,
        1024 at 128k); 0 = always the plain loss; N = chunks of N tokens.
    """

    steps: int = 1200
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    max_nonfinite_steps: int = 10
    sample_tokens: int = 200
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    loss_chunk_size: int | None = None

    def __post_init__(self):
        for name in ("steps", "eval_every", "eval_batches", "log_every", "checkpoint_every",
                     "keep_checkpoints", "max_nonfinite_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"train.{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "sample_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"train.{name} must be a non-negative int, got {value!r}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"train.warmup_steps must be <= train.steps={self.steps} (lower it with steps), "
                             f"got {self.warmup_steps!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"train.learning_rate must be positive, got {self.learning_rate!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError(f"train.weight_decay must be >= 0 and train.grad_clip > 0, got "
                             f"{self.weight_decay!r}, {self.grad_clip!r}")
        if self.sample_temperature < 0:
            raise ValueError(f"train.sample_temperature must be >= 0, got {self.sample_temperature!r}")
        if self.loss_chunk_size is not None and (not isinstance(self.loss_chunk_size, int)
                                                 or isinstance(self.loss_chunk_size, bool) or self.loss_chunk_size < 0):
            raise ValueError(f"train.loss_chunk_size must be None or an int >= 0, got {self.loss_chunk_size!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs. `workdir` holds checkpoints, metrics.jsonl and TensorBoard logs.

    `seed` (an int in [0, 2**32), the data loader's shuffle-seed range) seeds parameters and data order.

    The model's vocabulary comes from `data.tokenizer` (as torchtitan and flame take it from the
    tokenizer): a `model.vocab_size` left at the byte default 259 becomes the tokenizer's (bytes: 259;
    bpe:<path>: the file's vocabulary; train-bpe:<V>: V). An explicit larger one is kept (as MaxText's
    `vocab_size`, which may exceed the tokenizer's: the extra ids are never targets and never sampled);
    an explicit smaller one raises.
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    workdir: str = "runs/default"
    seed: int = 0

    def __post_init__(self):
        if not self.workdir:
            raise ValueError("workdir must be a non-empty path")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        needed = spec_vocab_size(self.data.tokenizer)
        if self.model.vocab_size == BYTE_VOCAB_SIZE and needed != BYTE_VOCAB_SIZE:
            object.__setattr__(self, "model", dataclasses.replace(self.model, vocab_size=needed))
        elif self.model.vocab_size < needed:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is smaller than the vocabulary of "
                             f"data.tokenizer={self.data.tokenizer!r} ({needed} ids); leave model.vocab_size at "
                             f"its default {BYTE_VOCAB_SIZE} to take the tokenizer's, or set it >= {needed}")


def _build(cls, section: str, values: Mapping[str, Any]):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{section}: unknown field(s) {unknown}; known: {sorted(fields)}")
    return cls(**values)


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Build a validated `RunConfig` from a nested plain dict or `ml_collections.ConfigDict`.

    The inverse of ``dataclasses.asdict(run_config)`` (what run_header.json holds). Unknown keys raise;
    a flat model key of the older config (``model.moe_top_k``) raises a ValueError naming its new path
    (``model.moe.top_k``) rather than being mapped (docs/config.md).
    """
    d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
    unknown = sorted(set(d) - {"model", "data", "train", "workdir", "seed"})
    if unknown:
        raise ValueError(f"config: unknown field(s) {unknown}")
    return RunConfig(
        model=model_config_from_dict(d.get("model", {})),
        data=_build(DataConfig, "data", d.get("data", {})),
        train=_build(TrainConfig, "train", d.get("train", {})),
        workdir=d.get("workdir", "runs/default"),
        seed=d.get("seed", 0),
    )
