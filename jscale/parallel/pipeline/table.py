"""The action table: for every tick and stage, what the stage runs (the data every schedule is).

`kind[t, s]` is IDLE, F (forward), B (input gradient) or W (weight gradient), for micro-batch
`mb[t, s]` and model chunk `chunk[t, s]`; the chunk runs on the stage the table's placement
gives it (`placement.stage_of`). Time is in unit ticks, F = B = W = 1.

Actions may be fused into one op of several ticks: `with_next()[t, s]` says the action at
(t, s) runs together with the one at (t + 1, s), in one executor branch. Two kinds exist: a full
backward (B then its W: schedules without the B/W split run every backward so) and a pair, a
forward of one micro-batch with the backward of another (DualPipeV's F&B, optionally with the
W), whose halves' communication can hide under each other's compute. An op needs all its inputs
when it starts and hands its outputs on when it ends; the executor runs it at its first tick.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jscale.parallel.pipeline import placement

IDLE, F, B, W = 0, 1, 2, 3
NAMES = {IDLE: ".", F: "F", B: "B", W: "W"}
Action = tuple[int, int, int]  # (kind, micro-batch, model chunk)


def inputs(kind: int, mb: int, c: int, chunks: int) -> list[Action]:
  """The actions whose outputs action (kind, mb, c) reads: an F the activation of the chunk
  before; a B its own F's residuals and the gradient of the chunk after; a W its own B."""
  if kind == F:
    return [(F, mb, c - 1)] if c else []
  if kind == B:
    return [(F, mb, c)] + ([(B, mb, c + 1)] if c < chunks - 1 else [])
  return [(B, mb, c)]


def fusable(actions: list[Action], chunks: int) -> bool:
  """Whether `actions`, in order, are one op the executor runs (`program.CODES`): a single
  action, a full backward (B then its W), or a pair (an F, then a B of another micro-batch or
  chunk, optionally its W) whose F is not the last chunk's while its B hands a gradient on (the
  head's gradient and the B's both leave on the backward channel)."""
  kinds = tuple(k for k, _, _ in actions)
  if len(kinds) == 1:
    return True
  back = actions[1:] if kinds[0] == F else actions
  if kinds not in ((B, W), (F, B), (F, B, W)) or (len(back) == 2 and back[0][1:] != back[1][1:]):
    return False
  return kinds[0] != F or (actions[0][1:] != back[0][1:]
                           and not (actions[0][2] == chunks - 1 and back[0][2] > 0))


@dataclasses.dataclass(frozen=True)
class Table:
  """An action table. `bound`: residual sets (F done, W not yet) a stage may hold at once."""
  name: str
  p: int  # stages
  m: int  # micro-batches
  v: int  # chunks per stage
  split: bool  # B and W may be apart (zero bubble); else W always follows B at once
  bound: int
  kind: np.ndarray  # [T, p] int
  mb: np.ndarray  # [T, p] int (-1 when idle)
  chunk: np.ndarray  # [T, p] int, model chunk (-1 when idle)
  backward: bool = True  # False: forwards only (evaluation)
  placement: str = "interleaved"  # `placement.PLACEMENTS`
  # [T, p] bool: the action runs fused with the next tick's (None: every B with its W when the
  # table has no split, nothing else)
  fuse: np.ndarray | None = None

  @property
  def ticks(self) -> int:
    return self.kind.shape[0]

  @property
  def chunks(self) -> int:
    return self.p * self.v

  def stage_of(self, c: int) -> int:
    """The stage that runs model chunk c."""
    return placement.stage_of(c, self.p, self.placement)

  def with_next(self) -> np.ndarray:
    """[T, p] bool: the action at (t, s) runs in one op with the one at (t + 1, s)."""
    if self.fuse is not None:
      return self.fuse
    return (self.kind == B) & (not self.split) & self.backward

  def starts(self) -> np.ndarray:
    """[T, p]: the first tick of the op each cell belongs to (when the executor runs it)."""
    start = np.tile(np.arange(self.ticks)[:, None], (1, self.p))
    fused = self.with_next()
    for t in range(1, self.ticks):
      start[t] = np.where(fused[t - 1], start[t - 1], start[t])
    return start

  def ends(self) -> np.ndarray:
    """[T, p]: the last tick of the op each cell belongs to (its outputs leave after it)."""
    end = np.tile(np.arange(self.ticks)[:, None], (1, self.p))
    fused = self.with_next()
    for t in range(self.ticks - 2, -1, -1):
      end[t] = np.where(fused[t], end[t + 1], end[t])
    return end

  def paired(self) -> np.ndarray:
    """[T, p] bool: the F that starts a forward + backward pair."""
    fused = self.with_next()
    nxt = np.vstack([self.kind[1:], np.full((1, self.p), IDLE)])
    return fused & (self.kind == F) & (nxt == B)

  def bubble(self) -> float:
    """Idle cells over busy cells (the playbook's bubble relative to useful work)."""
    busy = int(np.count_nonzero(self.kind))
    return (self.kind.size - busy) / busy

  def lockstep_bubble(self) -> float:
    """Idle over busy time as the executor runs the table: every tick ends with the stages'
    ppermutes, so a tick lasts as long as its longest op (a fused op's whole length, at its
    first tick). Equals `bubble` when no op is fused; DualPipeV's staggered pairs and the
    unsplit schedules' full backwards make it larger."""
    first = (self.starts() == np.arange(self.ticks)[:, None]) & (self.kind != IDLE)
    length = np.where(first, self.ends() - self.starts() + 1, 0)
    busy = int(np.count_nonzero(self.kind)) / self.p
    return (length.max(axis=1).sum() - busy) / busy

  def live(self) -> np.ndarray:
    """[T, p]: residual sets held at the end of each tick (F done and W not yet)."""
    delta = (self.kind == F).astype(int) - (self.kind == W).astype(int)
    return np.cumsum(delta, axis=0)

  def in_flight(self) -> np.ndarray:
    """[T, p]: micro-batch chunks whose input gradient is still to come (F done, B not yet):
    the activations a schedule keeps in flight, what the papers' memory figures count."""
    delta = (self.kind == F).astype(int) - (self.kind == B).astype(int)
    return np.cumsum(delta, axis=0)
