"""Tests for k3jax.data: tokenizer, corpora and their cache, packing, grain pipelines."""
import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from k3jax.data import corpus as corpus_lib
from k3jax.data import (
    EOS_ID,
    EXAMPLE_KEYS,
    ByteTokenizer,
    eval_batches,
    hash_split,
    iterator_restore_args,
    iterator_save_args,
    load_corpus,
    make_train_loader,
    pack_window,
    pack_windows,
    unigram_entropy_bits,
)

E = EOS_ID


# ------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize("text", ["", "hello, world\n", "déjà vu — naïve", "中文 テキスト", "🙂 x\x00y"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    data = text.encode("utf-8")
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [256, *data, 257])
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == data
    np.testing.assert_array_equal(tok.encode(text), list(data))


def test_tokenizer_special_ids_and_invalid_bytes():
    tok = ByteTokenizer()
    assert (tok.BOS, tok.EOS, tok.PAD, tok.vocab_size) == (256, 257, 258, 259)
    ids = np.array([[258, 104, 257], [105, 256, 258]])  # any shape, specials dropped
    assert tok.decode(ids) == "hi"
    # A multi-byte character cut in half decodes with U+FFFD instead of raising.
    assert tok.decode(tok.encode("é")[:1].tolist() + [97]) == "\ufffda"
    with pytest.raises(ValueError, match="ids"):
        tok.decode([1, 259])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")


# ------------------------------------------------------------------------------------------------
# Corpus: python-stdlib (built once per module; the real build reads ~30 MB)


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stdlib_cache")


@pytest.fixture(scope="module")
def stdlib_train(stdlib_cache):
    return load_corpus("python-stdlib", "train", cache_dir=stdlib_cache)


def _split_stream(paths):
    return b"".join(np.frombuffer(Path(p).read_bytes(), np.uint8).astype("<u2").tobytes()
                    + np.array([E], "<u2").tobytes() for p in paths)


def test_stdlib_corpus_manifest_and_split(stdlib_train, stdlib_cache):
    m = stdlib_train.manifest
    assert m["python_version"] == ".".join(map(str, sys.version_info[:3]))
    train, val = m["splits"]["train"], m["splits"]["validation"]
    n_docs = train["num_documents"] + val["num_documents"]
    assert n_docs + m["num_skipped"] == m["num_files"] > 500
    assert 0.002 < val["num_documents"] / n_docs < 0.03  # ~1% validation
    assert not any("site-packages" in p for p in m["validation_documents"] + m["skipped"])
    # Tokens: read-only uint16 memmap, one EOS per document, bytes + EOS count.
    tokens = stdlib_train.tokens
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert not tokens.flags.writeable
    assert tokens.shape == (train["num_tokens"],) == (train["num_bytes"] + train["num_documents"],)
    assert stdlib_train.num_documents == train["num_documents"] == int((tokens == E).sum())
    folder = stdlib_cache / m["key"]
    assert hashlib.sha256((folder / "train.bin").read_bytes()).hexdigest() == train["sha256"]
    # Validation = exactly the listed files (each hashed to validation), in sorted order.
    val_corpus = load_corpus("python-stdlib", "validation", cache_dir=stdlib_cache)
    assert all(hash_split(p) == "validation" for p in m["validation_documents"])
    assert m["validation_documents"] == sorted(m["validation_documents"])
    stdlib = Path(m["stdlib"])
    expected = _split_stream(stdlib / p for p in m["validation_documents"])
    assert val_corpus.tokens.tobytes() == expected
    assert val_corpus.num_documents == len(m["validation_documents"])
    # The train stream starts with the first train files in sorted relative-path order.
    rels = sorted(q.relative_to(stdlib).as_posix() for q in stdlib.rglob("*.py")
                  if not {"site-packages", "dist-packages", "__pycache__"} & set(q.parts))
    first = [r for r in rels if hash_split(r) == "train" and r not in m["skipped"]][:20]
    head = _split_stream(stdlib / r for r in first)
    assert tokens[:len(head) // 2].tobytes() == head


def test_stdlib_corpus_deterministic_and_cached(stdlib_train, stdlib_cache, tmp_path, monkeypatch):
    # Built again in another cache dir (through $K3JAX_CACHE): identical token files.
    monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "other"))
    again = load_corpus("python-stdlib", "train")
    assert (tmp_path / "other" / again.manifest["key"] / "manifest.json").is_file()
    for s in ("train", "validation"):
        assert again.manifest["splits"][s] == stdlib_train.manifest["splits"][s]
    # A second load reuses the cache: no build, same file.
    train_bin = stdlib_cache / stdlib_train.manifest["key"] / "train.bin"
    before = train_bin.stat()

    def no_build(*args, **kwargs):
        raise AssertionError("cache was rebuilt")

    monkeypatch.setattr(corpus_lib, "_write_build", no_build)
    reloaded = load_corpus("python-stdlib", "train", cache_dir=stdlib_cache)
    after = train_bin.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    np.testing.assert_array_equal(reloaded.tokens[:1000], stdlib_train.tokens[:1000])


