"""Fused RMSNorm (+ residual add) for Hopper GPUs: Pallas kernels on the Mosaic GPU backend.

The same contract as `kernel.rms_norm` (the portable, Triton-lowered kernel that also runs in
the Pallas interpreter): statistics in fp32,
  out = (x32 * rsqrt(mean(x32²) + eps)).astype(dtype) * weight.astype(dtype),
and with a residual, h = x + residual is normalised and returned beside the output.

Bandwidth decides this op; `hopper_pipeline` streams row slabs through shared memory with bulk
copies. Each row makes two passes over its slab in shared memory (10x HBM's bandwidth there):
the first sums squares chunk by chunk into a vector (one cross-warp reduction per row), the
second writes the output. The backward recomputes rstd from h, which it reads anyway, instead
of the forward storing it; both of its row sums come from the first pass
(mean(dy * y) = rstd * mean(dy * h)), and dweight accumulates in registers across every row a
CUDA block sees, so its partial sums are [blocks, D], not one per slab. In interpret mode (CPU,
JAX's Mosaic GPU interpreter) the same kernels run unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rms_norm import hopper_pipeline as hp
from pallas_kernels.rms_norm.hopper_pipeline import HopperNormBlocks, why_not
from pallas_kernels.rms_norm.kernel import check_shapes

__all__ = ["HopperNormBlocks", "check_shapes", "rms_norm", "why_not"]

f32 = jnp.float32


def _load_weight(w_gmem, w_smem, barrier):
  hp.copy_in(w_gmem, w_smem, barrier)
  plgpu.barrier_wait(barrier)


def forward(x_ND, weight_D, residual_ND, cfg: hp.Config):
  """Runs the forward kernel: (out, h = x [+ residual]), both [N, D] in x's dtype."""
  n, d = x_ND.shape
  dtype = x_ND.dtype
  has_residual = residual_ND is not None

  def fwd(in_gmem, out_gmem, in_smem, out_smem, loaded, w_smem, w_loaded):
    x_gmem, w_gmem, *res_gmem = in_gmem
    _load_weight(w_gmem, w_smem, w_loaded)

    def body(ins, outs, carry):
      for r in range(cfg.block_rows):
        ss = cfg.strided(jnp.zeros((cfg.chunks[0].size,), f32))
        for c in cfg.chunks:
          x = cfg.load(ins[0], r, c, dtype)
          if has_residual:  # the model adds the residual stream in the compute dtype
            x = x + cfg.load(ins[1], r, c, dtype)
            outs[1][r, c] = x
          ss = ss + jnp.square(x.astype(f32))
        rstd = lax.rsqrt(jnp.sum(ss) / d + cfg.eps)
        h = outs[1] if has_residual else ins[0]  # a thread rereads only what it wrote
        for c in cfg.chunks:
          y = (cfg.load(h, r, c) * rstd).astype(dtype)
          outs[0][r, c] = y * cfg.load(w_smem, None, c, dtype)
      return carry
    hp.walk(cfg, n, body, [x_gmem, *res_gmem], out_gmem, in_smem, out_smem, loaded)

  row_out = jax.ShapeDtypeStruct((n, d), dtype)
  ins = [x_ND, weight_D] + ([residual_ND] if has_residual else [])
  outs = hp.kernel("rms_norm_fwd_hopper", fwd, cfg, ins, [row_out] * (1 + has_residual),
                   1 + has_residual)
  return (outs[0], outs[1]) if has_residual else (outs[0], x_ND)


