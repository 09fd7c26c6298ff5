"""FP8 experts: the tiled grouped matmul's products (`jscale.model.grouped_tiles`) with e4m3
operands forward and e5m2 output gradients backward, each expert scaled by its own current
amax (`fp8.targets: [experts]`).

For tile t, which holds rows of expert e = expert_T[t]:

  forward    y_t  = (q(x_t) . q(w_e)) * sx_e * sw_e      q(x_t) = x_t / sx_e in e4m3
  backward   dx_t = (q(g_t) . q(w_e)^T) * sg_e * sw_e    q(g_t) = g_t / sg_e in e5m2
             dw_e = sum over e's tiles of (q(x_t)^T . q(g_t)) * sx_e * sg_e

sx_e, sw_e and sg_e are powers of two (`scaling.scale_for`) from this step's amax of expert e's
rows, weights and output gradients: one expert's outliers never coarsen another's values, which
a tensor-wide scale would (an expert 10^4 times smaller than the largest falls into e4m3's
subnormals). Each product is a batched `dot_general` of FP8 operands with fp32 accumulation,
its result in the compute dtype; the per-tile scale, a power of two, multiplies it exactly, so
rounding to the formats (and the result to the compute dtype) is the only error. XLA:GPU
compiles the batched FP8 dot as a Triton gemm on FP8 operands; its cuBLAS path would upcast
them (cuBLASLt's FP8 gemm takes no batch of per-item scales).

`row_products` (`fp8.experts_scaling: row`) scales finer: every operand by a power of two per
row along its free dimension (x per token, w per output column forward and per input row
backward, g per token for dx and per column for dw), all in e4m3, as DeepSeek-V3 runs every
tensor in e4m3 once its scales are fine-grained. Scales along a product's free dimensions
multiply its result exactly, so each operand is quantised once per product it enters:

  forward    y_t  = (q(x_t) . q(w_e)) * sx_t[rows] * sw_e[columns]
  backward   dx_t = (q(g_t) . q'(w_e)^T) * sg_t[rows] * sw'_e[rows of w]
             dw_e = (sum over e's tiles of q'(x_t)^T . q'(g_t)) * sx'_e[K] * sg'_e[N]

Not DeepSeek-V3's block scaling (1×128 activation tiles, 128×128 weight blocks): its scales
change along the contraction, so each 128-wide slice of K needs its own fp32 partial product,
scaled, before the sum — a kernel's inner loop (DeepGEMM promotes to fp32 every 128 of K in
registers). As XLA ops that is K/128 separate products and an fp32 [K/128, M, N] buffer per
tile: slower than bf16, so not offered. Rows are the finest scales that stay exact outside
the product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jscale.fp8 import scaling
from jscale.fp8.scaling import E4M3, E5M2
from jscale.model import matmul

_TMK_TKN = (((2,), (1,)), ((0,), (0,)))   # x_TMK . w_TKN -> TMN
_TMN_TKN = (((2,), (2,)), ((0,), (0,)))   # g_TMN . w_TKN^T -> TMK
_TMK_TMN = (((1,), (1,)), ((0,), (0,)))   # x_TMK^T . g_TMN -> TKN


def expert_scales(x_T: jax.Array, expert_T: jax.Array, n_experts: int, fmt) -> jax.Array:
  """[E] fp32 power-of-two scales from each expert's amax over its tiles (`x_T`: a tensor whose
  leading dim is the tiles; tiles past the experts, expert_T = E, count for none)."""
  amax_T = jnp.max(jnp.abs(x_T.astype(jnp.float32)), axis=tuple(range(1, x_T.ndim)))
  amax_E = jax.ops.segment_max(amax_T, expert_T, num_segments=n_experts)
  return scaling.scale_for(jnp.maximum(amax_E, 0.0), fmt)


def _per_tile(v_E: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, 1, 1]: each tile's expert's entry (unused tiles: the last expert's; rows are zero)."""
  return jnp.take(v_E, expert_T, axis=0, mode="clip")[:, None, None]


def _quantize_tiles(x_T, scale_T, fmt):
  return jnp.clip(x_T.astype(jnp.float32) / scale_T, -scaling.format_max(fmt),
                  scaling.format_max(fmt)).astype(fmt)