# ------------------------------------------------------------------------------------------------
# Corpus: text:<glob>


def _make_tree(root: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        sub = root / f"d{i % 7}" / (f"e{i % 3}" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        words = rng.choice(["alpha", "beta", "γάμμα", "δ", "ε", "zeta\n"], size=int(rng.integers(1, 20)))
        (sub / f"f{i:04d}.txt").write_text(" ".join(words), encoding="utf-8")


def test_text_corpus_split_stream_and_skips(tmp_path):
    root = tmp_path / "tree"
    _make_tree(root, 400)
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8 \x80")
    (root / "ignored.md").write_text("not matched")
    cache = tmp_path / "cache"
    source = f"text:{root}/**/*.txt"
    train = load_corpus(source, "train", cache_dir=cache)
    val = load_corpus(source, "validation", cache_dir=cache)
    m = train.manifest
    assert m["num_files"] == 401 and m["num_skipped"] == 1 and m["skipped"] == ["bad.txt"]
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt") if p.name != "bad.txt")
    expect = {s: [r for r in rels if hash_split(r) == s] for s in ("train", "validation")}
    assert 0 < len(expect["validation"]) < 20
    assert m["validation_documents"] == expect["validation"]
    assert train.tokens.tobytes() == _split_stream(root / r for r in expect["train"])
    assert val.tokens.tobytes() == _split_stream(root / r for r in expect["validation"])
    assert (train.num_documents, val.num_documents) == (len(expect["train"]), len(expect["validation"]))
    # Deterministic: the same tree elsewhere gives the same token files.
    copy = tmp_path / "copy"
    _make_tree(copy, 400)
    (copy / "bad.txt").write_bytes(b"\xff\xfe not utf-8 \x80")
    other = load_corpus(f"text:{copy}/**/*.txt", "train", cache_dir=tmp_path / "cache2")
    assert other.manifest["splits"] == m["splits"]
    # Stable split: adding files moves no existing file; a changed tree gets a new cache entry.
    _make_tree(root / "more", 100, seed=1)
    grown = load_corpus(source, "train", cache_dir=cache).manifest
    assert grown["key"] != m["key"] and grown["num_files"] == 501
    kept = [r for r in grown["validation_documents"] if not r.startswith("more/")]
    assert kept == expect["validation"]


def test_text_corpus_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    root = tmp_path / "tree"
    _make_tree(root, 20)
    cache = tmp_path / "cache"
    real = corpus_lib._read_utf8_files

    def dying(base, relpaths):
        for i, doc in enumerate(real(base, relpaths)):
            if i == 5:
                raise KeyboardInterrupt("killed mid-build")
            yield doc

    monkeypatch.setattr(corpus_lib, "_read_utf8_files", dying)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(f"text:{root}/**/*.txt", "train", cache_dir=cache)
    assert [p for p in cache.iterdir() if not p.name.startswith(".tmp-")] == []
    monkeypatch.setattr(corpus_lib, "_read_utf8_files", real)
    # A stale temp folder of a killed process is ignored.
    (cache / ".tmp-text-stale").mkdir()
    (cache / ".tmp-text-stale" / "train.bin").write_bytes(b"\x00\x01")
    c = load_corpus(f"text:{root}/**/*.txt", "train", cache_dir=cache)
    assert c.manifest["splits"]["train"]["num_documents"] + c.manifest["splits"]["validation"][
        "num_documents"] == 20


# ------------------------------------------------------------------------------------------------
# Corpus: tokens:<path> and hf:<dataset>


def test_tokens_source_folder_and_single_file(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 258, 1000).astype("<u2")
    val = np.array([1, 2, E, 3, E], "<u2")
    (tmp_path / "ds").mkdir()
    train.tofile(tmp_path / "ds" / "train.bin")
    val.tofile(tmp_path / "ds" / "val.bin")
    c = load_corpus(f"tokens:{tmp_path / 'ds'}", "validation")
    np.testing.assert_array_equal(c.tokens, val)
    assert c.num_documents == 2 and not c.tokens.flags.writeable
    assert c.manifest["splits"]["validation"]["sha256"] == hashlib.sha256(val.tobytes()).hexdigest()
    np.testing.assert_array_equal(load_corpus(f"tokens:{tmp_path / 'ds'}", "train").tokens, train)
    # A single file: the last 1% is validation; no EOS is inserted.
    train.tofile(tmp_path / "all.bin")
    t = load_corpus(f"tokens:{tmp_path / 'all.bin'}", "train").tokens
    v = load_corpus(f"tokens:{tmp_path / 'all.bin'}", "validation").tokens
    np.testing.assert_array_equal(t, train[:990])
    np.testing.assert_array_equal(v, train[990:])
    # Ids must fit the byte vocabulary.
    np.array([1, 300], "<u2").tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(f"tokens:{tmp_path / 'big.bin'}", "train")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="odd byte size"):
        load_corpus(f"tokens:{tmp_path / 'odd.bin'}", "train")
    with pytest.raises(ValueError, match="source"):
        load_corpus(f"tokens:{tmp_path / 'missing'}", "train")


def test_hf_source_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"doc {i} ünïcode {'x' * (i % 13)}" for i in range(300)]
    # A DatasetDict with its own train/validation splits: used as given.
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": texts[:250], "n": list(range(250))}),
        "validation": datasets.Dataset.from_dict({"body": texts[250:], "n": list(range(50))}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    cache = tmp_path / "cache"
    v = load_corpus(f"hf:{tmp_path / 'dd'}:body", "validation", cache_dir=cache)
    assert v.tokens.tobytes() == b"".join(
        np.frombuffer(t.encode(), np.uint8).astype("<u2").tobytes() + np.array([E], "<u2").tobytes()
        for t in texts[250:])
    assert v.num_documents == 50
    with pytest.raises(ValueError, match="text_field"):
        load_corpus(f"hf:{tmp_path / 'dd'}:missing", "train", cache_dir=cache)
    # A plain Dataset: hash split on the document text.
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "plain"))
    m = load_corpus(f"hf:{tmp_path / 'plain'}", "train", cache_dir=cache).manifest
    n_val = sum(hash_split(t) == "validation" for t in texts)
    assert m["splits"]["validation"]["num_documents"] == n_val
    assert m["splits"]["train"]["num_documents"] == 300 - n_val


