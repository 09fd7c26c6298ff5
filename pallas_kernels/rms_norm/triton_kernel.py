"""The RMSNorm of `kernel.py` written directly in Triton, called through jax-triton.

GPU only, and needs the `triton` extra (jax-triton, which brings triton). Nothing here imports
triton at module import time: the kernels are built on first use, so importing this module on
a CPU-only install is harmless (calling `rms_norm_triton` is not). Same formula as the Pallas
kernel and jscale's RMSNorm: (x32 * rsqrt(mean(x32²) + eps)).astype(dtype) * weight.astype(dtype).
One program per row in the forward; the backward gives each program `rows_per_program` rows
and writes one fp32 partial sum of dweight, reduced in jnp. Untested here (no GPU in CI).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.cache
def _kernels():
  """Builds the Triton kernels (imports triton lazily)."""
  # the optional triton extra
  import triton  # pyright: ignore[reportMissingImports]

  # the optional triton extra
  import triton.language as tl  # pyright: ignore[reportMissingImports]

  @triton.jit
  def fwd_kernel(x_ptr, w_ptr, n_cols, eps, out_ptr, rstd_ptr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * n_cols may pass 2**31
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=col_ok, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(x.dtype).to(tl.float32)
    y = (x32 * rstd).to(x.dtype).to(tl.float32)
    # The product of two bf16 / fp16 values is exact in fp32, so rounding it once equals the
    # model's multiply in the input dtype (and Triton's interpreter mis-multiplies bf16).
    tl.store(out_ptr + row * n_cols + cols, (y * w).to(x.dtype), mask=col_ok)
    tl.store(rstd_ptr + row, rstd)

  @triton.jit
  def bwd_kernel(h_ptr, w_ptr, rstd_ptr, dout_ptr, n_rows, n_cols, dx_ptr, dw_ptr,
                 BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(h_ptr.dtype.element_ty)
    w = w.to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROWS):
      row = block * ROWS + i
      if row < n_rows:  # the last program's rows may run past the end
        h = tl.load(h_ptr + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        y = h * rstd
        dy = dout * w
        dx = rstd * (dy - y * (tl.sum(dy * y, axis=0) / n_cols))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_ok)
        # The forward multiplies the weight by the normalised row rounded to the input dtype.
        dw += dout * y.to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_ptr + block * BLOCK_D + cols, dw)

  return triton, fwd_kernel, bwd_kernel


def _num_warps(block_d: int) -> int:
  return min(max(block_d // 256, 1), 8)


def _out_kwarg(jt) -> str:
  # jax-triton renamed out_shape= to out_type= (the old name still works, with a warning).
  import inspect
  return "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"


def _forward(x_ND, weight_D, eps: float):
  # the optional triton extra
  import jax_triton as jt  # pyright: ignore[reportMissingImports]
  triton, fwd_kernel, _ = _kernels()
  n, d = x_ND.shape
  block_d = triton.next_power_of_2(d)
  out_types = (jax.ShapeDtypeStruct((n, d), x_ND.dtype), jax.ShapeDtypeStruct((n,), jnp.float32))
  # Scalars (d, eps) are baked into the kernel as specialisation values. Every kernel takes
  # its operands, then its outputs: old jax-triton appends the output pointers after the
  # positional arguments, new jax-triton binds them to the parameters left unbound.
  return jt.triton_call(x_ND, weight_D, d, eps, kernel=fwd_kernel, grid=(n,),
                        num_warps=_num_warps(block_d), BLOCK_D=block_d,
                        **{_out_kwarg(jt): out_types})


def _backward(h_ND, weight_D, rstd_N, dout_ND, rows_per_program: int):
  # the optional triton extra
  import jax_triton as jt  # pyright: ignore[reportMissingImports]
  triton, _, bwd_kernel = _kernels()
  n, d = h_ND.shape
  block_d = triton.next_power_of_2(d)
  num_blocks = triton.cdiv(n, rows_per_program)
  out_types = (jax.ShapeDtypeStruct((n, d), h_ND.dtype),
               jax.ShapeDtypeStruct((num_blocks, block_d), jnp.float32))
  dx_ND, dw_partial = jt.triton_call(
      h_ND, weight_D, rstd_N, dout_ND, n, d, kernel=bwd_kernel, grid=(num_blocks,),
      num_warps=_num_warps(block_d), BLOCK_D=block_d, ROWS=rows_per_program,
      **{_out_kwarg(jt): out_types})
  return dx_ND, jnp.sum(dw_partial[:, :d], axis=0).astype(weight_D.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x_ND, weight_D, eps, rows_per_program):
  return _forward(x_ND, weight_D, eps)[0]


def _rms_norm_fwd(x_ND, weight_D, eps, rows_per_program):
  out, rstd = _forward(x_ND, weight_D, eps)
  return out, (x_ND, weight_D, rstd)


def _rms_norm_bwd(eps, rows_per_program, res, dout_ND):
  x_ND, weight_D, rstd_N = res
  return _backward(x_ND, weight_D, rstd_N, dout_ND, rows_per_program)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm_triton(x, weight, eps: float = 1e-6, residual=None, rows_per_program: int = 16):
  """RMSNorm over the last axis via a Triton kernel (GPU + jax-triton only), differentiable.

  With `residual`, normalises h = x + residual and returns (normed, h) like
  `pallas_kernels.rms_norm.rms_norm`; here the add is left to XLA (fused into one elementwise
  pass) rather than to the kernel.
  """
  h = x if residual is None else x + residual
  d = h.shape[-1]
  # partial(custom_vjp)'s result is typed as object
  out: Any = _rms_norm(h.reshape(-1, d), weight, float(eps), rows_per_program)
  out = out.reshape(h.shape)
  return out if residual is None else (out, h)
