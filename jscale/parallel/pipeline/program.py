"""An action table compiled into what each device's executor reads per tick.

The executor is SPMD: every stage runs the same tick loop and reads its column of these [T, p]
int arrays. An op (one action, or fused ones: `table.Table.with_next`) runs at its first tick;
the other ticks of a fused op stay idle, and the table's ticks where no stage starts an op are
not executed (`Program.rows`: the lockstep tables of `lockstep.in_steps` have one executed
tick per step). Buffers are fixed size; this module assigns their
slots: a residual set lives from its F to its W, an inbound activation from its arrival to its F,
an inbound gradient from its arrival to its B. A stage never consumes a message on the tick it
was sent. Slot `n` of every buffer is a scratch slot that absorbs writes nobody will read.

Messages travel on channels, each one `ppermute` per tick over fixed (source, target) stage
pairs: one stage down (s -> s+1) or up (s -> s-1), wrapping round for the interleaved
placement's forward (and backward) from the last stage to the first. Interleaved tables send
activations down and gradients up, one channel each; the V sends both ways both ways, and a
pair can send two messages the same way, so a table gets as many channels each way as its ops
send at once. A message whose next chunk lives on the same stage (the V's turn) is filed into
the stage's own inbox instead.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from jscale.parallel.pipeline import placement
from jscale.parallel.pipeline.table import IDLE, B, F, Table, W

# What a device computes in one tick (the executor's lax.switch branches); a pair's code is
# "<forward code>+<backward code>" (e.g. "f_first+bw"), appended to these when a table has pairs.
CODES = ("idle", "f", "f_first", "f_last", "b", "b_first", "bw", "bw_first", "w")
(C_IDLE, C_F, C_F_FIRST, C_F_LAST, C_B, C_B_FIRST, C_BW, C_BW_FIRST, C_W) = range(len(CODES))
SEND_F, SEND_B = 1, 2  # `send`: a channel carries this tick's activation / gradient
# The named scope of the executor's per-tick switch: the compiled program's conditional carries
# it, so `jscale.predict` can time each tick by the branches `Program.code` runs in it.
TICK_SCOPE = "pipeline_tick"


@dataclasses.dataclass(frozen=True)
class Program:
  table: Table
  rows: np.ndarray  # [T]: the table tick each executed tick runs (those where an op starts)
  codes: tuple[str, ...]  # the switch's branches, by index
  code: np.ndarray  # [T, p]: index into `codes`
  mb: np.ndarray  # micro-batch of the op's first action (0 when idle)
  local: np.ndarray  # which of the stage's chunks that action runs
  mb_b: np.ndarray  # a pair's backward: its micro-batch (else = mb)
  local_b: np.ndarray  # ... and its local chunk (else = local)
  res_write: np.ndarray  # residual slot an F fills (scratch otherwise)
  res_read: np.ndarray  # residual slot a B / BW / W reads
  stash_write: np.ndarray  # split backward: slot where B keeps its output gradient for W
  read_f: np.ndarray  # inbound-activation slot an F reads
  read_b: np.ndarray  # inbound-gradient slot a B reads
  send: np.ndarray  # [T, p, K]: what channel k carries from this stage (0, SEND_F, SEND_B)
  file_f: np.ndarray  # [T, p, K]: where an activation arriving on channel k is filed
  file_b: np.ndarray  # [T, p, K]: where a gradient arriving on channel k is filed
  self_f: np.ndarray  # where an F files its output for the next chunk on its own stage
  self_b: np.ndarray  # where the last chunk's F files its head gradient, or a B its output
  # gradient for the chunk before on its own stage
  channels: tuple[tuple[tuple[int, int], ...], ...]  # per channel: its (source, target) pairs
  carries: tuple[str, ...]  # per channel: "f", "b" or "fb", what it may carry
  n_res: int
  n_in_f: int
  n_in_b: int

  @property
  def has_pairs(self) -> bool:
    """Whether some op is a forward + backward pair."""
    return any("+" in code for code in self.codes)

  def executed(self, code: np.ndarray) -> np.ndarray:
    """Kinds (IDLE/F/B/W) of executor codes [T, p], on the table's ticks: for comparing what
    ran with the table. A fused op counts as its first action (its other ticks ran no compute:
    they were done with it)."""
    first = {"f": F, "b": B, "w": W, "i": IDLE}
    on_table = np.full((self.table.ticks, self.table.p), C_IDLE)
    on_table[self.rows] = code
    kinds = np.array([first[name[0]] for name in self.codes])[on_table]
    inside = (self.table.starts() != np.arange(self.table.ticks)[:, None])
    return np.where(inside & (on_table == C_IDLE), self.table.kind, kinds)


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


def _direction(table: Table, kind: int, src: int, dst: int) -> int:
  """+1: a message one stage down (or round from the last to the first), -1: one stage up."""
  if table.placement == "interleaved":
    return 1 if kind == F else -1
  return 1 if dst > src else -1


def _perm(table: Table, d: int) -> tuple[tuple[int, int], ...]:
  p = table.p
  wraps = table.placement == "interleaved" and table.v > 1
  down = [(i, (i + 1) % p) for i in range(p if wraps else p - 1)]
  return tuple(down if d == 1 else [(j, i) for i, j in down])


def _code(table: Table, op: list[tuple[int, int, int]]) -> str:
  """The executor code of an op: its actions, fused."""
  C = table.chunks

  def one(kind: int, c: int, with_w: bool) -> str:
    if kind == F:
      return "f_first" if c == 0 else "f_last" if c == C - 1 else "f"
    if kind == B:
      return ("bw" if with_w else "b") + ("_first" if c == 0 else "")
    return "w"

  kinds = [k for k, _, _ in op]
  if kinds[0] == F and len(op) > 1:  # a pair
    return f"{one(F, op[0][2], False)}+{one(B, op[1][2], kinds[-1] == W)}"
  return one(kinds[0], op[0][2], len(op) > 1)


class _Slots(NamedTuple):
  """Each stage's buffer slot per (micro-batch, chunk), and each buffer's size (the most
  slots a stage holds at once)."""
  res: list[dict]  # residual sets: from their F to their W (or B)
  in_f: list[dict]  # inbound activations: from arrival to their F
  in_b: list[dict]  # inbound gradients: from arrival to their B
  n_res: int
  n_f: int
  n_b: int


def _buffer_slots(table: Table) -> _Slots:
  """Slots for every residual set and message, allocated by lifetime on each stage."""
  p, C = table.p, table.chunks
  at = {(int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s])): int(t)
        for t, s in zip(*np.nonzero(table.kind))}
  starts = table.starts()
  stage = table.stage_of
  run = lambda key: int(starts[at[key], stage(key[2])])  # the tick the executor runs it
  # When a message can be read: the producer's run tick if it stays on its stage (filed after
  # the switch), else the tick after (filed before the switch).
  arrives = lambda key, dst: run(key) + (stage(key[2]) != dst)
  res, in_f, in_b = [[] for _ in range(p)], [[] for _ in range(p)], [[] for _ in range(p)]
  for (k, mb, c), t in at.items():
    s = stage(c)
    if k != F:
      continue
    last = at.get((W, mb, c), at.get((B, mb, c), t))  # forward-only tables: until the F itself
    res[s].append((t, last, (mb, c)))
    if c > 0:
      in_f[s].append((arrives((F, mb, c - 1), s), t, (mb, c)))
    if table.backward:
      sent = run((F, mb, c)) if c == C - 1 else arrives((B, mb, c + 1), s)
      in_b[s].append((sent, at[(B, mb, c)], (mb, c)))
  slots = [[_allocate(lists[s])[0] for s in range(p)] for lists in (res, in_f, in_b)]
  size = lambda per_stage: max([len(set(x.values())) or 1 for x in per_stage] + [1])
  return _Slots(*slots, *(size(x) for x in slots))


def _ops_and_channels(table: Table):
  """(the ops at their first tick {(t, s): actions}, what each sends {(t, s): [(direction,
  kind, to)]}, the channels [(direction, index)]: as many each way as an op sends at once)."""
  C, starts, stage = table.chunks, table.starts(), table.stage_of
  ops: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
  for t, s in zip(*np.nonzero(table.kind)):
    ops[int(starts[t, s]), int(s)].append(
        (int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s])))
  sends: dict[tuple[int, int], list[tuple[int, int, tuple]]] = {}  # (t, s) -> (dir, what, to)
  for (t, s), op in ops.items():
    out = []
    for k, mb, c in op:
      to = (F, mb, c + 1) if k == F and c < C - 1 else (B, mb, c - 1) if k == B and c else None
      if to is not None and stage(to[2]) != s:
        out.append((_direction(table, k, s, stage(to[2])), k, to))
    sends[t, s] = out
  width = defaultdict(int)
  for out in sends.values():
    for d in (1, -1):
      width[d] = max(width[d], sum(x[0] == d for x in out))
  return ops, sends, [(d, j) for d in (1, -1) for j in range(width[d])]


def _write_op(a, table: Table, t: int, s: int, op, slots: _Slots) -> None:
  """Stage `s`'s buffer reads and writes at tick `t` for `op` (`a(name, value)` sets them)."""
  C, stage = table.chunks, table.stage_of
  for k, mb, c in op:
    if k == F:
      a("res_write", slots.res[s][(mb, c)])
      if c > 0:
        a("read_f", slots.in_f[s][(mb, c)])
      if c == C - 1 and table.backward:
        a("self_b", slots.in_b[s][(mb, c)])
      elif c < C - 1 and stage(c + 1) == s:
        a("self_f", slots.in_f[s][(mb, c + 1)])
    elif k == B:
      a("res_read", slots.res[s][(mb, c)])
      a("read_b", slots.in_b[s][(mb, c)])
      if table.split and len(op) == 1 or op[-1][0] == B:  # W comes later: keep dy for it
        a("stash_write", slots.res[s][(mb, c)])
      if c > 0 and any(x[0] == F and x[2] == C - 1 for x in op):
        raise ValueError(f"tick {t}, stage {s}: a pair of the last chunk's F (its head "
                         "gradient) with a B that hands a gradient on: one gradient an op")
      if c > 0 and stage(c - 1) == s:
        a("self_b", slots.in_b[s][(mb, c - 1)])
    elif k == W and len(op) == 1 and table.split:
      a("res_read", slots.res[s][(mb, c)])