def test_hf_source_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"k3jax\[hf\]"):
        load_corpus("hf:some/dataset", "train")


def test_bad_corpus_arguments(tmp_path):
    with pytest.raises(ValueError, match="split"):
        load_corpus("python-stdlib", "test", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="source"):
        load_corpus("wikipedia", "train", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="source"):
        load_corpus(f"text:{tmp_path}/nothing/*.txt", "train", cache_dir=tmp_path)


def test_unigram_entropy_bits():
    assert unigram_entropy_bits(np.array([0, 1, 2, 3] * 5 + [E, 256, 258], np.uint16)) == 2.0
    expected = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert abs(unigram_entropy_bits(np.array([7, 7, 9, E])) - expected) < 1e-12
    with pytest.raises(ValueError, match="tokens"):
        unigram_entropy_bits(np.array([E, E]))


# ------------------------------------------------------------------------------------------------
# Packing


def test_pack_window_handmade():
    a, b, c, d, e, f = 97, 98, 99, 100, 101, 102
    out = pack_window(np.array([a, b, E, c, d, E, e, f, E], np.uint16))
    np.testing.assert_array_equal(out["inputs"], [a, b, E, c, d, E, e, f])
    np.testing.assert_array_equal(out["targets"], [b, E, c, d, E, e, f, E])
    np.testing.assert_array_equal(out["segment_ids"], [1, 1, 1, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(out["positions"], [0, 1, 2, 0, 1, 2, 0, 1])
    np.testing.assert_array_equal(out["loss_mask"], [1, 1, 0, 1, 1, 0, 1, 1])
    assert [out[k].dtype for k in EXAMPLE_KEYS] == [np.int32] * 4 + [np.bool_]
    # Leading EOS, consecutive EOS (an empty document), no EOS at all.
    out = pack_window(np.array([E, a, E, E, b, c]))
    np.testing.assert_array_equal(out["segment_ids"], [1, 2, 2, 3, 4])
    np.testing.assert_array_equal(out["positions"], [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(out["loss_mask"], [0, 1, 0, 0, 1])
    out = pack_window(np.array([a, b, c]))
    np.testing.assert_array_equal(out["segment_ids"], [1, 1])
    np.testing.assert_array_equal(out["positions"], [0, 1])
    with pytest.raises(ValueError, match="window"):
        pack_window(np.array([a]))
    with pytest.raises(ValueError, match="windows"):
        pack_windows(np.zeros((2, 3, 4), np.int32))


def test_pack_windows_matches_per_token_reference():
    rng = np.random.default_rng(0)
    windows = np.where(rng.random((6, 33)) < 0.15, E, rng.integers(0, 256, (6, 33)))
    batched = pack_windows(windows)
    for row, w in enumerate(windows):
        seg, pos = 1, 0
        for t in range(32):
            if t > 0 and w[t - 1] == E:
                seg, pos = seg + 1, 0
            assert batched["segment_ids"][row, t] == seg and batched["positions"][row, t] == pos
            assert batched["loss_mask"][row, t] == (w[t] != E)
            pos += 1
        single = pack_window(w)
        for k in EXAMPLE_KEYS:
            np.testing.assert_array_equal(single[k], batched[k][row])


# ------------------------------------------------------------------------------------------------
# Pipeline


def _stream(n=2000):
    return np.arange(n, dtype=np.uint16)  # token value = stream position: windows are identifiable


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        for k in EXAMPLE_KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def test_train_loader_epochs_cover_every_window_once():
    tokens, seq_len, batch = _stream(), 16, 4
    n = (len(tokens) - 1) // seq_len  # 124 windows = 31 batches per epoch
    it = make_train_loader(tokens, batch_size=batch, seq_len=seq_len, seed=7)
    batches = _take(it, 2 * n // batch)
    for b in batches:
        assert all(b[k].shape == (batch, seq_len) for k in EXAMPLE_KEYS)
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    starts = np.concatenate([b["inputs"][:, 0] for b in batches]) // seq_len
    epoch1, epoch2 = starts[:n], starts[n:]
    assert sorted(epoch1) == sorted(epoch2) == list(range(n))
    assert not np.array_equal(epoch1, epoch2) and not np.array_equal(epoch1, np.arange(n))
    again = make_train_loader(tokens, batch_size=batch, seq_len=seq_len, seed=7)
    _assert_same_batches(_take(again, 5), batches[:5])
    other = make_train_loader(tokens, batch_size=batch, seq_len=seq_len, seed=8)
    assert not np.array_equal(next(other)["inputs"], batches[0]["inputs"])
    finite = make_train_loader(tokens, batch_size=batch, seq_len=seq_len, seed=7, num_epochs=1)
    assert len(list(finite)) == n // batch


def test_train_loader_state_resume():
    tokens = _stream()
    kwargs = dict(batch_size=3, seq_len=8, seed=1)
    it = make_train_loader(tokens, **kwargs)
    _take(it, 90)  # crosses an epoch boundary (249 windows = 83 batches)
    state = it.get_state()
    expected = _take(it, 100)
    resumed = make_train_loader(tokens, **kwargs)
    resumed.set_state(state)
    _assert_same_batches(_take(resumed, 100), expected)


def test_train_loader_orbax_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tokens = _stream()
    kwargs = dict(batch_size=2, seq_len=16, seed=3)
    it = make_train_loader(tokens, **kwargs)
    _take(it, 11)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(11, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.arange(4.0)}),
            data=iterator_save_args(it)))
        mngr.wait_until_finished()
    expected = _take(it, 20)
    fresh = make_train_loader(tokens, **kwargs)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == 11
        restored = mngr.restore(11, args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"w": np.zeros(4)}),
            data=iterator_restore_args(fresh)))
    np.testing.assert_array_equal(restored["state"]["w"], np.arange(4.0))
    _assert_same_batches(_take(restored["data"], 20), expected)


