"""The keys that take effect only under others: a table (`RULES`), part of the config's
schema. `jscale.validate.no_ops` checks a config against it (refused, or warned about once at
startup, as `POLICY` says); `jscale.config_cli` lists it in docs/config.md.

`live(cfg, sizes)` is judged on the mesh's resolved axis sizes and on the config with its
`auto` choices resolved for the devices (`runtime.build`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jscale.config import Config, Fp8Config

Sizes = dict[str, int]

# What happens where a key has no effect follows its meaning.
POLICY = (
    "**Refused** where the key asks for something that would then not happen: a pipeline "
    "schedule, its virtual stages or micro-batches on one stage, an FP8 setting with FP8 off, "
    "a data path the source does not read. **Warned** where it tunes a mode that is off and "
    "the run is still the one asked for: a capacity factor under dropless dispatch, the "
    "grouped-matmul kernel under capacity dispatch, checkpoints kept when none is saved, eval "
    "batches when nothing is evaluated, ZeRO, node-limited expert dispatch or the context "
    "layout on an axis of one device, the interpreter with no Pallas kernel chosen.")


@dataclasses.dataclass(frozen=True)
class Rule:
  """`key` has an effect only where `live(cfg, sizes)`; else `why` says why not, `fix` what
  would give it one."""
  key: str
  live: Callable[[Config, Sizes], bool]
  why: str
  fix: str
  refuse: bool


def _moe(cfg: Config) -> Any:
  return cfg.model.moe


def _pallas(cfg: Config) -> bool:
  m = cfg.model
  return "pallas" in (m.attention_impl, m.norm_impl, m.moe and m.moe.gemm)


def _evaluates(cfg: Config) -> bool:
  return cfg.train.eval_every > 0 and cfg.data.val_fraction > 0


_ONE_STAGE = "mesh.stage is 1 here, and one stage runs no pipeline"
_NO_SAVES = "checkpoint.every=0 saves no checkpoint"
RULES: tuple[Rule, ...] = (
    Rule("pipeline.schedule", lambda c, s: s["stage"] > 1, _ONE_STAGE, "set mesh.stage >= 2",
         True),
    Rule("pipeline.virtual_stages", lambda c, s: s["stage"] > 1, _ONE_STAGE,
         "set mesh.stage >= 2", True),
    Rule("pipeline.microbatches", lambda c, s: s["stage"] > 1, _ONE_STAGE,
         "set mesh.stage >= 2 (or, for gradient accumulation, train.microbatches)", True),
    # Warned, not refused: a model key, which eval, generate and the planner inherit from a run
    # that trained with expert devices.
    Rule("model.moe.exchange", lambda c, s: s["expert"] > 1,
         "mesh.expert is 1 here, so no token is exchanged", "set mesh.expert > 1", False),
    *(Rule(f"fp8.{f.name}", lambda c, s: c.fp8.enabled, "FP8 is off", "set fp8.enabled=true",
           True) for f in dataclasses.fields(Fp8Config)
      if f.name not in ("enabled", "experts_scaling")),
    Rule("fp8.experts_scaling", lambda c, s: c.fp8.enabled and "experts" in c.fp8.targets,
         "it scales FP8 experts' products, and FP8 is off or fp8.targets has no experts",
         "set fp8.enabled=true and add experts to fp8.targets", True),
    Rule("data.path", lambda c, s: c.data.source != "stdlib",
         "data.source=stdlib reads the Python standard library",
         "set data.source=bin, text, jsonl, parquet or arrow", True),
    Rule("data.text_field", lambda c, s: c.data.source in ("jsonl", "parquet", "arrow"),
         "only record sources (jsonl, parquet, arrow) have fields",
         "set data.source=jsonl, parquet or arrow", False),
    Rule("data.bin_dtype", lambda c, s: c.data.source == "bin",
         "only data.source=bin reads stored token ids", "set data.source=bin", False),
    Rule("model.moe.receive_factor", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and _moe(c).dispatch == "dropless",
         "it bounds the receive buffers of manual mode's dropless exchange over mesh.expert",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         False),
    Rule("model.moe.dispatch_dtype", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and _moe(c).dispatch == "dropless",
         "it is the wire format of manual mode's dropless exchange over mesh.expert",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         False),
    Rule("model.moe.dispatch_grad_dtype", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and _moe(c).dispatch == "dropless",
         "it is the backward's wire format of manual mode's dropless exchange over mesh.expert",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         False),
    Rule("model.moe.combine_dtype", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and _moe(c).dispatch == "dropless",
         "it is the return's wire format of manual mode's dropless exchange over mesh.expert",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         False),
    Rule("model.moe.combine_grad_dtype", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and _moe(c).dispatch == "dropless",
         "it is the backward's return wire format of manual mode's dropless exchange over "
         "mesh.expert",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         False),
    Rule("model.moe.capacity_factor", lambda c, s: _moe(c).dispatch == "capacity",
         "dropless dispatch drops no token", "set model.moe.dispatch=capacity", False),
    Rule("model.moe.gemm", lambda c, s: _moe(c).dispatch == "dropless",
         "capacity dispatch runs the experts as one batched matmul, not a grouped one",
         "set model.moe.dispatch=dropless", False),
    Rule("parallel.zero_stage", lambda c, s: s["fsdp"] > 1,
         "ZeRO shards over mesh.fsdp, which is 1 here",
         "put the data-parallel devices on mesh.fsdp", False),
    Rule("parallel.sequence_parallel", lambda c, s: s["tensor"] > 1,
         "it splits activations over mesh.tensor, which is 1 here", "set mesh.tensor > 1", False),
    Rule("parallel.context_layout", lambda c, s: s["sequence"] > 1,
         "mesh.sequence is 1 here: no context parallelism", "set mesh.sequence > 1", False),
    Rule("parallel.context_impl", lambda c, s: s["sequence"] > 1,
         "mesh.sequence is 1 here: no context parallelism", "set mesh.sequence > 1", False),
    Rule("parallel.collective_matmul", lambda c, s: c.parallel.collectives == "manual"
         and s["tensor"] > 1 and c.parallel.sequence_parallel,
         "it overlaps sequence parallelism's hand-written gather / scatter with the TP matmuls "
         "(xla mode: XLA:GPU's windowed einsum does not apply to SP's constraints)",
         "set parallel.collectives=manual, mesh.tensor > 1 and parallel.sequence_parallel=true",
         True),
    Rule("parallel.expert_chunks", lambda c, s: c.parallel.collectives == "manual"
         and s["expert"] > 1 and c.model.moe is not None and c.model.moe.dispatch == "dropless",
         "it slices the hand-written dropless expert exchange (xla mode: GSPMD's all-to-alls "
         "come from sharding constraints, which jscale does not slice)",
         "set parallel.collectives=manual, mesh.expert > 1 and model.moe.dispatch=dropless",
         True),
    Rule("parallel.overlap_skew", lambda c, s: c.parallel.overlap_microbatches > 1
         and c.parallel.collectives == "manual" and s["expert"] > 1 and c.model.moe is not None
         and c.model.moe.dispatch == "dropless" and c.parallel.expert_chunks == 1,
         "it skews side-by-side micro-batches by the phases of the hand-written dropless expert "
         "exchange in one slice; other layers have no phase to skew",
         "set parallel.overlap_microbatches > 1 (train.accumulate=layer), "
         "parallel.collectives=manual, mesh.expert > 1, model.moe.dispatch=dropless and "
         "parallel.expert_chunks=1", False),
    Rule("parallel.scatter_each_trip", lambda c, s: c.train.layer_microbatches > 1
         and c.parallel.manual_zero3 and s["fsdp"] > 1,
         "only a layer's micro-batch loop under manual ZeRO-3 reduce-scatters its gradient "
         "after the loop", "set train.accumulate=layer with train.microbatches > 1, "
         "parallel.collectives=manual, parallel.zero_stage=3 and mesh.fsdp > 1", False),
    Rule("parallel.prefetch_layers", lambda c, s: c.train.layer_microbatches > 1
         and c.parallel.scatters_each_trip and s["fsdp"] > 1,
         "it prefetches manual ZeRO-3's layer gathers inside the micro-batch loop whose trips "
         "reduce-scatter the gradient", "set parallel.scatter_each_trip=true (its own "
         "conditions: train.accumulate=layer with train.microbatches > 1, "
         "parallel.collectives=manual, parallel.zero_stage=3, mesh.fsdp > 1)", False),
    Rule("parallel.bucket_mb", lambda c, s: c.parallel.collectives == "manual",
         "XLA chooses how gradients are reduced", "set parallel.collectives=manual", False),
    Rule("model.kernel_interpret", lambda c, s: _pallas(c), "no Pallas kernel is chosen",
         "set model.attention_impl, model.norm_impl or model.moe.gemm to pallas", False),
    Rule("train.eval_batches", lambda c, s: _evaluates(c), "nothing is evaluated",
         "set train.eval_every > 0 and data.val_fraction > 0", False),
    Rule("train.eval_every", lambda c, s: c.data.val_fraction > 0,
         "data.val_fraction=0 holds no val split out", "set data.val_fraction > 0", False),
    Rule("checkpoint.keep", lambda c, s: c.checkpoint.every > 0, _NO_SAVES,
         "set checkpoint.every > 0", False),
    Rule("checkpoint.async_save", lambda c, s: c.checkpoint.every > 0, _NO_SAVES,
         "set checkpoint.every > 0", False),
    Rule("train.profile_steps", lambda c, s: c.train.profile_steps[0] < c.train.steps,
         "its first step is past train.steps, so nothing is traced",
         "give steps up to train.steps", False),
)
