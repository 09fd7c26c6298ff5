"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

# LLVM optimisation level 0 for the CPU backend: the suite is compile-bound (tiny shapes, many
# layouts), and -O0 halves compile time; HLO passes, sharding, collectives and buffer assignment
# (memory_analysis) are unchanged. Set before jax is imported (subprocesses inherit it).
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
  _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (after the environment is set)

from jscale.config_load import load_config  # noqa: E402


def small_config(tmp_path=None, *overrides: str):
  """A model small enough to compile in seconds on a 2-core CPU, trained on the stdlib."""
  base = ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
          "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.batch_size=8",
          "train.seq_len=32", "train.steps=6", "train.warmup_steps=2", "train.eval_every=0",
          "logging.progress=false", "logging.every=1", "logging.plot=false"]
  if tmp_path is not None:
    base += [f"train.output_dir={tmp_path}/run", f"data.cache_dir={tmp_path.parent}/cache"]
  return load_config(None, base + list(overrides))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
  """One tokenized stdlib cache for the whole session."""
  return str(tmp_path_factory.mktemp("jscale_cache"))


@pytest.fixture(scope="session")
def traced_run(tmp_path_factory, data_cache):
  """A tiny 4-step CPU training run with steps 1-2 traced (jax.profiler), and what it printed:
  (output_dir, stdout). Shared by the tests of the run's metadata and of the profile summary."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  from jscale import train as train_lib  # pylint: disable=import-outside-toplevel
  tmp = tmp_path_factory.mktemp("traced_run")
  cfg = small_config(tmp, f"data.cache_dir={data_cache}", "train.steps=4",
                     "train.profile_steps=[1,2]", "model.n_layers=1")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    train_lib.run(cfg)
  return tmp / "run", out.getvalue()
