"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): heads traded for sequence.

Under `mesh.sequence = n` each device holds L/n tokens of every head. Around the attention,
one all-to-all per tensor trades that for all L tokens of H/n query heads and G/n K/V heads:

    q [B, L/n, H, K]  --all-to-all-->  [B, L, H/n, K]     (k, v likewise with G)
    out = attention(q, k, v)            whole sequence, causal, any impl (cuDNN, flash, XLA)
    out [B, L, H/n, Kv] --all-to-all--> [B, L/n, H, Kv]

Per layer each device sends (n-1)/n of its q, k, v and output in the forward and of their
cotangents in the backward: (n-1)/n · B·(L/n)·(H·K + 2·G·K + H·Kv) elements each way, which
falls as 1/n where the ring's K/V hops stay (n-1)/n · B·L·2·G·K. The heads must divide: H and G
by n times mesh.tensor (which splits them first); GQA's query heads h of device i use K/V heads
h // (H/G), which are device i's own since each holds a contiguous block of both.

The data pipeline orders tokens for the ring (`order.token_order`: zig-zag by default); after
the gather the sequence is in slot order, so it is put in sequence order (a local permutation of
chunks, `to_sequence_order`) for index-causal kernels, and back before the return.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jscale.model import attention as attn_lib
from jscale.model import positions as positions_lib
from jscale.model.positions import Positions
from jscale.model.seam import Seam
from jscale.parallel.context.order import chunks_per_device
from jscale.sharding import Layouts


def whole_sequence(context_impl: str, cp: int) -> bool:
  """Whether each device's attention sees the whole sequence (no CP, or Ulysses), so that an
  index-causal kernel applies; False for the ring's per-chunk blocks."""
  return cp == 1 or context_impl == "ulysses"


def to_sequence_order(x_BL: jax.Array, n: int, layout: str) -> jax.Array:
  """The sequence axis (1) from the pipeline's slot order (`order.token_order`) to sequence
  order. Zig-zag slots hold chunks (0, 2n-1, 1, 2n-2, ...): the first of each device's pair
  in order, then the second ones reversed."""
  if chunks_per_device(layout) == 1:
    return x_BL
  b, l = x_BL.shape[:2]
  pairs = x_BL.reshape(b, n, 2, l // (2 * n), *x_BL.shape[2:])
  return jnp.concatenate([pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)],
                         axis=1).reshape(x_BL.shape)


