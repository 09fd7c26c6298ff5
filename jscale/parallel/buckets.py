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
  dim: int | None = None  # dim of the leaf split by the reduce-scatter
  n: int = 1
  stacked: bool = False  # leading `layers` dim: split into one piece per layer
  position: int = 0  # forward order; stacked leaves use position + layer index

  @property
  def key(self) -> tuple:
    return (self.axes, self.scatter, self.n)


def _to_rows(x: jax.Array, dim: int | None, n: int) -> jax.Array:
  if n == 1:
    return x.reshape(1, -1)
  shape = x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:]
  return jnp.moveaxis(x.reshape(shape), dim, 0).reshape(n, -1)


def reduce_buckets(grads: Any, plans: Any, bucket_bytes: int) -> Any:
  """Reduces every leaf of `grads` per its `Plan` (same tree); scattered leaves come back as
  this device's shard. Returns the reduced tree."""
  leaves, treedef = jax.tree.flatten(grads)
  plans = treedef.flatten_up_to(plans)
  pieces = []  # (forward position, leaf index, layer or None)
  for i, (x, p) in enumerate(zip(leaves, plans)):
    if not p.axes and p.scatter is None:
      continue
    if p.stacked:
      pieces += [(p.position + layer, i, layer) for layer in range(x.shape[0])]
    else:
      pieces.append((p.position, i, None))
  pieces.sort(key=lambda t: -t[0])  # backward order

  done: dict[tuple[int, int | None], jax.Array] = {}
  open_buckets: dict[tuple, list] = {}

  def flush(key):
    members = open_buckets.pop(key, [])
    if not members:
      return
    axes, scatter, n = key
    rows = []
    for i, layer in members:
      x, p = leaves[i], plans[i]
      part, dim = (x, p.dim) if layer is None else (x[layer], None if p.dim is None else p.dim - 1)
      rows.append(_to_rows(part, dim, n))
    buf = jnp.concatenate(rows, axis=1)
    if scatter is not None:
      buf = jax.lax.psum_scatter(buf, scatter, scatter_dimension=0, tiled=True)
    if axes:
      buf = jax.lax.psum(buf, axes)
    offset = 0
    for (i, layer), row in zip(members, rows):
      x, p = leaves[i], plans[i]
      shape = list(x.shape[1:] if layer is not None else x.shape)
      if n > 1:
        shape[(p.dim - 1) if layer is not None else p.dim] //= n
      size = math.prod(shape)
      done[(i, layer)] = buf[0, offset:offset + size].reshape(shape)
      offset += size

  used: dict[tuple, int] = {}
  for _, i, layer in pieces:
    x, key = leaves[i], plans[i].key
    size = x.dtype.itemsize * (x.size // x.shape[0] if layer is not None else x.size)
    if open_buckets.get(key) and used[key] + size > bucket_bytes:
      flush(key)
    if key not in open_buckets:
      open_buckets[key], used[key] = [], 0
    open_buckets[key].append((i, layer))
    used[key] += size
  for key in list(open_buckets):
    flush(key)

  out = []
  for i, (x, p) in enumerate(zip(leaves, plans)):
    if (i, None) in done:
      out.append(done[(i, None)])
    elif p.stacked and (i, 0) in done:
      out.append(jnp.stack([done[(i, layer)] for layer in range(x.shape[0])]))
    else:
      out.append(x)
  return treedef.unflatten(out)
