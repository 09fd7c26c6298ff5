"""The V-shaped schedules as data: each stage's order of ops, placed on unit ticks.

Two chunks per stage in the V placement (`layout`): stage s runs chunk s on the way down
(local chunk 0, "F0 B0 W0" below) and chunk 2p − 1 − s on the way back up (local chunk 1). An
op is one action or several fused ones run together (`table.Table.with_next`). `place` puts
the orders on ticks: each stage runs its ops in order, an op on the first tick after the stage's
previous op ends at which every input has arrived (a message sent at the end of tick t is usable
from t + 1), so the orders alone decide the schedule.

- ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", the V schedule; "Pipeline Parallelism
  with Controllable Memory" calls it V-ZB): B/W split, every stage the same 2p residual sets at
  most (1F1B's p micro-batches of a whole stage), idle only while the pipeline fills and drains.
  Warm-up: 2(p − s) − 1 forwards down, then s times (F1, F0), then p − s times (F1, B1, W1);
  steady: (F0, B0, W0, F1, B1, W1) while forwards remain; cool-down: s times (B0, B1) with
  their W's held back to fill the drain, p − s times (B0, W0), then the W's left. With fewer
  than 2p − 1 micro-batches the order is that of 2p − 1 with the missing ones' ops dropped, so
  each missing micro-batch idles every stage two ticks.
- DualPipeV (DeepSeek's DualPipe cut in half, github.com/deepseek-ai/DualPipe dualpipev.py):
  warm-up 2(p − s − 1) F0's, s + 1 times (F0, F1), p − s − 1 times (B1, W1, F1); steady
  m − 2p + s + 1 times the pairs (F0 & B1W1) then (F1 & B0W0); then p − s − 1 times (B1W1,
  F1 & B0W0); the drain's s + 1 (B1, B0), the later half of them split (W deferred), p − s − 1
  times (W, B0) and s + 1 W's. A pair is a forward of one micro-batch and the full backward of
  an older one on the same stage, three ticks as one op.
"""

from __future__ import annotations

import numpy as np

from jscale.parallel.pipeline.table import IDLE, B, F, W, inputs

Op = tuple[tuple[int, int, int], ...]  # fused actions (kind, local chunk, micro-batch)


class _Counts:
  """Per stage: the next micro-batch of each (kind, local chunk), and the W's held back."""

  def __init__(self):
    self.next = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0, (W, 0): 0, (W, 1): 0}
    self.held: list[tuple[int, int, int]] = []

  def take(self, kind: int, local: int) -> tuple[int, int, int]:
    i = self.next[kind, local]
    self.next[kind, local] += 1
    return (kind, local, i)


def zbv_orders(p: int, m: int) -> list[list[Op]]:
  """ZB-V's op order on each stage (one action per op)."""
  n = max(m, 2 * p - 1)  # the warm-up needs 2p − 1 micro-batches; missing ones are dropped
  orders = []
  for s in range(p):
    c, o = _Counts(), []

    def act(local: int, *kinds: int) -> None:
      o.extend((c.take(kind, local),) for kind in kinds)

    for _ in range(2 * (p - s) - 1):
      act(0, F)
    for _ in range(s):
      act(1, F)
      act(0, F)
    for _ in range(p - s):
      act(1, F, B, W)
    while c.next[F, 1] < n:
      if c.next[F, 0] < n:
        act(0, F)
      act(0, B, W)
      act(1, F, B, W)
    for _ in range(s):  # the W's wait: they fill the ticks the drain leaves idle
      act(0, B)
      act(1, B)
    for _ in range(p - s):
      act(0, B, W)
    while c.next[W, 1] < n:
      act(1, W)
    while c.next[W, 0] < n:
      act(0, W)
    orders.append([op for op in o if op[0][2] < m])
  return orders


def dualpipev_orders(p: int, m: int) -> list[list[Op]]:
  """DualPipeV's op order on each stage: pairs F & BW as one op, full backwards as B + W."""
  orders = []
  for s in range(p):
    c, o = _Counts(), []
    f = lambda local: (c.take(F, local),)

    def b(local: int, split: bool = False) -> Op:
      kind, _, i = c.take(B, local)
      if split:  # W later, in order
        c.held.append((W, local, i))
        return ((B, local, i),)
      return ((B, local, i), (W, local, i))

    w = lambda: (c.held.pop(0),)
    for _ in range(2 * (p - s - 1)):
      o.append(f(0))
    for _ in range(s + 1):
      o += [f(0), f(1)]
    for _ in range(p - s - 1):
      o += [b(1, split=True), w(), f(1)]
    for i in range(m - 2 * p + s + 1):
      if i == 0 and s == p - 1:  # as DualPipe: this one pair runs apart, a smaller bubble
        o += [f(0), b(1)]
      else:
        o.append(f(0) + b(1))
      o.append(f(1) + b(0))
    for _ in range(p - s - 1):
      o += [b(1), f(1) + b(0)]
    split = False
    for i in range(s + 1):  # the drain: the later half of the backwards leave their W's
      split = split or (i == (s + 1) // 2 and s % 2 == 1)
      o.append(b(1, split))
      split = split or (i == (s + 1) // 2 and s % 2 == 0)
      o.append(b(0, split))
    for _ in range(p - s - 1):
      o += [w(), b(0, split=True)]
    for _ in range(s + 1):
      o.append(w())
    orders.append(o)
  return orders


def forward_orders(p: int, m: int) -> list[list[Op]]:
  """Forwards only (evaluation), in ZB-V's order."""
  return [[op for op in order if op[0][0] == F] for order in zbv_orders(p, m)]


def place(p: int, orders: list[list[Op]]) -> tuple[np.ndarray, ...]:
  """(kind, mb, chunk, fuse) [T, p] arrays of `orders` placed on ticks (see the module doc)."""
  chunks = 2 * p
  chunk_of = lambda s, local: s if local == 0 else chunks - 1 - s
  ready: dict[tuple[int, int, int], int] = {}  # action -> first tick its output is usable
  nxt, free, cells = [0] * p, [0] * p, {}
  left, t = sum(map(len, orders)), 0
  limit = 4 * sum(len(op) for o in orders for op in o) + 4 * p
  while left:
    if t > limit:
      raise RuntimeError("V schedule deadlocked: its orders are inconsistent")
    for s in range(p):
      if nxt[s] == len(orders[s]) or free[s] > t:
        continue
      op = [(k, i, chunk_of(s, local)) for k, local, i in orders[s][nxt[s]]]
      inside = set(op)
      needs = [x for k, i, c in op for x in inputs(k, i, c, chunks) if x not in inside]
      if all(ready.get(x, t + 1) <= t for x in needs):
        for j, a in enumerate(op):
          cells[t + j, s] = (*a, j < len(op) - 1)
          ready[a] = t + len(op)
        nxt[s], free[s], left = nxt[s] + 1, t + len(op), left - 1
    t += 1
  T = max(tick for tick, _ in cells) + 1
  kind, mb, chunk = (np.full((T, p), fill, np.int32) for fill in (IDLE, -1, -1))
  fuse = np.zeros((T, p), bool)
  for (tick, s), (k, i, c, more) in cells.items():
    kind[tick, s], mb[tick, s], chunk[tick, s], fuse[tick, s] = k, i, c, more
  return kind, mb, chunk, fuse
