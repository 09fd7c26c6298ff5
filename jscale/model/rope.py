"""Rotary position embeddings, with Llama-3 frequency scaling (HF `rope_type: llama3`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jscale.config import RopeScalingConfig


def inv_frequencies(head_dim: int, theta: float,
                    scaling: RopeScalingConfig | None = None) -> np.ndarray:
  """Per-pair inverse frequencies [head_dim // 2], computed in float64 then cast to fp32."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv.astype(np.float32)
  old = scaling.original_max_position_embeddings
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv
  # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept; the band
  # between is interpolated smoothly.
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BLHK: jax.Array, positions_BL: jax.Array, inv_freq_K2: np.ndarray) -> jax.Array:
  """Rotates halves (x1, x2) of the head dim by position * frequency (HF rotate_half layout)."""
  angles_BLK2 = positions_BL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_K2)
  cos = jnp.cos(angles_BLK2)[:, :, None, :]
  sin = jnp.sin(angles_BLK2)[:, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLHK.dtype)
