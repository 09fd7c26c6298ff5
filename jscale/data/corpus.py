"""A tokenized corpus: one flat token stream plus document start offsets, cached on disk.

Documents are tokenized in order and each is followed by EOS. The stream and the offsets
are saved as two .npy files under `data.cache_dir` and reopened memory-mapped, so a corpus
is tokenized once per (source, tokenizer, inputs) key.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable, Sequence

import numpy as np

from jscale.config import ConfigError, DataConfig
from jscale.data.tokenizer import ByteTokenizer, Tokenizer

# Bump when the cache layout or tokenization changes, so old caches are not reused.
_FORMAT = 1
_HF_CHUNK = 64  # documents per encode_batch call: parallel, but bounded memory


@dataclasses.dataclass(frozen=True)
class Corpus:
  tokens: np.ndarray  # 1-D unsigned ints, documents each followed by EOS
  doc_starts: np.ndarray  # int64 offset of each document in `tokens`, ascending


def token_dtype(vocab_size: int) -> np.dtype:
  """Smallest unsigned dtype that holds every id (caches stay small)."""
  for dt in (np.uint8, np.uint16, np.uint32):
    if vocab_size <= np.iinfo(dt).max + 1:
      return np.dtype(dt)
  return np.dtype(np.int64)


def tokenize_files(files: Sequence[str], tok: Tokenizer) -> Corpus:
  """Tokenizes `files` in order (empty files skipped), each followed by `tok.eos_id`."""
  if isinstance(tok, ByteTokenizer):
    # Bytes are the ids: no decoding, one buffer, one frombuffer.
    buf, starts = bytearray(), []
    for path in files:
      with open(path, "rb") as f:
        data = f.read()
      if data:
        starts.append(len(buf))
        buf += data
        buf.append(tok.eos_id)
    return Corpus(np.frombuffer(bytes(buf), np.uint8), np.asarray(starts, np.int64))
  dtype = token_dtype(tok.vocab_size)
  pieces, starts, n = [], [], 0
  for i in range(0, len(files), _HF_CHUNK):
    texts = []
    for path in files[i:i + _HF_CHUNK]:
      with open(path, encoding="utf-8", errors="replace") as f:
        texts.append(f.read())
    for ids in tok.encode_batch([t for t in texts if t]):
      starts.append(n)
      pieces.append(np.asarray(ids + [tok.eos_id], dtype))
      n += len(ids) + 1
  tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
  return Corpus(tokens, np.asarray(starts, np.int64))


def cache_root(data_cfg: DataConfig) -> str:
  """`data.cache_dir`, or ~/.cache/jscale; created if missing."""
  root = os.path.expanduser(data_cfg.cache_dir or os.path.join("~", ".cache", "jscale"))
  try:
    os.makedirs(root, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"data.cache_dir={root!r} cannot be created ({e}): set data.cache_dir "
                      "to a writable directory") from None
  return root


def cached_corpus(data_cfg: DataConfig, key: str, build: Callable[[], Corpus]) -> Corpus:
  """The corpus cached under `key`, calling `build` and saving its result on a miss."""
  root = cache_root(data_cfg)
  stem = os.path.join(root, f"{key}-v{_FORMAT}")
  tokens_path, docs_path = stem + ".tokens.npy", stem + ".docs.npy"
  if not (os.path.isfile(tokens_path) and os.path.isfile(docs_path)):
    corpus = build()
    # Offsets first, tokens last: the tokens file marks a complete cache entry.
    _save_atomic(docs_path, corpus.doc_starts)
    _save_atomic(tokens_path, corpus.tokens)
  return Corpus(np.load(tokens_path, mmap_mode="r"), np.load(docs_path))


def _save_atomic(path: str, array: np.ndarray) -> None:
  # Write a temp file in the same directory, then rename: readers (and other processes
  # building the same cache) see either no file or a whole one, never a torn write.
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      np.save(f, array)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
