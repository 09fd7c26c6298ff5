"""End to end: the train loop, its outputs, resume after interruption, init_from, atomicity."""

import glob
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from jscale.ckpt import params_io
from jscale import train as train_lib
from jscale.step import state as state_lib

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu"}


def _cfg(out, cache, *extra):
  return small_config(None, f"train.output_dir={out}", f"data.cache_dir={cache}",
                      "checkpoint.every=3", "checkpoint.async_save=true", *extra)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, data_cache):
  out = tmp_path_factory.mktemp("full")
  cfg = _cfg(out, data_cache, "train.profile_steps=[2,3]", "train.eval_every=3",
             "logging.tensorboard=true")
  return out, train_lib.run(cfg)


def test_run_writes_metrics_tensorboard_profile_checkpoints(full_run):
  out, summary = full_run
  rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
  assert REQUIRED <= set(train_rows[-1])
  assert train_rows[-1]["mfu"] is None  # CPU: no peak FLOP/s known
  assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
  assert glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))
  assert glob.glob(str(out / "profile" / "**" / "*.xplane.pb"), recursive=True)
  assert sorted(os.listdir(out / "checkpoints")) == ["3", "6"]
  assert summary["losses"][6] < summary["losses"][1]


def test_interrupted_run_resumes_exactly(full_run, tmp_path, data_cache):
  _, full = full_run
  cfg = _cfg(tmp_path, data_cache)
  first = train_lib.run(cfg, stop_after=3)  # "killed" after step 3, checkpoint written
  assert first["final_step"] == 3
  # A crash during a later save leaves only orbax's temporary directory: it must be ignored.
  junk = tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-1234567"
  (junk / "state").mkdir(parents=True)
  (junk / "state" / "garbage").write_bytes(b"half written")
  second = train_lib.run(cfg)
  assert sorted(second["losses"]) == [4, 5, 6]
  losses = {**first["losses"], **second["losses"]}
  assert losses == full["losses"]  # bit-exact, every step
  a, b = full["state"]["params"], second["state"]["params"]
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_init_from_params_checkpoint(full_run, tmp_path, data_cache):
  _, full = full_run
  cfg = _cfg(tmp_path / "run", data_cache)
  model = nnx.merge(state_lib.model_graphdef(cfg), full["state"]["params"])
  params_io.save_params(str(tmp_path / "init"), model, cfg.model)
  cfg = _cfg(tmp_path / "run", data_cache, f"checkpoint.init_from={tmp_path}/init")
  start = train_lib.run(cfg, stop_after=0)
  assert start["final_step"] == 0
  a, b = full["state"]["params"], start["state"]["params"]
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  # The model comes from the checkpoint: a differing shape key fails when the config loads.
  with pytest.raises(train_lib.ConfigError, match="model.d_ff"):
    _cfg(tmp_path / "run2", data_cache, f"checkpoint.init_from={tmp_path}/init", "model.d_ff=256")


def test_cli_subprocess(tmp_path, data_cache):
  """The README command, as a real process (2 steps of a small model)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cmd = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", "train.steps=2",
         "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
         "model.d_ff=64", "train.seq_len=16", f"train.output_dir={tmp_path}",
         f"data.cache_dir={data_cache}", "train.eval_every=0", "logging.every=1"]
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "done: step 2, loss" in out.stdout
  assert len(open(tmp_path / "metrics.jsonl").readlines()) == 2
