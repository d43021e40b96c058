"""Training with a subword tokenizer (issue 28): bits per byte independent of the segmentation, the
model's vocabulary from the tokenizer, the chunked loss in the train step, the tokenizer recorded in
checkpoints and a resume with another one refused, the byte default unchanged."""
import json
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.data.corpus import load_tokenizer
from k3jax.data.pipeline import eval_batches
from k3jax.data.tokenizer import ByteTokenizer
from k3jax.ops.residuals import DepthForward
from k3jax.train.config import DataConfig, RunConfig, TrainConfig, run_config_from_dict
from k3jax.train.trainer import byte_lengths_table, evaluate, load_trained_model, train

SMALL_CORPUS = "text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
DOCS = ["def f(x):\n    return x + 1  # déjà vu\n", "import json\nprint(json.dumps({'a': 1}))\n",
        "class A:\n    pass\n\n\n🙂 中文\n"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def bpe(cache):
    return load_tokenizer("train-bpe:600", source=SMALL_CORPUS, cache_dir=cache)


class HandModel(nnx.Module):
    """A context-free model with a known loss per token: p(id) = exp(-NATS_PER_BYTE * bytes(id)) for every
    id that stands for text, p(EOS) = exp(-EOS_NATS), the rest of the mass on one unused padded id, so a
    target costs exactly NATS_PER_BYTE per UTF-8 byte it stands for (EOS_NATS for an EOS)."""
    NATS_PER_BYTE, EOS_NATS = 8.0, 5.0

    def __init__(self, byte_lengths, eos_id):
        lengths = np.asarray(byte_lengths, np.float64)
        logp = np.full(lengths.shape, -np.inf)
        logp[lengths > 0] = -self.NATS_PER_BYTE * lengths[lengths > 0]
        logp[eos_id] = -self.EOS_NATS
        sink = int(np.flatnonzero(np.isinf(logp))[-1])
        logp[sink] = np.log1p(-np.exp(logp[np.isfinite(logp)]).sum())
        self.log_probs = nnx.Variable(jnp.asarray(np.maximum(logp, -1e9), jnp.float32))

    def forward(self, inputs, *, segment_ids=None, positions=None, train=False):
        logits = jnp.broadcast_to(self.log_probs[...], (*inputs.shape, self.log_probs.shape[0]))
        return logits, {"moe": []}, DepthForward(hidden=logits, sublayer_inputs=(), depth_weights=())


def _evaluate_docs(tok, padded_vocab):
    stream = np.concatenate([tok.encode(d, add_bos=True, add_eos=True) for d in DOCS])
    lengths = np.zeros(padded_vocab, np.int32)
    lengths[:tok.vocab_size] = tok.token_byte_lengths()
    batches = eval_batches(stream, batch_size=1, seq_len=len(stream) - 1, max_batches=1, eos_id=tok.eos_id)
    return evaluate(HandModel(lengths, tok.eos_id), batches, lengths), len(stream)


def test_bits_per_byte_do_not_depend_on_the_segmentation(bpe):
    """The same documents as bytes (1 token per byte) and as BPE tokens: different nats per token, equal
    bits per byte = total nats / ln 2 / the text's UTF-8 bytes."""
    num_bytes = sum(len(d.encode("utf-8")) for d in DOCS)
    expected = (HandModel.NATS_PER_BYTE * num_bytes + HandModel.EOS_NATS * len(DOCS)) / (np.log(2) * num_bytes)
    by_bytes, n_bytes = _evaluate_docs(ByteTokenizer(), 640)
    by_bpe, n_bpe = _evaluate_docs(bpe, 640)
    assert n_bpe < 0.75 * n_bytes  # the BPE segments the text into fewer, longer tokens
    assert by_bpe["val_loss"] > 1.3 * by_bytes["val_loss"]  # so more nats per token
    np.testing.assert_allclose([by_bytes["val_bpb"], by_bpe["val_bpb"]], expected, rtol=1e-6)
    assert by_bpe["val_bytes_per_token"] > 1.3 * by_bytes["val_bytes_per_token"]
    # The byte default's formula (targets < 256 count one byte each) gives the same number.
    stream = np.concatenate([ByteTokenizer().encode(d, add_bos=True, add_eos=True) for d in DOCS])
    batches = eval_batches(stream, batch_size=1, seq_len=len(stream) - 1, max_batches=1)
    table = byte_lengths_table(RunConfig(), ByteTokenizer())
    assert evaluate(HandModel(table, 257), batches)["val_bpb"] == by_bytes["val_bpb"]


def test_chunked_loss_in_the_model_equals_the_plain_one():
    from k3jax.models.config import ModelConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.step import _forward_loss

    tokens = jax.random.randint(jax.random.key(0), (2, 25), 0, 700)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((2, 24), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(24), (2, 24)), "loss_mask": tokens[:, 1:] % 5 != 0}
    # A tied head (the head matrix is the embedding table transposed; the untied head runs in the BPE
    # training run below and in tests/k3jax/ops/test_cross_entropy.py).
    model = LanguageModel(ModelConfig(vocab_size=700, d_model=16, num_layers=1, num_heads=2, head_dim=8, d_ff=32,
                                      tie_embeddings=True), rngs=nnx.Rngs(0))

    @nnx.jit
    def both(m):  # one compile: the plain loss and the chunked one, each with its gradients
        return [nnx.value_and_grad(lambda m, c=c: _forward_loss(m, batch, True, c)[0])(m) for c in (0, 16)]

    (plain, g_plain), (chunked, g_chunked) = both(model)
    np.testing.assert_allclose(chunked, plain, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 nnx.to_pure_dict(g_chunked), nnx.to_pure_dict(g_plain))


