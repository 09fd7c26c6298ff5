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

Collective matmul (`parallel.collective_matmul`, manual mode with SP; Wang et al., "Overlap
Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
ASPLOS 2023): the gather and the scatter are decomposed into tp ring steps, each overlapped
with the product of the chunk in hand, for the block modules that enter the region themselves
(`seam.EntersTensorParallel`: `tp_column` / `tp_row`). With t = tp and rank r:

  gather + column linears: step s multiplies the chunk of rank (r - s) mod t while passing it
      on to rank r + 1, and writes the product at that chunk's rows;
  row linear + scatter: step s multiplies the rows of chunk (r - s - 1) mod t and adds them to
      the partial sum received from rank r - 1; after t - 1 passes rank r holds chunk r's sum.

Autodiff of the ring (ppermute's transpose is the reverse ppermute) gives a backward of the
same shape. XLA:GPU has no such path for xla mode: its windowed-einsum rewrite handles an
einsum whose operand GSPMD shards, while SP's gather there is a sharding constraint on the
residual stream (`xla_gpu_threshold_for_windowed_einsum_mib=0` changed nothing in the step).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

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


def ring_gather_linears(h_BLD: jax.Array, linears: Sequence[Callable], axis: str,
                        n: int) -> list[jax.Array]:
  """SP's all-gather fused with column-parallel `linears`: [B, L/n, D] -> each [B, L, ...].

  A rolled loop, not n unrolled steps: XLA would merge unrolled products of one weight into a
  single gemm over the concatenated chunks, which waits for every pass (seen on XLA:GPU)."""
  me, to_next = jax.lax.axis_index(axis), [(i, (i + 1) % n) for i in range(n)]
  shapes = [jax.eval_shape(f, h_BLD) for f in linears]
  outs = [jnp.zeros((s.shape[0], n * s.shape[1], *s.shape[2:]), s.dtype) for s in shapes]

  def place(step, chunk, outs):  # the products of the chunk that came from rank me - step
    held = (me - step) % n
    return [jax.lax.dynamic_update_slice_in_dim(o, f(chunk), held * s.shape[1], axis=1)
            for o, f, s in zip(outs, linears, shapes)]

  def body(step, carry):
    chunk, outs = carry
    passed = jax.lax.ppermute(chunk, axis, to_next)  # in flight while this chunk multiplies
    return passed, place(step, chunk, outs)

  chunk, outs = jax.lax.fori_loop(0, n - 1, body, (h_BLD, outs))
  return place(n - 1, chunk, outs)


def ring_linear_scatter(x_BL_: jax.Array, linear: Callable, axis: str, n: int) -> jax.Array:
  """A row-parallel `linear` fused with SP's reduce-scatter: [B, L, ...] -> summed [B, L/n, D]."""
  me, to_next = jax.lax.axis_index(axis), [(i, (i + 1) % n) for i in range(n)]
  rows = x_BL_.shape[1] // n
  part = lambda step: linear(jax.lax.dynamic_slice_in_dim(
      x_BL_, ((me - step - 1) % n) * rows, rows, 1))  # chunk (me - step - 1)'s partial sum

  def body(step, acc):  # this step's product runs while the sum so far arrives
    return jax.lax.ppermute(acc, axis, to_next) + part(step)

  return jax.lax.fori_loop(1, n, body, part(0))


class ManualTensor:
  """TP / SP by hand (mixed into `ManualComms`: uses `tp`, `sp`, `collective_matmul`)."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  tp: int
  sp: bool
  collective_matmul: bool

  def tp_column(self, h_BLD: jax.Array, linears: Sequence[Callable]) -> list[jax.Array]:
    if self.sp and self.collective_matmul:
      return ring_gather_linears(h_BLD, linears, "tensor", self.tp)
    h_BLD = self.enter_tensor_parallel(h_BLD)
    return [f(h_BLD) for f in linears]

  def tp_row(self, x: jax.Array, linear: Callable) -> jax.Array:
    if self.sp and self.collective_matmul:
      return ring_linear_scatter(x, linear, "tensor", self.tp)
    return self.leave_tensor_parallel(linear(x))


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
