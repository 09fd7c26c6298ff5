"""Stopping a run without losing work: SIGTERM / SIGINT requests, timed saves, and the agreement
of every process on when to act.

A scheduler's SIGTERM (SLURM, Kubernetes, a spot reclaim) or a Ctrl-C does not interrupt a step:
`StopSignals` records the request, the loop starts at most one more step (two with several
processes), saves a checkpoint and exits with `exit_codes.PREEMPTED`. A second Ctrl-C exits at
once, unsaved (the checkpoints already on disk are whole: orbax renames a save into place only
once it is complete). A signal during the final save or plot lets it finish.

In a multi-process run the processes must save at the same step (a save is collective), but
each sees its signals on its own. `StopStep` settles the step through JAX's coordination
service, read after every step without a device sync. Timed saves (each process's own
clock) are agreed by `agree`, one small allgather at steps every process visits alike (logging
and checkpoint boundaries).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jscale import exit_codes, jax_compat


class StopSignals:
  """Context manager: while active, SIGTERM and SIGINT set `requested` (the signal's name)
  instead of killing the process; a second SIGINT exits at once. Outside the main thread
  (where Python cannot install handlers) it does nothing.

  The loop keeps `started` (the last step the host dispatched) current; `at` records it when
  the first signal comes, and `on_request` (if set) is called then. `phase` names work after
  the last step (the final save, the plot) that a signal lets finish."""

  def __init__(self):
    self.requested: str | None = None
    self.started = 0
    self.at: int | None = None
    self.phase: str | None = None
    self.on_request: Callable[[], None] | None = None
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
      os._exit(exit_codes.INTERRUPTED)  # at once: no cleanup, no save
    if self.requested is not None:
      return
    self.requested, self.at = name, self.started  # before printing: a signal may come mid-print
    if self.on_request is not None:
      self.on_request()
    if self.phase is not None:
      print(f"\n{name} received during {self.phase}: finishing it, then exiting (Ctrl-C again "
            "exits at once; the checkpoints on disk are whole)", file=sys.stderr, flush=True)
    else:
      within = "one step" if jax.process_count() == 1 else "two steps (agreed by every process)"
      print(f"\n{name} received at step {self.at}: saving a checkpoint within {within} "
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


_RUNS = itertools.count()  # each run in a program gets its own key (every process counts alike)


class StopStep:
  """The step a stop request ends the run at, the same in every process. The loop calls
  `reached(step)` after each step, in every process; once it returns True the loop saves and
  stops. `by` says whose request it was.

  One process: the step after which the request is first read. Several: the process with the
  request proposes, from its signal handler, the step two past the one its host had started
  (`StopSignals.at`); the first proposal written to the coordination service stands, and every
  process reads it after each step (no device sync). No process can have passed it: a process
  reads after step k only once step k-1 is complete, which needs every process's share of
  step k-1, and the proposer starts step at+1 only after proposing."""

  def __init__(self, signals: StopSignals):
    self.signals = signals
    self.step: int | None = None
    self.by = ""
    run = next(_RUNS)
    self._dir, self._count = f"jscale/stop/{run}/", f"jscale/stop_proposals/{run}"
    self._client = jax_compat.coordination_client() if jax.process_count() > 1 else None
    if self._client is not None:
      signals.on_request = self._propose
      if signals.requested is not None:  # the signal came before the loop (while compiling)
        self._propose()

  def reached(self, step: int) -> bool:
    if self.step is None and self.signals.requested is not None and self._client is None:
      self.step, self.by = step, self.signals.requested
    elif self.step is None and self._client is not None:
      self._read()
    return self.step is not None and step >= self.step

  def _propose(self) -> None:
    # An atomic counter picks the first proposer; only it writes a step.
    if self._client.key_value_increment(self._count, 1) == 1:
      self._client.key_value_set(self._dir + "step", f"{self.signals.at + 2} "
                                 f"{self.signals.requested} {jax.process_index()}")

  def _read(self) -> None:
    found = self._client.key_value_dir_get(self._dir)  # [] until the proposal is written
    if not found:
      return
    at, name, process = found[0][1].split()
    self.step = int(at)
    self.by = name if int(process) == jax.process_index() else f"{name} to process {process}"


def agree(*flags: bool) -> tuple[bool, ...]:
  """Each flag ORed over every process (one allgather; a no-op in a single-process run).
  Every process must call it at the same step."""
  if jax.process_count() == 1:
    return tuple(bool(f) for f in flags)
  gathered = multihost_utils.process_allgather(np.asarray(flags, dtype=np.int32))
  anywhere = np.asarray(np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))
  return tuple(bool(v) for v in anywhere.ravel())
