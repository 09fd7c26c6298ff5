"""Data sources: each yields a flat train token stream and a flat validation token stream.

- stdlib: this Python's standard-library .py files (no download), tokenized and cached.
- text: text files (a file, a directory searched recursively, or a glob), tokenized and cached.
- bin: pre-tokenized nanoGPT .bin (raw data.bin_dtype) or .npy, memory-mapped as is.
- jsonl / parquet / arrow: records, one document per `data.text_field` (`jscale.data.records`),
  tokenized and cached.

Validation is the tail: the last `data.val_fraction` of the stream, for tokenized sources moved
forward to the next document boundary so no document straddles the split.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import platform
import sysconfig

import numpy as np

from jscale.config import ConfigError, DataConfig, choices
from jscale.data import records
from jscale.data.corpus import Corpus, cached_corpus, file_documents
from jscale.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".tex", ".html", ".c", ".h", ".cc", ".cpp",
                   ".js", ".ts", ".rs", ".go", ".java")
# Never read installed packages (GBs) or caches as "standard library".
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
_VOCAB_CHECK_TOKENS = 1 << 20  # ids checked against the tokenizer when opening a .bin


@dataclasses.dataclass(frozen=True)
class Splits:
  train: np.ndarray  # 1-D token ids (often a read-only memmap)
  val: np.ndarray
  eos_id: int  # document separator, also the padding id
  # The train documents' offsets in `train` (None for pre-tokenized ids: not indexed)
  train_doc_starts: np.ndarray | None = None

  def documents_longer_than(self, n: int) -> tuple[int, int] | None:
    """(train documents of more than `n` tokens, EOS included: a window splits them; all
    train documents), or None where the documents are not indexed."""
    starts = self.train_doc_starts
    if starts is None:
      return None
    lengths = np.diff(np.append(starts, len(self.train)))
    return int((lengths > n).sum()), len(lengths)


@dataclasses.dataclass(frozen=True)
class Component:
  """One source of the data: its label in the metrics ("" for a single source), its share of
  the draws, and its config (as `data.*`, no mixture)."""
  label: str
  weight: float
  cfg: DataConfig


def components(data_cfg: DataConfig) -> list[Component]:
  """The run's sources: `data.mixture`'s, each with the run's tokenizer, seed, validation
  fraction, cache and document mask; or `data.*`'s one source."""
  if data_cfg.mixture is None:
    return [Component("", 1.0, data_cfg)]
  total = sum(m.weight for m in data_cfg.mixture)
  return [Component(m.label, m.weight / total, dataclasses.replace(
      data_cfg, source=m.source, path=m.path, text_field=m.text_field, bin_dtype=m.bin_dtype,
      mixture=None)) for m in data_cfg.mixture]


def load_splits(data_cfg: DataConfig) -> Splits:
  """Train and validation token streams for `data.source` (one source: `components` gives a
  mixture's)."""
  if data_cfg.mixture is not None:
    raise ValueError("data.mixture has a split per source: load each of components(data_cfg)")
  tok = load_tokenizer(data_cfg)
  if data_cfg.source == "bin":
    train, val = bin_streams(data_cfg, tok)
    return Splits(train, val, tok.eos_id)
  if data_cfg.source == "stdlib":
    corpus = stdlib_corpus(data_cfg, tok)
  elif data_cfg.source == "text":
    corpus = text_corpus(data_cfg, tok)
  elif data_cfg.source in records.EXTENSIONS:
    corpus = record_corpus(data_cfg, tok)
  else:
    raise ConfigError(f"data.source={data_cfg.source!r}: choose one of "
                      f"{', '.join(choices(DataConfig, 'source'))}")
  train, val = split_corpus(corpus, data_cfg.val_fraction)
  return Splits(train, val, tok.eos_id, corpus.doc_starts[corpus.doc_starts < len(train)])


def split_corpus(corpus: Corpus, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, val): val starts at the first document boundary in the last `val_fraction`."""
  tokens, starts = corpus.tokens, corpus.doc_starts
  n = len(tokens)
  target = n - int(round(n * val_fraction))
  i = int(np.searchsorted(starts, target))
  # One huge final document has no boundary to move to: then cut inside it.
  cut = int(starts[i]) if i < len(starts) and n - starts[i] >= 2 else target
  return tokens[:cut], tokens[cut:]


def stdlib_files(root: str | None = None) -> list[str]:
  """The standard library's .py files, sorted, excluding site-/dist-packages."""
  root = root or sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  return sorted(files)


def stdlib_corpus(data_cfg: DataConfig, tok: Tokenizer) -> Corpus:
  """The whole standard library, tokenized (cached per Python version and tokenizer)."""
  root = sysconfig.get_paths()["stdlib"]
  where = hashlib.sha256(root.encode()).hexdigest()[:8]
  key = f"stdlib-py{platform.python_version()}-{where}-{tok.fingerprint}"
  return cached_corpus(data_cfg, key, tok, lambda: file_documents(stdlib_files(root)))


