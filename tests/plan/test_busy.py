"""The planner's busy time (`jscale.plan.busy`): each term is the rule it names, and the fitted
passes are what the stored sweep of compiled programs gives."""

import dataclasses
import os
import sys

import pytest

from jscale import hardware
from jscale.config_load import load_config
from jscale.metrics import param_counts
from jscale.plan import busy, cost, memory
from jscale.plan.layout import Layout
from jscale.predict import rates, timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import estimate_vs_compiled as sweep  # noqa: E402  pylint: disable=wrong-import-position

H100 = hardware.GPUS["h100"]
SEQ = 4096


@pytest.fixture(scope="module")
def model():
  return load_config(None, ["model.preset=llama3_1b"]).model


def test_gemms_run_at_the_predictors_efficiency_for_their_shapes(model):
  lay = Layout(fsdp=8, zero_stage=2, mbs=8, accum=4)
  chip = rates.chip("h100")
  eff, rerun = busy.gemm_efficiency(model, lay, SEQ, chip)
  mlp_up = timing.gemm_efficiency(1, 8 * SEQ, 2 * model.d_ff, model.d_model, chip)
  assert 0.5 < eff <= chip.fit.gemm_ceiling and eff == pytest.approx(mlp_up, rel=0.05)
  tokens = 8 * 4 * SEQ  # per device: 8 sequences in each of 4 micro-batches
  gemm = busy.terms(model, lay, SEQ, H100)["gemm"]
  assert gemm == pytest.approx(6 * param_counts(model)["matmul"] * tokens / (989.5e12 * eff))
  # One sequence split 8 ways over tensor: short rows and thin shards run slower.
  thin, _ = busy.gemm_efficiency(model, Layout(tensor=8, mbs=1, accum=32), SEQ, chip)
  assert thin < 0.9 * eff
  # Full remat reruns the attention projections and each MLP's in-projection: 2 of the MLP's 3
  # matrices, and not the head.
  d, f = model.d_model, model.d_ff
  a = 2 * d * 2048 + 2 * d * 512  # GQA: 32 query and 8 K/V heads of 64
  per_layer = a + 3 * d * f
  share = 16 * (a + 2 * d * f) / (16 * per_layer + d * model.vocab_size)
  assert rerun == pytest.approx(share, rel=0.03)


def test_full_remat_runs_the_forward_again(model):
  full = busy.terms(model, Layout(fsdp=8, mbs=8, accum=4, remat="full"), SEQ, H100)
  chip = rates.chip("h100")
  tokens = 8 * 4 * SEQ
  att_fwd, att_bwd = busy.attention_seconds(model, Layout(fsdp=8, mbs=8), SEQ, tokens, chip)
  assert full["attention"] == pytest.approx(att_fwd + att_bwd)
  assert att_bwd == pytest.approx(2.5 * att_fwd * rates.attention_rate(
      "cudnn", True, 64, SEQ, False)[0] / rates.attention_rate("cudnn", True, 64, SEQ, True)[0])
  _, rerun = busy.gemm_efficiency(model, Layout(fsdp=8, mbs=8), SEQ, chip)
  assert full["recompute"] == pytest.approx(full["gemm"] / 3 * rerun + att_fwd)
  assert busy.terms(model, Layout(fsdp=8, mbs=8, accum=4), SEQ, H100)["recompute"] == 0


def test_sequence_parallel_splits_the_residual_stream_and_adds_its_own_passes(model):
  tp = busy.terms(model, Layout(fsdp=4, tensor=2, mbs=8, accum=8), SEQ, H100)
  sp = busy.terms(model, Layout(fsdp=4, tensor=2, sequence_parallel=True, mbs=8, accum=8), SEQ,
                  H100)
  assert sp["residual"] == pytest.approx(tp["residual"] / 2)
  assert sp["sequence_parallel"] == pytest.approx(tp["residual"]) and tp["sequence_parallel"] == 0
  assert sp["hidden"] == pytest.approx(tp["hidden"])  # the MLP's width is split either way


@pytest.mark.parametrize("zero,term,share", [(1, "weights", 1), (2, "weights", 1),
                                             (3, "weight_shards", 1 / 8)])
def test_per_microbatch_weight_passes_cover_what_each_zero_stage_holds(model, zero, term, share):
  """ZeRO-0/1/2 sum each micro-batch's gradients over the whole copy (ZeRO-2 scatters after),
  ZeRO-3 over its shard."""
  parts = busy.terms(model, Layout(fsdp=8, zero_stage=zero, mbs=4, accum=8), SEQ, H100)
  whole = 7 * memory.local_params(model, Layout(fsdp=8)) * 2 / H100.hbm_bytes_s
  assert parts[term] == pytest.approx(whole * share)
  assert parts["weights" if term == "weight_shards" else "weight_shards"] == 0


def test_memory_pressure_counts_only_past_half_the_device(model):
  light = Layout(fsdp=8, zero_stage=3, mbs=1, accum=32, remat="full")
  heavy = Layout(fsdp=8, zero_stage=2, mbs=16, accum=2)
  usable = memory.usable_bytes(H100)
  assert memory.estimate(model, light, SEQ).total < busy.PRESSURE_FROM * usable
  assert busy.terms(model, light, SEQ, H100)["pressure"] == 0
  assert memory.estimate(model, heavy, SEQ).total > 0.8 * usable
  assert busy.terms(model, heavy, SEQ, H100)["pressure"] > 0


def test_an_unmeasured_gpu_is_refused(model):
  with pytest.raises(ValueError, match="no measured HBM bandwidth"):
    cost.estimate(model, Layout(fsdp=8), SEQ, hardware.GPUS["a100"])


def test_the_constants_in_the_code_are_the_sweeps_fit():
  """`busy.FIT` and `cost.EXPOSURE` are `estimate_vs_compiled.py fit` on the stored sweep,
  rounded to 3 figures: a new compiled row that moves them fails here until they are refit."""
  passes, exposure = sweep.fit(sweep.load())
  for fitted, code in ((passes, busy.FIT), (exposure, cost.EXPOSURE)):
    for f in dataclasses.fields(code):
      assert getattr(code, f.name) == pytest.approx(getattr(fitted, f.name), rel=0.01), f.name
