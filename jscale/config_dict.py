"""A `Config` from nested dicts: the one conversion config loading, checkpoints (a saved
`model.yaml`, a run's saved config) and `checkpoint.init_from` all use.

Unknown keys are refused with the closest valid one; values are coerced to the field's type
(YAML reads `3e-4` as a string); a `model.preset` fills the model keys not given. Whether a
value is allowed is `jscale.validate`'s question, not this module's.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from jscale import presets
from jscale.config import Config, ConfigError


def from_dict(raw: dict[str, Any]) -> Config:
  """Builds a Config from nested dicts, rejecting unknown keys and wrong types."""
  raw = dict(raw)
  model = dict(raw.get("model") or {})
  if model.get("preset") is not None:
    raw["model"] = presets.apply(model)
  return _build(Config, raw, "")


def optional_sections(cls) -> dict[str, type]:
  """The fields of dataclass `cls` that are a section or None (`model.moe`): name -> its
  dataclass."""
  out = {}
  for name, tp in typing.get_type_hints(cls).items():
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
      out[name] = args[0]
  return out


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
