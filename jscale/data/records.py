"""Documents from record files: JSON Lines, Parquet and Arrow, one document per record's
`data.text_field`.

- jsonl: one JSON object per line (`.jsonl`, `.json`); blank lines skipped.
- parquet: the text column read in record batches (pyarrow), never a whole file.
- arrow: Arrow IPC files, the stream format `datasets.Dataset.save_to_disk` writes
  (`data-00000-of-0000N.arrow` beside `state.json`) or the file format, memory-mapped. A saved
  `datasets` directory is read through its `state.json` (a `DatasetDict`'s through its train
  split), with the `datasets` package if it is installed, else by pyarrow alone.

`data.path` names a file, a directory (searched recursively for the format's extensions), or a
glob. A record that cannot be read stops the run with one line naming the file, the line or
row, and the fix.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from jscale.config import ConfigError

EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "arrow": (".arrow",)}
_BATCH_ROWS = 1024  # records per Parquet / Arrow batch read
_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format's first bytes (the stream format has none)


def record_files(path: str, fmt: str) -> list[str]:
  """The `fmt` files `path` names: one file, a directory (recursive; a saved `datasets`
  directory: its own data files), or a glob; sorted."""
  p = os.path.expanduser(path)
  if any(c in p for c in "*?["):
    files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    if not files:
      raise ConfigError(f"data.path={path!r} matches no file: check the glob (quote it in the "
                        "shell, and use ** for subdirectories)")
    return files
  if os.path.isfile(p):
    return [p]
  if not os.path.isdir(p):
    raise ConfigError(f"data.path={path!r}: no such file or directory; give a {fmt} file, a "
                      f"directory of them, or a glob such as 'corpus/**/*{EXTENSIONS[fmt][0]}'")
  if fmt == "arrow" and (saved := saved_dataset(p)) is not None:
    return _saved_files(saved)
  files = []
  for dirpath, dirnames, filenames in os.walk(p):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(EXTENSIONS[fmt]))
  if not files:
    raise ConfigError(f"data.path={path!r} holds no {fmt} files (looked for "
                      f"{', '.join(EXTENSIONS[fmt])}); point data.path at your data")
  return sorted(files)


def saved_dataset(path: str) -> str | None:
  """The directory of the `datasets.Dataset` that `save_to_disk` wrote at `path` (a
  `DatasetDict`: its train split's), or None if `path` is not one."""
  p = os.path.expanduser(path)
  splits = os.path.join(p, "dataset_dict.json")
  if os.path.isfile(splits):
    with open(splits, encoding="utf-8") as f:
      names = json.load(f).get("splits", [])
    if "train" not in names:
      raise ConfigError(f"data.path={path!r} is a saved DatasetDict without a train split "
                        f"(splits: {names}); point data.path at the split's directory")
    p = os.path.join(p, "train")
  return p if os.path.isfile(os.path.join(p, "state.json")) else None


def _saved_files(directory: str) -> list[str]:
  with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
    return [os.path.join(directory, d["filename"]) for d in json.load(f)["_data_files"]]


def documents(path: str, fmt: str, field: str) -> Iterator[str]:
  """Each record's `field` of the files `path` names (`record_files`), in order, streamed; a
  saved `datasets` directory through `datasets` when it is installed."""
  if fmt == "arrow" and importlib.util.find_spec("datasets") is not None and (
      saved := saved_dataset(path)) is not None:
    yield from _saved_with_datasets(saved, field)
    return
  read = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[fmt]
  for file in record_files(path, fmt):
    if os.path.getsize(file) == 0:
      raise ConfigError(f"data.path: {file} is empty; remove it or give a file with records")
    yield from read(file, field)


def _jsonl(path: str, field: str) -> Iterator[str]:
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, 1):
      where = f"data.path: {path} line {line_no}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 ({e.reason} at byte {e.start}): re-encode the "
                          "file as UTF-8") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not a JSON object ({e.msg}): one object per line, "
                          "e.g. {\"text\": \"...\"}") from None
      yield _text(record, field, where)


def _text(record, field: str, where: str) -> str:
  if not isinstance(record, dict) or field not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(f"{where} has no field {field!r} (it has {keys}): set data.text_field")
  text = record[field]
  if not isinstance(text, str):
    raise ConfigError(f"{where}: field {field!r} is {type(text).__name__}, not text: set "
                      "data.text_field to a text field")
  return text


def _parquet(path: str, field: str) -> Iterator[str]:
  table = pq.ParquetFile(path)
  _check_column(table.schema_arrow, field, path)
  row = 0
  for batch in table.iter_batches(batch_size=_BATCH_ROWS, columns=[field]):
    yield from _column(batch.column(0), f"data.path: {path}", field, row)
    row += batch.num_rows


def _arrow(path: str, field: str) -> Iterator[str]:
  with pa.memory_map(path) as source:
    with open(path, "rb") as f:
      is_file_format = f.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
    reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
    _check_column(reader.schema, field, path)
    batches = ((reader.get_batch(i) for i in range(reader.num_record_batches))
               if is_file_format else reader)
    row = 0
    for batch in batches:
      yield from _column(batch.column(reader.schema.get_field_index(field)),
                         f"data.path: {path}", field, row)
      row += batch.num_rows


def _saved_with_datasets(directory: str, field: str) -> Iterator[str]:
  """A `save_to_disk` directory through `datasets.load_from_disk` (memory-mapped)."""
  import datasets  # pylint: disable=import-outside-toplevel  (the optional extra)
  ds = datasets.load_from_disk(directory)
  if not isinstance(ds, datasets.Dataset):  # (`saved_dataset` picked a DatasetDict's split)
    raise ConfigError(f"data.path: {directory} is not a saved Dataset")
  if field not in ds.column_names:
    raise ConfigError(f"data.path: {directory} has no column {field!r} (it has "
                      f"{ds.column_names}): set data.text_field")
  for start in range(0, len(ds), _BATCH_ROWS):
    for i, value in enumerate(ds[start:start + _BATCH_ROWS][field]):
      yield _cell(value, f"data.path: {directory}", field, start + i)


def _check_column(schema: pa.Schema, field: str, path: str) -> None:
  if field not in schema.names:
    raise ConfigError(f"data.path: {path} has no column {field!r} (it has {schema.names}): set "
                      "data.text_field")


def _column(column: pa.Array, where: str, field: str, first_row: int) -> Iterator[str]:
  for i, value in enumerate(column.to_pylist()):
    yield _cell(value, where, field, first_row + i)


def _cell(value, where: str, field: str, row: int) -> str:
  if not isinstance(value, str):
    raise ConfigError(f"{where} row {row}: column {field!r} holds "
                      f"{type(value).__name__}, not text: set data.text_field to a text column")
  return value
