"""Tokenizers: the byte tokenizer (default) and byte-level BPE through Hugging Face `tokenizers`.

Every tokenizer has the interface of `Tokenizer`: encode, decode, vocab_size, bos_id/eos_id/pad_id,
`token_byte_lengths()` (UTF-8 bytes each id stands for, the denominator of bits per byte) and a stable
`identity` string with a content `hash` (recorded in corpus caches and checkpoints).

`data.tokenizer` strings (`parse_tokenizer_spec`): "bytes" | "bpe:<path to tokenizer.json>" |
"train-bpe:<vocab size>" (trained by `k3jax.data.corpus.load_tokenizer` on the corpus's train split).

Byte tokenizer:

Byte-level modelling (as in ByT5, Xue et al. 2022, and the bits-per-byte evaluations of the
language-modelling literature) needs no trained vocabulary: every string has exactly one encoding
and `decode(encode(s)) == s` for any Python string.

Id layout (vocab_size = 259):

    0..255   the byte with that value
    256      BOS  beginning of sequence (never inserted by the corpora; available to callers)
    257      EOS  end of document; the corpora append it after every document
    258      PAD  padding; never appears in a corpus stream
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 byte tokenizer with BOS/EOS/PAD (see the module docstring for the id layout).

    Stateless; construct with `ByteTokenizer()`. The constants are also class attributes
    (`ByteTokenizer.EOS`) and module constants (`EOS_ID`).
    """

    BOS: ClassVar[int] = BOS_ID
    EOS: ClassVar[int] = EOS_ID
    PAD: ClassVar[int] = PAD_ID
    bos_id: ClassVar[int] = BOS_ID
    eos_id: ClassVar[int] = EOS_ID
    pad_id: ClassVar[int] = PAD_ID
    vocab_size: ClassVar[int] = VOCAB_SIZE
    identity: ClassVar[str] = "bytes"
    path: ClassVar[None] = None

    @property
    def hash(self) -> str:
        """sha256 (16 hex digits) of the identity: the byte tokenizer has no other content."""
        return hashlib.sha256(b"bytes").hexdigest()[:16]

    def token_byte_lengths(self) -> np.ndarray:
        """int32 [259]: 1 for the byte ids 0..255, 0 for BOS/EOS/PAD."""
        lengths = np.zeros(VOCAB_SIZE, np.int32)
        lengths[:256] = 1
        return lengths

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Encodes `text` as its UTF-8 bytes.

        Args:
          text: any Python string (lone surrogates are not valid UTF-8 and raise, see Raises).
          add_bos: prepend BOS (256).
          add_eos: append EOS (257).

        Returns:
          int32 array [len(text.encode("utf-8")) + add_bos + add_eos].

        Raises:
          ValueError: `text` is not a str, or cannot be encoded as UTF-8 (lone surrogates).
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text)=}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not encodable as UTF-8: {e}") from e
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        parts = []
        if add_bos:
            parts.append(np.array([BOS_ID], np.int32))
        parts.append(ids)
        if add_eos:
            parts.append(np.array([EOS_ID], np.int32))
        return np.concatenate(parts) if len(parts) > 1 else ids

    def decode_bytes(self, ids) -> bytes:
        """Returns the bytes of `ids`, dropping the special ids (BOS, EOS, PAD).

        Args:
          ids: integer array-like of any shape (flattened in C order), values in [0, 259).

        Raises:
          ValueError: `ids` is not integer-valued, or holds an id outside [0, vocab_size).
        """
        arr = np.asarray(ids)
        if arr.size == 0:
            return b""
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got {arr.dtype=}")
        arr = arr.reshape(-1)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= VOCAB_SIZE:
            raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got min={lo} max={hi}")
        return arr[arr < 256].astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        """Decodes `ids` to a string, dropping the special ids.

        Exact inverse of `encode` for any valid UTF-8 text: `decode(encode(s, add_bos=True,
        add_eos=True)) == s`. Byte sequences that are not valid UTF-8 (e.g. a model sample cut in
        the middle of a multi-byte character) are decoded with `errors="replace"`: each invalid
        sequence becomes U+FFFD, so decoding never raises on model output.

        Raises:
          ValueError: as `decode_bytes`.
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    """What the corpora, the trainer and checkpoints use of a tokenizer.

    `encode(text, add_bos=False, add_eos=False) -> int32 [n]`; `decode(ids) -> str` (special ids
    dropped); `token_byte_lengths() -> int32 [vocab_size]` (UTF-8 bytes each id decodes to, 0 for
    special ids); `identity` (e.g. "bytes", "bpe:/abs/tokenizer.json") and `hash` (16 hex digits of
    sha256 of the tokenizer's content: equal hashes encode identically); `path` (the tokenizer.json it
    was read from, None for bytes).
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str
    path: str | None

    @property
    def hash(self) -> str: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def token_byte_lengths(self) -> np.ndarray: ...


