"""Collectives over a leaf's non-major dim, run on its major dim.

XLA:GPU gathers and scatters only along an array's most major dim (NCCL's buffers are
contiguous): layout assignment gives any other all-gather's operand a layout with that dim
major, and propagates it back through the cast and the layer loop's slice to the weight stack
itself. The stack is then copied, in fp32 and whole, into that layout before the loop and kept
there for the step (DeepSeek-V3 671B on 1,024 H100s, ZeRO-3: 7.6 GB a device for the experts'
and the attention output's stacks, `scripts/peak_memory.py`), and the gradient stacks are
written in it. Gathering a new leading axis instead, and moving it into place after the
gather, puts the transpose on the one gathered layer in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def all_gather(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
  """`jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)`, gathered along a new major
  axis: [n, *x.shape], then that axis moved before `dim` and merged with it (shard i is rows
  i·s … (i+1)·s − 1 of `dim`, as the tiled gather's)."""
  if dim == 0:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
  g = jnp.moveaxis(jax.lax.all_gather(x, axis_name, axis=0), 0, dim)
  return g.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])


def psum_scatter(x: jax.Array, axis_name: str, dim: int, n: int) -> jax.Array:
  """`jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)` over `n` devices,
  scattered along a new major axis (`all_gather`'s transpose)."""
  if dim == 0:
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
  s = x.shape[dim] // n
  g = jnp.moveaxis(x.reshape(*x.shape[:dim], n, s, *x.shape[dim + 1:]), dim, 0)
  return jax.lax.psum_scatter(g, axis_name, scatter_dimension=0)
