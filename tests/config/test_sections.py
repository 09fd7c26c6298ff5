"""Explicit sections: a key of an optional model section that is off (`model.moe: null`) does not
switch the feature on. It is refused naming the key and the switch, unless the same file or
command turns the section on (its switch key, a preset that has it, or the section written as
`{}`). Walked for every optional section the config has."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jscale import presets
from jscale.config import ConfigError, ModelConfig
from jscale.config_dict import optional_sections
from jscale.config_load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SECTIONS = optional_sections(ModelConfig)
NEEDS = {"mla": "n_kv_heads"}  # MLA has one key / value head per query head: tiny's 8


def test_the_optional_sections_each_name_a_switch():
  assert set(SECTIONS) == {"moe", "mla", "mtp", "rope_scaling"}
  for cls in SECTIONS.values():
    assert cls.SWITCH in {f.name for f in dataclasses.fields(cls)} and cls.FEATURE


def _other_key(cls) -> tuple[str, object]:
  """A key of the section other than its switch, with its default value."""
  field = next(f for f in dataclasses.fields(cls) if f.name != cls.SWITCH)
  return field.name, field.default


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_a_key_of_an_off_section_is_refused(name, tmp_path):
  cls = SECTIONS[name]
  key, value = _other_key(cls)
  override = f"model.{name}.{key}={value}"
  with pytest.raises(ConfigError) as e:
    load_config(TINY, [override])
  msg = str(e.value)
  assert msg.startswith(f"{override}: model.{name} is off in this config; set "
                        f"model.{name}.{cls.SWITCH} to turn {cls.FEATURE} on"), msg
  # ... written in a file, the same.
  path = tmp_path / "c.yaml"
  path.write_text(f"model:\n  preset: tiny\n  {name}:\n    {key}: {value}\n")
  with pytest.raises(ConfigError, match=f"model.{name} is off in this config"):
    load_config(str(path))


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_the_same_command_or_file_turns_it_on(name, tmp_path):
  cls = SECTIONS[name]
  key, value = _other_key(cls)
  switch = f"model.{name}.{cls.SWITCH}={getattr(cls(), cls.SWITCH)}"
  extra = {f"model.{NEEDS[name]}": 8} if name in NEEDS else {}
  cfg = load_config(TINY, [switch, f"model.{name}.{key}={value}",
                           *(f"{k}={v}" for k, v in extra.items())])
  assert getattr(cfg.model, name) == cls()
  path = tmp_path / "c.yaml"
  lines = "".join(f"  {k.split('.')[1]}: {v}\n" for k, v in extra.items())
  path.write_text(f"model:\n  preset: tiny\n{lines}  {name}: {{}}\n")  # on, keys default
  assert getattr(load_config(str(path)).model, name) == cls()
  having = sorted(p for p, keys in presets.PRESETS.items() if keys.get(name))
  if having:  # a preset that has the section: its keys may be changed alone
    cfg = load_config(None, [f"model.preset={having[0]}", f"model.{name}.{key}={value}"])
    assert getattr(getattr(cfg.model, name), key) == value
