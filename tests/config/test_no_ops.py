"""No silent no-op: every key the validator knows is conditional (`validate.config_conditional.RULES`) is
refused or warned about where it has no effect, naming why, and says nothing where it has one;
no config file or preset trips a rule. Pure checks on a config and mesh sizes: no devices."""

from __future__ import annotations

import glob
import os

import pytest

from jscale import presets
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale import config_conditional
from jscale.validate import no_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
ONE = dict(data=1, stage=1, fsdp=1, expert=1, sequence=1, tensor=1)
MOE = ("model.moe.n_experts=4",)

# key -> (overrides that set it, overrides and mesh sizes under which it has an effect)
EXAMPLES = {
    "pipeline.schedule": (["pipeline.schedule=zbv"], [], dict(stage=2)),
    "pipeline.virtual_stages": (["pipeline.virtual_stages=2"], [], dict(stage=2)),
    "pipeline.microbatches": (["pipeline.microbatches=8"], [], dict(stage=2)),
    "model.moe.exchange": ([*MOE, "model.moe.exchange=node_limited"], [], dict(expert=2)),
    "fp8.recipe": (["fp8.recipe=current"], ["fp8.enabled=true"], {}),
    "fp8.amax_history": (["fp8.amax_history=4"], ["fp8.enabled=true"], {}),
    "fp8.margin": (["fp8.margin=1"], ["fp8.enabled=true"], {}),
    "fp8.targets": (["fp8.targets=mlp"], ["fp8.enabled=true"], {}),
    "fp8.experts_scaling": ([*MOE, "fp8.experts_scaling=row"],
                            ["fp8.enabled=true", "fp8.targets=[experts]"], {}),
    "data.path": (["data.path=corpus.txt"], ["data.source=text"], {}),
    "data.text_field": (["data.text_field=body"], ["data.source=jsonl", "data.path=d.jsonl"],
                        {}),
    "data.bin_dtype": (["data.bin_dtype=uint32"], ["data.source=bin", "data.path=ids.bin"], {}),
    "model.moe.receive_factor": ([*MOE, "model.moe.receive_factor=2"],
                                 ["parallel.collectives=manual"], dict(expert=2)),
    "model.moe.dispatch_dtype": ([*MOE, "model.moe.dispatch_dtype=e4m3"],
                                 ["parallel.collectives=manual"], dict(expert=2)),
    "model.moe.dispatch_grad_dtype": ([*MOE, "model.moe.dispatch_grad_dtype=e4m3"],
                                      ["parallel.collectives=manual"], dict(expert=2)),
    "model.moe.combine_dtype": ([*MOE, "model.moe.combine_dtype=e4m3"],
                                ["parallel.collectives=manual"], dict(expert=2)),
    "model.moe.combine_grad_dtype": ([*MOE, "model.moe.combine_grad_dtype=e4m3"],
                                     ["parallel.collectives=manual"], dict(expert=2)),
    "model.moe.capacity_factor": ([*MOE, "model.moe.capacity_factor=2"],
                                  ["model.moe.dispatch=capacity"], {}),
    "model.moe.gemm": ([*MOE, "model.moe.gemm=tiled", "model.moe.dispatch=capacity"],
                       ["model.moe.dispatch=dropless"], {}),
    "parallel.zero_stage": (["parallel.zero_stage=1"], [], dict(fsdp=2)),
    "parallel.sequence_parallel": (["parallel.sequence_parallel=true"], [], dict(tensor=2)),
    "parallel.context_layout": (["parallel.context_layout=contiguous"], [], dict(sequence=2)),
    "parallel.context_impl": (["parallel.context_impl=ulysses"], [], dict(sequence=2)),
    "parallel.bucket_mb": (["parallel.bucket_mb=8"], ["parallel.collectives=manual"], {}),
    "parallel.collective_matmul": (["parallel.collective_matmul=true"],
                                   ["parallel.collectives=manual",
                                    "parallel.sequence_parallel=true"], dict(tensor=2)),
    "parallel.expert_chunks": ([*MOE, "parallel.expert_chunks=2"],
                               ["parallel.collectives=manual"], dict(expert=2)),
    "parallel.overlap_skew": ([*MOE, "parallel.overlap_skew=true"],
                              ["train.microbatches=2", "train.accumulate=layer",
                               "parallel.overlap_microbatches=2", "parallel.collectives=manual"],
                              dict(expert=2)),
    "parallel.scatter_each_trip": (["parallel.scatter_each_trip=true", "parallel.zero_stage=3"],
                                   ["train.microbatches=2", "train.accumulate=layer",
                                    "parallel.collectives=manual"], dict(fsdp=2)),
    "parallel.prefetch_layers": (["parallel.prefetch_layers=true", "parallel.zero_stage=3",
                                  "train.microbatches=2", "train.accumulate=layer",
                                  "parallel.collectives=manual"],
                                 ["parallel.scatter_each_trip=true"], dict(fsdp=2)),
    "model.kernel_interpret": (["model.kernel_interpret=true"], ["model.norm_impl=pallas"], {}),
    "train.eval_batches": (["train.eval_batches=2", "train.eval_every=0"],
                           ["train.eval_every=10"], {}),
    "train.eval_every": (["train.eval_every=10", "data.val_fraction=0"],
                         ["data.val_fraction=0.01"], {}),
    "checkpoint.keep": (["checkpoint.keep=5", "checkpoint.every=0"], ["checkpoint.every=10"], {}),
    "checkpoint.async_save": (["checkpoint.async_save=false", "checkpoint.every=0"],
                              ["checkpoint.every=10"], {}),
    "train.profile_steps": (["train.profile_steps=[400,401]"], ["train.steps=500"], {}),
}


def test_every_rule_has_an_example():
  assert sorted(r.key for r in config_conditional.RULES) == sorted(EXAMPLES)


def _mentions(lines: list[str], key: str) -> list[str]:
  return [line for line in lines if line.startswith((f"warning: {key}=", f"{key}="))]


@pytest.mark.parametrize("rule", config_conditional.RULES, ids=lambda r: r.key)
def test_a_key_without_effect_is_refused_or_warned_and_with_one_is_not(rule):
  given, live, live_sizes = EXAMPLES[rule.key]
  dead = load_config(TINY, given)
  if rule.refuse:
    with pytest.raises(ConfigError) as e:
      no_ops.check(dead, ONE)
    msg = str(e.value)
    assert msg.startswith(f"{rule.key}=") and f"has no effect: {rule.why} ({rule.fix}, or " \
        "drop the key)" in msg, msg
  else:
    lines = _mentions(no_ops.check(dead, ONE), rule.key)
    assert lines and lines[0].endswith(f"has no effect: {rule.why} ({rule.fix})"), lines
  cfg = load_config(TINY, [*given, *live])
  assert not _mentions(no_ops.check(cfg, {**ONE, **live_sizes}), rule.key)


def _configs():
  files = {os.path.basename(p): (p, []) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))}
  return {**files, **{f"preset {p}": (None, [f"model.preset={p}"]) for p in presets.PRESETS}}


@pytest.mark.parametrize("name", sorted(_configs()))
def test_no_config_file_or_preset_trips_a_rule(name):
  path, overrides = _configs()[name]
  cfg = load_config(path, overrides)
  # Their mesh as written, -1 taken as 8 devices (what the config is for).
  sizes = {axis: 8 if size == -1 else size for axis, size in vars(cfg.mesh).items()}
  assert no_ops.check(cfg, sizes) == []
