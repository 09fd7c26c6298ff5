"""`parallel.schedule_costs` on this CPU machine: refused where the predictor has no rates for
the devices, and the trainer's ahead-of-time step (what it runs under `predicted` on an H100 or
H200) equals its jitted step, state and metrics. What the predicted costs do to a GPU program:
tests/predict/test_schedule_costs.py."""

import jax
import numpy as np
import pytest
from conftest import small_config

from jscale import runtime
from jscale.analysis import introspect
from jscale.config import ConfigError
from jscale.run import scheduled
from jscale.validate import machine


def test_predicted_costs_are_refused_off_an_h100_or_h200():
  with pytest.raises(ConfigError, match=r"parallel.schedule_costs=predicted .*'cpu'.*"
                                        r"set parallel.schedule_costs=default"):
    machine.check_schedule_costs(small_config(None, "parallel.schedule_costs=predicted"),
                                 jax.devices()[0])
  machine.check_schedule_costs(small_config(None), jax.devices()[0])  # default: any device


def _batch(cfg, sharding):
  rng = np.random.default_rng(0)
  shapes = introspect.abstract_batch(cfg)
  host = {k: (rng.integers(0, cfg.model.vocab_size, s.shape).astype(s.dtype) if k != "loss_mask"
              else np.ones(s.shape, s.dtype)) for k, s in shapes.items()}
  return jax.device_put(host, sharding)


def test_the_guided_step_runs_as_the_jitted_step():
  cfg = small_config(None, "mesh.data=2", "mesh.fsdp=2", "parallel.zero_stage=3",
                     "parallel.schedule_costs=predicted")
  rt = runtime.build(cfg, jax.devices()[:4])
  jitted, guided = rt.train_step(), scheduled.train_step(rt.cfg, rt, gpu="h100")
  assert isinstance(guided, jax.stages.Compiled)
  batch = _batch(cfg, rt.layouts.batch())
  want_state, want = jitted(rt.init_state(), batch)
  got_state, got = guided(rt.init_state(), batch)  # donates its state, as the trainer's does
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               got_state["params"], want_state["params"])
