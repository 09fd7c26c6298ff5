"""ZB-V and DualPipeV run by the executor on simulated CPU devices: loss and every gradient
against the single-device reference (both modes; dense and MoE with experts split inside the
stages; p = 2 and 4 with v = 2 chunks; data, tensor, ZeRO-1 and ZeRO-2 inside stages), the
executed ops against the table, evaluation through the V, a checkpoint resumed across
placements, and config errors before compile. The pairs' overlap on XLA:GPU:
test_pipeline_v_gpu.py."""

import os
import shutil

import jax
import numpy as np
import pytest

import parity
from conftest import small_config
from jscale import runtime
from jscale import train as train_lib
from jscale.ckpt import checkpoint
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.step import pipelined
from pipeline_harness import case_id, max_rel_err, overrides, pipeline_grads, reference

MOE = ("model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=64")
# (mode, schedule, p, m, extra): each schedule in each mode, each mode dense at one p and MoE
# (experts split over mesh.expert inside the stages) at the other, ZeRO-1 and ZeRO-2 once.
# scripts/sweep_pipeline.py runs more V layouts.
CASES = [
    ("manual", "zbv", 4, 8, ("mesh.fsdp=2", "parallel.zero_stage=2")),
    ("manual", "dualpipev", 2, 4, (*MOE, "mesh.expert=2", "mesh.data=2")),
    ("xla", "zbv", 2, 4, (*MOE, "mesh.expert=2")),
    ("xla", "dualpipev", 4, 8, ("mesh.fsdp=2", "parallel.zero_stage=1")),
]


def _id(case):
  mode, schedule, p, m, extra = case
  moe = any(e.startswith("model.moe") for e in extra)
  return case_id((mode, schedule, p, m, ("moe",) * moe + tuple(e for e in extra
                                                               if not e.startswith("model."))))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_loss_and_grads_equal_no_pipeline(case):
  mode, schedule, p, m, extra = case
  model = tuple(e for e in extra if e.startswith("model."))
  # Router losses are per micro-batch: the reference accumulates the same ones.
  ref_loss, ref_grads = reference(*model, microbatches=m if model else 1)
  got = pipeline_grads(*overrides(*case))
  tol = 1e-4 if model else 1e-5
  assert got.loss == pytest.approx(ref_loss, rel=tol)
  assert max_rel_err(got.grads, ref_grads) <= tol
  # The executor ran exactly the table: an op at its first tick, idle on the others.
  codes = got.codes
  prog = pipelined.program_for(got.rt.cfg.pipeline, p)
  per_stage = codes.reshape(p, -1, codes.shape[-1])[:, 0]
  np.testing.assert_array_equal(prog.executed(per_stage.T), prog.table.kind)
  assert prog.has_pairs == (schedule == "dualpipev")


EVAL_BATCH = {"tokens": np.arange(16 * 32, dtype=np.int32).reshape(16, 32) % 200,
              "labels": np.ones((16, 32), np.int32), "loss_mask": np.ones((16, 32), np.float32)}


def test_eval_step_through_the_v_matches_one_device():
  one = runtime.build(small_config(None, "mesh.data=1", "train.batch_size=16",
                                   "model.n_layers=4"), jax.devices()[:1])
  want = one.eval_step()(parity.initial_state(one)["params"], EVAL_BATCH)
  pp = ("mesh.stage=2", "pipeline.microbatches=4", "parallel.collectives=manual",
        "pipeline.schedule=zbv", "pipeline.virtual_stages=2", "model.n_layers=4",
        "mesh.data=2", "train.batch_size=16")
  rt = runtime.build(small_config(None, *pp), jax.devices()[:4])
  got = rt.eval_step()(parity.initial_state(rt)["params"],
                       jax.device_put(EVAL_BATCH, rt.layouts.batch()))
  np.testing.assert_allclose([float(x) for x in got], [float(x) for x in want], rtol=1e-5)


def _run_cfg(out, cache, *extra):
  """A 4-step run of 2 stages x 4 data shards, checkpointed every 2 steps."""
  return load_config(None, [
      "model.preset=tiny", "model.d_model=64", "model.n_layers=4", "model.n_heads=4",
      "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.batch_size=16",
      "train.seq_len=32", "train.steps=4", "train.warmup_steps=0", "train.eval_every=0",
      "logging.progress=false", "logging.every=1", "logging.plot=false", "checkpoint.every=2",
      "mesh.stage=2", "mesh.data=4", "pipeline.microbatches=4", "pipeline.virtual_stages=2",
      f"train.output_dir={out}", f"data.cache_dir={cache}", *extra])


def test_a_checkpoint_resumes_across_placements(tmp_path, data_cache, capsys):
  # Four steps of an interleaved run; then ZB-V resumes its step-2 checkpoint: the layers are
  # stored in the interleaved order (stage 0: chunks 0, 2) and are restacked into the V's
  # (0, 3), so steps 3 and 4 repeat the interleaved run's losses.
  whole_cfg = _run_cfg(tmp_path, data_cache, "pipeline.schedule=interleaved")
  whole = train_lib.run(whole_cfg)
  shutil.rmtree(os.path.join(checkpoint.checkpoint_dir(whole_cfg), "4"))
  resumed = train_lib.run(_run_cfg(tmp_path, data_cache, "pipeline.schedule=zbv"))
  assert 'changed since the checkpoint: pipeline.schedule "interleaved" -> "zbv"' in (
      capsys.readouterr().out)
  assert sorted(resumed["losses"]) == [3, 4]
  np.testing.assert_allclose([resumed["losses"][s] for s in (3, 4)],
                             [whole["losses"][s] for s in (3, 4)], rtol=1e-5)


@pytest.mark.parametrize("extra,match", [
    (("pipeline.schedule=zbv",), r"set pipeline.virtual_stages=2 \(not 1\)"),
    (("pipeline.schedule=dualpipev", "pipeline.virtual_stages=2", "pipeline.microbatches=2"),
     r"dualpipev needs pipeline.microbatches >= 2 x mesh.stage = 4 \(it is 2\)"),
    (("pipeline.schedule=zbv", "pipeline.virtual_stages=2", "model.n_layers=6"),
     r"model.n_layers=6 is not divisible by mesh.stage x pipeline.virtual_stages \(4\)"),
    # Every schedule: xla mode's stage region keeps data / fsdp shards' routing apart.
    (("pipeline.schedule=1f1b", *MOE, "mesh.expert=2", "mesh.fsdp=2", "parallel.zero_stage=2",
      "parallel.collectives=xla"), r"use parallel.collectives=manual, or split the batch over"),
])
def test_bad_v_configs_fail_before_compile(extra, match):
  cfg = small_config(None, "model.n_kv_heads=4", "train.batch_size=16", "mesh.data=-1",
                     "mesh.stage=2", "model.n_layers=8", *extra)
  with pytest.raises(ConfigError, match=match):
    runtime.build(cfg)
