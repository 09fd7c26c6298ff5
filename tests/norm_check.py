"""Shared by the RMSNorm kernel tests: a kernel against the plain-jnp reference on random
inputs, values and gradients through both outputs (the normed rows and the residual stream)."""

import jax
import jax.numpy as jnp
import numpy as np

from close import assert_close
from pallas_kernels.rms_norm import reference


def normal(rng, shape, dtype, mean=0.0, std=1.0):
  return jnp.asarray(mean + std * rng.standard_normal(shape, np.float32)).astype(dtype)


def check(name, kernel_fn, shape, dtype, w_dtype, with_residual, others=None):
  """kernel_fn(x, w, residual) -> normed, or (normed, h) with a residual. The forward must
  match the reference in the same dtype (same roundings: fp32 1e-5 of its scale, bf16 one
  rounding); gradients match fp32 math on the same inputs (jnp's own bf16 backward rounds
  dweight's row sum in bf16, the kernels sum in fp32): fp32 1e-5, bf16 2e-2. `others`:
  {label: fn}, kernels that round as this one does, whose gradients must agree to 1e-2."""
  rng = np.random.default_rng(0)
  x = normal(rng, shape, dtype)
  w = normal(rng, shape[-1:], w_dtype, mean=1.0, std=0.2)
  res = normal(rng, shape, dtype) if with_residual else None
  d_out, d_h = normal(rng, shape, dtype), normal(rng, shape, dtype)

  def loss(fn):
    def f(x, w, res):
      out = fn(x, w, res)
      if with_residual:  # both outputs get a cotangent: the normed one and the stream's
        out, h = out
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(h.astype(jnp.float32) * d_h)
      return jnp.sum(out.astype(jnp.float32) * d_out)
    return f

  ref_fn = lambda x, w, res: reference(x, w, eps=1e-5, residual_ND=res)
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  argnums = (0, 1, 2) if with_residual else (0, 1)
  both = lambda fn: jax.jit(lambda *a: (fn(*a), jax.grad(loss(fn), argnums)(*a)))(x, w, res)
  out, grads = both(kernel_fn)
  ref_out = ref_fn(x, w, res)
  outs, ref_outs = (out, ref_out) if with_residual else ((out,), (ref_out,))
  fp32 = dtype == jnp.float32
  for part, got, want in zip(("normed", "h"), outs, ref_outs):
    assert got.dtype == dtype and got.shape == shape
    assert_close(f"{name} {part}", got, want, 1e-5 if fp32 else 1e-2)
  ref_grads = jax.grad(loss(lambda x, w, res: ref_fn(f32(x), f32(w), f32(res))), argnums)(
      x, w, res)
  for part, got, want in zip(("dx", "dweight", "dresidual"), grads, ref_grads):
    assert_close(f"{name} {part}", got, want, 1e-5 if fp32 else 2e-2)
  for label, fn in (others or {}).items():
    for part, got, want in zip(("dx", "dweight", "dresidual"), grads, both(fn)[1]):
      assert_close(f"{name} {part} vs {label}", got, want, 1e-5 if fp32 else 1e-2)
  assert grads[1].dtype == w_dtype
