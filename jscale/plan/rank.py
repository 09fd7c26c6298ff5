"""Every valid layout estimated and ranked: what fits, then what is fastest.

The playbook's order (PLAYBOOK_DIGEST.md §5): fit the model in memory, reach the global batch,
then go fast. A layout is kept when its estimated memory fits the device; the rest are ranked
by estimated step time (the same global batch for all, so also by MFU and tokens/s).
"""

from __future__ import annotations

import dataclasses

from jscale import hardware
from jscale.config import ModelConfig
from jscale.plan import cost, memory
from jscale.plan.layout import Layout, candidates


@dataclasses.dataclass(frozen=True)
class Row:
  """A layout with its estimates."""
  layout: Layout
  memory: memory.Memory
  cost: cost.Cost
  tokens_per_s: float
  limit: float  # the device's usable bytes

  @property
  def fits(self) -> bool:
    return self.memory.total <= self.limit


def evaluate(model: ModelConfig, lay: Layout, seq: int, gpu: hardware.Gpu,
             mem: memory.Memory | None = None) -> Row:
  """One layout's memory and cost (`mem`: its `memory.estimate`, where the caller has it)."""
  mem = mem or memory.estimate(model, lay, seq)
  c = cost.estimate(model, lay, seq, gpu, mem=mem)
  tokens = lay.mbs * lay.accum * lay.batch_ways * seq
  return Row(lay, mem, c, tokens / c.step_s, memory.usable_bytes(gpu))


def rank(model: ModelConfig, devices: int, seq: int, global_batch_tokens: int,
         gpu: hardware.Gpu, include_unfit: bool = False, **kw) -> list[Row]:
  """Rows of every valid layout, fitting ones first, fastest first; ValueError when the global
  batch is not a whole number of sequences."""
  if global_batch_tokens % seq:
    raise ValueError(f"the global batch ({global_batch_tokens} tokens) is not a multiple of "
                     f"the sequence length {seq}")
  batch = global_batch_tokens // seq
  rows = []
  for lay in candidates(model, devices, seq, batch, gpu.gpus_per_node, **kw):
    mem = memory.estimate(model, lay, seq)
    if mem.total > memory.usable_bytes(gpu) and not include_unfit:
      continue
    rows.append(evaluate(model, lay, seq, gpu, mem))
  rows.sort(key=lambda r: (not r.fits, r.cost.step_s, r.memory.total))
  return rows
