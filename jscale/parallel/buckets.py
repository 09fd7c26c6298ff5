"""Bucketed gradient reduction (inside shard_map): few large collectives instead of one per leaf.

As in PyTorch DDP, gradients are packed into contiguous buffers of at most `bucket_bytes` and
each buffer is reduced by one collective. Pieces (a whole leaf, or one layer's slice of a
stacked leaf) are packed in the order the backward produces them: head first, then layers from
last to first, then the embedding, so that the first buckets can be reduced while later ones
are still being packed (and, with XLA's latency-hiding scheduler, while the optimizer runs).

A bucket is a [n, N] buffer. For a plain all-reduce n = 1. For a reduce-scatter over n shards,
each piece is first laid out with its sharded dim split as (n, rest) and moved to the front, so
that row r of the bucket holds exactly the slices shard r owns: `psum_scatter` over rows then
leaves each device its own per-leaf shards, in the same layout as the ZeRO optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one gradient leaf is reduced: reduce-scatter `dim` over `scatter` (n shards), then
  all-reduce over `axes`. `position` is where the leaf's layer sits in the forward pass."""
  axes: tuple[str, ...] = ()
  scatter: str | None = None
  dim: int = -1  # dim of the (whole, stacked) leaf split by the reduce-scatter; -1: none
  n: int = 1
  stacked: bool = False  # leading `layers` dim: split into one piece per layer
  position: int = 0  # forward order; stacked leaves use position + layer index

  @property
  def key(self) -> tuple:
    return (self.axes, self.scatter, self.n)


def _to_rows(x: jax.Array, dim: int | None, n: int) -> jax.Array:
  if n == 1:
    return x.reshape(1, -1)
  if dim is None:
    raise ValueError(f"{n} shards of a tensor that has no dimension to split them over")
  shape = x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:]
  return jnp.moveaxis(x.reshape(shape), dim, 0).reshape(n, -1)


def pack(leaves: list, plans: list[Plan], bucket_bytes: int) -> list[tuple[tuple, list]]:
  """Buckets in issue order: [(plan key, [(leaf index, layer or None), ...]), ...]. Pieces go in
  backward order; a bucket holds pieces with one plan key and at most `bucket_bytes` (or one
  larger piece)."""
  pieces = []  # (forward position, leaf index, layer or None)
  for i, (x, p) in enumerate(zip(leaves, plans)):
    if p.axes or p.scatter is not None:
      pieces += ([(p.position + layer, i, layer) for layer in range(x.shape[0])] if p.stacked
                 else [(p.position, i, None)])
  pieces.sort(key=lambda t: -t[0])
  buckets, current, used = [], {}, {}
  for _, i, layer in pieces:
    x, key = leaves[i], plans[i].key
    size = x.dtype.itemsize * (x.size // x.shape[0] if layer is not None else x.size)
    if current.get(key) and used[key] + size > bucket_bytes:
      buckets.append((key, current.pop(key)))
    if key not in current:
      current[key], used[key] = [], 0
    current[key].append((i, layer))
    used[key] += size
  return buckets + list(current.items())


def reduce_buckets(grads: Any, plans: Any, bucket_bytes: int) -> Any:
  """Reduces every leaf of `grads` per its `Plan` (same tree); scattered leaves come back as
  this device's shard. Returns the reduced tree.

  Layer slices are written back into their stacked leaf in place (dynamic-update-slice on a
  buffer nothing else reads), so the only extra memory is a bucket and its reduced copy.
  """
  leaves, treedef = jax.tree.flatten(grads)
  plans = treedef.flatten_up_to(plans)
  out = list(leaves)
  for i, p in enumerate(plans):  # scattered stacked leaves: a shard-sized buffer to fill
    if p.stacked and p.scatter is not None:
      shape = list(leaves[i].shape)
      shape[p.dim] //= p.n
      out[i] = jnp.zeros(shape, leaves[i].dtype)
  for (axes, scatter, n), members in pack(leaves, plans, bucket_bytes):
    src = lambda i: leaves[i] if scatter is not None else out[i]
    parts = [(src(i), plans[i].dim) if layer is None else (src(i)[layer], plans[i].dim - 1)
             for i, layer in members]
    buf = jnp.concatenate([_to_rows(x, dim, n) for x, dim in parts], axis=1)
    if scatter is not None:
      buf = jax.lax.psum_scatter(buf, scatter, scatter_dimension=0, tiled=True)
    if axes:
      buf = jax.lax.psum(buf, axes)
    offset = 0
    for (i, layer), (x, dim) in zip(members, parts):
      shape = list(x.shape)
      if n > 1:
        shape[dim] //= n
      piece = buf[0, offset:offset + math.prod(shape)].reshape(shape)
      offset += math.prod(shape)
      out[i] = piece if layer is None else jax.lax.dynamic_update_index_in_dim(
          out[i], piece, layer, 0)
  return treedef.unflatten(out)
