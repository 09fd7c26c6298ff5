"""A routed expert's weights gathered in e4m3, a power-of-two scale per output column: ZeRO-3's
pieces for the forward under FP8 experts scaled per row (`fp8.experts_scaling: row`;
`jscale.parallel.zero_prefetch.Chunked.forward`).

The forward's FP8 product quantises each expert's [K, N] weights per output column
(`jscale.fp8.grouped_kernel`, `jscale.fp8.grouped.row_products`):

  q[e, :, n] = w[e, :, n] / s[e, n] in e4m3,     s[e, n] = scale_for(max_k |w[e, k, n]|)

so a gather that carries q and s in place of w's bf16 values carries 1 byte a weight, not 2,
and loses nothing the product keeps: the arrived w' = q·s (exact in bf16) re-quantises to q
(its column amax is max|q|·s with max|q| in [224, 448], so its scale is s, or s/2 with every
value doubled where max|q| rounded down to 224: the argument of `jscale.fp8.wire`). The
forward's values are the bf16 gather's, bit for bit. The backward's dx quantises w per input
row instead, so the backward gathers bf16 weights as before.

K is dim 1 of the [E, K, ...N] leaves (gate and up: [E, D, 2, F]; down: [E, F, D]). Where
ZeRO-3 splits K over devices, each device's amax covers its slice of K, and the scales take
the max over those devices first (`amax_over`: a pmax of [E, 1, ...N] fp32, 64 KiB for the
671B's gate and up). The bytes travel as words of the compute dtype (two e4m3 to a bf16), so a
layer's pieces stay one array of one dtype.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jscale.fp8 import grouped, scaling
from jscale.fp8.scaling import E4M3

K_DIM = 1  # the contraction dim of the forward's product, in a routed expert's weight leaf


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  return (*shape[:K_DIM], 1, *shape[K_DIM + 1:])


def n_words(shape: tuple[int, ...], dtype) -> int:
  """Words of `dtype` that `encode` gives a shard of `shape`: its e4m3 values and fp32 column
  scales, padded to a whole word."""
  size = math.prod(shape) + 4 * math.prod(_scale_shape(shape))
  return -(-size // jnp.dtype(dtype).itemsize)


def encode(w: jax.Array, dtype,
           amax_over: Callable[[jax.Array], jax.Array] = lambda a: a) -> jax.Array:
  """[n_words] of `dtype`: `w` (one device's shard) quantised per column to e4m3, then its
  scales' fp32 bytes. `amax_over`: the column amax's reduction over the devices sharing K."""
  amax = amax_over(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=K_DIM, keepdims=True))
  s = scaling.scale_for(amax, E4M3)
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
  raw = jnp.concatenate([as_bytes(scaling.quantize(w, s, E4M3)), as_bytes(s)])
  word = jnp.dtype(dtype).itemsize
  raw = jnp.pad(raw, (0, n_words(w.shape, dtype) * word - raw.shape[0]))
  return jax.lax.bitcast_convert_type(raw.reshape(-1, word), dtype)


def decode(words: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(e4m3 values [shape], fp32 column scales [shape with K 1]) of `encode`'s words for a
  shard of `shape`."""
  raw = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  size, scales = math.prod(shape), _scale_shape(shape)
  q = jax.lax.bitcast_convert_type(raw[:size], E4M3).reshape(shape)
  s = jax.lax.bitcast_convert_type(raw[size:size + 4 * math.prod(scales)].reshape(-1, 4),
                                   jnp.float32)
  return q, s.reshape(scales)


def per_column(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(e4m3, scales) of a whole leaf quantised as the forward's product does: the reference
  `encode` / `decode` across devices must agree with."""
  s = grouped.scales_along(w, K_DIM, E4M3)
  return scaling.quantize(w, s, E4M3), s
