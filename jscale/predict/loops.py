"""A predicted step loop by loop: for each while loop, a trip's compute-stream time against its
collective-stream time (nested loops counted by their trips), and the step's waits for the
collectives inside it.

Why: XLA:GPU schedules each loop body on its own, and its one collective stream runs one
transfer at a time, so a trip takes at least the longer of its two streams. A loop whose
collectives outlast its compute is collective-bound: no schedule hides them there, however
the rest of the step overlaps. The step's ceiling with every collective hidden is then not
the longer of the whole step's two streams (`Summary.overlap_ceiling_s`) but each loop at its
own longer stream, summed (`ceiling_s`): DeepSeek-V3 671B's forward layer loop on 1,024 H100s
sends 206.7 ms a trip against 155.0 ms of compute, so its step's ceiling is 23.5 s, not the
22.1 s of its whole compute stream (docs/deepseek.md).

A sequence of launches with loops in it takes at least

    ceiling(seq) = max(compute of its launches + sum over its loops of trips * ceiling(body),
                       collectives of its launches and its loops' bodies, by their trips)

(a conditional by its longest branch): the compute stream runs the launches and the loops one
after another, each loop at least its own ceiling, while the collective stream carries every
transfer once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

from jscale.predict import rates
from jscale.predict.launches import Branches, Item, Launch, Loop
from jscale.predict.timing import Schedule, Timed, time_launch


@dataclasses.dataclass
class LoopTime:
  """One while loop of a predicted step."""
  name: str             # XLA's while instruction
  source: str           # the JAX source it comes from (`source`)
  depth: int            # loops around it
  runs: int             # trips per step: its trip count times the enclosing loops'
  compute_s: float      # per trip: its kernels and launch gaps, nested loops' by their trips
  collectives_s: float  # per trip: its transfers on the collective stream
  exposed_s: float      # per step: the compute stream's waits for collectives inside it

  @property
  def collective_bound(self) -> bool:
    """Whether a trip's transfers outlast its compute (no schedule hides them all)."""
    return self.collectives_s > self.compute_s


def loop_times(s: Schedule, items: list[Item], chip: rates.Chip) -> list[LoopTime]:
  """Every loop of `items` (the program `s` was scheduled from) with its two streams per trip
  and the waits `s` recorded for the collectives inside it, outermost first."""
  timed = {x.launch.name: x for x in s.timed}
  out = []
  for loop, depth, runs in _loops(items, 0, 1):
    compute, collectives = _streams(loop.body, timed, chip)
    inside = {x.name for x in _launches(loop.body)}
    out.append(LoopTime(loop.name, source(loop), depth, runs, compute, collectives,
                        sum(t for name, t in s.waits.items() if name in inside)))
  return out


def ceiling_s(items: list[Item], s: Schedule, chip: rates.Chip) -> float:
  """The shortest step `items` allow with each loop's collectives hidden within the loop
  (module docstring)."""
  return _ceiling(items, {x.launch.name: x for x in s.timed}, chip)


def source(loop: Loop) -> str:
  """The JAX source of `loop`: its metadata, or where XLA rewrote the loop (double buffering,
  peeling) and left none, the ".../while" whose body all its launches come from."""
  if loop.op_name:
    return loop.op_name
  names = [x.op_name for x in loop.body if isinstance(x, Launch) and "/while/body" in x.op_name]
  shared = os.path.commonprefix(names) + "/"  # the launches may share no more than the body
  cut = shared.rfind("/while/body/")
  return shared[:cut + len("/while")] if cut >= 0 else ""


def _loops(items: list[Item], depth: int, runs: int) -> Iterator[tuple[Loop, int, int]]:
  for it in items:
    if isinstance(it, Loop):
      trips = it.trips or 1
      yield it, depth, runs * trips
      yield from _loops(it.body, depth + 1, runs * trips)
    elif isinstance(it, Branches):
      for branch in it.branches:
        yield from _loops(branch, depth, runs)


def _launches(items: list[Item]) -> Iterator[Launch]:
  for it in items:
    if isinstance(it, Loop):
      yield from _launches(it.body)
    elif isinstance(it, Branches):
      for branch in it.branches:
        yield from _launches(branch)
    else:
      yield it


def _time(it: Launch, timed: dict[str, Timed], chip: rates.Chip) -> Timed:
  return timed.get(it.name) or time_launch(it, chip)


def _on_collective_stream(it: Launch) -> bool:
  return it.kind == "collective"  # a -start or a synchronous collective (not its -done)


def _streams(items: list[Item], timed, chip) -> tuple[float, float]:
  """(compute, collectives) seconds of one run of `items`."""
  compute = collectives = 0.0
  for it in items:
    if isinstance(it, Loop):
      c, k = _streams(it.body, timed, chip)
      compute, collectives = compute + (it.trips or 1) * c, collectives + (it.trips or 1) * k
    elif isinstance(it, Branches):
      runs = [_streams(b, timed, chip) for b in it.branches] or [(0.0, 0.0)]
      compute += max(c for c, _ in runs)
      collectives += max(k for _, k in runs)
    elif _on_collective_stream(it):
      collectives += _time(it, timed, chip).seconds
    elif it.kind not in ("done", "transfer"):
      x = _time(it, timed, chip)
      compute += x.seconds + x.gap
  return compute, collectives


def _ceiling(items: list[Item], timed, chip) -> float:
  compute = 0.0
  for it in items:
    if isinstance(it, Loop):
      compute += (it.trips or 1) * _ceiling(it.body, timed, chip)
    elif isinstance(it, Branches):
      compute += max((_ceiling(b, timed, chip) for b in it.branches), default=0.0)
    elif not _on_collective_stream(it) and it.kind not in ("done", "transfer"):
      x = _time(it, timed, chip)
      compute += x.seconds + x.gap
  return max(compute, _streams(items, timed, chip)[1])
