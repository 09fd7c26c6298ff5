"""Orbax CheckpointManager args for a grain iterator (saved beside the train state).

  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=checkpoint_save(train_iter)))
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=checkpoint_restore(train_iter)))

grain's handler writes <step>/data/process_<i>-of-<n>.json (i, n = jax.process_index/count),
one small JSON per process. Its save is synchronous inside `mngr.save` even with async
checkpointing, so the iterator may advance as soon as `save` returns. Restore calls
`set_state` on the iterator you pass, in place (restored["data"] is that same iterator).
"""

from __future__ import annotations

import grain


def checkpoint_save(iterator: grain.DatasetIterator):
  """Composite-item args that save `iterator`'s position."""
  return grain.checkpoint.CheckpointSave(iterator)


def checkpoint_restore(iterator: grain.DatasetIterator):
  """Composite-item args that restore `iterator` in place to the saved position."""
  return grain.checkpoint.CheckpointRestore(iterator)
