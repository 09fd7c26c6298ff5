"""Keys that have no effect under the rest of the config (`jscale.config_conditional.RULES`,
which says why each is refused or warned about): refused, or a warning line printed once at
startup, naming why.

A key is looked at only where it differs from its default: a value nobody wrote cannot
surprise. `check_mesh` raises the refusals; the trainer prints `no_op_warnings(...)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jscale.config import Config, ConfigError
from jscale.config_conditional import RULES, Sizes


def check(cfg: Config, sizes: Sizes) -> list[str]:
  """Raises ConfigError for the first refused no-op; returns a warning line for each other."""
  out = []
  for rule in RULES:
    value, default = _value_and_default(cfg, rule.key)
    if value is _ABSENT or value == default or rule.live(cfg, sizes):
      continue
    shown = list(value) if isinstance(value, tuple) else value
    line = f"{rule.key}={shown} has no effect: {rule.why} ({rule.fix}"
    if rule.refuse:
      raise ConfigError(f"{line}, or drop the key)")
    out.append(f"warning: {line})")
  return out


_ABSENT = object()


def _value_and_default(cfg: Config, key: str) -> tuple[Any, Any]:
  """The value at dotted `key` and its dataclass default; `_ABSENT` where a section on the way
  is off (null: `model.moe` of a dense model)."""
  node: Any = cfg
  *path, name = key.split(".")
  for part in path:
    node = getattr(node, part)
    if node is None:
      return _ABSENT, None
  field = next(f for f in dataclasses.fields(node) if f.name == name)
  default = (field.default_factory() if field.default is dataclasses.MISSING  # type: ignore[misc]
             else field.default)
  return getattr(node, name), default
