"""Training checkpoints: orbax CheckpointManager holding the train state, the data position and
the run's metadata.

Each step directory holds `state/` (params, optimizer state, step, rng), `data/` (the grain
iterator position, one small JSON per process) and `meta/` (the resolved config, the jscale
version and the command line: `run_dir.metadata`). Saves are asynchronous and atomic: orbax
writes into a temporary directory and renames it only once complete, so a crash mid-save leaves
the previous checkpoints restorable and never a half-written one that `latest_step` would pick;
the oldest step beyond `checkpoint.keep` is removed only after a newer one is complete.

Whether a step can be read back is `integrity`'s to decide, before anything restores it. A
resume starts from `newest_intact`: a damaged newer step (a truncated array file, deleted
metadata, a lost data position) is moved aside to `<step>.damaged-<time>` (nothing is deleted)
with one warning line naming what is wrong. A step written by another number of processes
resumes from its global data position (every process saved the same one: the train iterator
counts global batches), so a run continues the same sequence of examples on any process count;
one whose processes saved different positions is refused and never moved. A run's last save
is read back before it says done (`Checkpointer.check_last`), and saved once more if it does
not read back.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jscale.ckpt import integrity, legacy_experts
from jscale.config import Config, ConfigError
from jscale.data import checkpoint_restore, checkpoint_save

Warn = Callable[[str], None]


def checkpoint_dir(cfg: Config) -> str:
  return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


def complete_steps(directory: str) -> list[int]:
  """The checkpoint steps in `directory`, ascending, without starting orbax; its unfinished
  temporary dirs (`<step>.orbax-checkpoint-tmp-*`) and moved-aside ones are not steps."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and os.path.isdir(os.path.join(directory, d, "state")))


def verify(directory: str, step: int, read_arrays: bool = True) -> integrity.Finding | None:
  """`integrity.check_step` for this job's processes, each reading its share of the stored
  values; every process returns a finding if any process found one (that process's log names
  the value)."""
  pi, pc = jax.process_index(), jax.process_count()
  found = integrity.check_step(directory, step, processes=pc, read_arrays=read_arrays,
                               share=(pi, pc))
  if pc == 1:
    return found
  if found is not None:
    print(f"process {pi}: {found.line()}", file=sys.stderr, flush=True)
  bad = np.asarray(multihost_utils.process_allgather(np.int32(found is not None)))
  if found is None and bad.any():
    found = integrity.Finding(f"checkpoint step {step} in {directory}", "arrays",
                              f"process {int(np.argmax(bad))} could not read its share of the "
                              "stored values (its log names the first)")
  return found


def newest_intact(directory: str, read_arrays: bool, warn: Warn | None = None) -> int | None:
  """The newest step in `directory` that reads back (None: none is there). Each newer, damaged
  one is moved aside with one warning line. A step written by another number of processes
  is a ConfigError (nothing is moved); so is a directory whose every step is damaged."""
  warn = warn or _stderr
  steps = complete_steps(directory)
  for i, step in enumerate(reversed(steps)):
    found = verify(directory, step, read_arrays)
    if found is None:
      return step
    if not found.damaged:
      raise ConfigError(f"{found.line()} (nothing was moved)")
    moved = move_aside(directory, step)
    rest = (f"resuming from step {steps[-i - 2]} instead" if i + 1 < len(steps) else
            "no older checkpoint is left")
    warn(f"warning: {found.line()}; moved to {moved}; {rest}")
  if steps:
    raise ConfigError(f"no intact checkpoint in {directory} (steps "
                      f"{', '.join(map(str, steps))} are damaged, moved aside): start a new run "
                      "with train.output_dir=<new dir>, or checkpoint.resume=false")
  return None


