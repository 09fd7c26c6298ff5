"""What commands print, read as a user would: counts with units, plurals, directions."""

import argparse

import jax
import pytest

from jscale import eval as eval_cli
from jscale import mesh as mesh_lib
from jscale import metrics
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.predict import summary


@pytest.mark.parametrize("n, text", [(512, "512"), (16_384, "16.4k"), (3_300_000, "3.3M"),
                                     (38.24e9, "38.2B")])
def test_counts_carry_their_unit(n, text):
  assert metrics.count_text(n) == text


def test_one_device_is_not_devices():
  cfg = load_config(None, ["mesh.data=3"]).mesh
  with pytest.raises(ConfigError, match=r"but the run has 1 device: "):
    mesh_lib.make_mesh(cfg, jax.devices()[:1])


def test_eval_refuses_zero_batches():
  with pytest.raises(argparse.ArgumentTypeError, match="give a positive number of batches"):
    eval_cli._batches("0")  # pylint: disable=protected-access
  assert eval_cli._batches("all") == 0 and eval_cli._batches("3") == 3  # pylint: disable=protected-access


def test_the_gap_to_the_target_reads_forwards():
  assert summary._to_target(0.0613) == "61.3 ms less than predicted"  # pylint: disable=protected-access
  assert summary._to_target(-0.002) == "already 2.0 ms under it"  # pylint: disable=protected-access
