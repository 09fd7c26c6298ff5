"""Tokenizers: raw UTF-8 bytes, or a Hugging Face `tokenizers` tokenizer.json.

Both expose `vocab_size`, `eos_id`, `encode(str) -> list[int]`, `decode(ids) -> str` and a
`fingerprint` that keys the token caches (two tokenizers with the same fingerprint produce
the same ids).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

from jscale.config import ConfigError, DataConfig

# Special tokens tried, in order, when no tokenizer_config.json names the EOS token.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class ByteTokenizer:
  """Ids are the UTF-8 bytes of the text (vocab 256).

  EOS, which separates documents, is byte 0 (NUL): text essentially never contains it, so a
  256-entry vocabulary needs no extra id. Decoding replaces invalid UTF-8 with U+FFFD.
  """
  vocab_size = 256
  eos_id = 0
  fingerprint = "byte"

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text`."""
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    """The text whose UTF-8 bytes are `ids`."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json.

  `encode` adds no special tokens (no BOS): documents are joined by `eos_id` when packing.
  The EOS token comes from a tokenizer_config.json beside the file (`eos_token`), else from
  the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> found in the vocabulary.
  """

  def __init__(self, path: str):
    import tokenizers
    if not os.path.isfile(path):
      raise ConfigError(f"data.tokenizer={path!r}: no such file; give a path to a Hugging Face "
                        "tokenizer.json, or 'byte' for the byte tokenizer")
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
      raise ConfigError(f"data.tokenizer={path!r} is not a valid tokenizer.json: {e}") from None
    self.path = path
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._find_eos()
    with open(path, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()[:16]
    self.fingerprint = f"hf{digest}e{self.eos_id}"

  def _find_eos(self) -> int:
    names = list(_EOS_NAMES)
    config = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
    if os.path.isfile(config):
      with open(config, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
      if isinstance(eos, dict):  # {"content": "</s>", ...} in older configs
        eos = eos.get("content")
      if isinstance(eos, str):
        names.insert(0, eos)
    for name in names:
      token_id = self._tok.token_to_id(name)
      if token_id is not None:
        return token_id
    raise ConfigError(f"data.tokenizer={self.path!r} has no end-of-text token: add one of "
                      f"{', '.join(_EOS_NAMES)} to it, or put a tokenizer_config.json with "
                      "eos_token beside it")

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without special tokens."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (parallel in Rust), without special tokens."""
    return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` (special tokens kept)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(data_cfg: DataConfig) -> Tokenizer:
  """The tokenizer named by `data.tokenizer`: "byte", or a path to a tokenizer.json."""
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  return HFTokenizer(os.path.expanduser(data_cfg.tokenizer))


def tokenizer_vocab_size(data_cfg: DataConfig) -> int:
  """Number of token ids `data.tokenizer` produces; model.vocab_size must be at least this."""
  return load_tokenizer(data_cfg).vocab_size
