"""Tensor and sequence parallelism (playbook: "Tensor parallelism", "Sequence parallelism"),
in both modes, and the vocab-parallel embedding and loss.

xla (`XlaTensor`): the weights' logical rules split heads / mlp / vocab over `tensor`; entering
and leaving the tensor-parallel region are sharding constraints on the residual stream, from
which GSPMD makes the all-reduce (or, with SP, the all-gather and reduce-scatter along the
sequence).

manual (`ManualTensor`): Megatron's conjugate collectives, written for shard_map. A
column-parallel linear (weights split over output features) takes a replicated input and gives
a feature-sharded output; a row-parallel linear (split over input features) takes that sharded
input and gives partial sums. Around such a pair (attention: QKV then O; MLP: gate/up
then down) the playbook places two operators that are each other's transpose:

  f (enter): identity forward, all-reduce of the input's gradient backward;
  g (leave): all-reduce of the partial sums forward, identity backward.

They are custom_vjp functions because the shard_map runs with `check_vma=False`: there JAX
transposes `psum` to another `psum`, which for g would multiply gradients by the TP degree.

Sequence parallelism replaces f by an all-gather along the sequence and g by a reduce-scatter
along it; those two are already each other's transpose under autodiff, so JAX's own rules give
the backward (reduce-scatter for the gather, all-gather for the scatter).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tp(x: jax.Array, axis: str) -> jax.Array:
  """f: identity forward; backward sums the gradient over `axis` (each rank holds a part)."""
  return x


copy_to_tp.defvjp(lambda x, axis: (x, None),
                  lambda axis, _, g: (jax.lax.psum(g, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tp(x: jax.Array, axis: str) -> jax.Array:
  """g: all-reduce forward; backward passes the (already replicated) gradient through."""
  return jax.lax.psum(x, axis)


reduce_from_tp.defvjp(lambda x, axis: (jax.lax.psum(x, axis), None),
                      lambda axis, _, g: (g,))


def gather_sequence(x_BLD: jax.Array, axis: str) -> jax.Array:
  """SP entry: [B, L/tp, D] -> [B, L, D] (all-gather; its gradient is a reduce-scatter)."""
  return jax.lax.all_gather(x_BLD, axis, axis=1, tiled=True)


def scatter_sequence(y_BLD: jax.Array, axis: str) -> jax.Array:
  """SP exit: partial sums [B, L, D] -> summed [B, L/tp, D] (reduce-scatter; grad: all-gather)."""
  return jax.lax.psum_scatter(y_BLD, axis, scatter_dimension=1, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scale_grad(x: jax.Array, factor: float) -> jax.Array:
  """Identity forward; backward multiplies the gradient by `factor` (a replicated computation
  inside the TP region, whose whole gradient f would otherwise sum over the ranks)."""
  return x


scale_grad.defvjp(lambda x, factor: (x, None), lambda factor, _, g: (g * factor,))


class XlaTensor:
  """TP / SP as constraints on the residual stream (mixed into `XlaComms`)."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  activation: Callable[..., jax.Array]


  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    # With sequence parallelism this is the all-gather along the sequence (playbook's g).
    return self.activation(x_BLD, ("batch", "seq", "embed"))

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    # All-reduce of the row-parallel partial sums, or reduce-scatter along sequence under SP.
    return self.activation(y_BLD, ("batch", "res_seq", "embed"))


class ManualTensor:
  """TP / SP by hand (mixed into `ManualComms`: uses `tp`, `sp`)."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  tp: int
  sp: bool


  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    if self.tp == 1:
      return x_BLD
    if self.sp:
      return gather_sequence(x_BLD, "tensor")
    return copy_to_tp(x_BLD, "tensor")

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    if self.tp == 1:
      return y_BLD
    if self.sp:
      return scatter_sequence(y_BLD, "tensor")
    return reduce_from_tp(y_BLD, "tensor")

  def embed(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    if self.tp == 1:
      return jnp.take(table_VD, tokens_BL, axis=0)
    # Vocab-parallel: each rank looks up the tokens in its slice of the vocab (zeros for the
    # others), and the partial rows are summed like a row-parallel output (g, or SP's scatter).
    ids_BL = tokens_BL - self.vocab_offset(table_VD.shape[0])
    mine_BL = (ids_BL >= 0) & (ids_BL < table_VD.shape[0])
    rows_BLD = jnp.take(table_VD, jnp.where(mine_BL, ids_BL, 0), axis=0)
    return self.leave_tensor_parallel(jnp.where(mine_BL[..., None], rows_BLD, 0))

  def vocab_max(self, x: jax.Array) -> jax.Array:
    m = jnp.max(jax.lax.stop_gradient(x), axis=-1, keepdims=True)
    return jax.lax.pmax(m, "tensor") if self.tp > 1 else m

  def vocab_sum(self, x: jax.Array) -> jax.Array:
    s = jnp.sum(x, axis=-1, keepdims=True)
    return reduce_from_tp(s, "tensor") if self.tp > 1 else s

  def vocab_offset(self, local_size: int) -> int | jax.Array:
    return jax.lax.axis_index("tensor") * local_size if self.tp > 1 else 0
