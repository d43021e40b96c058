"""Subword tokenizers next to bytes (issue 28): BPE training is deterministic and cached, encode/decode
round trips, per-(corpus, tokenizer) caches with uint16/uint32 ids, `tokens:` streams with a declared
vocabulary, the tokenizer's EOS through packing, clear errors for a missing file or a bad spec."""
import os
import sysconfig

import numpy as np
import pytest

from k3jax.data import corpus as corpus_lib
from k3jax.data import (
    EOS_ID,
    ByteTokenizer,
    eval_batches,
    load_corpus,
    load_tokenizer,
    make_train_loader,
    parse_tokenizer_spec,
    spec_vocab_size,
    unigram_entropy_bits,
)
from k3jax.data.tokenizer import load_bpe_file, train_bpe

# ~80 KB of Python in a handful of files: trains a 400-id BPE in well under a second.
SMALL_CORPUS = "text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
TEXTS = ["", "hello, world\n", "déjà vu — naïve", "中文 テキスト", "🙂 x\x00y", "def f(x):\n    return x  # ok\n"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tok_cache")


@pytest.fixture(scope="module")
def bpe(cache):
    return load_tokenizer("train-bpe:400", source=SMALL_CORPUS, cache_dir=cache)


def test_bpe_training_is_deterministic_and_cached(bpe, cache, tmp_path, monkeypatch):
    assert bpe.vocab_size == 400 and (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    assert bpe.identity.startswith("train-bpe:400:text-")
    folder = cache / f"{bpe.identity.split(':', 2)[2]}-bpe400"
    manifest = corpus_lib._read_manifest(folder)
    assert manifest["hash"] == bpe.hash and manifest["vocab_size"] == 400 and bpe.path == str(folder / "tokenizer.json")
    # Trained again from scratch (another cache, one thread): the same tokenizer.json, byte for byte.
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    again = load_tokenizer("train-bpe:400", source=SMALL_CORPUS, cache_dir=tmp_path)
    assert again.hash == bpe.hash and again.to_str() == bpe.to_str()
    docs = list(corpus_lib._byte_documents(corpus_lib._byte_cache(tmp_path, SMALL_CORPUS), "train"))
    assert train_bpe(docs, 400, identity="x").hash == bpe.hash
    # A later load reads the cache and trains nothing.
    monkeypatch.setattr(corpus_lib, "train_bpe", lambda *a, **k: pytest.fail("retrained a cached BPE"))
    assert load_tokenizer("train-bpe:400", source=SMALL_CORPUS, cache_dir=cache).hash == bpe.hash


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip_and_byte_lengths(bpe, text):
    ids = bpe.encode(text, add_bos=True, add_eos=True)
    assert ids.dtype == np.int32 and ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
    assert bpe.decode(ids) == text == bpe.decode(bpe.encode(text))
    # The UTF-8 bytes each id stands for add up to the text's (the bits-per-byte denominator), even where
    # a token holds part of a character; special ids stand for none.
    assert int(bpe.token_byte_lengths()[ids].sum()) == len(text.encode("utf-8"))
    byte = ByteTokenizer()
    assert int(byte.token_byte_lengths()[byte.encode(text, add_eos=True)].sum()) == len(text.encode("utf-8"))


def test_bpe_merges_and_saved_file_loads_with_bpe_spec(bpe, tmp_path):
    text = "import json\nfrom json import decoder\n"
    assert len(bpe.encode(text)) < len(text.encode("utf-8")) / 1.5  # it learned merges
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_str(), encoding="utf-8")
    loaded = load_tokenizer(f"bpe:{path}")
    assert loaded.hash == bpe.hash and loaded.identity == f"bpe:{path.resolve()}" and loaded.path == str(path.resolve())
    np.testing.assert_array_equal(loaded.encode(text), bpe.encode(text))
    assert spec_vocab_size(f"bpe:{path}") == 400 and spec_vocab_size("train-bpe:512") == 512
    assert spec_vocab_size("bytes") == 259
    with pytest.raises(ValueError, match="ids"):
        bpe.decode([400])


def test_tokenizer_spec_errors_name_the_field(tmp_path):
    assert parse_tokenizer_spec("bytes") == ("bytes", None)
    assert parse_tokenizer_spec("train-bpe:8192") == ("train-bpe", 8192)
    for bad in ("byte", "bpe:", "train-bpe:", "train-bpe:100", "train-bpe:8k", "gpt2"):
        with pytest.raises(ValueError, match="data.tokenizer"):
            parse_tokenizer_spec(bad)
    with pytest.raises(ValueError, match="data.tokenizer: tokenizer file not found"):
        load_tokenizer(f"bpe:{tmp_path / 'missing' / 'tokenizer.json'}")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        load_bpe_file(tmp_path / "junk.json")
    (tmp_path / "t.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer("train-bpe:512", source=f"tokens:{tmp_path / 't.bin'}")


def test_tokenized_corpus_cache(bpe, cache):
    byte_train = load_corpus(SMALL_CORPUS, "train", cache_dir=cache)
    train = load_corpus(SMALL_CORPUS, "train", cache_dir=cache, tokenizer=bpe)
    val = load_corpus(SMALL_CORPUS, "validation", cache_dir=cache, tokenizer=bpe)
    m = train.manifest
    assert m["key"] == f"{byte_train.manifest['key']}-tok-{bpe.hash}" and (cache / m["key"] / "train.bin").is_file()
    assert (m["tokenizer"], m["tokenizer_hash"], m["vocab_size"], m["eos_id"], m["dtype"]) == (
        bpe.identity, bpe.hash, 400, 1, "<u2")
    assert train.tokens.dtype == np.uint16 and not train.tokens.flags.writeable
    # The same documents, one EOS each, in the same order; fewer tokens than bytes.
    assert train.num_documents == byte_train.num_documents == int((np.asarray(train.tokens) == 1).sum())
    assert bpe.decode(train.tokens) == ByteTokenizer().decode(byte_train.tokens)
    assert train.num_tokens < 0.6 * byte_train.num_tokens
    assert val.num_documents == val.manifest["splits"]["validation"]["num_documents"]
    # The byte cache keeps the manifest every cache has had ("byte"), so existing caches read as before.
    assert byte_train.manifest["tokenizer"] == "byte"
    assert corpus_lib.token_dtype(65536) == np.uint16 and corpus_lib.token_dtype(65537) == np.uint32


def test_tokens_source_with_a_declared_vocabulary(tmp_path):
    ids = np.array([5, 1000, 7, EOS_ID, 3, 1023, EOS_ID], "<u2")
    (tmp_path / "ds").mkdir()
    ids.tofile(tmp_path / "ds" / "train.bin")
    ids.tofile(tmp_path / "ds" / "val.bin")
    source = f"tokens:{tmp_path / 'ds'}"
    with pytest.raises(ValueError, match="vocab_size 259"):
        load_corpus(source, "train")
    c = load_corpus(source, "train", vocab_size=1024)
    np.testing.assert_array_equal(c.tokens, ids)
    assert c.manifest["tokenizer"] == "byte" and c.manifest["vocab_size"] == 1024 and c.num_documents == 2
    with pytest.raises(ValueError, match="vocab_size 1000"):
        load_corpus(source, "train", vocab_size=1000)
    # Above 65536 ids the file holds uint32.
    big = np.array([70000, EOS_ID, 1, 69999], "<u4")
    big.tofile(tmp_path / "big.bin")
    c = load_corpus(f"tokens:{tmp_path / 'big.bin'}", "train", vocab_size=70001)
    assert c.tokens.dtype == np.uint32 and c.manifest["dtype"] == "<u4"
    np.testing.assert_array_equal(c.tokens, big[:4 - 4 // 100])
    with pytest.raises(ValueError, match="tokens: sources only"):
        load_corpus(SMALL_CORPUS, "train", vocab_size=1024, cache_dir=tmp_path)


def test_packing_uses_the_tokenizer_eos():
    # Id 257 is an ordinary token here; id 1 ends documents.
    stream = np.array([9, 257, 1, 4, 5, 1, 6, 257, 1], np.uint16)
    batch = eval_batches(stream, batch_size=1, seq_len=8, max_batches=1, eos_id=1)[0]
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(batch["loss_mask"][0], [1, 1, 0, 1, 1, 0, 1, 1])
    train = next(make_train_loader(stream, batch_size=1, seq_len=8, seed=0, eos_id=1))
    for k in batch:
        np.testing.assert_array_equal(train[k], batch[k])


def test_unigram_entropy_per_byte_of_another_tokenizer(bpe):
    byte = ByteTokenizer()
    stream = byte.encode("abracadabra", add_eos=True)
    assert unigram_entropy_bits(stream, byte.token_byte_lengths()) == pytest.approx(unigram_entropy_bits(stream))
    # Two tokens of 2 bytes, equally frequent: 1 bit per token = 0.5 bits per byte (EOS not counted).
    lengths = np.array([0, 2, 2])
    assert unigram_entropy_bits(np.array([1, 2, 1, 2, 0]), lengths) == pytest.approx(0.5)
