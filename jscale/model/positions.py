"""Where each token sits: its index in the window and the start of its document.

A packed window (`data.document_mask`) holds several documents. A query token attends only to
keys of its own document at or before it, and its RoPE position restarts at each document:

    sees(q, k)     = start[q] == start[k]  and  index[q] >= index[k]
    rope_pos[t]    = index[t] - start[t]

`start` (the index of the document's first token, `jscale.data.windows.doc_starts`) doubles as
the segment id the flash kernels compare. Without document masking `start` is None: the row is
one document, `rope_pos = index`. `index` is the array index unless context parallelism
reordered the tokens (`jscale.parallel.context.order`): masks over a reordered sequence read it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Positions(NamedTuple):
  """[B, L] int32 arrays: `index_BL` each token's index in its window, `start_BL` its
  document's first index (None: one document per row)."""
  index_BL: jax.Array
  start_BL: jax.Array | None = None

  @property
  def rope_BL(self) -> jax.Array:
    """RoPE's position: the index in the token's document."""
    return self.index_BL if self.start_BL is None else self.index_BL - self.start_BL


def resolve(positions: Positions | jax.Array | None, shape: tuple[int, ...]) -> Positions:
  """`positions` as `Positions`: an index array alone, or None (tokens in order, one document
  per row) for a [B, L] batch of `shape`."""
  if isinstance(positions, Positions):
    return positions
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  return Positions(positions)


def from_batch(batch: dict[str, jax.Array]) -> Positions:
  """The positions of a batch's "tokens": its "positions" (context parallelism's reordered
  indices) and "doc_starts" (`data.document_mask`), whichever it carries."""
  tokens = batch["tokens"]
  return Positions(resolve(batch.get("positions"), tokens.shape).index_BL,
                   batch.get("doc_starts"))


def sees(q: Positions, k: Positions) -> jax.Array:
  """[B, L, S] bool: query l may attend to key s (causal by index, within its document)."""
  mask_BLS = q.index_BL[:, :, None] >= k.index_BL[:, None, :]
  if q.start_BL is not None and k.start_BL is not None:
    mask_BLS &= q.start_BL[:, :, None] == k.start_BL[:, None, :]
  return mask_BLS
