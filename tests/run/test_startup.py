"""The startup summary a run prints: parameters, devices and mesh, numerics, kernels, data,
batch, output paths and resume state."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from jscale import metrics, mesh as mesh_lib
from jscale.config_load import load_config
from jscale.data.sources import Splits
from jscale.presets import PRESETS
from jscale.run import startup
from jscale.model import llama


def test_the_run_prints_what_it_resolved(traced_run):
  run_dir, stdout = traced_run
  lines = {line.split()[0]: line for line in stdout.splitlines() if line[:1].isalpha()}
  assert lines["devices"].startswith("devices   8 x cpu in 1 process(es); mesh data=8;")
  assert "collectives xla, ZeRO-0" in lines["devices"]
  assert "compute float32, params float32, Adam moments float32, norm xla, remat none" in lines["numerics"]
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
    counts = metrics.param_counts(cfg)
    assert counts["total"] == total
    line = startup.model_line(cfg)
    if cfg.moe is None:
      assert counts["active"] == total and "active" not in line
    else:  # two MoE layers, each with 2 of its 4 experts idle per token
      idle = 2 * 2 * 3 * cfg.d_model * cfg.d_ff
      assert counts["active"] == total - idle and "active per token" in line


def _hand_counts(cfg) -> tuple[int, int]:
  """(total, active) from the model's own parameter shapes: every routed expert weight
  ([layers, n_experts, ...] under an `mlp`, the MTP block's included) counts (E - k) / E idle."""
  model = nnx.eval_shape(lambda: llama.create(cfg))
  total = idle = 0
  for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    names = [str(getattr(k, "key", k)) for k in path]
    size = int(np.prod(x.shape))
    total += size
    if cfg.moe is not None and names[-2] in ("w_gate_up", "w_down") and "mlp" in names \
        and x.shape[1] == cfg.moe.n_experts:
      idle += size // cfg.moe.n_experts * (cfg.moe.n_experts - cfg.moe.top_k)
  return total, total - idle


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_active_parameters_of_every_preset_match_a_hand_count(preset):
  cfg = load_config(None, [f"model.preset={preset}"]).model
  counts = metrics.param_counts(cfg)
  assert (counts["total"], counts["active"]) == _hand_counts(cfg)
  assert f"{metrics.count_text(counts['active'])} active per token" in startup.model_line(cfg) \
      or cfg.moe is None


def test_deepseek_v3_671b_is_37b_active():
  # The paper: 671B parameters, 37B activated per token, without the 14B MTP module.
  cfg = load_config(None, ["model.preset=deepseek_v3_671b"]).model
  main = metrics.param_counts(dataclasses.replace(cfg, mtp=None))
  assert abs(main["total"] / 1e9 - 671) < 0.5 and 37 <= main["active"] / 1e9 < 38
  assert 37 <= metrics.param_counts(cfg)["active"] / 1e9 < 38.5  # + MTP's block, eh_proj
  assert "38.2B active per token" in startup.model_line(cfg)


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


def test_the_data_line_says_how_many_documents_a_window_splits(tmp_path):
  """Documents longer than a window are split across windows, and the summary says so (and
  whether documents are masked apart); the train split counts them from its index."""
  cfg = small_config(tmp_path, "data.document_mask=true")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  text = startup.summary(cfg, mesh, None, "/ck", (1000, 10), 256, ["attention: xla"], (3, 10))
  assert ("3 of 10 documents longer than a window (32 tokens) are split across windows; "
          "documents masked apart") in text
  assert "10 documents, each fits a window" in startup.summary(
      cfg, mesh, None, "/ck", (1000, 10), 256, ["attention: xla"], (0, 10))
  splits = Splits(np.arange(100), np.arange(5), 0, np.array([0, 10, 60]))
  assert splits.documents_longer_than(30) == (2, 3)  # lengths 10, 50, 40
  assert splits.documents_longer_than(45) == (1, 3)
  assert Splits(np.arange(100), np.arange(5), 0).documents_longer_than(30) is None
