"""Fused RMSNorm (optionally with the residual add) as Pallas (Triton backend) GPU kernels.

Matches `jscale.model.layers.RMSNorm` exactly: statistics in fp32, the normalised row cast to
the input dtype, then multiplied by the weight cast to the input dtype:
  out = (x32 * rsqrt(mean(x32²) + eps)).astype(dtype) * weight.astype(dtype).
Each program owns `block_rows` whole rows, so a row is loaded once: its sum of squares and its
output come from the same registers. Leading dims are flattened to N rows. Rows past N (when N
is not a multiple of block_rows) and columns past D (the tile is padded to a power of two,
which Triton requires) are masked on load and store, never padded in HBM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Rows per program (a power of two) and warps; None picks ~4K elements per program for
  block_rows (one row when D >= 4096) and 1-8 warps by tile size."""
  block_rows: int | None = None
  block_rows_bwd: int | None = None
  num_warps: int | None = None


@dataclasses.dataclass(frozen=True)
class _Config:
  eps: float
  block_rows: int
  block_rows_bwd: int
  num_warps: int
  interpret: bool


def _masks(n_rows: int, d: int, block_rows: int, d_pad: int):
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_ok = rows < n_rows
  col_ok = jnp.arange(d_pad) < d
  return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def _fwd_kernel(*refs, n_rows: int, d: int, eps: float, has_residual: bool):
  # Refs: x (and residual) / out (and h = x + residual) [block_rows, d_pad]; weight [d_pad];
  # rstd [block_rows].
  if has_residual:
    x_ref, w_ref, res_ref, out_ref, h_ref, rstd_ref = refs
  else:
    x_ref, w_ref, out_ref, rstd_ref = refs
  row_ok, col_ok, mask = _masks(n_rows, d, *x_ref.shape)
  x = plgpu.load(x_ref, mask=mask, other=0)
  if has_residual:  # the model adds the residual stream in the compute dtype
    x = x + plgpu.load(res_ref, mask=mask, other=0)
    plgpu.store(h_ref, x, mask=mask)
  x32 = x.astype(jnp.float32)
  rstd = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / d + eps)  # / d: the tile may be padded
  w = plgpu.load(w_ref, mask=col_ok, other=0).astype(x.dtype)
  plgpu.store(out_ref, (x32 * rstd[:, None]).astype(x.dtype) * w, mask=mask)
  plgpu.store(rstd_ref, rstd, mask=row_ok)


def _bwd_kernel(*refs, n_rows: int, d: int, has_dh: bool):
  # Refs: h (the normalised input), dout (and dh, the residual stream's cotangent), dx
  # [block_rows, d_pad]; weight [d_pad]; rstd [block_rows]; dw [d_pad] this block's partial sum.
  if has_dh:
    h_ref, w_ref, rstd_ref, dout_ref, dh_ref, dx_ref, dw_ref = refs
  else:
    h_ref, w_ref, rstd_ref, dout_ref, dx_ref, dw_ref = refs
  row_ok, col_ok, mask = _masks(n_rows, d, *h_ref.shape)
  dtype = h_ref.dtype
  # Masked rows / columns load as 0, so they add nothing to dw and the row sums below.
  h = plgpu.load(h_ref, mask=mask, other=0).astype(jnp.float32)
  dout = plgpu.load(dout_ref, mask=mask, other=0).astype(jnp.float32)
  rstd = plgpu.load(rstd_ref, mask=row_ok, other=0)
  w = plgpu.load(w_ref, mask=col_ok, other=0).astype(dtype).astype(jnp.float32)
  y = h * rstd[:, None]
  dy = dout * w
  # d/dx of x * rsqrt(mean(x²) + eps): rstd * (dy - y * mean(dy * y)).
  dx = rstd[:, None] * (dy - y * (jnp.sum(dy * y, axis=1) / d)[:, None])
  if has_dh:
    dx = dx + plgpu.load(dh_ref, mask=mask, other=0).astype(jnp.float32)
  plgpu.store(dx_ref, dx.astype(dx_ref.dtype), mask=mask)
  # The forward multiplies the weight by the normalised row rounded to the input dtype.
  dw_ref[...] = jnp.sum(dout * y.astype(dtype).astype(jnp.float32), axis=0)


def _specs(block_rows: int, d_pad: int):
  row_spec = pl.BlockSpec((block_rows, d_pad), lambda i: (i, 0))
  w_spec = pl.BlockSpec((d_pad,), lambda i: (0,))
  stat_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
  return row_spec, w_spec, stat_spec


def forward(x_ND, weight_D, residual_ND, cfg: _Config):
  """Runs the forward kernel: (out, h = x [+ residual], rstd [N] fp32)."""
  n, d = x_ND.shape
  d_pad = pl.next_power_of_2(d)
  row_spec, w_spec, stat_spec = _specs(cfg.block_rows, d_pad)
  has_residual = residual_ND is not None
  row_out = jax.ShapeDtypeStruct(x_ND.shape, x_ND.dtype)
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, n_rows=n, d=d, eps=cfg.eps, has_residual=has_residual),
      grid=(pl.cdiv(n, cfg.block_rows),),
      in_specs=[row_spec, w_spec] + [row_spec] * has_residual,
      out_specs=[row_spec] * (1 + has_residual) + [stat_spec],
      out_shape=[row_out] * (1 + has_residual) + [jax.ShapeDtypeStruct((n,), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps),
      interpret=cfg.interpret,
      name="rms_norm_fwd",
  )(x_ND, weight_D, *([residual_ND] if has_residual else []))
  if has_residual:
    return tuple(outs)
  out, rstd = outs
  return out, x_ND, rstd


