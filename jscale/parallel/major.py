"""Collectives over a leaf's non-major dim, run on its major dim.

XLA:GPU gathers and scatters only along an array's most major dim (NCCL's buffers are
contiguous): layout assignment gives any other all-gather's operand a layout with that dim
major, and propagates it back through the cast and the layer loop's slice to the weight stack
itself. The stack is then copied, in fp32 and whole, into that layout before the loop and kept
there for the step, and the gradient stacks are written in it (DeepSeek-V3 671B on 1,024
H100s, ZeRO-3: 7.6 GB a device of the experts' and the attention output's stacks so laid out,
`scripts/peak_memory.py`; the compiled step fell 4.3 GiB without them). Gathering a new
leading axis instead, and moving it into place after the gather, puts the transpose on the one
gathered layer in the compute dtype. `split` and `unsplit` are that move; xla mode constrains
the split array's shardings instead of calling the collectives
(`jscale.parallel.zero.XlaZero._gather_major`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pays(depth: int, n: int) -> bool:
  """Whether a stack of `depth` layers split over `n` devices gathers its slices along a new
  major axis: the tiled gather's copy of the whole fp32 stack shard is depth · 4 / n bytes a
  layer's element, for the step; this transposes the gathered layer, 2 bytes an element while
  it is in use (twice over where XLA double-buffers the loop). Shallower stacks (DeepSeek's
  dense prefix) keep the tiled gather."""
  return depth > n


def split(x: jax.Array, dim: int, n: int) -> jax.Array:
  """`x` with `dim` split into [n, rest] and the n moved first: [n, ..., rest, ...]."""
  return jnp.moveaxis(x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1:]),
                      dim, 0)


def unsplit(x: jax.Array, dim: int) -> jax.Array:
  """`split`'s inverse."""
  x = jnp.moveaxis(x, 0, dim)
  return x.reshape(*x.shape[:dim], -1, *x.shape[dim + 2:])


def all_gather(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
  """`jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)`, gathered along a new major
  axis: [n, *x.shape] is the gathered array `split` (shard i is rows i·s … (i+1)·s − 1 of
  `dim`, as the tiled gather's)."""
  if dim == 0:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
  return unsplit(jax.lax.all_gather(x, axis_name, axis=0), dim)


def psum_scatter(x: jax.Array, axis_name: str, dim: int, n: int) -> jax.Array:
  """`jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)` over `n` devices,
  scattered along a new major axis (`all_gather`'s transpose)."""
  if dim == 0:
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
  return jax.lax.psum_scatter(split(x, dim, n), axis_name, scatter_dimension=0)
