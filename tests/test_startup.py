"""The startup summary a run prints: parameters, devices and mesh, numerics, kernels, data,
batch, output paths and resume state."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from conftest import small_config
from jscale import metrics, mesh as mesh_lib
from jscale.run import startup
from jscale.model import llama


def test_the_run_prints_what_it_resolved(traced_run):
  run_dir, stdout = traced_run
  lines = {line.split()[0]: line for line in stdout.splitlines() if line[:1].isalpha()}
  assert lines["devices"].startswith("devices   8 x cpu in 1 process(es); mesh data=8;")
  assert "collectives xla, ZeRO-0" in lines["devices"]
  assert "compute float32, params float32, norm xla, remat none" in lines["numerics"]
  assert "kernels   attention: xla (model.attention_impl=auto" in stdout
  assert lines["data"].startswith("data      stdlib, tokenizer byte (vocab 256): ")
  assert "8 x 32 = 256 tokens per step x 4 steps = 1.02k tokens" in lines["batch"]
  assert f"output    {run_dir}" in stdout and f"checkpoints {run_dir}/checkpoints" in stdout
  assert lines["start"] == "start     new run, random init (seed 0)"


def test_parameter_counts_match_the_model():
  for extra in ((), ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.every=2",
                     "model.n_layers=4")):
    cfg = small_config(None, *extra).model
    model = nnx.eval_shape(lambda cfg=cfg: llama.create(cfg))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert metrics.param_counts(cfg)["total"] == total
    line = startup.model_line(cfg)
    if cfg.moe is None:
      assert startup.active_params(cfg) == total and "active" not in line
    else:  # two MoE layers, each with 2 of its 4 experts idle per token
      idle = 2 * 2 * 3 * cfg.d_model * cfg.d_ff
      assert startup.active_params(cfg) == total - idle and "active per token" in line


def test_resume_and_init_from_are_named(tmp_path):
  cfg = small_config(tmp_path, "mesh.data=2", "mesh.tensor=2", "parallel.zero_stage=3",
                     "checkpoint.every=0")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])
  text = startup.summary(cfg, mesh, 40, "/ck", (1000, 10), 256, ["attention: xla"])
  assert "mesh data=2 x tensor=2; collectives xla, ZeRO-3" in text
  assert "start     resuming from step 40 (/ck)" in text
  assert "checkpoints /ck off (checkpoint.every=0)" in text
  assert "(metrics.jsonl, run.json)" in text  # logging.plot=false: no metrics.png named
  plot = small_config(tmp_path, "logging.plot=true")
  text = startup.summary(plot, mesh, None, "/ck", (1000, 10), 256, ["attention: xla"])
  assert "(metrics.jsonl, metrics.png, run.json)" in text