def _weights_per_tile(qw_EKN: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, K, N]: each tile's expert's FP8 weights, gathered as their bits (a gather need not
  know the format), four values to a 32-bit word where N allows. One byte at a time, the
  DeepSeek-V3 16B proxy's weight gathers ran at ~5% of an H200's bandwidth (by their count
  and 2:1 sizes, its [gate | up] tiles' 2.6 GB took 15.5 ms a launch; results/h200_measured/
  bench_train_deepseek_2026-11-29.md); as words, not yet measured."""
  bits = (jax.lax.bitcast_convert_type(qw_EKN.reshape(*qw_EKN.shape[:2], -1, 4), jnp.uint32)
          if qw_EKN.shape[-1] % 4 == 0 else jax.lax.bitcast_convert_type(qw_EKN, jnp.uint8))
  got = jax.lax.bitcast_convert_type(jnp.take(bits, expert_T, axis=0, mode="clip"),
                                     qw_EKN.dtype)
  return got.reshape(expert_T.shape[0], *qw_EKN.shape[1:])


@jax.custom_vjp
def tile_products(x_TMK: jax.Array, w_EKN: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, M, N]: each tile's rows times its expert's weights in FP8 (module docstring), in
  x's dtype; the drop-in for `grouped_tiles.tile_products`."""
  return _forward(x_TMK, w_EKN, expert_T)[0]


def _forward(x_TMK, w_EKN, expert_T):
  e = w_EKN.shape[0]
  sx_E = expert_scales(x_TMK, expert_T, e, E4M3)
  sw_E = scaling.scale_for(jnp.max(jnp.abs(w_EKN.astype(jnp.float32)), axis=(1, 2)), E4M3)
  qx_TMK = _quantize_tiles(x_TMK, _per_tile(sx_E, expert_T), E4M3)
  qw_EKN = _quantize_tiles(w_EKN, sw_E[:, None, None], E4M3)
  # Products accumulate in fp32 and come out in the compute dtype: a power-of-two scale after
  # the rounding is exact, so nothing is lost against scaling the fp32 result, at half the bytes.
  dt = x_TMK.dtype
  y_TMN = jax.lax.dot_general(qx_TMK, _weights_per_tile(qw_EKN, expert_T), _TMK_TKN,
                              preferred_element_type=dt)
  y_TMN = y_TMN * _per_tile(sx_E * sw_E, expert_T).astype(dt)
  # Saved as bytes: remat policies round saved floats with reduce_precision, which for e4m3fn
  # (no infinities) turns its top binade into inf / NaN (`jscale.fp8.dot`).
  as_bytes = lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8)
  w_dtype = jnp.zeros((0,), w_EKN.dtype)  # the weights' dtype, for their gradient
  return y_TMN, (as_bytes(qx_TMK), as_bytes(qw_EKN), sx_E, sw_E, expert_T, w_dtype)


def _bwd(res, g_TMN):
  bx_TMK, bw_EKN, sx_E, sw_E, expert_T, w_dtype = res
  qx_TMK = jax.lax.bitcast_convert_type(bx_TMK, E4M3)
  qw_TKN = _weights_per_tile(jax.lax.bitcast_convert_type(bw_EKN, E4M3), expert_T)
  e = sw_E.shape[0]
  sg_E = expert_scales(g_TMN, expert_T, e, E5M2)
  qg_TMN = _quantize_tiles(g_TMN, _per_tile(sg_E, expert_T), E5M2)
  dt = g_TMN.dtype
  dx_TMK = jax.lax.dot_general(qg_TMN, qw_TKN, _TMN_TKN, preferred_element_type=dt)
  dx_TMK = dx_TMK * _per_tile(sg_E * sw_E, expert_T).astype(dt)
  dw_TKN = jax.lax.dot_general(qx_TMK, qg_TMN, _TMK_TMN, preferred_element_type=dt)
  # Each expert's tiles summed by a matmul whose one-hot entries are the tiles' scales (powers
  # of two: exact), so the [T, K, N] per-tile gradients take no scaling pass of their own.
  scale_TE = jnp.where(expert_T[:, None] == jnp.arange(e),
                       jnp.take(sx_E * sg_E, expert_T, mode="clip")[:, None], 0.0)
  dw_EKN = matmul.einsum("TE,TKN->EKN", scale_TE, dw_TKN, dt)
  return dx_TMK, dw_EKN.astype(w_dtype.dtype), np.zeros(expert_T.shape, jax.dtypes.float0)