# Special tokens of the BPE vocabularies trained here (ids 0, 1, 2), and the EOS names looked up in a
# given tokenizer.json, in order.
BPE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
_EOS_NAMES = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


def _byte_level_decoder_table() -> dict[str, int]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), inverted: char -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (a tokenizer.json) behind the `Tokenizer` interface.

    Encoding never adds the tokenizer's own special tokens (`add_special_tokens=False`); BOS/EOS are
    added by `add_bos`/`add_eos`. EOS is the first of <|eos|>, <|endoftext|>, </s>, <eos>,
    <|end_of_text|> present in the vocabulary; BOS and PAD likewise (falling back to EOS).

    Args:
      json_str: the tokenizer.json content.
      identity: the identity string ("bpe:<absolute path>" or "train-bpe:<vocab>:<corpus key>").
      path: the file it was read from, if any (recorded in run headers and checkpoints).

    Raises:
      ValueError: the JSON is not a tokenizer, or it has no EOS token.
    """

    def __init__(self, json_str: str, identity: str, path: str | None = None):
        from tokenizers import Tokenizer as _HF  # pylint: disable=import-outside-toplevel
        try:
            self._tok = _HF.from_str(json_str)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"not a tokenizers tokenizer.json ({identity}): {e}") from e
        self._json = json_str
        self.identity = identity
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

        def find(names):
            for name in names:
                i = self._tok.token_to_id(name)
                if i is not None:
                    return int(i)
            return None

        eos = find(_EOS_NAMES)
        if eos is None:
            raise ValueError(f"tokenizer {identity} has no EOS token (one of {_EOS_NAMES})")
        self.eos_id = eos
        self.bos_id = find(_BOS_NAMES) if find(_BOS_NAMES) is not None else eos
        self.pad_id = find(_PAD_NAMES) if find(_PAD_NAMES) is not None else eos
        self._special = {self.eos_id, self.bos_id, self.pad_id} | {
            int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._lengths = None

    @property
    def hash(self) -> str:
        """sha256 (16 hex digits) of the tokenizer.json content."""
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()[:16]

    def to_str(self) -> str:
        return self._json

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """int32 [n] ids of `text` (plus BOS/EOS if asked). Raises ValueError if `text` is no str."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text)=}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else []),
                          np.int32)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (no special tokens), using the library's threads."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of `ids` with special ids dropped (invalid UTF-8 from a cut sample becomes U+FFFD).

        Raises:
          ValueError: `ids` not integers or outside [0, vocab_size).
        """
        arr = np.asarray(ids).reshape(-1)
        if arr.size == 0:
            return ""
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got {arr.dtype=}")
        if int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size:
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got min={arr.min()} max={arr.max()}")
        keep = [int(i) for i in arr if int(i) not in self._special]
        return self._tok.decode(keep, skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        """int32 [vocab_size]: UTF-8 bytes of each id, 0 for special ids.

        For a ByteLevel tokenizer (GPT-2 style; every one trained here) a token's string maps char by
        char to its bytes, so the lengths are exact even for tokens holding part of a character. Other
        tokenizers: the UTF-8 length of the id decoded alone (exact when tokens decode independently).
        """
        if self._lengths is None:
            table = _byte_level_decoder_table()
            byte_level = "ByteLevel" in json.dumps(json.loads(self._json).get("decoder"))
            lengths = np.zeros(self.vocab_size, np.int32)
            for i in range(self.vocab_size):
                if i in self._special:
                    continue
                token = self._tok.id_to_token(i)
                if token is None:
                    continue
                if byte_level and all(c in table for c in token):
                    lengths[i] = len(token)
                else:
                    lengths[i] = len(self._tok.decode([i]).encode("utf-8"))
            self._lengths = lengths
        return self._lengths


def parse_tokenizer_spec(spec: str) -> tuple[str, str | int | None]:
    """"bytes" -> ("bytes", None); "bpe:<path>" -> ("bpe", path); "train-bpe:<V>" -> ("train-bpe", V).

    Raises:
      ValueError: any other form, or a vocabulary size < 259 + 3 (the byte alphabet and the
        specials must fit). The message names data.tokenizer.
    """
    if spec == "bytes":
        return "bytes", None
    if isinstance(spec, str) and spec.startswith("bpe:") and spec[len("bpe:"):]:
        return "bpe", spec[len("bpe:"):]
    if isinstance(spec, str) and spec.startswith("train-bpe:"):
        value = spec[len("train-bpe:"):]
        if not value.isdigit() or int(value) < 256 + len(BPE_SPECIAL_TOKENS) + 1:
            raise ValueError(f"data.tokenizer 'train-bpe:<vocab size>' needs an int >= "
                             f"{256 + len(BPE_SPECIAL_TOKENS) + 1}, got {spec!r}")
        return "train-bpe", int(value)
    raise ValueError("data.tokenizer must be 'bytes', 'bpe:<path to tokenizer.json>' or "
                     f"'train-bpe:<vocab size>', got {spec!r}")


def load_bpe_file(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer.json at `path` (read locally; nothing is downloaded).

    Raises:
      ValueError: the file is missing or unreadable as a tokenizer (message names data.tokenizer).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"data.tokenizer: tokenizer file not found: {str(p)!r} (expected "
                         "'bpe:<path to a tokenizer.json>')")
    return HFTokenizer(p.read_text(encoding="utf-8"), identity=f"bpe:{p.resolve()}", path=str(p.resolve()))


def spec_vocab_size(spec: str) -> int:
    """The model vocabulary a `data.tokenizer` string needs, without training anything.

    "bytes": 259. "bpe:<path>": that tokenizer's vocabulary (the file is read). "train-bpe:<V>": V, the
    most ids the trained BPE can have (it has exactly V unless the corpus supports fewer merges; ids it
    lacks are never targets and never sampled).

    Raises:
      ValueError: as `parse_tokenizer_spec` and `load_bpe_file`.
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return VOCAB_SIZE
    if kind == "bpe":
        return load_bpe_file(arg).vocab_size
    return int(arg)


def train_bpe(texts: Iterable[str], vocab_size: int, *, identity: str) -> HFTokenizer:
    """Trains a byte-level BPE (GPT-2 pre-tokenisation, no normaliser) on `texts`.

    Ids 0, 1, 2 are <|bos|>, <|eos|>, <|pad|>, then the 256 byte symbols, then merges in order
    (`tokenizers.trainers.BpeTrainer`, min_frequency 2, full byte alphabet so every string encodes).
    Deterministic for the same texts in the same order (tested). The vocabulary may end below
    `vocab_size` when the texts support fewer merges.
    """
    from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2,
                                  special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str(), identity=identity)