def backward(h_ND, weight_D, dout_ND, dh_ND, cfg: hp.Config):
  """Runs the backward kernel: (dx [N, D] in h's dtype, dweight [D] in weight's dtype);
  dh_ND (the residual stream's cotangent, or None) is added into dx."""
  n, d = h_ND.shape
  dtype = h_ND.dtype
  has_dh = dh_ND is not None

  def bwd(in_gmem, out_gmem, in_smem, out_smem, loaded, w_smem, w_loaded, dw_smem):
    h_gmem, w_gmem, *rest_gmem = in_gmem
    dx_gmem, dw_gmem = out_gmem
    _load_weight(w_gmem, w_smem, w_loaded)
    w = lambda c: cfg.load(w_smem, None, c, dtype).astype(f32)  # as the forward rounds it

    def body(ins, outs, dw):
      h_ref, dout_ref = ins[:2]
      for r in range(cfg.block_rows):
        ss = dyh = cfg.strided(jnp.zeros((cfg.chunks[0].size,), f32))
        for c in cfg.chunks:
          h = cfg.load(h_ref, r, c)
          ss = ss + h * h
          dyh = dyh + cfg.load(dout_ref, r, c) * w(c) * h
        rstd = lax.rsqrt(jnp.sum(ss) / d + cfg.eps)  # recomputed: cheaper than storing it
        mean_dy_y = jnp.sum(dyh) * rstd / d
        for i, c in enumerate(cfg.chunks):
          dout = cfg.load(dout_ref, r, c)
          y = cfg.load(h_ref, r, c) * rstd
          # d/dx of x * rsqrt(mean(x²) + eps): rstd * (dy - y * mean(dy * y)).
          dx = rstd * (dout * w(c) - y * mean_dy_y)
          if has_dh:
            dx = dx + cfg.load(ins[2], r, c)
          outs[0][r, c] = dx.astype(dtype)
          # The forward multiplies the weight by the normalised row rounded to the input dtype.
          dw[i] = dw[i] + dout * y.astype(dtype).astype(f32)
      return dw

    zeros = [cfg.strided(jnp.zeros((c.size,), f32)) for c in cfg.chunks]
    dw = hp.walk(cfg, n, body, [h_gmem, *rest_gmem], [dx_gmem], in_smem, out_smem, loaded,
                 zeros)
    for c, dw_c in zip(cfg.chunks, dw):
      dw_smem[c] = dw_c
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dw_smem, dw_gmem.at[lax.axis_index("block")])
    plgpu.wait_smem_to_gmem(0)

  ins = [h_ND, weight_D, dout_ND] + ([dh_ND] if has_dh else [])
  dx_ND, dw_partial = hp.kernel(
      "rms_norm_bwd_hopper", bwd, cfg, ins,
      [jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((cfg.num_blocks, d), f32)],
      1, extra_scratch=[plgpu.SMEM((d,), f32)])
  return dx_ND, jnp.sum(dw_partial, axis=0).astype(weight_D.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rms_norm(x_ND, weight_D, residual_ND, fwd_cfg, bwd_cfg):
  out, h = forward(x_ND, weight_D, residual_ND, fwd_cfg)
  return out if residual_ND is None else (out, h)


def _rms_norm_fwd(x_ND, weight_D, residual_ND, fwd_cfg, bwd_cfg):
  out, h = forward(x_ND, weight_D, residual_ND, fwd_cfg)
  return (out if residual_ND is None else (out, h)), (h, weight_D)


def _rms_norm_bwd(fwd_cfg, bwd_cfg, res, cotangents):
  h, weight_D = res
  has_residual = isinstance(cotangents, tuple)  # (d normed, d h) when fused with the residual
  dout, dh = cotangents if has_residual else (cotangents, None)
  dx, dw = backward(h, weight_D, dout, dh, bwd_cfg)
  # x and the residual enter only through h = x + residual: both get dh's total.
  return dx, dw, (dx if has_residual else None)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x_ND, weight_D, *, eps: float = 1e-6, residual_ND=None,
             block_sizes: HopperNormBlocks = HopperNormBlocks(), interpret: bool = False):
  """Fused RMSNorm over the last axis on Hopper, differentiable in x, weight and residual.

  Args:
    x_ND: input [..., D] (leading dims flattened to rows), bf16 / fp16 / fp32, D % 128 == 0.
    weight_D: scale [D] (cast to x's dtype like the model's RMSNorm).
    eps: added to the mean of squares.
    residual_ND: optional, x's shape and dtype: h = x + residual is normalised.
    block_sizes: rows per slab, slabs in flight, CUDA blocks per SM.
    interpret: run the kernels in JAX's Mosaic GPU interpreter (CPU tests).

  Returns:
    normed [..., D], or (normed, h) with residual_ND.
  """
  check_shapes(x_ND, weight_D, residual_ND)
  d = x_ND.shape[-1]
  if (why := why_not(x_ND.shape, x_ND.dtype)) is not None:
    raise ValueError(f"the Hopper RMSNorm kernels cannot take {why}: use the portable kernel "
                     f"(pallas_kernels.rms_norm.rms_norm)")
  shape, n = x_ND.shape, x_ND.size // d
  itemsize = jnp.dtype(x_ND.dtype).itemsize
  has_residual = residual_ND is not None
  # Row arrays each kernel moves: x, out (+ residual, h); h, dout, dx (+ dh).
  fwd_cfg = hp.config(n, d, itemsize, eps, block_sizes, 2 + 2 * has_residual, interpret)
  bwd_cfg = hp.config(n, d, itemsize, eps, block_sizes, 3 + has_residual, interpret)
  flat = lambda a: None if a is None else a.reshape(n, d)
  # partial(custom_vjp)'s result is typed as object
  result: Any = _rms_norm(flat(x_ND), weight_D, flat(residual_ND), fwd_cfg, bwd_cfg)
  if not has_residual:
    return result.reshape(shape)
  return result[0].reshape(shape), result[1].reshape(shape)
