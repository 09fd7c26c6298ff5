"""Where the layers live under pipeline parallelism.

The stacked layer axis is split over `stage` in contiguous blocks (the sharding rule
layers -> stage). With v chunks per stage the interleaved schedule needs stage s to hold model
chunks s, s+p, s+2p, ...; the stack is therefore stored in that order: stored position i holds
model layer `storage_order(...)[i]`. With v = 1 the order is the identity.
"""

from __future__ import annotations

import jax
import numpy as np


def storage_order(n_layers: int, p: int, v: int) -> np.ndarray:
  """[n_layers]: the model layer stored at each position of the stacked axis."""
  k = n_layers // (p * v)  # layers per chunk
  order = [(j * p + s) * k + i for s in range(p) for j in range(v) for i in range(k)]
  return np.asarray(order, np.int32)


def to_storage(blocks, n_layers: int, p: int, v: int):
  """Stacked layer params in model order -> storage order (a no-op when v = 1)."""
  if v == 1:
    return blocks
  order = storage_order(n_layers, p, v)
  return _take(blocks, order)


def to_model(blocks, n_layers: int, p: int, v: int):
  """Stacked layer params (or their gradients) in storage order -> model order."""
  if v == 1:
    return blocks
  return _take(blocks, np.argsort(storage_order(n_layers, p, v)))


def _take(tree, index):
  return jax.tree.map(lambda x: x[index], tree)