def to_slot_order(x_BL: jax.Array, n: int, layout: str) -> jax.Array:
  """The inverse of `to_sequence_order`."""
  if chunks_per_device(layout) == 1:
    return x_BL
  b, l = x_BL.shape[:2]
  chunks = x_BL.reshape(b, 2 * n, l // (2 * n), *x_BL.shape[2:])
  pairs = jnp.stack([chunks[:, :n], jnp.flip(chunks[:, n:], axis=1)], axis=2)
  return pairs.reshape(x_BL.shape)


def _attend_whole(attend: Callable, q_BLHK, k_BSGK, v_BSGV, docs_BL, n: int,
                  layout: str) -> jax.Array:
  """`attend(q, k, v, positions)` (index-causal, within documents) on gathered q, k, v and
  documents `docs_BL` (None: none) in slot order; the output in slot order."""
  order = lambda x: to_sequence_order(x, n, layout)
  exchanged = lambda x: order(checkpoint_name(x, attn_lib.CP_EXCHANGED))
  docs_BL = None if docs_BL is None else order(docs_BL)
  shape = q_BLHK.shape[:2]  # the whole sequence, in order
  positions = positions_lib.resolve(None, shape)._replace(start_BL=docs_BL)
  ctx_BLHV = attend(exchanged(q_BLHK), exchanged(k_BSGK), exchanged(v_BSGV), positions)
  return to_slot_order(ctx_BLHV, n, layout)


def ulysses_attention(q_BLHK, k_BSGK, v_BSGV, attend: Callable, axis_name: str,
                      layout: str, docs_BL: jax.Array | None = None) -> jax.Array:
  """Ulysses attention by hand, inside a shard_map over `axis_name` (n devices, each with L/n
  tokens): all-to-alls gather the sequence and split the heads, `attend(q, k, v, positions)`
  runs causal attention on the whole sequence (within the documents of `docs_BL`, gathered
  too), and the reverse all-to-all splits it again."""
  n = jax.lax.axis_size(axis_name)
  gather = lambda x: jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
  if docs_BL is not None:
    docs_BL = jax.lax.all_gather(docs_BL, axis_name, axis=1, tiled=True)
  ctx_BLHV = _attend_whole(attend, gather(q_BLHK), gather(k_BSGK), gather(v_BSGV), docs_BL, n,
                           layout)
  return checkpoint_name(jax.lax.all_to_all(ctx_BLHV, axis_name, split_axis=1, concat_axis=2,
                                            tiled=True), attn_lib.CP_EXCHANGED)


def heads_spec(layouts: Layouts, names) -> P:
  """The activation spec of `names` (batch, seq, heads, head_dim) with the sequence whole and
  the heads split over `sequence` too (after the tensor axes, which split them first)."""
  b, _, h, d = layouts.activation(names).spec
  h = tuple(h if isinstance(h, tuple) else (h,) if h else ())
  return P(b, None, h + ("sequence",), d)


class XlaUlysses:
  """Ulysses in xla mode (mixed into `XlaComms` before `XlaContext`): sharding constraints
  that move the `sequence` split from the tokens to the heads, which GSPMD makes all-to-alls."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  layouts: Layouts
  _sharding: Callable
  _shard_map: Callable[..., Callable]

  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions: Positions, impl: str,
                interpret: bool = False) -> jax.Array:
    lay, n = self.layouts, self.layouts.mesh.shape["sequence"]
    if n == 1 or lay.context_impl != "ulysses":
      return super().attention(q_BLHK, k_BSGK, v_BSGK, positions, impl,  # type: ignore
                               interpret)
    q_spec, kv_spec = heads_spec(lay, attn_lib.Q_NAMES), heads_spec(lay, attn_lib.KV_NAMES)
    docs_spec = P(q_spec[0], None)
    pin = lambda x, s: jax.lax.with_sharding_constraint(x, self._sharding(s))
    impl = attn_lib.local_impl(impl, q_BLHK, v_BSGK)
    attend = self._local_attend(impl, interpret, q_spec, kv_spec, docs_spec)
    docs_BL = None if positions.start_BL is None else pin(positions.start_BL, docs_spec)
    ctx_BLHV = _attend_whole(attend, pin(q_BLHK, q_spec), pin(k_BSGK, kv_spec),
                             pin(v_BSGK, kv_spec), docs_BL, n, lay.context_layout)
    ctx_BLHV = pin(pin(ctx_BLHV, q_spec), lay.activation(attn_lib.Q_NAMES).spec)
    return checkpoint_name(ctx_BLHV, attn_lib.CP_EXCHANGED)

  def _local_attend(self, impl: str, interpret: bool, q_spec: P, kv_spec: P,
                    docs_spec: P) -> Callable:
    """Index-causal attention within documents on head-split operands: a kernel per device's
    heads (GSPMD cannot split a custom call), plain XLA as global math."""
    if impl not in attn_lib.KERNEL_IMPLS:
      return lambda q, k, v, p: attn_lib.in_order(q, k, v, impl, p)
    kernel = attn_lib.kernel_fn(impl, interpret,
                                self.kernel_device())  # type: ignore[attr-defined]

    def attend(q, k, v, p: Positions):
      if p.start_BL is None:
        return self._shard_map(kernel, (q_spec, kv_spec, kv_spec), q_spec)(q, k, v)
      return self._shard_map(kernel, (q_spec, kv_spec, kv_spec, docs_spec), q_spec)(
          q, k, v, p.start_BL)
    return attend


class ManualUlysses:
  """Ulysses by hand (mixed into `ManualComms` before `ManualContext`): `ulysses_attention`."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  layouts: Layouts
  cp: int

  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions: Positions, impl: str,
                interpret: bool = False) -> jax.Array:
    if self.cp == 1 or self.layouts.context_impl != "ulysses":
      return super().attention(q_BLHK, k_BSGK, v_BSGK, positions, impl,  # type: ignore
                               interpret)
    attend = lambda q, k, v, p: Seam.attention(self, q, k, v, p, impl,  # type: ignore
                                               interpret)
    return ulysses_attention(q_BLHK, k_BSGK, v_BSGK, attend, "sequence",
                             self.layouts.context_layout, positions.start_BL)
