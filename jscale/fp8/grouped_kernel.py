"""FP8 experts on the Hopper grouped matmul kernel (`model.moe.gemm: pallas` with
`fp8.targets: [experts]` and `fp8.experts_scaling: row`).

The row scaling of `jscale.fp8.grouped.row_products`, on the kernel's rows sorted by expert
instead of the tiled path's tiles. Every operand is e4m3 with a power-of-two scale per row
along its free dimension; a scale along a free dimension multiplies the product's result
exactly, so the kernel accumulates the unscaled e4m3 product in fp32, rounds it to the compute
dtype, and the scales multiply that (exact: powers of two):

  forward  y[r]  = (q(x)[r] . q(w_e)) * sx[r] * sw_e[columns]        e = expert of row r
  dx       dx[r] = (q(g)[r] . q'(w_e)^T) * sg[r] * sw'_e[rows of w]
  dw       dw_e  = x_e^T . g_e                                         in the compute dtype

wgmma reads 8-bit operands only K-major, so the forward's weights are quantised into [E, N, K]
(a transposed copy: the quantisation pass writes it) and dx reads w's own [E, K, N] layout.
The weight gradient stays in bf16 on the transposed kernel: in FP8 it would need x and g
quantised transposed ([K, M], [N, M]) and each group's boundary rows masked along the 8-bit
blocks' minor dimension, not written yet. So two of the three products run in FP8.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jscale.fp8 import grouped, scaling, wire
from jscale.fp8.scaling import E4M3
from jscale.model import grouped_tiles

if TYPE_CHECKING:
  from pallas_kernels.grouped_matmul import GmmBlocks


def _kernels():
  """The Hopper kernels' module, imported when a product runs (not when FP8 is configured)."""
  from pallas_kernels import grouped_matmul
  return grouped_matmul


@dataclasses.dataclass(frozen=True)
class _Static:
  blocks: GmmBlocks | None
  interpret: bool


def row_scales(x: jax.Array, axis: int) -> jax.Array:
  """e4m3 power-of-two scales from x's amax along `axis` (kept as a size-1 dim)."""
  return grouped.scales_along(x, axis, E4M3)


def _product(q_MK, q_ENK, s_M1, s_EN, sizes_E, dtype, cfg: _Static) -> jax.Array:
  """The kernel's unscaled e4m3 product in `dtype`, times each row's and column's scales."""
  y = _kernels().fp8_matmul(q_MK, q_ENK, sizes_E, out_dtype=dtype, blocks=cfg.blocks,
                            interpret=cfg.interpret)
  # (rows past sum(sizes_E) are zeros from the kernel: any expert's scales keep them zero)
  s_MN = jnp.take(s_EN, grouped_tiles.row_experts(sizes_E.astype(jnp.int32), q_MK.shape[0]),
                  axis=0)
  return y * s_M1.astype(dtype) * s_MN.astype(dtype)


def _forward(q_MK, sx_M1, w_EKN, sizes_E, dtype, cfg: _Static) -> jax.Array:
  """The forward product of x's e4m3 rows `q_MK` (scales `sx_M1`): w quantised per column,
  into the [E, N, K] layout wgmma reads."""
  sw_E1N = row_scales(w_EKN, 1)
  qw_ENK = jnp.swapaxes(scaling.quantize(w_EKN, sw_E1N, E4M3), 1, 2)
  return _product(q_MK, qw_ENK, sx_M1, sw_E1N[:, 0], sizes_E, dtype, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rows(x_MK, w_EKN, sizes_E, cfg: _Static):
  sx_M1 = row_scales(x_MK, 1)
  return _forward(scaling.quantize(x_MK, sx_M1, E4M3), sx_M1, w_EKN, sizes_E, x_MK.dtype, cfg)


def _rows_fwd(x_MK, w_EKN, sizes_E, cfg):
  # The backward re-quantises w along its other free dim, so x and w are what it keeps.
  return _rows(x_MK, w_EKN, sizes_E, cfg), (x_MK, w_EKN, sizes_E)


def _rows_bwd(cfg, res, g_MN):
  x_MK, w_EKN, sizes_E = res
  g_MN = g_MN.astype(x_MK.dtype)
  sg_M1, sw_EK1 = row_scales(g_MN, 1), row_scales(w_EKN, 2)
  dx_MK = _product(scaling.quantize(g_MN, sg_M1, E4M3), scaling.quantize(w_EKN, sw_EK1, E4M3),
                   sg_M1, sw_EK1[..., 0], sizes_E, x_MK.dtype, cfg)
  dw_EKN = _kernels().weight_gradient(x_MK, g_MN, sizes_E, interpret=cfg.interpret)
  return dx_MK, dw_EKN.astype(w_EKN.dtype), None


_rows.defvjp(_rows_fwd, _rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _wire_rows(x_MK, w_EKN, sizes_E, b_MW, cfg: _Static):
  # x's e4m3 rows and scales as they came over the wire: what quantising the decoded x per
  # row gives (`jscale.fp8.wire`), without reading x. The backward reads x (dw's bf16 operand).
  return _forward(*wire.split(b_MW), w_EKN, sizes_E, x_MK.dtype, cfg)


def _wire_rows_fwd(x_MK, w_EKN, sizes_E, b_MW, cfg):
  return _wire_rows(x_MK, w_EKN, sizes_E, b_MW, cfg), (x_MK, w_EKN, sizes_E, b_MW)


def _wire_rows_bwd(cfg, res, g_MN):
  x_MK, w_EKN, sizes_E, b_MW = res
  dx_MK, dw_EKN, _ = _rows_bwd(cfg, (x_MK, w_EKN, sizes_E), g_MN)
  return dx_MK, dw_EKN, None, np.zeros(b_MW.shape, jax.dtypes.float0)


_wire_rows.defvjp(_wire_rows_fwd, _wire_rows_bwd)


def row_scaled_matmul(x_MK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, *,
                      blocks: GmmBlocks | None = None, interpret: bool = False,
                      wire_MW: jax.Array | None = None) -> jax.Array:
  """[M, N] = ragged_dot(x_MK, w_EKN, sizes_E) with the forward and dx products in e4m3 on the
  Hopper kernel, scaled per row (module docstring), in x's dtype (bf16 / fp16); differentiable
  in x and w. `interpret`: JAX's Mosaic GPU interpreter (CPU tests). `wire_MW`: x as the FP8
  wire's bytes (`jscale.fp8.wire.Wire.encode`; x their decoding): the forward's e4m3 operand
  and row scales read from them, the same values (the module docstring of `jscale.fp8.wire`)
  without x's amax and quantisation passes."""
  if wire_MW is not None:
    return _wire_rows(x_MK, w_EKN, sizes_E, wire_MW, _Static(blocks, interpret))
  return _rows(x_MK, w_EKN, sizes_E, _Static(blocks, interpret))
