"""Data pipeline: tokenizers, token sources (stdlib, text, records, bin) and their mixtures,
packed grain iterators."""

from jscale.data.iterators import make_eval_batches, make_eval_sets, make_train_iterator
from jscale.data.position import checkpoint_restore, checkpoint_save
from jscale.data.sources import Component, Splits, components, load_splits
from jscale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_vocab_size
from jscale.data.windows import Windows

__all__ = [
    "ByteTokenizer", "Component", "HFTokenizer", "Splits", "Windows", "checkpoint_restore",
    "checkpoint_save", "components", "load_splits", "load_tokenizer", "make_eval_batches",
    "make_eval_sets", "make_train_iterator", "tokenizer_vocab_size",
]
