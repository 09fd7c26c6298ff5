"""Every numeric, boolean and list config key rejects a wrong value when the config loads
(before anything compiles), with an error naming the key; ranges that would only fail inside
the jitted step (Adam's betas, eps) are checked too."""

import dataclasses
import types
import typing

import pytest

from jscale.config import Config, ConfigError
from jscale.config_load import load_config
from jscale.validate.choices import literal_keys


def _leaves(cls, prefix=""):
  """(dotted key, type) of every scalar or list field, nested sections included."""
  for f in dataclasses.fields(cls):
    tp = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    inner = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    if dataclasses.is_dataclass(inner):
      yield from _leaves(inner, f"{prefix}{f.name}.")
    elif inner in (int, float, bool) or typing.get_origin(inner) in (list, tuple):
      yield f"{prefix}{f.name}", inner


KEYS = sorted(_leaves(Config), key=lambda kv: kv[0])


def test_every_typed_key_is_covered():
  names = {k for k, _ in KEYS}
  assert {"train.lr", "train.b1", "train.weight_decay", "train.steps", "checkpoint.resume",
          "train.profile_steps", "fp8.targets", "checkpoint.every_minutes",
          "distributed.heartbeat_timeout_s", "model.moe.top_k"} <= names
  assert len(KEYS) > 60


@pytest.mark.parametrize("key, tp", KEYS, ids=[k for k, _ in KEYS])
def test_wrong_type_names_the_key(key, tp):
  wrong = "abc"
  if typing.get_origin(tp) is tuple:
    wrong = "[1.5]"  # a list of strings: a number is not one
  elif typing.get_origin(tp) is list:
    wrong = "[a,b]" if typing.get_args(tp)[0] is not str else "abc"
  extra = ["model.moe.n_experts=4"] if key.startswith("model.moe.") else []
  if key.startswith("model.rope_scaling."):
    extra = ["model.rope_scaling.factor=8"] if key != "model.rope_scaling.factor" else []
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    load_config(None, extra + [f"{key}={wrong}"])


@pytest.mark.parametrize("override", ["train.lr=fast", "train.weight_decay=abc", "train.b1=abc",
                                      "train.lr=nan", "train.lr=inf", "train.b1=1.0",
                                      "train.b2=-0.1", "train.eps=0", "train.peak_flops=0",
                                      "checkpoint.every_minutes=-1",
                                      "distributed.heartbeat_timeout_s=0",
                                      "checkpoint.resume=maybe"])
def test_values_that_used_to_crash_late(override):
  with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
    load_config(None, [override])


CHOICES = sorted(literal_keys(Config))


def test_every_choice_key_is_swept():
  keys = {k for k, _ in CHOICES}
  assert {"model.moe.gemm", "model.moe.dispatch", "model.moe.router", "model.moe.exchange",
          "model.rope_scaling.rope_type", "pipeline.schedule", "train.remat"} <= keys


@pytest.mark.parametrize("key, allowed", CHOICES, ids=[k for k, _ in CHOICES])
def test_a_bad_choice_anywhere_gets_the_one_line_error(key, allowed):
  # The section a nested key lives in is switched on by a preset that has it.
  preset = ["model.preset=deepseek_v3_tiny"] if key.startswith("model.") else []
  with pytest.raises(ConfigError) as e:
    load_config(None, [*preset, f"{key}=pallass"])
  assert str(e.value) == f"{key}='pallass': choose one of {', '.join(map(str, allowed))}"
