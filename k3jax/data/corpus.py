"""Corpora as one flat stream of byte-tokenizer ids, cached as uint16 memmaps.

`load_corpus(source, split)` returns a `Corpus` whose `tokens` is a read-only uint16 memmap of
token ids (`k3jax.data.tokenizer`: bytes 0..255, EOS = 257). Sources:

`python-stdlib` (the default)
    Every `.py` file under the running interpreter's standard library
    (`sysconfig.get_paths()["stdlib"]`), excluding `site-packages`/`dist-packages` and
    `__pycache__`, read in sorted relative-path order (POSIX separators). One document per file,
    its raw bytes followed by EOS. Files that are not valid UTF-8 (the stdlib ships a few encoding
    test files) are skipped and listed in the manifest.

`text:<glob>`
    UTF-8 files matching `<glob>` (`~` expanded, `**` recursive). The document key used for the
    split is the path relative to the glob's root (the leading path components without wildcards),
    so moving the tree does not move files between splits. Non-UTF-8 files are skipped and listed.

`tokens:<path>`
    A pre-tokenised stream in the nanoGPT convention (flat little-endian uint16 ids, no header).
    `<path>` is either a folder holding `train.bin` and `val.bin`, or a single `.bin` file whose
    first `n - n // 100` tokens are train and last `n // 100` tokens are validation. The stream is
    used as-is: no EOS is inserted, `num_documents` is the number of EOS ids in the split, and every
    id must be < the vocabulary: `vocab_size=` when declared, else the tokenizer's (bytes: 259). A
    declared vocabulary above 65536 reads the file as uint32. Nothing is cached; the file is memory-mapped in place.
    A k3jax cache folder is itself a valid `tokens:` folder.

`hf:<dataset>[:<text_field>]`
    A Hugging Face `datasets` dataset (optional dependency: `pip install k3jax[hf]`). `<dataset>` is
    a folder written by `Dataset.save_to_disk`/`DatasetDict.save_to_disk` (read with
    `datasets.load_from_disk`) or else a hub name (read with `datasets.load_dataset`, which needs
    the network or a warm HF cache). `<text_field>` defaults to `"text"`. If the dataset has both
    `"train"` and `"validation"` splits they are used; otherwise the `"train"` split (or the only
    split, or a plain `Dataset`) is hash-split with the document key = the text itself (so
    duplicate documents always land in the same split). Rows whose field is not a string are
    skipped and counted.

Split rule (all sources except `tokens:` and hf datasets with their own validation split): a
document goes to validation iff `int.from_bytes(sha1(key)[:8], "big") % 100 == 0` (`hash_split`),
about 1% of documents, independent of every other document. A corpus with fewer than ~100
documents may therefore have an empty validation split (its `tokens` is then a length-0 array).

Cache: `$K3JAX_CACHE` (default `~/.cache/k3jax`), or `cache_dir=`. One folder per corpus key
(`python-stdlib-<implementation>-<python version>-<hash of the stdlib path>-f<format>`,
`text-<hash of the resolved file list, sizes and mtimes>-f<format>`, `hf-<name>-<hash of name,
field and dataset fingerprints>-f<format>`) holding `train.bin`, `val.bin` and `manifest.json`.
Other tokenizers (`tokenizer=` of `load_corpus`, `load_tokenizer`): the byte cache is built first, and
its documents (the byte stream cut at EOS) are encoded into `<byte key>-tok-<tokenizer hash>` (same files
and manifest, ids uint16 when the vocabulary has <= 65536 ids, else uint32, the manifest's "dtype"); a
trained BPE lives in `<byte key>-bpe<vocab size>` (tokenizer.json + manifest.json: corpus, key, train
split sha256, vocab size, hash). A build is written to a temporary folder next to it and moved into place with `os.replace`, so
a killed build never leaves a half-written cache (only a `.tmp-*` folder that is never read and
may be deleted); a later load reuses the folder without reading the sources.
"""
from __future__ import annotations

import dataclasses
import glob as glob_lib
import hashlib
import itertools
import json
import os
import platform
import shutil
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from k3jax.data.tokenizer import (EOS_ID, VOCAB_SIZE, ByteTokenizer, HFTokenizer, Tokenizer,
                                  load_bpe_file, parse_tokenizer_spec, train_bpe)

