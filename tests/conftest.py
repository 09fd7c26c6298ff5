"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os
import subprocess
import sys
from importlib import metadata

# The suite is compile-bound (tiny shapes, many layouts), so XLA:CPU compiles for speed of
# compiling: LLVM -O0 (halves compile time) and the legacy elemental emitters instead of the
# MLIR fusion emitters (a third less again: the emitters, not the pass pipeline, own XLA:CPU's
# compile time). Sharding, collectives and what the tests inspect hold under both; CPU
# numerics may move in the last bits. Set before jax is imported (subprocesses inherit them).
# jax 0.11's XLA has no legacy emitters, and an unknown XLA_FLAGS entry ends the process
# (exit 1 before pytest prints a line: "Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters",
# jax 0.11.2 on an H200, 2026-11-30), so that switch is set only where XLA has it.
LEGACY_EMITTERS = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2]) < (0, 11)
# Compile options for XLA:CPU's default (fusion) emitters, for the tests whose figures need them.
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if LEGACY_EMITTERS else {}
_FLAGS = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_backend_optimization_level=0",
              *(("--xla_cpu_use_fusion_emitters=false",) if LEGACY_EMITTERS else ())):
  if _flag.split("=")[0] not in _FLAGS:
    _FLAGS += " " + _flag
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402

from jscale.config_load import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests that compile and run Hopper-only kernels (Mosaic GPU, cuDNN at MLA's head sizes) run
# where the first device is one: `gpu_session.py`'s parts run them on a lent GPU.
ON_HOPPER = (jax.default_backend() == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import launch_local  # noqa: E402  pylint: disable=wrong-import-position


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


# A run small enough that `python -m jscale.train` takes seconds once its program is cached
# (`child_env`): 12 steps, a line every 4, an eval of 2 batches every 6, a checkpoint at the end.
TINY_RUN = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
            "model.d_ff=64", "train.seq_len=16", "train.steps=12", "train.eval_every=6",
            "train.eval_batches=2", "logging.every=4", "logging.plot=false",
            "logging.tensorboard=false", "checkpoint.every=1000"]


@pytest.fixture(scope="session")
def child_env(tmp_path_factory):
  """The environment of `python -m jscale.train` subprocesses: this one's with 1 CPU device per
  process and a persistent compilation cache shared by the session's subprocesses (a program
  run by several tests compiles once: ~30 s to ~8 s a run on a busy 2-core machine). Under
  xdist every worker shares it (the workers' temporary directories have one parent)."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    cache = tmp_path_factory.getbasetemp().parent / "jax_cache"
    cache.mkdir(exist_ok=True)
  else:
    cache = tmp_path_factory.mktemp("jax_cache")
  env = launch_local.child_env(dict(os.environ), 1)
  env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_cache, child_env):
  """`python -m jscale.train` of TINY_RUN with its output to a pipe (as under SLURM or nohup):
  (output_dir, what it printed, stdout and stderr merged)."""
  out = tmp_path_factory.mktemp("tiny_run")
  done = subprocess.run([sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml",
                         *TINY_RUN, f"train.output_dir={out}", f"data.cache_dir={data_cache}"],
                        cwd=ROOT, env=child_env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-3000:]
  return out, done.stdout


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
