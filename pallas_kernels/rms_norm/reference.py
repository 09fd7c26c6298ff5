"""The plain-jnp RMSNorm every kernel of this folder is checked against."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def reference(x_ND, weight_D, *, eps: float = 1e-6, residual_ND=None):
  """Plain-jnp RMSNorm with `rms_norm`'s contract (jscale.model.layers.RMSNorm's formula)."""
  if residual_ND is not None:
    x_ND = x_ND + residual_ND
  x32 = x_ND.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  out = y.astype(x_ND.dtype) * weight_D.astype(x_ND.dtype)
  return out if residual_ND is None else (out, x_ND)
