"""FP8 formats and per-tensor power-of-two scales: amax -> scale, quantise, amax history.

Two formats, as Transformer Engine and the FP8 paper (Micikevicius et al., 2022) use them:
e4m3 (3 mantissa bits, max 448) for the forward's operands, e5m2 (2 mantissa bits, max 57344)
for the output gradients, whose values span more binades.

Scales are powers of two (`q = x / scale`, `x ~= q * scale`): dividing by one and multiplying the
product back are exact in any float type, so rounding to the format is the only error, and an
FP8 matmul equals dequantise-then-multiply exactly. A power of two costs at most one binade of
the format's range (the largest |x| lands in (max/2, max]), not precision: a float's relative
precision does not depend on its scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands: activations and weights
E5M2 = jnp.float8_e5m2  # backward: the gradient of the product's output


def format_max(fmt) -> float:
  """The largest finite value of an FP8 format (448 for e4m3, 57344 for e5m2)."""
  return float(jnp.finfo(fmt).max)


def scale_for(amax: jax.Array, fmt, margin: int = 0) -> jax.Array:
  """The smallest power of two `s` with amax / s <= the format's max / 2**margin (fp32 scalar);
  1 when amax is 0 or not finite (nothing to scale, or a NaN/inf the step reports anyway).

  Built from the exponent bits (ceil(log2(r)) of a float r is its exponent, plus one unless
  its mantissa is zero), so it is exact: no log2 / exp2 rounding."""
  amax = jnp.asarray(amax, jnp.float32)
  ok = (amax > 0) & jnp.isfinite(amax)
  ratio = jnp.where(ok, amax, 1.0) / format_max(fmt)
  bits = jax.lax.bitcast_convert_type(ratio, jnp.int32)
  exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  exponent = jnp.clip(exponent + margin, -126, 127)  # fp32's normal powers of two
  scale = jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)
  return jnp.where(ok, scale, jnp.float32(1.0))


def quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
  """x / scale rounded to `fmt` (to nearest even), saturating at the format's max: a delayed
  scale may be too small for this step's values."""
  m = format_max(fmt)
  return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -m, m).astype(fmt)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """q * scale in `dtype`."""
  return q.astype(dtype) * scale.astype(dtype)


def amax(x: jax.Array) -> jax.Array:
  """max |x| as an fp32 scalar (of this array; the seam's `amax` reduces it over devices)."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def push(history: jax.Array, value: jax.Array) -> jax.Array:
  """`history` (newest first) with `value` in front and the oldest entry dropped."""
  return jnp.roll(history, 1).at[0].set(value.astype(history.dtype))


def delayed_amax(history: jax.Array, current: jax.Array) -> jax.Array:
  """The amax delayed scaling uses: the max of the previous steps' amaxes (`history`); on the
  first step (an empty, all-zero history) this step's own amax, so no step runs unscaled."""
  past = jnp.max(history)
  return jnp.where(past > 0, past, current)
