"""Training checkpoints: orbax CheckpointManager holding the train state and the data position.

Each step directory holds `state/` (params, optimizer state, step, rng) and `data/` (the grain
iterator position, one small JSON per process). Saves are asynchronous and atomic: orbax writes
into a temporary directory and renames it only once complete, so a crash mid-save leaves the
previous checkpoints restorable and never a half-written one that `latest_step` would pick.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from jscale.config import Config
from jscale.data import checkpoint_restore, checkpoint_save


def checkpoint_dir(cfg: Config) -> str:
  return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


class Checkpointer:
  """Saves every `checkpoint.every` steps, keeps the last `checkpoint.keep`."""

  def __init__(self, cfg: Config):
    ck = cfg.checkpoint
    self.directory = checkpoint_dir(cfg)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep,
        enable_async_checkpointing=ck.async_save, create=True)
    self.enabled, self.every = ck.every > 0, ck.every
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_iter: Any, *, force: bool = False) -> bool:
    """Saves if `step` is on the interval (or `force`); returns whether a save started."""
    if not (force or (self.enabled and step % self.every == 0)):
      return False
    return self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=checkpoint_save(data_iter)), force=True)

  def restore(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
    """Restores the state (with the shardings of `abstract_state`) and the iterator in place."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=checkpoint_restore(data_iter)))
    return out["state"]

  def close(self) -> None:
    """Waits for pending async saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

