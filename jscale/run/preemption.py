"""Stopping a run without losing work: SIGTERM / SIGINT requests, timed saves, and the agreement
of every process on when to act.

A scheduler's SIGTERM (SLURM, Kubernetes, a spot reclaim) or a Ctrl-C does not interrupt a step:
`StopSignals` records the request, the loop finishes the step it is in, saves a checkpoint and
exits with `EXIT_PREEMPTED`. A second Ctrl-C exits at once, unsaved (the checkpoints already on
disk are whole: orbax renames a save into place only once it is complete).

In a multi-process run the processes must save at the same step (a save is collective), but
each sees its signals and its clock on its own: `agree` ORs their flags with one small
allgather, at steps every process visits alike (logging and checkpoint boundaries).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

# Exit statuses of `python -m jscale.train` (documented in the README).
EXIT_CONFIG = 2  # a config error, reported before anything compiled
EXIT_NONFINITE = 3  # a non-finite loss or gradient norm with train.on_nan=stop
EXIT_PREEMPTED = 75  # stopped by SIGTERM / SIGINT after saving: rerun the command to resume
EXIT_INTERRUPTED = 130  # a second Ctrl-C: exited at once, unsaved
EXIT_PEERS_MISSING = 69  # not every process reached the coordinator (distributed.init_timeout_s)


class StopSignals:
  """Context manager: while active, SIGTERM and SIGINT set `requested` (the signal's name)
  instead of killing the process; a second SIGINT exits at once. Outside the main thread
  (where Python cannot install handlers) it does nothing."""

  def __init__(self):
    self.requested: str | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if self.requested is not None and signum == signal.SIGINT:
      print(f"\n{name} again: exiting now, without saving (the checkpoints on disk are whole)",
            file=sys.stderr, flush=True)
      os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access
    first = self.requested is None
    self.requested = self.requested or name  # before printing: a signal may arrive mid-print
    if first:
      print(f"\n{name} received: finishing the current step, then saving a checkpoint "
            "(Ctrl-C again exits at once, unsaved)", file=sys.stderr, flush=True)


class SaveTimer:
  """`checkpoint.every_minutes`: due once that long has passed since the last save (or start)."""

  def __init__(self, minutes: float):
    self.seconds = minutes * 60.0
    self._last = time.monotonic()

  def due(self) -> bool:
    return self.seconds > 0 and time.monotonic() - self._last >= self.seconds

  def reset(self) -> None:
    self._last = time.monotonic()


def agree(*flags: bool) -> tuple[bool, ...]:
  """Each flag ORed over every process (one allgather; a no-op in a single-process run).
  Every process must call it at the same step."""
  if jax.process_count() == 1:
    return tuple(bool(f) for f in flags)
  gathered = multihost_utils.process_allgather(np.asarray(flags, dtype=np.int32))
  return tuple(bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))
