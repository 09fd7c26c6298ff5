"""Rotary position embeddings, with Llama-3 frequency scaling (HF `rope_type: llama3`) or YaRN
as DeepSeek-V3 ships it (HF `rope_type: yarn`): interpolated low frequencies, extrapolated
high ones, a linear ramp between, and two attention scales (`yarn_rope_scale` on the rotated
parts, `yarn_softmax_scale` on the scores) that MLA applies."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jscale.config import ModelConfig, RopeScalingConfig


def for_model(cfg: ModelConfig) -> np.ndarray:
  """The model's inverse frequencies: over `cfg.rope_dim` (MLA: its rope part), scaled."""
  return inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)


def inv_frequencies(head_dim: int, theta: float,
                    scaling: RopeScalingConfig | None = None) -> np.ndarray:
  """Per-pair inverse frequencies [head_dim // 2], computed in float64 then cast to fp32."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv.astype(np.float32)
  if scaling.rope_type == "yarn":
    return _yarn(inv, head_dim, theta, scaling).astype(np.float32)
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


def _yarn(inv: np.ndarray, dim: int, theta: float, s: RopeScalingConfig) -> np.ndarray:
  """YaRN: frequencies that turn fewer than beta_slow times over the original context are
  interpolated (divided by `factor`), those turning more than beta_fast times kept, a linear
  ramp over the dims between (bounds floored / ceiled, as DeepSeek and HF truncate)."""
  def dim_of(rotations: float) -> float:
    return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))
  low = max(math.floor(dim_of(s.beta_fast)), 0)
  high = min(math.ceil(dim_of(s.beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
  keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
  return inv / s.factor * (1 - keep) + inv * keep


def _mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope_scale(scaling: RopeScalingConfig | None) -> float:
  """The factor YaRN multiplies cos and sin by (HF's `attention_scaling`; 1.0 for
  DeepSeek-V3, whose mscale equals mscale_all_dim), 1.0 without YaRN."""
  if scaling is None or scaling.rope_type != "yarn":
    return 1.0
  if scaling.mscale and scaling.mscale_all_dim:
    return _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor,
                                                              scaling.mscale_all_dim)
  return _mscale(scaling.factor, 1.0)


def yarn_softmax_scale(scaling: RopeScalingConfig | None) -> float:
  """The factor YaRN multiplies the softmax scale 1/sqrt(qk head dim) by: mscale(factor,
  mscale_all_dim)^2 (DeepSeek-V3: ~1.87 at factor 40), 1.0 without."""
  if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim:
    return 1.0
  return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def apply_rope(x_BLHK: jax.Array, positions_BL: jax.Array, inv_freq_K2: np.ndarray) -> jax.Array:
  """Rotates halves (x1, x2) of the head dim by position * frequency (HF rotate_half layout)."""
  angles_BLK2 = positions_BL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_K2)
  cos = jnp.cos(angles_BLK2)[:, :, None, :]
  sin = jnp.sin(angles_BLK2)[:, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLHK.dtype)
