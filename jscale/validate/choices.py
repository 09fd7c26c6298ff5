"""One rule for every choice: a `Literal` field anywhere in the config (nested sections such as
`model.moe` or `model.rope_scaling` included, where set) holds one of its values."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator

from jscale.config import ConfigError


def check_choices(section: Any, prefix: str = "") -> None:
  """ConfigError `<key>=<value>: choose one of ...` for the first `Literal` field of `section`
  (a config dataclass; its nested sections recursively) that holds another value."""
  hints = typing.get_type_hints(type(section))
  for field in dataclasses.fields(section):
    value, key = getattr(section, field.name), f"{prefix}{field.name}"
    if dataclasses.is_dataclass(value):
      check_choices(value, key + ".")
      continue
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
      for i, item in enumerate(value):  # data.mixture's sources
        check_choices(item, f"{key}[{i}].")
      continue
    allowed = literal_values(hints[field.name])
    if allowed is not None and value not in allowed:
      raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(str, allowed))}")


def literal_values(tp) -> tuple[Any, ...] | None:
  """The values a `Literal[...]` type (or `Literal[...] | None`) allows; None for other types."""
  if typing.get_origin(tp) is typing.Literal:
    return typing.get_args(tp)
  args = [a for a in typing.get_args(tp) if a is not type(None)]
  if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
    return typing.get_args(args[0]) + (None,)
  return None


def literal_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, tuple[Any, ...]]]:
  """(dotted key, allowed values) of every `Literal` field under config dataclass `cls`,
  optional sections included."""
  for name, tp in typing.get_type_hints(cls).items():
    nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
    if nested:
      yield from literal_keys(nested[0], f"{prefix}{name}.")
    elif (allowed := literal_values(tp)) is not None:
      yield f"{prefix}{name}", allowed
