"""References for the grouped matmul kernels: XLA's ragged_dot, and a loop over groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def reference(lhs_MK, rhs_GKN, group_sizes_G, precision=jnp.float32):
  """jax.lax.ragged_dot with fp32 accumulation and output (the kernels' contract, unrounded)."""
  return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=precision)


def loop_reference(lhs_MK, rhs_GKN, group_sizes_G):
  """One plain matmul per group over its rows (host-side sizes; fp32): the definition."""
  lhs, rhs = np.asarray(lhs_MK, np.float32), np.asarray(rhs_GKN, np.float32)
  out, start = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32), 0
  for i, size in enumerate(np.asarray(group_sizes_G)):
    out[start:start + size] = lhs[start:start + size] @ rhs[i]
    start += size
  return out