def _cfg(workdir, cache, tokenizer, **train):
    return run_config_from_dict({
        "workdir": str(workdir), "seed": 0,
        "model": dict(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64),
        "data": dict(source=SMALL_CORPUS, seq_len=32, batch_size=4, cache_dir=str(cache), tokenizer=tokenizer),
        "train": dict(steps=2, warmup_steps=1, eval_every=2, eval_batches=1, checkpoint_every=2, sample_tokens=5,
                      sample_prompt="import ", **train),
    })


def test_bpe_run_records_its_tokenizer_and_refuses_another_on_resume(bpe, cache, tmp_path):
    cfg = _cfg(tmp_path / "run", cache, "train-bpe:600", loss_chunk_size=16)  # the chunked loss in the trainer
    assert cfg.model.vocab_size == 600  # from the tokenizer
    summary = train(cfg, show_progress=False)
    assert np.isfinite(summary["val_bpb"]) and summary["val_bytes_per_token"] > 1.5
    assert summary["sample"].startswith("import ")
    header = json.loads((tmp_path / "run" / "run_header.json").read_text())
    assert header["tokenizer"] == {"spec": "train-bpe:600", "identity": bpe.identity, "hash": bpe.hash,
                                   "path": bpe.path, "vocab_size": 600}
    assert header["config"]["model"]["vocab_size"] == 600 and header["loss_chunk_size"] == 16
    meta = json.loads(next((tmp_path / "run" / "checkpoints" / "2").rglob("meta/metadata")).read_text())
    assert meta["tokenizer"]["hash"] == bpe.hash
    # Resuming (or sampling) with another tokenizer is refused before any array is read.
    other = _cfg(tmp_path / "run", cache, "bytes")
    with pytest.raises(ValueError, match=r"written with tokenizer 'train-bpe:600:.*this run's data.tokenizer='bytes'"):
        train(other, show_progress=False)
    with pytest.raises(ValueError, match="another tokenizer|written with tokenizer"):
        load_trained_model(other, tokenizer=ByteTokenizer())
    _, step = load_trained_model(cfg, tokenizer=bpe)
    assert step == 2


def test_tokenizer_config_checks_and_vocabulary(bpe, tmp_path):
    assert DataConfig().tokenizer == "bytes" and TrainConfig().loss_chunk_size is None
    assert RunConfig().model.vocab_size == 259
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_str())
    assert RunConfig(data=DataConfig(tokenizer=f"bpe:{path}")).model.vocab_size == 600
    assert RunConfig(data=DataConfig(tokenizer="train-bpe:8192")).model.vocab_size == 8192
    from k3jax.models.config import ModelConfig
    assert RunConfig(model=ModelConfig(vocab_size=1024), data=DataConfig(tokenizer=f"bpe:{path}")).model.vocab_size == 1024
    with pytest.raises(ValueError, match=r"model.vocab_size=500 is smaller than the vocabulary of data.tokenizer"):
        RunConfig(model=ModelConfig(vocab_size=500), data=DataConfig(tokenizer=f"bpe:{path}"))
    for bad, message in [("wordpiece", "data.tokenizer must be"), ("train-bpe:10", "data.tokenizer 'train-bpe"),
                         (f"bpe:{tmp_path / 'nope.json'}", "data.tokenizer: tokenizer file not found")]:
        with pytest.raises(ValueError, match=message):
            run_config_from_dict({"data": {"tokenizer": bad}})
    (tmp_path / "t.bin").write_bytes(b"\1\0")
    with pytest.raises(ValueError, match="data.tokenizer 'train-bpe:512' trains on the corpus's text"):
        DataConfig(source=f"tokens:{tmp_path / 't.bin'}", tokenizer="train-bpe:512")
    with pytest.raises(ValueError, match="train.loss_chunk_size"):
        TrainConfig(loss_chunk_size=-1)


def test_the_byte_default_is_unchanged():
    """`make train`'s config: bytes, 259 ids, the plain loss, the byte eval formula."""
    from experiments.configs.k3_tiny import get_config
    from k3jax.train.trainer import loss_chunk_size
    cfg = run_config_from_dict(get_config())
    assert cfg.data.tokenizer == "bytes" and cfg.model.vocab_size == 259 and loss_chunk_size(cfg) == 0
    table = byte_lengths_table(cfg, ByteTokenizer())
    assert table.shape == (320,) and table[:256].tolist() == [1] * 256 and not table[256:].any()
