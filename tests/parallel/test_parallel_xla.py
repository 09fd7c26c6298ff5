"""xla mode on 8 simulated devices: every layout initialises as one device does and reproduces
the single-device losses."""

import jax
import numpy as np
import pytest

import parity
from conftest import small_config
from jscale import runtime
from jscale.config import ConfigError
from parity import ACCUMULATE, BASE, LAYOUTS, losses, reference

INIT_LAYOUTS = [LAYOUTS[-1], ("mesh.tensor=4", "mesh.data=2"),
                ("mesh.stage=2", "mesh.data=4", "pipeline.schedule=interleaved",
                 "pipeline.virtual_stages=2", "model.n_layers=4"),
                ("mesh.expert=4", "mesh.data=2", "model.moe.n_experts=4", "fp8.enabled=true")]


@pytest.mark.parametrize("layout", INIT_LAYOUTS, ids=lambda c: "+".join(c))
def test_sharded_init_equals_one_devices(layout):
  # What the parity tests rely on (`parity.initial_state` places one device's initial state
  # instead of compiling each layout's init): ZeRO-3 x TP, a pipeline storing its layers in
  # chunk order, experts and FP8's scale state; bit for bit.
  rt = runtime.build(small_config(None, *BASE, *layout), jax.devices()[:8])
  got, want = jax.device_get(rt.init_state()), jax.device_get(parity.initial_state(rt))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "+".join(c))
def test_layout_matches_single_device(layout):
  np.testing.assert_allclose(losses(layout), reference(), rtol=1e-5)


@pytest.mark.parametrize("numerics", ACCUMULATE, ids=lambda c: "+".join(c))
def test_3d_layout_with_accumulation_and_remat(numerics):
  np.testing.assert_allclose(losses(LAYOUTS[-1] + numerics), reference(*numerics), rtol=1e-5)


@pytest.mark.parametrize("overrides, key", [
    (("mesh.data=3",), "mesh sizes multiply to 3"),
    (("mesh.tensor=8", "mesh.data=1"), "model.n_heads"),
    (("mesh.tensor=4", "mesh.data=2", "model.n_kv_heads=2"), "model.n_kv_heads"),
    (("mesh.data=8", "train.batch_size=12"), "train.batch_size"),
    (("mesh.data=4", "mesh.tensor=2", "model.vocab_size=257"), "model.vocab_size"),
    (("mesh.data=4", "mesh.tensor=2", "parallel.sequence_parallel=true", "train.seq_len=31",
      "model.max_seq_len=64"), "train.seq_len"),
])
def test_bad_layouts_fail_before_compile(overrides, key):
  cfg = small_config(None, *BASE, *overrides)
  with pytest.raises(ConfigError, match=key):
    runtime.build(cfg)


def test_two_processes_match_one(tmp_path, data_cache):
  """2 processes x 4 CPU devices (gloo) train data=2 x fsdp=2 x tensor=2 like 1 x 8 devices."""
  import json
  import os
  import subprocess
  import sys
  from jscale import train as train_lib
  layout = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
            "parallel.zero_stage=3"]
  common = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.d_ff=128", "model.dtype=float32", "train.batch_size=8", "train.seq_len=32",
            "train.steps=4", "train.warmup_steps=0", "train.eval_every=0", "logging.every=1",
            "logging.progress=false", "checkpoint.every=2", f"data.cache_dir={data_cache}"]
  single = train_lib.run(small_config(None, *common, *layout,
                                      f"train.output_dir={tmp_path}/one"))
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cmd = [sys.executable, "scripts/launch_local.py", "-n", "2", "--devices-per-process", "4",
         "--", sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", *common,
         *layout, f"train.output_dir={tmp_path}/two"]
  out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = [json.loads(l) for l in open(tmp_path / "two" / "metrics.jsonl")]
  two = {r["step"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(two) == [1, 2, 3, 4]  # process 0 alone writes metrics
  np.testing.assert_allclose([two[s] for s in range(1, 5)],
                             [single["losses"][s] for s in range(1, 5)], rtol=1e-4)
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]
