"""Communication volume per device per step of the collectives a compiled program runs, in the
playbook's convention (the planner's formulas for a layout, `jscale.plan.cost`, use the same).

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
