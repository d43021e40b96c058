"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then three special ids.

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
from typing import ClassVar

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
    vocab_size: ClassVar[int] = VOCAB_SIZE

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
