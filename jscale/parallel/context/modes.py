"""The seam's attention under context parallelism, in both modes (no CP: the model's own)."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jscale.model import attention as attn_lib
from jscale.model.positions import Positions
from jscale.model.seam import Seam
from jscale.parallel.context.ring import ring_attention
from jscale.sharding import Layouts


class XlaContext:
  """CP in xla mode (mixed into `XlaComms`: uses `layouts`, `activation`, `_shard_map`)."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  layouts: Layouts
  activation: Callable[..., jax.Array]
  _shard_map: Callable[..., Callable]


  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions: Positions, impl: str,
                interpret: bool = False) -> jax.Array:
    layouts = self.layouts
    if layouts.mesh.shape["sequence"] == 1:
      # The seam's own attention: one device's math (GSPMD shards it).
      return Seam.attention(self, q_BLHK, k_BSGK, v_BSGK, positions, impl, interpret)
    if impl in ("ring", "pallas"):  # the hand-written ring, on the shards XLA already holds
      q_spec = layouts.activation(("batch", "seq", "heads", "head_dim")).spec
      kv_spec = layouts.activation(("batch", "seq", "kv_heads", "head_dim")).spec
      ring = functools.partial(_ring, layout=layouts.context_layout,
                               block=attn_lib.ring_blocks(impl, interpret))
      docs_BL = positions.start_BL
      specs = (q_spec, kv_spec, kv_spec) + (() if docs_BL is None else
                                           (layouts.activation(("batch", "seq")).spec,))
      args = (q_BLHK, k_BSGK, v_BSGK) + (() if docs_BL is None else (docs_BL,))
      # The ring names its output "attn_ctx" itself; naming it again here saved it twice.
      return self._shard_map(ring, specs, q_spec)(*args)
    # The playbook's all-gather variant: every device sees all keys and values (and their
    # positions and documents, for the mask) and keeps its own queries.
    kv_names = ("batch", None, "kv_heads", "head_dim")
    k_BSGK, v_BSGK = self.activation(k_BSGK, kv_names), self.activation(v_BSGK, kv_names)
    keys = jax.tree.map(lambda x: self.activation(x, ("batch", None)), positions)
    ctx_BLHK = attn_lib.attention(q_BLHK, k_BSGK, v_BSGK, impl, positions=(positions, keys))
    # Pinning the output (hence its cotangent) to the queries' layout keeps GSPMD from picking a
    # layout for the backward's score matmuls that it can only reach by replicating (with SP).
    return self.activation(ctx_BLHK, ("batch", "seq", "heads", "head_dim"))


class ManualContext:
  """CP by hand (mixed into `ManualComms`: uses `cp`, `layouts`)."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  layouts: Layouts
  cp: int


  def sequence_sum(self, x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, "sequence") if self.cp > 1 else x

  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions: Positions, impl: str,
                interpret: bool = False) -> jax.Array:
    if self.cp == 1:  # a Pallas impl runs on this device's shards as they are
      return Seam.attention(self, q_BLHK, k_BSGK, v_BSGK, positions, impl, interpret)
    # The ring (Ulysses: `ManualUlysses`); the block math is the flash kernel for
    # attention_impl=pallas, else plain jnp. It names its output "attn_ctx" itself.
    return ring_attention(q_BLHK, k_BSGK, v_BSGK, "sequence", layout=self.layouts.context_layout,
                          block=attn_lib.ring_blocks(impl, interpret),
                          docs_BL=positions.start_BL)


def _ring(q_BLHK, k_BSGK, v_BSGK, docs_BL=None, *, layout: str, block) -> jax.Array:
  return ring_attention(q_BLHK, k_BSGK, v_BSGK, "sequence", layout=layout, block=block,
                        docs_BL=docs_BL)
