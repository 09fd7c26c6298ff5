"""Where the layers live under pipeline parallelism.

The model is cut into p·v chunks of consecutive layers. A placement says which stage runs each
chunk and, there, which of its v local chunks it is:

- interleaved (Megatron's; one chunk per stage when v = 1): chunk c on stage c % p, so stage s
  holds chunks s, s+p, s+2p, ...;
- v (ZB-V, DualPipeV; v = 2): chunk c on stage c for c < p and on stage 2p − 1 − c after, so
  the micro-batch goes down the stages and back up: stage 0 holds the first and the last chunk,
  stage p − 1 the two middle ones (their hand-over stays on the stage).

The stacked layer axis is split over `stage` in contiguous blocks (the sharding rule
layers -> stage), so the stack is stored with each stage's chunks together in local order:
stored position i holds model layer `storage_order(...)[i]` (the identity when v = 1).
"""

from __future__ import annotations

import jax
import numpy as np

PLACEMENTS = ("interleaved", "v")
# The schedules whose tables use the V placement; every other one is interleaved.
V_SCHEDULES = ("zbv", "dualpipev")


def placement_of(schedule: str) -> str:
  """The placement pipeline.schedule=`schedule` runs."""
  return "v" if schedule in V_SCHEDULES else "interleaved"


def stage_of(c: int, p: int, placement: str = "interleaved") -> int:
  """The stage that runs model chunk c."""
  if placement == "v":
    return c if c < p else 2 * p - 1 - c
  return c % p


def local_of(c: int, p: int, placement: str = "interleaved") -> int:
  """Which of its stage's chunks model chunk c is (0 .. v − 1, in stored order)."""
  return c // p


def chunk_at(s: int, local: int, p: int, placement: str = "interleaved") -> int:
  """The model chunk stage s holds as its `local`-th chunk."""
  if placement == "v":
    return s if local == 0 else 2 * p - 1 - s
  return local * p + s


def storage_order(n_layers: int, p: int, v: int, placement: str = "interleaved") -> np.ndarray:
  """[n_layers]: the model layer stored at each position of the stacked axis."""
  k = n_layers // (p * v)  # layers per chunk
  order = [chunk_at(s, j, p, placement) * k + i for s in range(p) for j in range(v)
           for i in range(k)]
  return np.asarray(order, np.int32)


def to_storage(blocks, n_layers: int, p: int, v: int, placement: str = "interleaved"):
  """Stacked layer params in model order -> storage order (a no-op when v = 1)."""
  if v == 1:
    return blocks
  return _take(blocks, storage_order(n_layers, p, v, placement))


def to_model(blocks, n_layers: int, p: int, v: int, placement: str = "interleaved"):
  """Stacked layer params (or their gradients) in storage order -> model order."""
  if v == 1:
    return blocks
  return _take(blocks, np.argsort(storage_order(n_layers, p, v, placement)))


def _take(tree, index):
  return jax.tree.map(lambda x: x[index], tree)
