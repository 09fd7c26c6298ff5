"""The planner's estimate ranks layouts as their compiled programs do (issue 49).

The stored sweep (results/estimate_vs_compiled.jsonl: layouts compiled for H100s by XLA:GPU and
timed by `jscale.predict`) is re-scored against `jscale.plan.cost` as it is now, so a change to
the estimate that breaks the ranking fails here without compiling; a small sweep is compiled
afresh where JAX's CUDA plugin is installed, so the stored figures cannot drift from the code.
"""

import os
import sys

import pytest

from jscale import hardware
from jscale.analysis import gpu_target
from jscale.config_load import load_config
from jscale.plan.layout import Layout
from jscale.plan.rank import evaluate
from jscale.plan.verify import compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import estimate_vs_compiled as sweep  # noqa: E402  pylint: disable=wrong-import-position

H100 = hardware.GPUS["h100"]


def test_the_stored_sweep_ranks_as_compiled():
  """Spearman >= 0.9 pooled and >= 0.85 per case, also with the constants fitted on the other
  cases only (held out); `--rank compiled` (the estimate's top 10 compiled) picks the compiled
  best, and so does the estimate's own #1 within 3% — for Llama 3 70B on 64 H100s too, whose
  ZeRO-3 gathers are link-bound across 8 nodes (`cost.Exposure`'s prefetch window)."""
  rows = sweep.load()
  cases, table, pooled = sweep.score(rows)
  assert len(table) >= 60 and pooled >= 0.9
  for c in cases:
    assert min(c["spearman"], c["held_spearman"]) >= 0.85, c
    assert c["top10_over_best"] <= 0.03, c
    assert c["first_over_best"] <= 0.03, c


# llama3_1b on 8 H100s at 1M tokens: the compiled best, a ZeRO-3 layout of 32 micro-batches
# (re-gathers and per-micro-batch passes), the whole context split 8 ways (ring hops).
SMALL = [Layout(fsdp=4, tensor=2, zero_stage=1, mbs=16, accum=4, remat="selective"),
         Layout(fsdp=8, zero_stage=3, mbs=1, accum=32),
         Layout(sequence=8, mbs=4, accum=64)]


@pytest.mark.skipif(not gpu_target.available(), reason="needs JAX's CUDA plugin: pip install "
                    "-e '.[gpu-compile]' (.ci/run does)")
def test_a_small_sweep_compiles_in_the_estimates_order():
  model = load_config(None, ["model.preset=llama3_1b"]).model
  devices = gpu_target.devices("h100x8")
  rows = [evaluate(model, lay, 4096, H100) for lay in SMALL]
  compiled = [compare("llama3_1b", [], r, 4096, H100, devices)["step_compiled"] for r in rows]
  estimate = [r.cost.step_s for r in rows]
  assert sorted(range(3), key=estimate.__getitem__) == [0, 1, 2]
  assert sorted(range(3), key=compiled.__getitem__) == [0, 1, 2]
  for e, c in zip(estimate, compiled):  # and each within 25% of its program's predicted step
    assert e == pytest.approx(c, rel=0.25)
