"""Loading a `Config`: YAML files, dotted `key=value` overrides, model presets.

`load_config(path, overrides)` reads a YAML file, applies overrides such as
`train.steps=100 model.n_layers=4`, fills a model preset (`model.preset: llama3_8b`) or, with
`checkpoint.init_from`, takes the model from that checkpoint (`jscale.ckpt.init_from`), and runs
the device-independent checks (`validate.check_config`), so that a bad value fails here, naming
the key and the fix, before anything is traced or compiled.
"""

from __future__ import annotations

import os
import typing
from typing import Any

import yaml

from jscale import config_cli, presets, validate
from jscale.ckpt import init_from
from jscale.config import Config, ConfigError, ModelConfig
from jscale.config_dict import from_dict, optional_sections


def load_config(path: str | os.PathLike | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
  """Reads `path` (YAML), applies dotted `key=value` overrides, validates.

  With `checkpoint.init_from`, the model config is the checkpoint's with only the `model.*`
  keys written here applied on top (`jscale.ckpt.init_from.merge_model`).
  """
  raw: dict[str, Any] = {}
  if path is not None:
    raw = _read_yaml(path)
  for item in overrides:
    _apply_override(raw, item)
  if isinstance(raw.get("checkpoint"), dict) and raw["checkpoint"].get("init_from"):
    raw = init_from.merge_model(raw)
  _check_sections(raw.get("model") or {})
  cfg = from_dict(raw)
  validate.check_config(cfg)
  return cfg


def _check_sections(model: dict[str, Any]) -> None:
  """A key of an optional model section that is off (`model.moe: null`, the default) does not
  switch the whole feature on: it is refused unless the same file or command turns the section
  on, with its switch key (`model.moe.n_experts`) or a preset that has it."""
  preset = presets.PRESETS.get(model.get("preset") or "", {})
  for name, cls in optional_sections(ModelConfig).items():
    section = model.get(name)
    if not isinstance(section, dict) or not section or cls.SWITCH in section or preset.get(name):
      continue
    given = ", ".join(f"model.{name}.{k}={v}" for k, v in section.items())
    having = sorted(p for p, keys in presets.PRESETS.items() if keys.get(name))
    with_preset = f" (or a preset that has it: model.preset={' | '.join(having)})" if having else ""
    raise ConfigError(f"{given}: model.{name} is off in this config; set model.{name}."
                      f"{cls.SWITCH} to turn {cls.FEATURE} on{with_preset}, or drop the key")


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
    name = key.lstrip("-")
    full = [k for k in config_cli.all_keys() if k.rsplit(".", 1)[-1] == name]
    hint = f"did you mean {' or '.join(f'{k}={text}' for k in full)}? " if full and sep else ""
    raise ConfigError(f"override {item!r}: {hint}write it as section.key=value, e.g. "
                      "train.steps=100")
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


def from_overrides(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
  """A validated Config from nested dicts `raw` (e.g. a saved run's) with dotted `key=value`
  `overrides` applied on top."""
  raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
  for item in overrides:
    _apply_override(raw, item)
  cfg = from_dict(raw)
  validate.check_config(cfg)
  return cfg