def backward(h_ND, weight_D, rstd_N, dout_ND, dh_ND, cfg: _Config):
  """Runs the backward kernel: (dx [N, D] in h's dtype, dweight [D] in weight's dtype);
  dh_ND (the residual stream's cotangent, or None) is added into dx."""
  n, d = h_ND.shape
  d_pad = pl.next_power_of_2(d)
  block_rows = cfg.block_rows_bwd
  num_blocks = pl.cdiv(n, block_rows)
  row_spec, w_spec, stat_spec = _specs(block_rows, d_pad)
  has_dh = dh_ND is not None
  dx_ND, dw_partial = pl.pallas_call(
      functools.partial(_bwd_kernel, n_rows=n, d=d, has_dh=has_dh),
      grid=(num_blocks,),
      in_specs=[row_spec, w_spec, stat_spec, row_spec] + [row_spec] * has_dh,
      out_specs=[row_spec, pl.BlockSpec((None, d_pad), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct(h_ND.shape, h_ND.dtype),
                 jax.ShapeDtypeStruct((num_blocks, d_pad), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps),
      interpret=cfg.interpret,
      name="rms_norm_bwd",
  )(h_ND, weight_D, rstd_N, dout_ND, *([dh_ND] if has_dh else []))
  # Per-block partial sums of dweight, reduced here (a [N / block_rows, D] fp32 read).
  return dx_ND, jnp.sum(dw_partial[:, :d], axis=0).astype(weight_D.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm(x_ND, weight_D, residual_ND, cfg):
  out, h, _ = forward(x_ND, weight_D, residual_ND, cfg)
  return out if residual_ND is None else (out, h)


def _rms_norm_fwd(x_ND, weight_D, residual_ND, cfg):
  out, h, rstd = forward(x_ND, weight_D, residual_ND, cfg)
  primal = out if residual_ND is None else (out, h)
  return primal, (h, weight_D, rstd)


def _rms_norm_bwd(cfg, res, cotangents):
  h, weight_D, rstd = res
  has_residual = isinstance(cotangents, tuple)  # (d normed, d h) when fused with the residual
  dout, dh = cotangents if has_residual else (cotangents, None)
  dx, dw = backward(h, weight_D, rstd, dout, dh, cfg)
  # x and the residual enter only through h = x + residual: both get dh's total.
  return dx, dw, (dx if has_residual else None)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _rows_for(d_pad: int, block_rows: int | None, name: str) -> int:
  if block_rows is None:
    return max(1, min(16, 4096 // d_pad))
  if block_rows < 1 or block_rows & (block_rows - 1):
    raise ValueError(f"{name}={block_rows} must be a power of two (Triton tiles)")
  return block_rows


def why_not(x_ND, weight_D, residual_ND=None) -> str | None:
  """What disagrees with the RMSNorm kernels' contract on shapes (None: nothing); arrays or
  ShapeDtypeStructs."""
  d = x_ND.shape[-1]
  if weight_D.shape != (d,):
    return f"weight {weight_D.shape} must be [D] = ({d},) for x {x_ND.shape}"
  if residual_ND is not None and (residual_ND.shape != x_ND.shape or
                                  residual_ND.dtype != x_ND.dtype):
    return (f"residual {residual_ND.shape} {residual_ND.dtype} must match x "
            f"{x_ND.shape} {x_ND.dtype}")
  return None


def check_shapes(x_ND, weight_D, residual_ND=None) -> None:
  """The RMSNorm kernels' contract on shapes: ValueError naming what disagrees (`why_not`)."""
  if (why := why_not(x_ND, weight_D, residual_ND)) is not None:
    raise ValueError(why)


def rms_norm(x_ND, weight_D, *, eps: float = 1e-6, residual_ND=None,
             block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
  """Fused RMSNorm over the last axis, differentiable in x, weight and residual.

  Args:
    x_ND: input [..., D] (leading dims flattened to rows); the output has its dtype.
    weight_D: scale [D] (any float dtype; cast to x's dtype like the model's RMSNorm).
    eps: added to the mean of squares.
    residual_ND: optional, same shape and dtype as x: h = x + residual is normalised.
    block_sizes: rows per program and warps.
    interpret: run the kernels in the Pallas interpreter (CPU tests).

  Returns:
    normed [..., D], or (normed, h) with residual_ND, h = x + residual being the pre-norm
    residual stream for the next block.
  """
  check_shapes(x_ND, weight_D, residual_ND)
  d = x_ND.shape[-1]
  d_pad = pl.next_power_of_2(d)
  block_rows = _rows_for(d_pad, block_sizes.block_rows, "block_rows")
  cfg = _Config(eps=float(eps), block_rows=block_rows,
                block_rows_bwd=_rows_for(d_pad, block_sizes.block_rows_bwd, "block_rows_bwd"),
                num_warps=block_sizes.num_warps or min(max(block_rows * d_pad // 512, 1), 8),
                interpret=interpret)
  shape = x_ND.shape
  flat = lambda a: None if a is None else a.reshape(-1, d)
  # partial(custom_vjp)'s result is typed as object
  result: Any = _rms_norm(flat(x_ND), weight_D, flat(residual_ND), cfg)
  if residual_ND is None:
    return result.reshape(shape)
  return result[0].reshape(shape), result[1].reshape(shape)
