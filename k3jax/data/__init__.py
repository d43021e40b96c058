"""k3jax.data: tokenizers (bytes, BPE), corpora cached as uint16/uint32 memmaps, packing, grain pipelines."""
from k3jax.data.corpus import (
    Corpus,
    default_cache_dir,
    hash_split,
    load_corpus,
    load_tokenizer,
    unigram_entropy_bits,
)
from k3jax.data.packing import EXAMPLE_KEYS, pack_window, pack_windows
from k3jax.data.pipeline import (
    eval_batches,
    iterator_restore_args,
    iterator_save_args,
    make_train_loader,
    num_windows,
)
from k3jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    parse_tokenizer_spec,
    spec_vocab_size,
)

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "ByteTokenizer", "HFTokenizer", "Tokenizer",
    "parse_tokenizer_spec", "spec_vocab_size",
    "Corpus", "default_cache_dir", "hash_split", "load_corpus", "load_tokenizer", "unigram_entropy_bits",
    "EXAMPLE_KEYS", "pack_window", "pack_windows",
    "eval_batches", "iterator_restore_args", "iterator_save_args", "make_train_loader",
    "num_windows",
]
