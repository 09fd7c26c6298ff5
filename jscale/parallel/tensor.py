"""Megatron's conjugate collectives for tensor (and sequence) parallelism, for use in shard_map.

A column-parallel linear (weights split over output features) takes a replicated input and
gives a feature-sharded output; a row-parallel linear (split over input features) takes that
sharded input and gives partial sums. Around such a pair (attention: QKV then O; MLP: gate/up
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

import jax


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