SPLITS = ("train", "validation")
SPLIT_FILES = {"train": "train.bin", "validation": "val.bin"}
VALIDATION_MODULUS = 100
FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")
_CHUNK = 1 << 22  # tokens per chunk for streaming scans (8 MiB of uint16)
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_MAX_LISTED = 1000  # longest document list kept in a manifest


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One split of a corpus.

    Attributes:
      source: the source string given to `load_corpus`.
      split: "train" or "validation".
      tokens: read-only uint16 array [num_tokens] of token ids (a `np.memmap`, or a length-0
        array when the split is empty): each document's bytes followed by EOS (257), except for
        `tokens:` sources, which are used as stored.
      manifest: the corpus manifest (for cached sources the parsed `manifest.json`); see
        `load_corpus`.
      num_documents: documents in this split (for `tokens:` sources: the number of EOS ids).
    """

    source: str
    split: str
    tokens: np.ndarray
    manifest: dict[str, Any]
    num_documents: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def default_cache_dir() -> Path:
    """`$K3JAX_CACHE` if set and non-empty, else `~/.cache/k3jax` (read at call time)."""
    env = os.environ.get("K3JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "k3jax"


def hash_split(key: str) -> str:
    """The split of the document with `key`: "validation" iff sha1(key)[:8] (big-endian) % 100 == 0.

    Stable across machines, Python versions and runs (unlike `hash()`), and independent of every
    other document, so adding or removing files never moves another file between splits.
    """
    digest = hashlib.sha1(key.encode("utf-8", errors="surrogateescape")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") % VALIDATION_MODULUS == 0 else "train"


def unigram_entropy_bits(tokens, byte_lengths=None) -> float:
    """Unigram entropy of `tokens`, in bits per byte.

    Bytes (`byte_lengths=None`): H = -sum_b p(b) log2 p(b) over byte ids b < 256, with p the empirical
    frequency among byte ids only (EOS/BOS/PAD are not counted). This is the cross-entropy a model that
    ignores context could reach on this stream, the baseline a language model's bits-per-byte must beat.

    Another tokenizer (`byte_lengths` = its `token_byte_lengths()`): the same over the ids that stand for
    text (byte length > 0), H_token bits per token divided by the mean byte length of those tokens: the
    bits per byte of a context-free model over that tokenizer's tokens.

    Args:
      tokens: integer array-like [N] (e.g. `Corpus.tokens`); scanned in chunks, memmap-friendly.
      byte_lengths: None (byte ids) or int [vocab]: UTF-8 bytes each id stands for.

    Raises:
      ValueError: `tokens` is not a 1-D integer array, or holds no byte ids (no id of byte length > 0).
    """
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got {arr.shape=} {arr.dtype=}")
    if byte_lengths is not None:
        lengths = np.asarray(byte_lengths, np.int64)
        counts = np.zeros(lengths.shape[0], np.int64)
        for start in range(0, arr.shape[0], _CHUNK):
            chunk = np.asarray(arr[start:start + _CHUNK]).astype(np.int64)
            counts += np.bincount(chunk[(chunk >= 0) & (chunk < counts.shape[0])], minlength=counts.shape[0])
        counts = np.where(lengths > 0, counts, 0)
        total = int(counts.sum())
        if total == 0:
            raise ValueError(f"tokens holds no ids that stand for text; {arr.shape=}")
        p = counts[counts > 0] / total
        return float(-(p * np.log2(p)).sum()) * total / float((counts * lengths).sum())
    counts = np.zeros(256, np.int64)
    for start in range(0, arr.shape[0], _CHUNK):
        chunk = np.asarray(arr[start:start + _CHUNK])
        chunk = chunk[(chunk >= 0) & (chunk < 256)]
        counts += np.bincount(chunk.astype(np.int64), minlength=256)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"tokens holds no byte ids (< 256); {arr.shape=}")
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def check_source(source: str) -> None:
    """Cheap check that `source` names something that exists, without reading or caching it.

    `text:<glob>` must match at least one file (stops at the first match); `tokens:<path>` must be a
    folder holding train.bin and val.bin or a `.bin` file; `hf:<dataset>[:<text_field>]` must have
    both parts non-empty (a hub name cannot be checked offline); `python-stdlib` always exists.
    `DataConfig` calls it when built, so a bad source fails there, not at the first corpus load.

    Raises:
      ValueError: the message names `source` and says what is missing.
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty str, got {source=}")
    if source == "python-stdlib":
        return
    if source.startswith("text:"):
        pattern = os.path.expanduser(source[len("text:"):])
        if not pattern:
            raise ValueError(f"source 'text:<glob>' needs a glob, got {source=}")
        if not any(os.path.isfile(p) for p in glob_lib.iglob(pattern, recursive=True)):
            raise ValueError(f"source matches no files: {source=}")
    elif source.startswith("tokens:"):
        path = Path(source[len("tokens:"):]).expanduser()
        if path.is_dir():
            missing = [str(path / f) for f in ("train.bin", "val.bin") if not (path / f).is_file()]
            if missing:
                raise ValueError(f"source folder lacks {missing}: {source=}")
        elif not (path.is_file() and path.suffix == ".bin"):
            raise ValueError(f"source must name a folder with train.bin/val.bin or a .bin file: {source=}")
    elif source.startswith("hf:"):
        spec = source[len("hf:"):]
        name, text_field = (spec.rsplit(":", 1) if ":" in spec else (spec, "text"))
        if not name or not text_field:
            raise ValueError(f"source must be 'hf:<dataset>[:<text_field>]', got {source=}")
    else:
        raise ValueError("source must be 'python-stdlib', 'text:<glob>', 'tokens:<path>' or "
                         f"'hf:<dataset>[:<text_field>]', got {source=}")


