"""A tokenized corpus: one flat token stream plus document start offsets, cached on disk.

Documents are tokenized in order and each is followed by EOS. The stream and the offsets
are saved as two .npy files under `data.cache_dir` and reopened memory-mapped, so a corpus
is tokenized once per (source, tokenizer, inputs) key. Documents stream through: tokens are
appended to a temporary file in batches (`_HF_CHUNK` documents at a time, tokenized in
parallel by the Rust tokenizer), so neither the text nor the tokens are ever held whole; the
temporary files become the cache entry by an atomic rename only once complete, and are removed
if tokenization stops (an exception or Ctrl-C): nothing half-written is ever read back.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from jscale.config import ConfigError, DataConfig
from jscale.data.tokenizer import ByteTokenizer, Tokenizer

# Bump when the cache layout or tokenization changes, so old caches are not reused.
_FORMAT = 1
_HF_CHUNK = 64  # documents per encode_batch call: parallel, but bounded memory

Document = str | bytes  # bytes: raw file contents (UTF-8 expected)


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


def file_documents(files: Sequence[str], utf8: bool = False) -> Iterator[bytes]:
  """Each file's bytes, in order (empty files skipped): one document per file. `utf8`: a file
  that is not UTF-8 stops with a ConfigError naming it, its line and the fix (a text tokenizer
  would otherwise replace the bytes silently)."""
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    if utf8:
      _check_utf8(path, data)
    if data:
      yield data


def _check_utf8(path: str, data: bytes) -> None:
  try:
    data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise ConfigError(f"data.path: {path} line {line} is not UTF-8 ({e.reason} at byte "
                      f"{e.start}): re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                      ) from None


def token_batches(documents: Iterable[Document], tok: Tokenizer) -> Iterator[list[np.ndarray]]:
  """The documents' ids, each followed by `tok.eos_id`, `_HF_CHUNK` documents at a time (empty
  documents skipped). Bytes are the byte tokenizer's ids as they are; text for it is encoded as
  UTF-8; a HF tokenizer decodes bytes as UTF-8 (invalid bytes replaced)."""
  dtype = token_dtype(tok.vocab_size)
  batch: list[Document] = []
  for doc in documents:
    if doc:
      batch.append(doc)
    if len(batch) == _HF_CHUNK:
      yield _encode(batch, tok, dtype)
      batch = []
  if batch:
    yield _encode(batch, tok, dtype)


def _encode(docs: list[Document], tok: Tokenizer, dtype: np.dtype) -> list[np.ndarray]:
  if isinstance(tok, ByteTokenizer):
    raw = [d if isinstance(d, bytes) else d.encode("utf-8") for d in docs]
    return [np.frombuffer(r + bytes([tok.eos_id]), np.uint8) for r in raw]
  texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
  return [np.asarray(ids + [tok.eos_id], dtype) for ids in tok.encode_batch(texts)]


def tokenize(documents: Iterable[Document], tok: Tokenizer) -> Corpus:
  """The documents tokenized in memory (tests and small inputs; `cached_corpus` streams)."""
  pieces = [ids for batch in token_batches(documents, tok) for ids in batch]
  starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]) if pieces else np.zeros(0)
  tokens = (np.concatenate(pieces) if pieces
            else np.zeros(0, token_dtype(tok.vocab_size)))
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


def cached_corpus(data_cfg: DataConfig, key: str, tok: Tokenizer,
                  documents: Callable[[], Iterable[Document]]) -> Corpus:
  """The corpus cached under `key`; on a miss `documents()` is tokenized into it, streamed."""
  root = cache_root(data_cfg)
  stem = os.path.join(root, f"{key}-v{_FORMAT}")
  tokens_path, docs_path = stem + ".tokens.npy", stem + ".docs.npy"
  if not (os.path.isfile(tokens_path) and os.path.isfile(docs_path)):
    _write(root, tokens_path, docs_path, token_batches(documents(), tok),
           token_dtype(tok.vocab_size))
  return Corpus(np.load(tokens_path, mmap_mode="r"), np.load(docs_path))


def _write(root: str, tokens_path: str, docs_path: str, batches: Iterable[list[np.ndarray]],
           dtype: np.dtype) -> None:
  # Tokens go to a raw temporary file batch by batch, then into a temporary .npy (header, then
  # the raw bytes copied over), renamed into place: readers (and other processes building the
  # same cache) see no file or a whole one. Offsets first, tokens last: the tokens file marks
  # a complete entry.
  raw_fd, raw = tempfile.mkstemp(dir=root, suffix=".tokens.tmp")
  try:
    starts, n = [], 0
    with os.fdopen(raw_fd, "wb") as f:
      for batch in batches:
        for ids in batch:
          starts.append(n)
          n += len(ids)
          f.write(np.ascontiguousarray(ids, dtype).tobytes())
    _save_atomic(docs_path, lambda f: np.save(f, np.asarray(starts, np.int64)))
    _save_atomic(tokens_path, lambda f: _npy_from_raw(f, raw, dtype, n))
  finally:
    os.remove(raw)


def _npy_from_raw(f, raw: str, dtype: np.dtype, n: int) -> None:
  header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
  np.lib.format.write_array_header_1_0(f, header)
  with open(raw, "rb") as src:
    while chunk := src.read(1 << 24):
      f.write(chunk)


def _save_atomic(path: str, write: Callable) -> None:
  # Write a temp file in the same directory, then rename: a reader sees no file or a whole one.
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
