"""Training checkpoints: orbax CheckpointManager holding the train state, the data position and
the run's metadata.

Each step directory holds `state/` (params, optimizer state, step, rng), `data/` (the grain
iterator position, one small JSON per process) and `meta/` (the resolved config, the jscale
version and the command line: `run_dir.metadata`). Saves are asynchronous and atomic: orbax
writes into a temporary directory and renames it only once complete, so a crash mid-save leaves
the previous checkpoints restorable and never a half-written one that `latest_step` would pick;
the oldest step beyond `checkpoint.keep` is removed only after a newer one is complete.

A checkpoint that is complete on disk but unreadable (a truncated array file, deleted metadata)
is found at restore: it is moved aside to `<step>.unreadable-<time>` (nothing is deleted) and
the previous one restored, with a warning naming both.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jscale.config import Config, ConfigError
from jscale.data import checkpoint_restore, checkpoint_save


def checkpoint_dir(cfg: Config) -> str:
  return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


def complete_steps(directory: str) -> list[int]:
  """The checkpoint steps in `directory`, ascending, without starting orbax; its unfinished
  temporary dirs (`<step>.orbax-checkpoint-tmp-*`) and moved-aside ones are not steps."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and os.path.isdir(os.path.join(directory, d, "state")))


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
    """Restores the state (with the shardings of `abstract_state`) and the iterator in place."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=checkpoint_restore(data_iter)))
    return out["state"]

  def restore_latest(self, abstract_state: Any, data_iter: Any,
                     warn: Callable[[str], None] | None = None) -> tuple[Any, int] | None:
    """Restores the newest readable checkpoint: `(state, step)`, or None when there is none.
    Unreadable newer ones are moved aside (process 0, once every process failed on them)."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    steps = sorted(self._manager.all_steps(), reverse=True)
    for i, step in enumerate(steps):
      try:
        return self.restore(step, abstract_state, data_iter), step
      except Exception as e:  # any storage error: tensorstore / orbax / OSError
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      moved = self._move_aside(step)
      rest = (f"restoring step {steps[i + 1]} instead" if i + 1 < len(steps) else
              "no older checkpoint is left")
      warn(f"warning: checkpoint step {step} in {self.directory} is unreadable ({reason}); "
           f"moved to {moved}; {rest}")
    if steps:
      raise ConfigError(f"no readable checkpoint in {self.directory} (steps "
                        f"{', '.join(map(str, sorted(steps)))} all failed, moved aside): start "
                        "a new run with train.output_dir=<new dir>, or checkpoint.resume=false")
    return None

  def _move_aside(self, step: int) -> str:
    target = os.path.join(self.directory, f"{step}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    multihost_utils.sync_global_devices(f"jscale_unreadable_{step}")  # every process has tried
    if jax.process_index() == 0:
      os.replace(os.path.join(self.directory, str(step)), target)
    multihost_utils.sync_global_devices(f"jscale_moved_{step}")
    self._manager.reload()  # forget the step
    return target

  def wait(self) -> None:
    """Blocks until pending async saves are complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending async saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
