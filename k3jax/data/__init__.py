"""k3jax.data: byte tokenizer, corpora cached as uint16 memmaps, packing, grain pipelines."""
from k3jax.data.corpus import (
    Corpus,
    default_cache_dir,
    hash_split,
    load_corpus,
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
from k3jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "ByteTokenizer",
    "Corpus", "default_cache_dir", "hash_split", "load_corpus", "unigram_entropy_bits",
    "EXAMPLE_KEYS", "pack_window", "pack_windows",
    "eval_batches", "iterator_restore_args", "iterator_save_args", "make_train_loader",
    "num_windows",
]
