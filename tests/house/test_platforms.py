"""JAX's CUDA plugin on a machine without a GPU, and a machine without the plugin: no command
prints a plugin or cuFFT traceback (`jscale.platforms.settle` starts the CPU alone), and the
commands that need the plugin (`jscale.predict`, `jscale.plan --verify`) say in one line what to
install, exit 2. Real subprocesses, as a user starts them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_RUN
from jscale import exit_codes, platforms

NO_PLUGIN = os.path.join(ROOT, "tests", "no_cuda_plugin.py")
NOISE = ("Traceback", "plugin configuration error", "cuFFT", "Unable to load")


def _env(child_env) -> dict[str, str]:
  """A child's environment with JAX_PLATFORMS unset (what a user's shell has)."""
  return {k: v for k, v in child_env.items() if k != "JAX_PLATFORMS"}


def _run(argv, env, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("argv", [
    ["-m", "jscale.predict", "--target", "h100x1"],
    ["-m", "jscale.plan", "--model", "llama3_8b", "--gpus", "8", "--seq", "4096",
     "--global-batch-tokens", "1048576", "--verify", "8", "--target", "h100x8"],
], ids=["predict", "plan_verify"])
def test_without_the_plugin_one_line_names_the_extra(argv, child_env):
  r = _run([NO_PLUGIN, argv[1], *argv[2:]], _env(child_env))
  assert r.returncode == exit_codes.BAD_INPUT, r.stdout + r.stderr
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: cannot compile for h100x") and '".[gpu-compile]"' in last
  assert "Traceback" not in r.stderr


@pytest.mark.skipif(not platforms.cuda_plugin_installed() or platforms.has_nvidia_gpu(),
                    reason="needs JAX's CUDA plugin installed on a machine without a GPU")
def test_with_the_plugin_and_no_gpu_training_prints_no_plugin_traceback(child_env, tmp_path,
                                                                        data_cache):
  r = _run(["-m", "jscale.train", "--config", "configs/tiny.yaml", *TINY_RUN, "train.steps=1",
            f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}"], _env(child_env))
  assert r.returncode == 0, r.stdout + r.stderr
  assert not [n for n in NOISE if n in r.stdout + r.stderr], r.stderr

