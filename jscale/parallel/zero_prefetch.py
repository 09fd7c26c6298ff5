"""ZeRO-3's gather of one layer in chunks, a chunk per trip of another layer's loop: the
backward's prefetch (`parallel.prefetch_layers`, `jscale.model.layer_prefetch`).

XLA:GPU keeps no collective in flight across a loop that holds collectives, so a layer's
gather before its micro-batch loop waits whole (DeepSeek-V3 671B on 1,024 H100s: 780 MiB a
layer, ~26 ms, predicted). Gathered inside the previous layer's loop instead, one chunk a trip,
each chunk runs beside that trip's compute. The chunks: a device's shards of the layer's split
leaves, cast to the compute dtype and laid end to end (`n` elements, padded to `r` equal
chunks of `c`):

    flat_RC = pad(concat_leaves(shard.astype(dtype).ravel()))  .reshape(r, c)
    got_RNC[t] = all_gather(flat_RC[t], fsdp)                  trip t of r
    leaf = unsplit(got_RNC.transpose(1, 0, 2).reshape(N, r·c)[:, off:off + size]
                   .reshape(N, *shard_shape), dim)

which is `major.all_gather(shard.astype(dtype), fsdp, dim)`, the gather it replaces: the same
values, in any order of trips. Leaves not split over fsdp are used as stored, as that gather
uses them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jscale.parallel import major


@dataclasses.dataclass(frozen=True)
class Chunked:
  """A layer's gather in `chunks` pieces over `axis` (`n` devices): `dims` is each array leaf's
  split dim (in `jax.tree.leaves` order; -1 not split), `dtype` the compute dtype."""
  dims: tuple[int, ...]
  dtype: Any
  chunks: int
  axis: str
  n: int

  def _flat_RC(self, layer: Any) -> jax.Array:
    parts = [x.astype(self.dtype).reshape(-1)
             for x, d in zip(jax.tree.leaves(layer), self.dims) if d >= 0]
    flat = jnp.concatenate(parts)
    pad = -flat.shape[0] % self.chunks
    return jnp.pad(flat, (0, pad)).reshape(self.chunks, -1)

  def empty(self, layer: Any) -> jax.Array:
    """The [r, N, c] buffer the trips fill (zeros)."""
    split = sum(math.prod(x.shape) for x, d in zip(jax.tree.leaves(layer), self.dims) if d >= 0)
    return jnp.zeros((self.chunks, self.n, -(-split // self.chunks)), self.dtype)

  def fetch(self, got_RNC: jax.Array, layer: Any, t: jax.Array) -> jax.Array:
    """`got_RNC` with chunk `t` of `layer` (its stored shards) gathered into it."""
    chunk_NC = jax.lax.all_gather(jax.lax.dynamic_index_in_dim(self._flat_RC(layer), t, 0,
                                                               keepdims=False), self.axis)
    return jax.lax.dynamic_update_index_in_dim(got_RNC, chunk_NC, t, 0)

  def whole(self, layer: Any) -> jax.Array:
    """Every chunk of `layer` gathered at once (one all-gather), as the trips would fill them."""
    return jax.lax.all_gather(self._flat_RC(layer), self.axis).swapaxes(0, 1)

  def assemble(self, got_RNC: jax.Array, layer: Any) -> Any:
    """The gathered layer from every chunk (`layer`: its stored shards, for the shapes and the
    leaves not split)."""
    flat_NF = got_RNC.transpose(1, 0, 2).reshape(self.n, -1)
    leaves, treedef = jax.tree.flatten(layer)
    out, off = [], 0
    for x, d in zip(leaves, self.dims):
      if d < 0:
        out.append(x)
        continue
      size = math.prod(x.shape)
      out.append(major.unsplit(flat_NF[:, off:off + size].reshape(self.n, *x.shape), d))
      off += size
    return jax.tree.unflatten(treedef, out)
