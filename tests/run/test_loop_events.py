"""The training loop's periodic events, each alone: when a log row, an eval and a profile are
due, and the clock that times steps (`jscale.run.loop`). The loop itself runs in
test_run_lifecycle and test_train."""

import os
import time

import jax.numpy as jnp

from jscale.config_load import load_config
from jscale.run import loop


def test_a_row_is_logged_every_logging_every_and_at_the_end():
  cfg = load_config(None, ["logging.every=10"])
  assert [d for d in range(1, 26) if loop.log_due(cfg, d, end=25)] == [10, 20, 25]


def test_evals_come_every_eval_every_and_at_train_steps_when_there_is_data():
  cfg = load_config(None, ["train.eval_every=5", "train.steps=12"])
  assert [d for d in range(1, 13) if loop.eval_due(cfg, d, has_eval=True)] == [5, 10, 12]
  assert not any(loop.eval_due(cfg, d, has_eval=False) for d in range(1, 13))
  off = load_config(None, ["train.eval_every=0", "train.steps=12"])
  assert not any(loop.eval_due(off, d, has_eval=True) for d in range(1, 13))


def test_the_step_clock_leaves_out_what_it_was_restarted_after():
  clock = loop.StepClock(start=0)
  assert clock.time is None  # the first step (compilation) is not timed
  clock.restart(1)
  time.sleep(0.02)
  per_step = clock.per_step(3)  # two steps in ~20 ms
  assert 0.005 < per_step < 1.0 and clock.step == 3
  assert clock.per_step(3) is None  # no step since


def test_a_profile_traces_from_its_first_step_to_its_last(tmp_path):
  off = loop.Profile(None, str(tmp_path))
  off.before(0)
  assert not off.tracing
  profile = loop.Profile([1, 2], str(tmp_path))
  profile.before(0)
  assert not profile.tracing
  profile.before(1)
  assert profile.tracing
  profile.after(1, jnp.ones(2))
  assert profile.tracing  # until after its last step
  profile.after(2, jnp.ones(2))
  assert not profile.tracing
  traces = [f for _, _, files in os.walk(tmp_path / "profile") for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces)
  profile.close()  # closing twice is harmless