def test_eval_batches_fixed_sequential_slice():
    tokens, seq_len = _stream(1000), 10
    batches = eval_batches(tokens, batch_size=4, seq_len=seq_len, max_batches=3)
    assert len(batches) == 3
    starts = np.concatenate([b["inputs"][:, 0] for b in batches])
    np.testing.assert_array_equal(starts, np.arange(12) * seq_len)
    _assert_same_batches(batches, eval_batches(tokens, batch_size=4, seq_len=seq_len, max_batches=3))
    # Limited by the stream: 99 windows -> 24 full batches.
    assert len(eval_batches(tokens, batch_size=4, seq_len=seq_len, max_batches=100)) == 24
    # Fewer windows than batch_size: one smaller batch of all of them.
    (small,) = eval_batches(tokens[:31], batch_size=8, seq_len=seq_len, max_batches=2)
    assert small["inputs"].shape == (3, seq_len)


def test_pipeline_bad_arguments():
    tokens = _stream(100)
    with pytest.raises(ValueError, match="seq_len"):
        make_train_loader(tokens, batch_size=2, seq_len=100, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        eval_batches(tokens, batch_size=2, seq_len=100, max_batches=1)
    with pytest.raises(ValueError, match="seq_len"):
        make_train_loader(tokens, batch_size=2, seq_len=0, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        make_train_loader(tokens, batch_size=0, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="seed"):
        make_train_loader(tokens, batch_size=2, seq_len=8, seed=-1)
    with pytest.raises(ValueError, match="num_epochs"):
        make_train_loader(tokens, batch_size=2, seq_len=8, seed=0, num_epochs=0)
    with pytest.raises(ValueError, match="max_batches"):
        eval_batches(tokens, batch_size=2, seq_len=8, max_batches=0)
