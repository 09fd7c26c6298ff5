"""Communication volume per device per step: the collectives a compiled program runs, and the
playbook's formulas for a runtime's layout (kept in `jscale.plan.cost.transfers`).

Volume counts what a ring implementation moves, without the (n-1)/n factor, as the playbook
does (PLAYBOOK_DIGEST.md §2): an all-reduce of X bytes costs 2X (reduce-scatter + all-gather),
an all-gather or a reduce-scatter of a full size X costs X, an all-to-all or a permute its size.
So DP costs 2Ψ, ZeRO-1/2 2Ψ (reduce-scatter Ψ + all-gather Ψ), ZeRO-3 3Ψ, TP 8·s·b·h per block,
and CP's ring per layer: K/V pass n-1 hops forward, again backward, with dK/dV n hops.
"""

from __future__ import annotations

from typing import Iterable

from jscale.analysis.hlo import Collective


def collective_volume(c: Collective) -> int:
  """Playbook volume of one collective per step (0 for a group of one device)."""
  if c.group_size == 1:
    return 0
  per_run = {"all-reduce": 2 * c.bytes,
             "reduce-scatter": c.bytes * (c.group_size or 1)}.get(c.kind, c.bytes)
  return per_run * c.executions


def hlo_volume(collectives: Iterable[Collective]) -> dict[str, int]:
  """{kind: volume bytes per step} and "total", from `jscale.analysis.hlo.collectives`."""
  out: dict[str, int] = {}
  for c in collectives:
    v = collective_volume(c)
    if v:
      out[c.kind] = out.get(c.kind, 0) + v
  out["total"] = sum(out.values())
  return out


def playbook_volume(rt) -> dict[str, float]:
  """Per-device bytes per step the playbook's formulas predict for `rt` (a `runtime.Runtime`),
  by term, and "total": the planner's communication terms (`jscale.plan.cost.transfers`, the
  one home of the formulas and their refinements) for the runtime's layout."""
  from jscale.plan import cost  # pylint: disable=import-outside-toplevel
  from jscale.plan.layout import Layout  # pylint: disable=import-outside-toplevel
  cfg, size, t = rt.cfg, dict(rt.mesh.shape), rt.cfg.train
  ways = size["data"] * size["fsdp"] * size["expert"]
  stages = size["stage"] > 1
  accum = cfg.pipeline.microbatches if stages else t.microbatches
  lay = Layout(**{a: size[a] for a in ("data", "stage", "fsdp", "expert", "sequence", "tensor")},
               zero_stage=cfg.parallel.zero_stage if size["fsdp"] > 1 else 0,
               sequence_parallel=cfg.parallel.sequence_parallel, schedule=cfg.pipeline.schedule,
               virtual_stages=cfg.pipeline.virtual_stages, remat=t.remat,
               mbs=t.batch_size // ways // accum, accum=accum)
  out: dict[str, float] = {}
  for x in cost.transfers(cfg.model, lay, t.seq_len, gpus_per_node=1):
    out[f"{x.axis}: {x.what}"] = out.get(f"{x.axis}: {x.what}", 0.0) + x.bytes
  out["total"] = sum(out.values())
  return out
