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

The forward's pieces (`Chunked.forward`) carry the routed experts' weights as e4m3 columns
where their FP8 products quantise them so (`jscale.fp8.weight_columns`): the same values for
the forward's product at 1 byte a weight (the 671B's 780 MiB a layer would be 604), in the
first c' <= c columns of the same [r, N, c] buffer, which the backward's bf16 pieces fill
whole (a layer scan's carry and its cotangent share one shape).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jscale.fp8 import scaling, weight_columns
from jscale.parallel import major


@dataclasses.dataclass(frozen=True)
class Chunked:
  """A layer's gather in `chunks` pieces over `axis` (`n` devices): `dims` is each array leaf's
  split dim (in `jax.tree.leaves` order; -1 not split), `dtype` the compute dtype. `e4m3`: the
  leaves the forward's pieces carry as e4m3 columns (`forward`), () for none."""
  dims: tuple[int, ...]
  dtype: Any
  chunks: int
  axis: str
  n: int
  e4m3: tuple[bool, ...] = ()
  for_forward: bool = False

  @property
  def forward(self) -> Chunked:
    """The forward's pieces: the `e4m3` leaves (the routed experts' weights, where their FP8
    products quantise them per column) as `jscale.fp8.weight_columns` sends them, 1 byte a
    weight instead of 2, the values the forward's product takes; the same buffer (`empty`),
    whose pieces it fills in part. Itself where no leaf is so sent."""
    return dataclasses.replace(self, for_forward=True) if any(self.e4m3) else self

  def _coded(self, i: int) -> bool:
    return self.for_forward and self.e4m3[i]

  def _words(self, layer: Any) -> list[int]:
    """Each split leaf's words in a piece's flat array (in the compute dtype)."""
    return [weight_columns.n_words(x.shape, self.dtype) if self._coded(i) else math.prod(x.shape)
            for i, (x, d) in enumerate(zip(jax.tree.leaves(layer), self.dims)) if d >= 0]

  def _width(self, layer: Any) -> int:
    return -(-sum(self._words(layer)) // self.chunks)

  def _flat_RC(self, layer: Any) -> jax.Array:
    parts = []
    for i, (x, d) in enumerate(zip(jax.tree.leaves(layer), self.dims)):
      if d < 0:
        continue
      if self._coded(i):  # the devices sharing K take the max of their column amaxes
        over = ((lambda a: jax.lax.pmax(a, self.axis)) if d == weight_columns.K_DIM else
                (lambda a: a))
        parts.append(weight_columns.encode(x.astype(self.dtype), self.dtype, over))
      else:
        parts.append(x.astype(self.dtype).reshape(-1))
    flat = jnp.concatenate(parts)
    return jnp.pad(flat, (0, self._width(layer) * self.chunks - flat.shape[0])).reshape(
        self.chunks, -1)

  def empty(self, layer: Any) -> jax.Array:
    """The [r, N, c] buffer the trips fill (zeros): the backward's pieces fill it whole, the
    forward's in part."""
    bf16 = dataclasses.replace(self, for_forward=False)  # the pieces that fill it whole
    return jnp.zeros((self.chunks, self.n, bf16._width(layer)), self.dtype)

  def fetch(self, got_RNC: jax.Array, layer: Any, t: jax.Array) -> jax.Array:
    """`got_RNC` with chunk `t` of `layer` (its stored shards) gathered into it."""
    chunk_NC = jax.lax.all_gather(jax.lax.dynamic_index_in_dim(self._flat_RC(layer), t, 0,
                                                               keepdims=False), self.axis)
    return jax.lax.dynamic_update_slice(got_RNC, chunk_NC[None], (t, 0, 0))

  def whole(self, layer: Any) -> jax.Array:
    """Every chunk of `layer` gathered at once (one all-gather), as the trips would fill them."""
    got_RNC = jax.lax.all_gather(self._flat_RC(layer), self.axis).swapaxes(0, 1)
    return jax.lax.dynamic_update_slice(self.empty(layer), got_RNC, (0, 0, 0))

  def assemble(self, got_RNC: jax.Array, layer: Any) -> Any:
    """The gathered layer from every chunk (`layer`: its stored shards, for the shapes and the
    leaves not split); the forward's e4m3 leaves as the values they stand for (w' = q·s)."""
    flat_NF = got_RNC[:, :, :self._width(layer)].transpose(1, 0, 2).reshape(self.n, -1)
    leaves, treedef = jax.tree.flatten(layer)
    out, off = [], 0
    for i, (x, d) in enumerate(zip(leaves, self.dims)):
      if d < 0:
        out.append(x)
        continue
      if self._coded(i):
        words = weight_columns.n_words(x.shape, self.dtype)
        q_N, s_N = jax.vmap(lambda w: weight_columns.decode(w, x.shape))(
            flat_NF[:, off:off + words])
        # Split along K every device's scales are the same (their amaxes' max); else each
        # covers its own columns.
        s = s_N[0] if d == weight_columns.K_DIM else major.unsplit(s_N, d)
        # w' = q·s: exact in bf16 (e4m3 times a power of two)
        out.append(scaling.dequantize(major.unsplit(q_N, d), s, self.dtype))
      else:
        words = math.prod(x.shape)
        out.append(major.unsplit(flat_NF[:, off:off + words].reshape(self.n, *x.shape), d))
      off += words
    return jax.tree.unflatten(treedef, out)