def load_corpus(source: str = "python-stdlib", split: str = "train", *,
                cache_dir: str | os.PathLike | None = None, tokenizer: Tokenizer | None = None,
                vocab_size: int | None = None) -> Corpus:
    """Loads one split of a corpus, building and caching it on first use.

    Args:
      source: "python-stdlib", "text:<glob>", "tokens:<path>" or "hf:<dataset>[:<text_field>]"
        (see the module docstring).
      split: "train" or "validation".
      cache_dir: cache root; default `default_cache_dir()`. Unused by `tokens:`.
      tokenizer: a `Tokenizer` (default `ByteTokenizer()`); a non-byte one encodes the byte cache's
        documents into its own cache folder (module docstring). `tokens:` streams are not re-encoded:
        the tokenizer gives their EOS id and, unless `vocab_size` is declared, their vocabulary.
      vocab_size: declared vocabulary of a `tokens:` stream (ids checked < it; > 65536 = uint32
        file); None = the tokenizer's. Only for `tokens:` sources.

    Returns:
      A `Corpus`. Its manifest for cached sources holds: format, source, key, tokenizer
      ("byte"), vocab_size, eos_id, dtype ("<u2"), split_rule, and per split (`splits[name]`)
      file, num_documents, num_bytes (document bytes), num_tokens (bytes + one EOS per
      document), sha256 (of the split's token file); plus skipped documents (`num_skipped`,
      `skipped`) and the validation document keys (`validation_documents`, at most 1000 listed).
      python-stdlib adds python_version, python_implementation and stdlib path.

    Raises:
      ValueError: unknown `source` form, a source that matches nothing or is malformed (message
        names `source`), a bad `split`, an hf `text_field` that is not a column, `vocab_size` given
        for a source other than `tokens:`, or token ids outside the vocabulary.
      ImportError: an `hf:` source without the `datasets` library.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split=}")
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty str, got {source=}")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if source.startswith("tokens:"):
        return _load_token_file(source, split, tokenizer, vocab_size)
    if vocab_size is not None:
        raise ValueError(f"vocab_size is declared for tokens: sources only, got {vocab_size=} for {source=}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = _byte_cache(root, source)
    if tokenizer.identity != "bytes":
        folder = _tokenized_cache(root, folder, tokenizer)
    return _open_cached(folder, source, split)


def _byte_cache(root: Path, source: str) -> Path:
    if source == "python-stdlib":
        return _cached(root, *_stdlib_plan(source))
    if source.startswith("text:"):
        return _cached(root, *_text_plan(source))
    if source.startswith("hf:"):
        return _cached(root, *_hf_plan(source))
    raise ValueError(
        "source must be 'python-stdlib', 'text:<glob>', 'tokens:<path>' or "
        f"'hf:<dataset>[:<text_field>]', got {source=}")


def manifest_tokenizer_name(tokenizer: Tokenizer) -> str:
    """The manifests' "tokenizer" value: "byte" for the byte tokenizer (what every byte cache has recorded
    since format 1, so existing caches and `tokens:` manifests read as before), else its identity."""
    return "byte" if tokenizer.identity == ByteTokenizer.identity else tokenizer.identity


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 ids when `vocab_size` <= 65536, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _byte_documents(folder: Path, split: str) -> Iterator[str]:
    """The documents of a byte cache split, in stream order, as text (the stream cut after each EOS)."""
    corpus = _open_cached(folder, "", split)
    tokens = np.asarray(corpus.tokens)
    ends = np.flatnonzero(tokens == EOS_ID)
    start = 0
    for end in ends:
        yield tokens[start:end].astype(np.uint8).tobytes().decode("utf-8")
        start = int(end) + 1


def load_tokenizer(spec: str = "bytes", *, source: str = "python-stdlib",
                   cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer named by a `data.tokenizer` string.

    "bytes": `ByteTokenizer()`. "bpe:<path>": that tokenizer.json, read locally. "train-bpe:<V>": a
    byte-level BPE of at most V ids trained (`k3jax.data.tokenizer.train_bpe`) on the train split of
    `source` (its byte cache, documents in stream order), cached in `<byte key>-bpe<V>` with a manifest
    and reused by later calls; identity "train-bpe:<V>:<byte key>". Not available for `tokens:`
    sources (their text is unknown).

    Raises:
      ValueError: a malformed spec, a missing tokenizer file, or train-bpe on a `tokens:` source (the
        message names data.tokenizer).
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        return load_bpe_file(arg)
    if source.startswith("tokens:"):
        raise ValueError(f"data.tokenizer {spec!r} trains on text; a tokens: source has none ({source=})")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    byte_folder = _byte_cache(root, source)
    byte_manifest = _read_manifest(byte_folder)
    key = f"{byte_folder.name}-bpe{arg}"
    folder = root / key
    identity = f"train-bpe:{arg}:{byte_folder.name}"
    manifest = _read_manifest(folder)
    if manifest is not None and (folder / "tokenizer.json").is_file():
        tok = HFTokenizer((folder / "tokenizer.json").read_text(encoding="utf-8"), identity=identity,
                          path=str(folder / "tokenizer.json"))
        if tok.hash == manifest.get("hash"):
            return tok
    import tokenizers  # pylint: disable=import-outside-toplevel
    tok = train_bpe(_byte_documents(byte_folder, "train"), arg, identity=identity)

    def write(tmp: Path) -> None:
        (tmp / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps({
            "format": FORMAT_VERSION, "corpus": source, "corpus_key": byte_folder.name,
            "corpus_train_sha256": byte_manifest["splits"]["train"]["sha256"],
            "requested_vocab_size": arg, "vocab_size": tok.vocab_size, "identity": identity,
            "hash": tok.hash, "tokenizers_version": tokenizers.__version__,
            "special_tokens": ["<|bos|>", "<|eos|>", "<|pad|>"]}, indent=1, sort_keys=True))
    _build_atomically(root, key, write, complete=lambda f: _read_manifest(f) is not None)
    tok.path = str(folder / "tokenizer.json")
    return tok


def _tokenized_cache(root: Path, byte_folder: Path, tokenizer: Tokenizer) -> Path:
    """`<byte key>-tok-<hash>`: the byte cache's documents encoded with `tokenizer`, each + EOS."""
    key = f"{byte_folder.name}-tok-{tokenizer.hash}"
    if _cache_complete(root / key):
        return root / key
    byte_manifest = _read_manifest(byte_folder)
    dtype = token_dtype(tokenizer.vocab_size)

    def write(tmp: Path) -> None:
        splits = {}
        for s in SPLITS:
            hasher, n_tokens = hashlib.sha256(), 0
            with open(tmp / SPLIT_FILES[s], "wb") as f:
                docs = _byte_documents(byte_folder, s)
                while batch := list(itertools.islice(docs, 256)):
                    encoded = (tokenizer.encode_batch(batch) if hasattr(tokenizer, "encode_batch")
                               else [tokenizer.encode(d).tolist() for d in batch])
                    for ids in encoded:
                        buf = np.asarray(list(ids) + [tokenizer.eos_id], dtype).tobytes()
                        f.write(buf)
                        hasher.update(buf)
                        n_tokens += len(ids) + 1
            splits[s] = {**byte_manifest["splits"][s], "num_tokens": n_tokens, "sha256": hasher.hexdigest()}
        manifest = {**byte_manifest, "key": key, "byte_key": byte_folder.name,
                    "tokenizer": manifest_tokenizer_name(tokenizer), "tokenizer_hash": tokenizer.hash,
                    "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "dtype": dtype.str,
                    "splits": splits}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return _build_atomically(root, key, write, complete=_cache_complete)


