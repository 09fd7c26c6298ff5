"""Config keys on the command line: `--help` lists every key of the config dataclasses with its
default and allowed values (walked here independently of `jscale.config_cli`), docs/config.md is
that reference as generated, `--print-config` prints the resolved config without starting a
run, `--section.key=value` is an override, and a stray option is refused naming the key."""

import dataclasses
import os
import typing

import pytest
import yaml

from jscale import config as config_lib
from jscale import config_cli
from jscale import eval as eval_cli
from jscale import train
from jscale.config_load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _fields(cls, prefix=""):
  """(dotted key, default, type) of every leaf field, nested sections walked."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    sub = tp if dataclasses.is_dataclass(tp) else (
        inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None)
    if sub is not None:
      yield from _fields(sub, f"{prefix}{f.name}.")
      continue
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    yield f"{prefix}{f.name}", default, tp


def test_help_lists_every_key_with_its_default_and_values(capsys):
  with pytest.raises(SystemExit):
    train.main(["--help"])
  text = capsys.readouterr().out
  keys = list(_fields(config_lib.Config))
  assert len(keys) > 90
  for key, default, tp in keys:
    shown = yaml.safe_dump(list(default) if isinstance(default, tuple) else default,
                           default_flow_style=True).strip().removesuffix("...").strip()
    line = next((l for l in text.splitlines() if l.startswith(f"  {key} = ")), None)
    assert line is not None, f"{key} missing from --help"
    assert line.startswith(f"  {key} = {shown}  ("), line
    literal = [a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is typing.Literal]
    for value in (typing.get_args(literal[0]) if literal else ()):
      assert str(value) in line, (key, value, line)
  assert "model.attention_impl = auto  (auto | xla | cudnn | ring | pallas)" in text
  assert "      steps between evals of the val loss" in text  # the field's comment


def test_docs_config_md_is_the_generated_reference():
  with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
    assert f.read() == config_cli.markdown(), (
        "docs/config.md is stale: python -m jscale.config_cli > docs/config.md")


def test_print_config_prints_the_resolved_config_and_starts_nothing(capsys, tmp_path):
  out = tmp_path / "run"
  assert train.main(["--config", TINY, "--print-config", f"--train.output_dir={out}",
                     "--train.steps", "7", "model.n_layers=2"]) == 0
  printed = capsys.readouterr().out
  (tmp_path / "printed.yaml").write_text(printed)
  want = load_config(TINY, [f"train.output_dir={out}", "train.steps=7", "model.n_layers=2"])
  assert load_config(tmp_path / "printed.yaml") == want
  assert "preset: tiny" in printed and "d_model: 256" in printed  # the preset filled in
  assert not out.exists()


def test_dashed_overrides_are_overrides():
  rest, overrides = config_cli.split_argv(
      ["--config", "x.yaml", "--train.steps=3", "--model.d_model", "64", "data.seed=1"])
  assert rest == ["--config", "x.yaml", "data.seed=1"]
  assert overrides == ["train.steps=3", "model.d_model=64"]


@pytest.mark.parametrize("argv, message", [
    (["--steps=10"], "unrecognized argument --steps=10: did you mean train.steps?"),
    (["--train.stepz=10"], "unknown config key train.stepz: did you mean train.steps?"),
    (["steps=10"], "did you mean train.steps=10?"),
    (["--train.steps"], "--train.steps: give a value"),
])
def test_a_stray_option_names_the_key(capsys, argv, message):
  try:
    code = train.main(["--config", TINY, "--print-config", *argv])
  except SystemExit as e:  # argparse's own exit
    code = e.code
  assert code == 2
  assert message in capsys.readouterr().err


def test_eval_help_lists_the_keys_it_takes(capsys):
  with pytest.raises(SystemExit):
    eval_cli.main(["--help"])
  text = capsys.readouterr().out
  assert "  data.tokenizer = byte  (str)" in text and "  train.seq_len = 256  (int)" in text
  assert "  train.lr = " not in text  # not an eval key