def compile_program(table: Table) -> Program:
  """Per-device executor arrays for `table` (any table `schedules.validate` accepts), one row
  per table tick where some op starts."""
  p = table.p
  slots = _buffer_slots(table)
  ops, sends, chan = _ops_and_channels(table)
  rows = np.array(sorted({t for t, _ in ops}), np.int32)
  tick = {int(t): i for i, t in enumerate(rows)}  # table tick -> executed tick
  T, K = len(rows), len(chan)
  codes = list(CODES)
  arrays = {name: np.zeros((T, p), np.int32) for name in ("code", "mb", "local", "mb_b",
                                                           "local_b")}
  scratch = {"res_write": slots.n_res, "res_read": slots.n_res, "stash_write": slots.n_res,
             "read_f": slots.n_f, "read_b": slots.n_b, "self_f": slots.n_f,
             "self_b": slots.n_b}
  arrays.update({name: np.full((T, p), n, np.int32) for name, n in scratch.items()})
  arrays["send"] = np.zeros((T, p, K), np.int32)
  arrays["file_f"] = np.full((T, p, K), slots.n_f, np.int32)
  arrays["file_b"] = np.full((T, p, K), slots.n_b, np.int32)
  carries = [set() for _ in chan]
  for (t, s), op in ops.items():
    code = _code(table, op)
    if code not in codes:
      codes.append(code)
    a = lambda name, value, t=tick[t], s=s: arrays[name].__setitem__((t, s), value)
    a("code", codes.index(code))
    a("mb", op[0][1])
    a("local", placement.local_of(op[0][2], p, table.placement))
    a("mb_b", op[-1][1])
    a("local_b", placement.local_of(op[-1][2], p, table.placement))
    _write_op(a, table, t, s, op, slots)
    used = defaultdict(int)
    for d, k, to in sends[t, s]:
      ch = chan.index((d, used[d]))
      used[d] += 1
      dst = table.stage_of(to[2])
      arrays["send"][tick[t], s, ch] = SEND_F if k == F else SEND_B
      carries[ch].add("f" if k == F else "b")
      slot = slots.in_f[dst][to[1:]] if k == F else slots.in_b[dst][(to[1], to[2])]
      # filed on the next executed tick: the receiver's op that reads it starts later
      arrays["file_f" if k == F else "file_b"][tick[t] + 1, dst, ch] = slot
  return Program(table, rows, codes=tuple(codes), n_res=slots.n_res, n_in_f=slots.n_f,
                 n_in_b=slots.n_b, channels=tuple(_perm(table, d) for d, _ in chan),
                 carries=tuple("".join(sorted(c, key="fb".index)) for c in carries), **arrays)