# ----------------------------------------------------------------------------------------------
# Cache: build into a temporary folder, then os.replace into place.


def _build_atomically(root: Path, key: str, write: Callable[[Path], None], *,
                      complete: Callable[[Path], bool]) -> Path:
    """`root / key` built by `write(tmp)` in a fresh temporary folder, then moved into place with one
    os.replace; a stale folder is removed first, and a folder another process completed first (per
    `complete`) is kept. An interrupted build leaves no folder at `root / key`."""
    folder = root / key
    if folder.exists():  # an unreadable or stale folder (never produced by an interrupted build)
        shutil.rmtree(folder, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same build first; keep its folder
            if not complete(folder):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _cached(root: Path, key: str, header: dict[str, Any],
            documents: Iterable[tuple[str, str, bytes | None]]) -> Path:
    """Returns the cache folder for `key`, building it from `documents` if it is missing.

    `documents` yields (split, document key, data); data None marks a skipped document. It is
    only iterated when a build is needed.
    """
    if _cache_complete(root / key):
        return root / key
    return _build_atomically(root, key, lambda tmp: _write_build(tmp, key, header, documents),
                             complete=_cache_complete)


def _write_build(tmp: Path, key: str, header: dict[str, Any],
                 documents: Iterable[tuple[str, str, bytes | None]]) -> None:
    files = {s: open(tmp / SPLIT_FILES[s], "wb") for s in SPLITS}
    hashers = {s: hashlib.sha256() for s in SPLITS}
    stats = {s: {"num_documents": 0, "num_bytes": 0} for s in SPLITS}
    skipped: list[str] = []
    num_skipped = 0
    validation_docs: list[str] = []
    eos = np.array([EOS_ID], TOKEN_DTYPE).tobytes()
    try:
        for split, doc_key, data in documents:
            if data is None:
                num_skipped += 1
                if len(skipped) < _MAX_LISTED:
                    skipped.append(doc_key)
                continue
            buf = np.frombuffer(data, np.uint8).astype(TOKEN_DTYPE).tobytes() + eos
            files[split].write(buf)
            hashers[split].update(buf)
            stats[split]["num_documents"] += 1
            stats[split]["num_bytes"] += len(data)
            if split == "validation" and len(validation_docs) < _MAX_LISTED:
                validation_docs.append(doc_key)
    finally:
        for f in files.values():
            f.close()
    splits = {}
    for s in SPLITS:
        n_docs, n_bytes = stats[s]["num_documents"], stats[s]["num_bytes"]
        splits[s] = {"file": SPLIT_FILES[s], "num_documents": n_docs, "num_bytes": n_bytes,
                     "num_tokens": n_bytes + n_docs, "sha256": hashers[s].hexdigest()}
    manifest = {
        "format": FORMAT_VERSION, **header, "key": key,
        "tokenizer": "byte", "vocab_size": VOCAB_SIZE, "eos_id": EOS_ID, "dtype": TOKEN_DTYPE.str,
        "split_rule": header.get(
            "split_rule",
            f"validation iff int.from_bytes(sha1(key)[:8], 'big') % {VALIDATION_MODULUS} == 0"),
        "splits": splits, "num_skipped": num_skipped, "skipped": skipped,
        "validation_documents": validation_docs,
    }
    # The manifest is written last; a folder is complete iff it parses and the sizes match.
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _cache_complete(folder: Path) -> bool:
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != FORMAT_VERSION:
        return False
    try:
        itemsize = np.dtype(manifest.get("dtype", TOKEN_DTYPE.str)).itemsize
        return all(
            (folder / SPLIT_FILES[s]).stat().st_size
            == manifest["splits"][s]["num_tokens"] * itemsize for s in SPLITS)
    except (OSError, KeyError, TypeError):
        return False


def _memmap(path: Path, offset_tokens: int = 0, num_tokens: int | None = None,
            dtype: np.dtype = TOKEN_DTYPE) -> np.ndarray:
    """Read-only memmap of `path` (uint16 default; a read-only length-0 array for an empty range)."""
    dtype = np.dtype(dtype)
    if num_tokens is None:
        num_tokens = path.stat().st_size // dtype.itemsize - offset_tokens
    if num_tokens == 0:
        empty = np.zeros(0, dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=offset_tokens * dtype.itemsize,
                     shape=(num_tokens,))


def _open_cached(folder: Path, source: str, split: str) -> Corpus:
    manifest = _read_manifest(folder)
    assert manifest is not None  # _cached only returns complete folders
    info = manifest["splits"][split]
    tokens = _memmap(folder / info["file"], 0, info["num_tokens"], manifest.get("dtype", TOKEN_DTYPE.str))
    return Corpus(source=source, split=split, tokens=tokens, manifest=manifest,
                  num_documents=info["num_documents"])


def _short_hash(*parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Sources: each plan is (cache key, manifest header, lazy document iterator).


def _read_utf8_files(root: Path, relpaths: list[str]) -> Iterator[tuple[str, str, bytes | None]]:
    for rel in relpaths:
        data = (root / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            yield hash_split(rel), rel, None
            continue
        yield hash_split(rel), rel, data


def _stdlib_plan(source: str):
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(stdlib)
        relpaths.extend((rel_dir / f).as_posix() for f in filenames
                        if f.endswith(".py") and (Path(dirpath) / f).is_file())
    relpaths.sort()
    impl = sys.implementation.name
    version = platform.python_version()
    key = f"python-stdlib-{impl}-{version}-{_short_hash(str(stdlib))[:8]}-f{FORMAT_VERSION}"
    header = {"source": source, "python_version": version, "python_implementation": impl,
              "stdlib": str(stdlib), "num_files": len(relpaths)}
    return key, header, _read_utf8_files(stdlib, relpaths)


def _glob_root(pattern: str) -> Path:
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if glob_lib.has_magic(part):
            break
        fixed.append(part)
    if len(fixed) == len(parts):  # no wildcard: the pattern names one file
        fixed = fixed[:-1]
    return Path(*fixed) if fixed else Path(".")


def _text_plan(source: str):
    pattern = os.path.expanduser(source[len("text:"):])
    if not pattern:
        raise ValueError(f"source 'text:<glob>' needs a glob, got {source=}")
    root = Path(os.path.abspath(_glob_root(pattern)))
    files = sorted({Path(os.path.abspath(p)) for p in glob_lib.glob(pattern, recursive=True)
                    if os.path.isfile(p)})
    if not files:
        raise ValueError(f"source matches no files: {source=}")
    relpaths = sorted(p.relative_to(root).as_posix() for p in files)
    listing = []
    for rel in relpaths:
        st = (root / rel).stat()
        listing.append((rel, st.st_size, st.st_mtime_ns))
    key = f"text-{_short_hash(str(root), listing)}-f{FORMAT_VERSION}"
    header = {"source": source, "root": str(root), "num_files": len(relpaths)}
    return key, header, _read_utf8_files(root, relpaths)


def _hf_plan(source: str):
    try:
        import datasets  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            f"{source=} needs the optional `datasets` library: pip install 'k3jax[hf]'") from e
    spec = source[len("hf:"):]
    name, text_field = (spec.rsplit(":", 1) if ":" in spec else (spec, "text"))
    if not name or not text_field:
        raise ValueError(f"source must be 'hf:<dataset>[:<text_field>]', got {source=}")
    local = Path(name).expanduser()
    if local.exists():
        obj = datasets.load_from_disk(str(local))
    else:
        obj = datasets.load_dataset(name)
    if isinstance(obj, datasets.Dataset):
        parts = {"train": obj}
    else:
        parts = dict(obj)
    if "train" in parts and "validation" in parts:
        use = {"train": parts["train"], "validation": parts["validation"]}
        rule = "the dataset's own train/validation splits"
    elif "train" in parts or len(parts) == 1:
        use = {"train": parts["train"] if "train" in parts else next(iter(parts.values()))}
        rule = (f"hash split of one dataset split: validation iff int.from_bytes(sha1(text)[:8], "
                f"'big') % {VALIDATION_MODULUS} == 0")
    else:
        raise ValueError(f"dataset of {source=} has no 'train' split; splits: {sorted(parts)}")
    for ds in use.values():
        if text_field not in ds.column_names:
            raise ValueError(f"text_field {text_field!r} of {source=} is not a column; "
                             f"columns: {ds.column_names}")
    fingerprints = {s: getattr(ds, "_fingerprint", None) for s, ds in use.items()}
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in local.name or name)[:40]
    where = str(local.resolve()) if local.exists() else name
    key = f"hf-{safe}-{_short_hash(where, text_field, fingerprints)}-f{FORMAT_VERSION}"
    header = {"source": source, "dataset": name, "text_field": text_field, "split_rule": rule,
              "fingerprints": fingerprints}

    def documents():
        for given_split, ds in use.items():
            row = 0
            for batch in ds.select_columns([text_field]).iter(batch_size=1024):
                for text in batch[text_field]:
                    doc_key = f"{given_split}:{row}"
                    row += 1
                    if not isinstance(text, str):
                        yield "train", doc_key, None
                        continue
                    split = given_split if len(use) == 2 else hash_split(text)
                    yield split, doc_key, text.encode("utf-8")
    return key, header, documents()


def _load_token_file(source: str, split: str, tokenizer: Tokenizer, vocab_size: int | None) -> Corpus:
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size <= 0):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size=}")
    vocab = vocab_size or tokenizer.vocab_size
    dtype = token_dtype(vocab)
    eos_id = tokenizer.eos_id
    path = Path(source[len("tokens:"):]).expanduser()
    if path.is_dir():
        files = {"train": path / "train.bin", "validation": path / "val.bin"}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise ValueError(f"source folder lacks {missing}: {source=}")
        layout = "folder with train.bin and val.bin"
        file = files[split]
        n_file = file.stat().st_size
        offset, count = 0, n_file // dtype.itemsize
    elif path.is_file() and path.suffix == ".bin":
        layout = "single file: first n - n // 100 tokens train, last n // 100 validation"
        file = path
        n_file = file.stat().st_size
        n = n_file // dtype.itemsize
        n_val = n // VALIDATION_MODULUS
        offset, count = (0, n - n_val) if split == "train" else (n - n_val, n_val)
    else:
        raise ValueError(
            f"source must name a folder with train.bin/val.bin or a .bin file: {source=}")
    if n_file % dtype.itemsize:
        raise ValueError(f"token file {file} has an odd byte size {n_file} (not {dtype.name}): {source=}")
    tokens = _memmap(file, offset, count, dtype)
    hasher = hashlib.sha256()
    num_eos, max_id = 0, -1
    for start in range(0, count, _CHUNK):
        chunk = np.asarray(tokens[start:start + _CHUNK])
        hasher.update(chunk.tobytes())
        max_id = max(max_id, int(chunk.max()))
        num_eos += int(np.count_nonzero(chunk == eos_id))
    if max_id >= vocab:
        raise ValueError(
            f"token file {file} holds id {max_id} >= vocab_size {vocab}: {source=}")
    manifest = {"format": FORMAT_VERSION, "source": source, "path": str(path.resolve()),
                "layout": layout, "tokenizer": manifest_tokenizer_name(tokenizer), "tokenizer_hash": tokenizer.hash,
                "vocab_size": vocab, "eos_id": eos_id, "dtype": dtype.str, "split": split,
                "splits": {split: {"file": str(file.resolve()), "offset_tokens": offset,
                                   "num_tokens": count, "num_documents": num_eos,
                                   "sha256": hasher.hexdigest()}}}
    return Corpus(source=source, split=split, tokens=tokens, manifest=manifest,
                  num_documents=num_eos)