def move_aside(directory: str, step: int) -> str:
  """Renames step's directory to `<step>.damaged-<time>` (process 0, once every process is
  done with it); returns the new path."""
  base = os.path.join(directory, f"{step}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
  target, n = base, 1
  while os.path.exists(target):  # a copy of the step moved aside in this second
    n += 1
    target = f"{base}-{n}"
  multihost_utils.sync_global_devices(f"jscale_damaged_{step}")
  if jax.process_index() == 0:
    os.replace(os.path.join(directory, str(step)), target)
  multihost_utils.sync_global_devices(f"jscale_moved_{step}")
  return target


def _own_position() -> str:
  """The file of this process's data position, as grain's checkpoint handler names it."""
  return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def read_meta(directory: str, step: int) -> dict[str, Any] | None:
  """The metadata saved with checkpoint `step` (None: none saved, or unreadable)."""
  try:
    with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


class Checkpointer:
  """Saves every `checkpoint.every` steps (and on request), keeps the last `checkpoint.keep`."""

  def __init__(self, cfg: Config, meta: dict[str, Any] | None = None):
    ck = cfg.checkpoint
    self.directory = checkpoint_dir(cfg)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep,
        enable_async_checkpointing=ck.async_save, create=True)
    self.enabled, self.every = ck.every > 0, ck.every
    self.verify_arrays = ck.verify
    self.meta = meta or {}
    self.last_saved: int | None = None
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether `step` is on the save interval."""
    return self.enabled and step % self.every == 0

  def save(self, step: int, state: Any, data_iter: Any, *, force: bool = False) -> bool:
    """Saves if `step` is on the interval (or `force`); returns whether a save started."""
    if not (force or self.due(step)) or step == self.last_saved:
      return False
    items = dict(state=ocp.args.StandardSave(state), data=checkpoint_save(data_iter))
    if self.meta:
      items["meta"] = ocp.args.JsonSave({**self.meta, "step": step})
    started = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    if started:
      self.last_saved = step
    return started

  def restore(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
    """Restores the state (with the shardings of `abstract_state`) and the iterator in place.
    A step saved by another number of processes gives every process its global data position
    (`integrity.global_position`; `newest_intact` admits no other)."""
    step_dir = os.path.join(self.directory, str(step))
    with ocp.StandardCheckpointer() as ckptr:  # the manager knows no handler before a restore
      stored = ckptr.metadata(os.path.join(step_dir, "state")).item_metadata.tree
    old = legacy_experts.is_old(abstract_state, stored)
    state = ocp.args.StandardRestore(legacy_experts.old_target(abstract_state) if old
                                     else abstract_state)
    if os.path.exists(os.path.join(step_dir, "data", _own_position())):
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=state, data=checkpoint_restore(data_iter)))
    else:
      position = integrity.global_position(step_dir)
      if position is None:
        raise ConfigError(f"checkpoint step {step} in {self.directory} holds no data position "
                          "this run's processes can share: resume it with the process count "
                          "that saved it")
      out = self._manager.restore(step, args=ocp.args.Composite(state=state))
      data_iter.set_state(position)
    if not old:
      return out["state"]
    shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
    return jax.jit(lambda t: legacy_experts.upgraded(t, abstract_state),
                   out_shardings=shardings)(out["state"])

  def check_last(self, state: Any, data_iter: Any, warn: Warn | None = None) -> str | None:
    """Reads the last save back once it is on disk. A damaged one is moved aside and `state` /
    `data_iter` (still at that step) saved again; None when a readable copy is on disk, else
    the line saying what could not be written."""
    step = self.last_saved
    if step is None:
      return None
    for attempt in range(2):
      self.wait()
      found = verify(self.directory, step, self.verify_arrays)
      if found is None:
        return None
      moved = move_aside(self.directory, step)
      self._manager.reload()  # forget the step
      if attempt == 0:
        (warn or _stderr)(f"warning: {found.line()}; moved to {moved}; saving step {step} again")
        self.last_saved = None
        self.save(step, state, data_iter, force=True)
    return (f"{found.line()}, twice: the storage under {self.directory} does not keep what is "
            f"written (full, over quota?). Both copies are beside it as {step}.damaged-*; once "
            "it is fixed, rerun the command to train on from the newest intact checkpoint")

  def wait(self) -> None:
    """Blocks until pending async saves are complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending async saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