tile_products.defvjp(_forward, _bwd)


def scales_along(x: jax.Array, axis: int, fmt) -> jax.Array:
  """Power-of-two scales from x's amax along `axis` (kept as a size-1 dim)."""
  return scaling.scale_for(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True),
                           fmt)


def _expert_scales(x_TMX: jax.Array, expert_T: jax.Array, n_experts: int) -> jax.Array:
  """[E, X]: e4m3 scales of each expert's columns (amax over its tiles' rows)."""
  amax_TX = jnp.max(jnp.abs(x_TMX.astype(jnp.float32)), axis=1)
  return scaling.scale_for(jnp.maximum(jax.ops.segment_max(amax_TX, expert_T, n_experts), 0.0),
                           E4M3)


def _quantized(x, scale):
  return _quantize_tiles(x, scale, E4M3)


def _of_tiles(v_EX: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, 1, X]: each tile's expert's row of per-column scales."""
  return jnp.take(v_EX, expert_T, axis=0, mode="clip")[:, None, :]


@jax.custom_vjp
def row_products(x_TMK: jax.Array, w_EKN: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, M, N]: `tile_products` with a scale per row of every operand, all e4m3 (module
  docstring); the drop-in for `grouped_tiles.tile_products`."""
  return _rows_forward(x_TMK, w_EKN, expert_T)[0]


def _rows_forward(x_TMK, w_EKN, expert_T):
  e, dt = w_EKN.shape[0], x_TMK.dtype
  sx_TM1, sw_E1N = scales_along(x_TMK, 2, E4M3), scales_along(w_EKN, 1, E4M3)
  y_TMN = jax.lax.dot_general(_quantized(x_TMK, sx_TM1),
                              _weights_per_tile(_quantized(w_EKN, sw_E1N), expert_T), _TMK_TKN,
                              preferred_element_type=dt)
  y_TMN = y_TMN * sx_TM1.astype(dt) * _of_tiles(sw_E1N[:, 0], expert_T).astype(dt)
  # What the backward's products read, quantised along their free dims now, kept as bytes
  # (`_forward` says why): x per expert column (dw), w per input row (dx).
  sx_EK = _expert_scales(x_TMK, expert_T, e)
  qx_TMK = _quantized(x_TMK, _of_tiles(sx_EK, expert_T))
  sw_EK1 = scales_along(w_EKN, 2, E4M3)
  as_bytes = lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8)
  w_dtype = jnp.zeros((0,), w_EKN.dtype)
  return y_TMN, (as_bytes(qx_TMK), as_bytes(_quantized(w_EKN, sw_EK1)), sx_EK, sw_EK1,
                 expert_T, w_dtype)


def _rows_bwd(res, g_TMN):
  bx_TMK, bw_EKN, sx_EK, sw_EK1, expert_T, w_dtype = res
  e, dt = sx_EK.shape[0], g_TMN.dtype
  qw_TKN = _weights_per_tile(jax.lax.bitcast_convert_type(bw_EKN, E4M3), expert_T)
  sg_TM1 = scales_along(g_TMN, 2, E4M3)
  dx_TMK = jax.lax.dot_general(_quantized(g_TMN, sg_TM1), qw_TKN, _TMN_TKN,
                               preferred_element_type=dt)
  dx_TMK = dx_TMK * sg_TM1.astype(dt) * _of_tiles(sw_EK1[..., 0], expert_T).astype(dt)
  sg_EN = _expert_scales(g_TMN, expert_T, e)
  qg_TMN = _quantized(g_TMN, _of_tiles(sg_EN, expert_T))
  dw_TKN = jax.lax.dot_general(jax.lax.bitcast_convert_type(bx_TMK, E4M3), qg_TMN, _TMK_TMN,
                               preferred_element_type=dt)
  # Each expert's tiles share its column scales: summed first (a one-hot matmul), then scaled.
  one_hot_TE = (expert_T[:, None] == jnp.arange(e)).astype(dt)
  dw_EKN = matmul.einsum("TE,TKN->EKN", one_hot_TE, dw_TKN, dt)
  dw_EKN = dw_EKN * (sx_EK[:, :, None] * sg_EN[:, None, :]).astype(dt)
  return dx_TMK, dw_EKN.astype(w_dtype.dtype), np.zeros(expert_T.shape, jax.dtypes.float0)


row_products.defvjp(_rows_forward, _rows_bwd)
