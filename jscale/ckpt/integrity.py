"""Whether a checkpoint can be read back, decided from its files before anything restores it.

The one owner of "is this checkpoint readable" for every command that reads one (train's resume
and its last save, eval, generate, convert, `checkpoint.init_from`). A training checkpoint step
(`<checkpoints>/<step>/`, laid out as `checkpoint` says) is intact when

- `meta/metadata` (the run's config), where present, is a JSON object;
- `data/` holds the iterator position of every process that wrote it: `process_<i>-of-<n>.json`
  for each i < n, each a JSON object;
- `state/_METADATA` (orbax's index of the arrays) is a JSON object naming the arrays; and
- every array it names is in the store, and every value the store holds (each zarr chunk and
  array header) reads back whole through tensorstore, the library orbax writes with.

A params checkpoint (`<dir>/params/`, from `jscale.convert`) is intact when its index and arrays
are. Reading every value back finds what storage loses (a truncated, missing or emptied file, a
missing index); orbax stores no checksums, so a flipped bit inside a value is not found.

A step written by another number of processes resumes where every process saved the same data
position (`global_position`: jscale's train iterator counts global batches); where they differ
it is intact but not resumable here: its `Finding` says so (`damaged=False`), and no command
moves it aside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import tensorstore as ts

# What the index calls an array that has values in the store.
_STORED_TYPES = ("jax.Array", "np.ndarray", "scalar")
_POSITION = re.compile(r"process_(\d+)-of-(\d+)\.json$")
_IN_FLIGHT = 32  # reads issued at once


@dataclasses.dataclass(frozen=True)
class Finding:
  """Why a checkpoint cannot be used: `part` of it (`arrays`, `array index`, `run metadata`,
  `data position`), what is wrong (`detail`, one line), and whether it is damaged or intact
  but written for another number of processes (`damaged=False`)."""
  where: str
  part: str
  detail: str
  damaged: bool = True

  def line(self) -> str:
    state = "is damaged" if self.damaged else "does not fit this run"
    return f"{self.where} {state}: {self.part}: {self.detail}"


def check_step(directory: str, step: int, *, processes: int | None = None,
               only: str | None = None, read_arrays: bool = True,
               share: tuple[int, int] = (0, 1)) -> Finding | None:
  """The first thing wrong with checkpoint `step` in `directory`, or None when it is intact.
  `processes`: the process count that will restore it (None: any). `only`: check just the
  arrays under this top-level key (`"params"`: what generate / eval / convert read; their data
  position and metadata are not needed then). `read_arrays=False`: the index only, no values.
  `share=(i, n)`: this caller reads every n-th value from the i-th (n processes split the
  reading; combine their findings)."""
  step_dir = os.path.join(directory, str(step))
  where = f"checkpoint step {step} in {directory}"
  if only is None:
    found = _check_meta(step_dir, where) or _check_position(step_dir, where, processes)
    if found:
      return found
  return check_store(os.path.join(step_dir, "state"), where, only=only,
                     read_arrays=read_arrays, share=share)


def check_store(store_dir: str, where: str, *, only: str | None = None, read_arrays: bool = True,
                share: tuple[int, int] = (0, 1)) -> Finding | None:
  """The first thing wrong with the orbax array store at `store_dir` (a step's `state/`, a
  params checkpoint's `params/`), or None. Arguments as `check_step`'s."""
  index = _read_json(os.path.join(store_dir, "_METADATA"))
  if not isinstance(index, dict) or not isinstance(index.get("tree_metadata"), dict):
    return Finding(where, "array index", f"{store_dir}/_METADATA is missing or not orbax's JSON "
                   "index")
  names = _array_names(index["tree_metadata"], only)
  if only is not None and not names:
    return Finding(where, "array index", f"it names no array under '{only}'")
  header = "zarr.json" if index.get("use_zarr3") else ".zarray"
  try:
    store = ts.KvStore.open(_kvstore_spec(store_dir, bool(index.get("use_ocdbt")))).result()
    keys = sorted(k.decode() for k in store.list().result())
  except Exception as e:  # tensorstore reports storage errors as several exception types
    return Finding(where, "arrays", f"the array store cannot be listed ({_reason(e, store_dir)})")
  present = set(keys)
  missing = [n for n in names if f"{n}/{header}" not in present]
  if missing:
    return Finding(where, "arrays", f"{len(missing)} of {len(names)} arrays are not in the store "
                   f"(first: {missing[0]})")
  if not read_arrays:
    return None
  named = set(names)
  wanted = [k for k in keys if k.split("/", 1)[0] in named]
  return _read_values(store, wanted[share[0]::share[1]], len(wanted), where, store_dir)


def _check_meta(step_dir: str, where: str) -> Finding | None:
  path = os.path.join(step_dir, "meta", "metadata")
  if not os.path.isdir(os.path.dirname(path)):
    return None  # a checkpoint saved without metadata (not by `jscale.train`)
  if not isinstance(_read_json(path), dict):
    return Finding(where, "run metadata", f"{path} is missing or not a JSON object")
  return None


def _check_position(step_dir: str, where: str, processes: int | None) -> Finding | None:
  data = os.path.join(step_dir, "data")
  found = {m.group(0): (int(m.group(1)), int(m.group(2)))
           for m in map(_POSITION.match, _listdir(data)) if m}
  counts = {n for _, n in found.values()}
  if len(counts) != 1:
    return Finding(where, "data position", f"{data} holds no single set of "
                   f"process_<i>-of-<n>.json files ({len(found)} found)")
  n = counts.pop()
  for i in range(n):
    name = f"process_{i}-of-{n}.json"
    if not isinstance(_read_json(os.path.join(data, name)), dict):
      return Finding(where, "data position", f"{data}/{name} is missing or not a JSON object")
  if processes is not None and n != processes and global_position(step_dir) is None:
    return Finding(where, "data position", f"written by {n} processes at different positions, "
                   f"and this run has {processes}; resume it with {n}", damaged=False)
  return None


def global_position(step_dir: str) -> dict | None:
  """The data position of a step as one state every process count can resume: each process's
  saved iterator state, where they are all equal (jscale's train iterator counts global
  batches: `jscale.data.iterators`); None where they differ, or none is readable."""
  data = os.path.join(step_dir, "data")
  names = [x for x in _listdir(data) if _POSITION.match(x)]
  states = [_read_json(os.path.join(data, x)) for x in names]
  if not states or not all(isinstance(x, dict) and x == states[0] for x in states):
    return None
  return states[0]


def _read_values(store: Any, keys: list[str], total: int, where: str,
                 store_dir: str) -> Finding | None:
  """Reads each of `keys` whole; a Finding naming how many failed and the first."""
  failed: list[tuple[str, str]] = []
  for start in range(0, len(keys), _IN_FLIGHT):
    batch = keys[start:start + _IN_FLIGHT]
    for key, future in zip(batch, [store.read(k) for k in batch]):
      try:
        result = future.result()
      except Exception as e:  # as in check_store
        failed.append((key, _reason(e, store_dir)))
        continue
      if result.state != "value" or not result.value:  # a missing data file reads as empty
        failed.append((key, "listed but missing or empty"))
  if not failed:
    return None
  key, reason = failed[0]
  return Finding(where, "arrays", f"{len(failed)} of {total} stored values unreadable (first: "
                 f"{key}: {reason})")


def _array_names(tree: dict[str, Any], only: str | None) -> list[str]:
  """The store names ('params.blocks.attn.wq') of the index's arrays, under `only` if given."""
  names = []
  for entry in tree.values():
    path = [str(k["key"]) for k in entry.get("key_metadata", [])]
    if entry.get("value_metadata", {}).get("value_type") not in _STORED_TYPES:
      continue
    if only is None or (path and path[0] == only):
      names.append(".".join(path))
  return sorted(names)


def _kvstore_spec(store_dir: str, ocdbt: bool) -> dict[str, Any]:
  base = {"driver": "file", "path": os.path.abspath(store_dir) + "/"}
  return {"driver": "ocdbt", "base": base} if ocdbt else base


def _reason(e: Exception, store_dir: str) -> str:
  """A storage error in one short line, its paths relative to the store (tensorstore appends
  source locations)."""
  text = " ".join(str(e).split("[source locations]")[0].split())
  text = text.replace(os.path.abspath(store_dir) + "/", "")
  return text if len(text) <= 200 else text[:197] + "..."


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _listdir(path: str) -> list[str]:
  return sorted(os.listdir(path)) if os.path.isdir(path) else []
