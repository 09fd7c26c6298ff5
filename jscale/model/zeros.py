"""A zero that stays where it is used, for `jnp.where` over large arrays.

A constant zero (`jnp.where(mask, rows, 0)`) depends on no input of the loops around it. Under
a custom VJP's partial evaluation (`jscale.model.layer_prefetch`'s layer) JAX lifts such a
computation out of the scans as loop-invariant, and XLA materialises it whole and reads it in
every trip: DeepSeek-V3 671B at 1,024 H100s held 6.9 GiB per device of the expert exchange's
zeros, a 4.4 GiB one read by each micro-batch's combine (predicted, 2026-12-03). A zero made
from an input of the loop body is computed there, fused into its `where`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_from(index: jax.Array, dtype) -> jax.Array:
  """A scalar zero of `dtype` made from `index`, an array of non-negative integers (so
  min(index[0], 0) is 0), not a constant (module docstring)."""
  return jnp.minimum(jax.lax.stop_gradient(index.reshape(-1)[0]), 0).astype(dtype)