def text_files(path: str) -> list[str]:
  """Files named by data.path: one file, a directory (recursive, TEXT_EXTENSIONS), or a glob."""
  p = os.path.expanduser(path)
  if any(c in p for c in "*?["):
    files = [f for f in glob.glob(p, recursive=True) if os.path.isfile(f)]
  elif os.path.isdir(p):
    files = []
    for dirpath, dirnames, filenames in os.walk(p):
      dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .venv, ...
      files.extend(os.path.join(dirpath, f) for f in filenames
                   if f.endswith(TEXT_EXTENSIONS) and not f.startswith("."))
  elif os.path.isfile(p):
    files = [p]
  else:
    raise ConfigError(f"data.path={path!r}: no such file or directory; give a text file, a "
                      "directory of text files, or a glob such as 'corpus/**/*.txt'")
  if not files:
    raise ConfigError(f"data.path={path!r} holds no text files (looked for "
                      f"{', '.join(TEXT_EXTENSIONS)}); point data.path at your corpus")
  return sorted(files)


def text_corpus(data_cfg: DataConfig, tok: Tokenizer) -> Corpus:
  """The text files of data.path, tokenized (cached until a file changes)."""
  if not data_cfg.path:
    raise ConfigError("data.source=text needs data.path (a text file, directory or glob)")
  files = text_files(data_cfg.path)
  key = f"text-{tok.fingerprint}-{_files_key(files, tok.fingerprint)}"
  # A text tokenizer decodes the bytes: invalid UTF-8 is named, not replaced silently.
  utf8 = not isinstance(tok, ByteTokenizer)
  corpus = cached_corpus(data_cfg, key, tok, lambda: file_documents(files, utf8))
  if len(corpus.tokens) < 2:
    raise ConfigError(f"data.path={data_cfg.path!r}: the files are empty; add text")
  return corpus


def record_corpus(data_cfg: DataConfig, tok: Tokenizer) -> Corpus:
  """The records of data.path (jsonl / parquet / arrow), each `data.text_field` a document,
  tokenized (cached until a file, the field or the tokenizer changes)."""
  fmt = data_cfg.source
  if not data_cfg.path:
    raise ConfigError(f"data.source={fmt} needs data.path (a {fmt} file, directory or glob)")
  files = records.record_files(data_cfg.path, fmt)
  key = (f"{fmt}-{tok.fingerprint}-"
         f"{_files_key(files, tok.fingerprint + chr(0) + data_cfg.text_field)}")
  corpus = cached_corpus(data_cfg, key, tok,
                         lambda: records.documents(data_cfg.path or "", fmt,
                                                   data_cfg.text_field))
  if len(corpus.tokens) < 2:
    raise ConfigError(f"data.path={data_cfg.path!r}: every {data_cfg.text_field!r} is empty; "
                      "give records with text")
  return corpus


def _files_key(files: list[str], salt: str) -> str:
  """A short hash of the files' paths, sizes and modification times, and `salt`."""
  h = hashlib.sha256(salt.encode())
  for f in files:
    st = os.stat(f)
    h.update(f"{os.path.abspath(f)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:16]


def bin_streams(data_cfg: DataConfig, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """(train, val) from train.bin/val.bin in a directory, or the tail split of one file."""
  if not data_cfg.path:
    raise ConfigError("data.source=bin needs data.path (a .bin/.npy file or a directory with "
                      "train.bin and val.bin)")
  path = os.path.expanduser(data_cfg.path)
  if os.path.isdir(path):
    for ext in (".bin", ".npy"):
      train_path, val_path = (os.path.join(path, s + ext) for s in ("train", "val"))
      if os.path.isfile(train_path) and os.path.isfile(val_path):
        train, val = _open_tokens(train_path, data_cfg), _open_tokens(val_path, data_cfg)
        break
    else:
      raise ConfigError(f"data.path={data_cfg.path!r} is a directory without train.bin and "
                        "val.bin: use the nanoGPT layout, or point data.path at one .bin/.npy")
  elif os.path.isfile(path):
    stream = _open_tokens(path, data_cfg)
    cut = len(stream) - int(round(len(stream) * data_cfg.val_fraction))
    train, val = stream[:cut], stream[cut:]
  else:
    raise ConfigError(f"data.path={data_cfg.path!r}: no such file or directory; give a "
                      "nanoGPT .bin/.npy file or a directory with train.bin and val.bin")
  for name, stream in (("train", train), ("val", val)):
    top = int(stream[:_VOCAB_CHECK_TOKENS].max(initial=0))
    if top >= tok.vocab_size:
      raise ConfigError(f"data.path={data_cfg.path!r} ({name}) has token id {top} but "
                        f"data.tokenizer={data_cfg.tokenizer!r} has {tok.vocab_size} ids: set "
                        "data.tokenizer to the tokenizer.json that produced the .bin")
  return train, val


def _open_tokens(path: str, data_cfg: DataConfig) -> np.ndarray:
  if path.endswith(".npy"):
    arr = np.load(path, mmap_mode="r")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
      raise ConfigError(f"data.path: {path} holds a {arr.dtype}{list(arr.shape)} array; "
                        "save a 1-D integer array of token ids")
    return arr
  dtype = np.dtype(data_cfg.bin_dtype)
  size = os.path.getsize(path)
  if size == 0:
    raise ConfigError(f"data.path: {path} is empty; give a file of token ids")
  if size % dtype.itemsize:
    raise ConfigError(f"data.path: {path} has {size} bytes, not a whole number of "
                      f"data.bin_dtype={data_cfg.bin_dtype} ids; check data.bin_dtype")
  return np.memmap(path, dtype=dtype, mode="r")
