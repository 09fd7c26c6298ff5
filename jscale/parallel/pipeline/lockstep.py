"""The schedule the executor runs: a table re-timed for ticks that run in lockstep.

The executor is one SPMD program: every stage runs one op per tick of a `lax.scan`, and every
tick ends in the stages' `ppermute`s, so a tick lasts as long as the longest op any stage runs
in it (`Table.lockstep_bubble`). The papers' tables are timed on unit ticks as if each stage
ran on its own clock: a fused op of n actions holds its stage n ticks while the others go on.
In lockstep that costs where ops of different lengths start together: DualPipeV's three-tick
pairs start on different ticks on different stages (p = 4, m = 16: 0.229 executed against its
table's 0.0625), and 1F1B's two-tick full backwards meet one-tick forwards (1.17 against 0.19).

`in_steps` re-places each stage's ops, in the table's order, on steps:

  1. each stage starts its next op if every input was made in an earlier step;
  2. the step lasts L, the longest op started; a stage whose op is shorter takes its following
     ops into the same op while they fit in L, their inputs were made in an earlier step (a
     W's own B may be in the op), and the op stays one the executor runs (`table.fusable`: a
     full backward, or a forward + backward pair).

A step of length L is L rows of the returned table with every op starting at its first, so
the table's bubble is its lockstep bubble, and what reads tables (`schedules.validate`,
`Table.live`, `program.compile_program`) reads it unchanged; the program drops the rows where
no op starts. Each stage keeps its order, so it holds the same residual sets at most.

What a single SPMD program cannot do is let one stage run ahead of another between messages
(DualPipe's own implementation runs each rank on its own stream): the steps are the price, and
`executed_table` keeps the papers' table where re-timing does not pay.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jscale.parallel.pipeline import schedules
from jscale.parallel.pipeline.table import IDLE, Action, B, Table, fusable, inputs


def stage_ops(table: Table) -> list[list[list[Action]]]:
  """Per stage, its ops in the order they start (each op its actions in order)."""
  starts = table.starts()
  out = []
  for s in range(table.p):
    ops: dict[int, list[Action]] = {}
    for t in np.nonzero(table.kind[:, s])[0]:
      ops.setdefault(int(starts[t, s]), []).append(
          (int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s])))
    out.append([ops[t] for t in sorted(ops)])
  return out


def in_steps(table: Table) -> Table:
  """`table` re-timed in lockstep steps (module docstring)."""
  p, chunks = table.p, table.chunks
  orders = stage_ops(table)
  made: dict[Action, int] = {}  # action -> the step that made it
  nxt = [0] * p
  steps: list[list[list[Action]]] = []

  def ready(op: list[Action], own: set[Action]) -> bool:
    return all(made.get(x, len(steps)) < len(steps)
               for k, i, c in op for x in inputs(k, i, c, chunks) if x not in own)

  while any(nxt[s] < len(orders[s]) for s in range(p)):
    if len(steps) > sum(map(len, orders)):
      raise RuntimeError(f"{table.name}: re-timing deadlocked (its ops' order is inconsistent)")
    row: list[list[Action]] = [[] for _ in range(p)]
    for s in range(p):
      if nxt[s] < len(orders[s]) and ready(orders[s][nxt[s]], set(orders[s][nxt[s]])):
        row[s], nxt[s] = list(orders[s][nxt[s]]), nxt[s] + 1
    longest = max(map(len, row))
    for s in range(p):
      while row[s] and nxt[s] < len(orders[s]):
        op = orders[s][nxt[s]]
        own = set(op) | {a for a in row[s] if a[0] == B}
        if len(row[s]) + len(op) > longest or not (ready(op, own) and
                                                   fusable(row[s] + op, chunks)):
          break
        row[s], nxt[s] = row[s] + op, nxt[s] + 1
    for s in range(p):
      made.update((a, len(steps)) for a in row[s])
    steps.append(row)
  return _as_table(table, steps)


def _as_table(table: Table, steps: list[list[list[Action]]]) -> Table:
  """Each step as rows of a table (as many as its longest op), its ops from its first row."""
  lengths = [max(map(len, row)) for row in steps]
  first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
  T = int(sum(lengths))
  kind, mb, chunk = (np.full((T, table.p), fill, np.int32) for fill in (IDLE, -1, -1))
  fuse = np.zeros((T, table.p), bool)
  for row, t0 in zip(steps, first):
    for s, op in enumerate(row):
      for j, (k, i, c) in enumerate(op):
        kind[t0 + j, s], mb[t0 + j, s], chunk[t0 + j, s] = k, i, c
        fuse[t0 + j, s] = j < len(op) - 1
  return dataclasses.replace(table, kind=kind, mb=mb, chunk=chunk, fuse=fuse)


def executed_table(name: str, p: int, m: int, v: int = 1) -> Table:
  """The training table the executor runs for schedule `name`: `in_steps` of the papers'
  table (`schedules.make_table`) where that lowers the lockstep bubble, else the table."""
  table = schedules.make_table(name, p, m, v)
  stepped = in_steps(table)
  return stepped if stepped.lockstep_bubble() < table.lockstep_bubble() else table
