"""An action table compiled into what each device's executor reads per tick.

The executor is SPMD: every stage runs the same tick loop and reads its column of these [T, p]
int arrays. Buffers are fixed size; this module assigns their slots: a residual set lives from
its F to its W, an inbound activation from its arrival (the tick after it was sent) to its F,
an inbound gradient from its arrival to its B. A stage never consumes a message on the tick it
was sent. Slot `n` of every buffer is a scratch slot that absorbs writes nobody will read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jscale.parallel.pipeline.schedules import B, F, IDLE, W, Table

# What a device computes in one tick (the executor's lax.switch branches).
CODES = ("idle", "f", "f_first", "f_last", "b", "b_first", "bw", "bw_first", "w")
(C_IDLE, C_F, C_F_FIRST, C_F_LAST, C_B, C_B_FIRST, C_BW, C_BW_FIRST, C_W) = range(len(CODES))


@dataclasses.dataclass(frozen=True)
class Program:
  table: Table
  code: np.ndarray  # [T, p]: index into CODES
  mb: np.ndarray  # micro-batch (0 when idle)
  local: np.ndarray  # which of the stage's chunks (c // p)
  res_write: np.ndarray  # residual slot an F fills (scratch otherwise)
  res_read: np.ndarray  # residual slot a B / BW / W reads
  stash_write: np.ndarray  # split backward: slot where B keeps its output gradient for W
  read_f: np.ndarray  # inbound-activation slot an F reads
  read_b: np.ndarray  # inbound-gradient slot a B reads
  file_f: np.ndarray  # where the activation arriving at the start of the tick is filed
  file_b: np.ndarray  # where the gradient arriving at the start of the tick is filed
  self_b: np.ndarray  # where the last chunk's F puts its own head gradient
  n_res: int
  n_in_f: int
  n_in_b: int

  def executed(self, code: np.ndarray) -> np.ndarray:
    """Kinds (IDLE/F/B/W) of executor codes: for comparing what ran with the table. A fused
    BW counts as B (its W tick ran no compute, the W was done with it)."""
    kinds = np.array([IDLE, F, F, F, B, B, B, B, W])[code]
    fused = (self.table.kind == W) & ~self.table.split
    return np.where(fused & (code == C_IDLE), W, kinds)


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
  """Slots for inclusive [start, end] intervals, first free; returns ({key: slot}, n slots)."""
  free_at: list[int] = []  # per slot: first tick it is free again
  slots = {}
  for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
    slot = next((i for i, f in enumerate(free_at) if f <= start), len(free_at))
    if slot == len(free_at):
      free_at.append(0)
    free_at[slot] = end + 1
    slots[key] = slot
  return slots, len(free_at)


def compile_program(table: Table) -> Program:
  """Per-device executor arrays for `table` (any table `schedules.validate` accepts)."""
  p, C, T = table.p, table.chunks, table.ticks
  at = {(int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s])): int(t)
        for t, s in zip(*np.nonzero(table.kind))}
  res, in_f, in_b = [[] for _ in range(p)], [[] for _ in range(p)], [[] for _ in range(p)]
  for (k, mb, c), t in at.items():
    s = c % p
    if k != F:
      continue
    last = at.get((W, mb, c), at.get((B, mb, c), t))  # forward-only tables: until the F itself
    res[s].append((t, last, (mb, c)))
    if c > 0:
      in_f[s].append((at[(F, mb, c - 1)] + 1, t, (mb, c)))
    if table.backward:
      sent = t if c == C - 1 else at[(B, mb, c + 1)] + 1  # the head's gradient: this very F
      in_b[s].append((sent, at[(B, mb, c)], (mb, c)))
  res_slots, in_f_slots, in_b_slots = [], [], []
  n_res = n_f = n_b = 1
  for s in range(p):
    for lists, out in ((res, res_slots), (in_f, in_f_slots), (in_b, in_b_slots)):
      slots, n = _allocate(lists[s])
      out.append(slots)
    n_res = max(n_res, len(set(res_slots[s].values())) or 1)
    n_f = max(n_f, len(set(in_f_slots[s].values())) or 1)
    n_b = max(n_b, len(set(in_b_slots[s].values())) or 1)
  arrays = {name: np.zeros((T, p), np.int32) for name in ("code", "mb", "local")}
  scratch = {"res_write": n_res, "res_read": n_res, "stash_write": n_res, "read_f": n_f,
             "read_b": n_b, "file_f": n_f, "file_b": n_b, "self_b": n_b}
  arrays.update({name: np.full((T, p), n, np.int32) for name, n in scratch.items()})
  for (k, mb, c), t in at.items():
    s, first, last = c % p, c == 0, c == C - 1
    a = lambda name, value: arrays[name].__setitem__((t, s), value)
    a("mb", mb)
    a("local", c // p)
    if k == F:
      a("code", C_F_FIRST if first else C_F_LAST if last else C_F)
      a("res_write", res_slots[s][(mb, c)])
      if not first:
        a("read_f", in_f_slots[s][(mb, c)])
      if last and table.backward:
        a("self_b", in_b_slots[s][(mb, c)])
      if not first:  # the activation arrived from the previous chunk's stage
        arrays["file_f"][at[(F, mb, c - 1)] + 1, s] = in_f_slots[s][(mb, c)]
    elif k == B:
      a("code", (C_B_FIRST if first else C_B) if table.split else
        (C_BW_FIRST if first else C_BW))
      a("res_read", res_slots[s][(mb, c)])
      a("read_b", in_b_slots[s][(mb, c)])
      if table.split:
        a("stash_write", res_slots[s][(mb, c)])
      if not last:
        arrays["file_b"][at[(B, mb, c + 1)] + 1, s] = in_b_slots[s][(mb, c)]
    elif k == W:
      if table.split:
        a("code", C_W)
        a("res_read", res_slots[s][(mb, c)])
      # else: done with its B (fused full backward); the tick stays idle
  return Program(table, n_res=n_res, n_in_f=n_f, n_in_b=n_b, **arrays)
