"""manual mode, from the compiled HLO: the collectives that run are the playbook's, with its
communication volume (within 10%), and gradient reductions do not multiply with micro-batches."""

import functools

import jax
import pytest

from conftest import small_config
from jscale import runtime
from jscale.analysis import hlo, introspect
from jscale.analysis import volume
from jscale.plan import cost

SHAPE = ("model.n_kv_heads=4", "train.batch_size=16", "parallel.collectives=manual")
STRATEGIES = {
    "dp": ("mesh.data=8",),
    "zero1": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=1"),
    "zero2": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=2"),
    "zero3": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3"),
    "tp": ("mesh.data=1", "mesh.tensor=4"),
    "tp_sp": ("mesh.data=1", "mesh.tensor=4", "parallel.sequence_parallel=true"),
    "3d": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
           "parallel.zero_stage=3"),
    "cp_tp_sp": ("mesh.data=2", "mesh.sequence=2", "mesh.tensor=2",
                 "parallel.sequence_parallel=true"),
    "ulysses_tp_sp": ("mesh.data=2", "mesh.sequence=2", "mesh.tensor=2",
                      "parallel.sequence_parallel=true", "parallel.context_impl=ulysses"),
}


@functools.lru_cache(maxsize=None)
def _compiled(*overrides):
  cfg = small_config(None, *SHAPE, *overrides)
  rt = runtime.build(cfg, jax.devices()[:4] if "mesh.tensor=4" in overrides else None)
  step = rt.train_step()
  text = step.lower(rt.abstract_state(), introspect.abstract_batch(cfg)).compile().as_text()
  return rt, hlo.collectives(text)


@pytest.mark.parametrize("name", STRATEGIES)
def test_volume_matches_the_playbook(name):
  rt, colls = _compiled(*STRATEGIES[name])
  got, theory = volume.hlo_volume(colls)["total"], cost.playbook_volume(rt)["total"]
  assert abs(got / theory - 1) <= 0.10, (name, got, cost.playbook_volume(rt))


def test_the_playbook_collectives_run():
  kinds = lambda name: {c.kind for c in _compiled(*STRATEGIES[name])[1] if c.group_size != 1}
  assert kinds("dp") == {"all-reduce"}
  assert kinds("zero1") == kinds("zero2") == {"reduce-scatter", "all-gather", "all-reduce"}
  assert {"reduce-scatter", "all-gather"} <= kinds("zero3")
  assert kinds("tp") == {"all-reduce"}
  assert {"reduce-scatter", "all-gather"} <= kinds("tp_sp")
  assert "collective-permute" in kinds("cp_tp_sp")  # the ring
  assert "all-to-all" in kinds("ulysses_tp_sp") and "collective-permute" not in kinds(
      "ulysses_tp_sp")
  # ZeRO-3: each layer's weights are gathered inside the forward and again inside the backward
  # layer loop, and each layer's gradient is reduce-scattered there.
  in_loop = [c for c in _compiled(*STRATEGIES["zero3"])[1] if c.in_while]
  assert sum(c.kind == "all-gather" for c in in_loop) >= 2 * 7
  assert sum(c.kind == "reduce-scatter" for c in in_loop) >= 7


def _grad_reductions(*overrides) -> dict[str, int]:
  """Executions per step of non-scalar all-reduce / reduce-scatter ops, by kind."""
  out = {}
  for c in _compiled(*overrides)[1]:
    if c.kind in ("all-reduce", "reduce-scatter") and any("[]" not in s for s in c.shapes):
      out[c.kind] = out.get(c.kind, 0) + c.executions
  return out


@pytest.mark.parametrize("name", ["dp", "zero1"])
def test_gradients_reduced_once_per_step(name):
  one = _grad_reductions(*STRATEGIES[name])
  assert one == _grad_reductions(*STRATEGIES[name], "train.microbatches=2")
  assert sum(one.values()) == 1  # one bucket: 460 kB < parallel.bucket_mb


def test_zero2_reduces_each_microbatch_to_its_shard_and_data_once():
  """ZeRO-2 keeps only gradient shards, between layers (reduce-scatter inside the backward
  scan) and between micro-batches, so its fsdp reduce-scatters run per micro-batch; the
  all-reduce over `data` runs once per step."""
  layout = ("mesh.data=2", "mesh.fsdp=4", "parallel.zero_stage=2")
  one = _grad_reductions(*layout)
  two = _grad_reductions(*layout, "train.microbatches=2")
  assert one["reduce-scatter"] > 2 and two["reduce-scatter"] == 2 * one["reduce-scatter"]
  assert one["all-reduce"] == two["all-reduce"] == 1
  in_loop = [c for c in _compiled(*layout)[1] if c.in_while and c.kind == "reduce-scatter"]
  assert len(in_loop) >= 7  # each layer weight's gradient, inside the backward layer loop


def test_compare_script_runs(tmp_path):
  """scripts/compare_collectives.py end to end on one strategy: table, CSV and chart."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "cmp.md"
  r = subprocess.run([sys.executable, "scripts/compare_collectives.py", "--only", "zero1",
                      "--steps", "2", "--out", str(out), "model.n_layers=2"],
                     cwd=root, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  table = out.read_text()
  assert "| zero1 | xla |" in table and "| zero1 | manual |" in table
  assert (tmp_path / "cmp.csv").exists() and (tmp_path / "cmp.png").stat().st_size > 1000


def test_collective_matmul_moves_the_blocks_gathers_into_ring_steps():
  """With `parallel.collective_matmul` the blocks' SP all-gathers and reduce-scatters (two
  each per layer and pass) become ring collective-permutes: t - 1 chunks of 1/t each, the
  volume the collectives moved times (t - 1) / t (t = 4, `volume.hlo_volume`'s convention);
  only the embedding's and the head's stay collectives of their own."""
  plain = volume.hlo_volume(_compiled(*STRATEGIES["tp_sp"])[1])
  ring = volume.hlo_volume(_compiled(*STRATEGIES["tp_sp"], "parallel.collective_matmul=true")[1])
  moved = 0
  for kind in ("all-gather", "reduce-scatter"):
    assert ring[kind] < 0.25 * plain[kind], kind
    moved += plain[kind] - ring[kind]
  assert ring["collective-permute"] == pytest.approx(moved * 3 / 4, rel=0.01)
