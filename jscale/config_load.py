"""Loading a `Config`: YAML files, dotted `key=value` overrides, model presets.

`load_config(path, overrides)` reads a YAML file, applies overrides such as
`train.steps=100 model.n_layers=4`, fills a model preset (`model.preset: llama3_8b`) or, with
`checkpoint.init_from`, takes the model from that checkpoint (`jscale.init_from`), and runs
the device-independent checks (`validate.check_config`), so that a bad value fails here, naming
the key and the fix, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any

import yaml

from jscale import presets
from jscale import validate
from jscale.config import Config, ConfigError


def load_config(path: str | os.PathLike | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
  """Reads `path` (YAML), applies dotted `key=value` overrides, validates.

  With `checkpoint.init_from`, the model config is the checkpoint's with only the `model.*`
  keys written here applied on top (`jscale.init_from.merge_model`).
  """
  raw: dict[str, Any] = {}
  if path is not None:
    raw = _read_yaml(path)
  for item in overrides:
    _apply_override(raw, item)
  if isinstance(raw.get("checkpoint"), dict) and raw["checkpoint"].get("init_from"):
    # Imported here: init_from reads checkpoints with from_dict (an import cycle otherwise).
    from jscale import init_from  # pylint: disable=import-outside-toplevel
    raw = init_from.merge_model(raw)
  cfg = from_dict(raw)
  validate.check_config(cfg)
  return cfg


def from_dict(raw: dict[str, Any]) -> Config:
  """Builds a Config from nested dicts, rejecting unknown keys and wrong types."""
  raw = dict(raw)
  model = dict(raw.get("model") or {})
  if model.get("preset") is not None:
    raw["model"] = presets.apply(model)
  return _build(Config, raw, "")


def _read_yaml(path) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file; pass a YAML file such as configs/tiny.yaml")
  with open(path, encoding="utf-8") as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"--config {path} is not valid YAML: {e}") from None
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ConfigError(f"--config {path}: top level must be a mapping of sections "
                      f"(model:, train:, ...), got {type(raw).__name__}")
  return raw


def _apply_override(raw: dict[str, Any], item: str) -> None:
  key, sep, text = item.partition("=")
  if not sep or not key or "." not in key:
    raise ConfigError(f"override {item!r}: write it as section.key=value, e.g. train.steps=100")
  try:
    value = yaml.safe_load(text) if text else None
  except yaml.YAMLError:
    value = text
  node = raw
  parts = key.split(".")
  for p in parts[:-1]:
    if node.get(p) is None:
      node[p] = {}
    if not isinstance(node[p], dict):
      raise ConfigError(f"override {item!r}: {p} is not a section")
    node = node[p]
  node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str):
  if not isinstance(raw, dict):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in raw:
    if key not in names:
      close = difflib.get_close_matches(str(key), names, n=1)
      hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(names)}"
      raise ConfigError(f"unknown config key {prefix}{key}: {hint}")
  kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in raw.items()}
  return cls(**kwargs)


def _coerce(tp, value, key):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      return None
    return _coerce(args[0], value, key)
  if origin is typing.Literal:
    # Only the type here (a string); whether it is one of the choices is validate's check.
    return _coerce(type(typing.get_args(tp)[0]), value, key)
  if dataclasses.is_dataclass(tp):
    return _build(tp, value or {}, key + ".")
  if tp is dict or origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {{mlp: tensor}}")
    return dict(value)
  if origin is tuple:  # tuple[X, ...]: a list in YAML, a tuple (hashable) in the config
    if not isinstance(value, (list, tuple)):
      value = [value]  # fp8.targets=mlp
    return tuple(_coerce(typing.get_args(tp)[0], v, key) for v in value)
  if origin is list:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[10,20]")
    (elem,) = typing.get_args(tp)
    return [_coerce(elem, v, key) for v in value]
  if value is None:
    raise ConfigError(f"{key} may not be empty: give a {tp.__name__}")
  if tp is float:
    return _float(value, key)
  if tp is bool and not isinstance(value, bool):
    raise ConfigError(f"{key}={value!r}: expected true or false")
  if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise ConfigError(f"{key}={value!r}: expected an integer")
  if tp is str and not isinstance(value, str):
    raise ConfigError(f"{key}={value!r}: expected a string")
  return value


def _float(value, key) -> float:
  """A finite float from a YAML number or a numeric string (YAML reads 3e-4, no dot, as one)."""
  out = None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    out = float(value)
  elif isinstance(value, str):
    try:
      out = float(value)
    except ValueError:
      pass
  if out is None or not math.isfinite(out):
    raise ConfigError(f"{key}={value!r}: expected a finite number, e.g. {key}=3e-4")
  return out


def from_overrides(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
  """A validated Config from nested dicts `raw` (e.g. a saved run's) with dotted `key=value`
  `overrides` applied on top."""
  raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
  for item in overrides:
    _apply_override(raw, item)
  cfg = from_dict(raw)
  validate.check_config(cfg)
  return cfg
