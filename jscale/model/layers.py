"""Building blocks: parameters with logical axis names, RMSNorm, the linear layers' einsum."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.model import attention as attn_lib
from jscale.model import matmul
from jscale.model.seam import GATHERED, LOCAL, Seam
from pallas_kernels.rms_norm import rms_norm


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str], std: float,
          dtype) -> nnx.Param:
  """A normal(std)-initialised parameter carrying logical axis `names` (one per dim).

  Sharding is not applied here: `jscale.sharding` maps the names to mesh axes when the whole
  state is laid out, so the model itself never needs a mesh.
  """
  assert len(shape) == len(names), (shape, names)
  value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
  return nnx.Param(value.astype(dtype), out_sharding=tuple(names), eager_sharding=False)


def ones_param(shape: Sequence[int], names: Sequence[str], dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(tuple(shape), dtype), out_sharding=tuple(names),
                   eager_sharding=False)


# Logical names of the normalised activations' dims (the residual stream) and of the
# kernel's view of them: the normalised dim is kept whole on every device.
_NORM_ROWS = ("batch", "res_seq", None)


def norm_backend(shape, dtype, compute_capability: str | None) -> tuple[str, str]:
  """("hopper" | "portable", why) for `norm_impl: pallas`: the Mosaic GPU kernels (bulk TMA
  slabs, persistent blocks) on compute capability 9.x where they take the shape (D a
  multiple of 128), the portable Triton-lowered kernel otherwise (other GPUs, the
  interpreter, odd widths)."""
  if compute_capability is None or not str(compute_capability).startswith("9"):
    return "portable", f"compute capability {compute_capability}: not Hopper"
  from pallas_kernels.rms_norm import hopper
  if (why := hopper.why_not(shape, dtype)) is not None:
    return "portable", why
  return "hopper", f"Hopper (sm_{str(compute_capability).replace('.', '')}): Mosaic GPU kernels"


class RMSNorm(nnx.Module):
  """RMSNorm with statistics in fp32 (HF LlamaRMSNorm semantics).

  `impl="pallas"`: a fused Pallas kernel (same formula; the input is cast to `dtype` first, a
  no-op for the model's residual stream), run on each device's rows through `comms.kernel`:
  the Mosaic GPU kernels (`pallas_kernels.rms_norm.hopper`) where `norm_backend` picks them
  for the mesh's device, else the portable one (`pallas_kernels.rms_norm`); `interpret` runs
  the portable kernel in the Pallas interpreter. `names`: the scale's logical dim name (MLA's
  latent norms: "latent").
  """

  def __init__(self, dim: int, eps: float, dtype, param_dtype, impl: str = "xla",
               interpret: bool = False, names: tuple[str] = ("embed",)):
    self.scale = ones_param((dim,), names, param_dtype)
    self.eps = eps
    self.dtype = dtype
    self.impl = impl
    self.interpret = interpret

  def __call__(self, x_BLD: jax.Array, comms: Seam = LOCAL, residual_BLD=None):
    """normed x, or with `residual_BLD` (normed h, h) for h = residual + x: the pallas
    kernels add the residual stream in the same pass over memory."""
    if residual_BLD is not None:
      if self.impl == "pallas" and x_BLD.dtype == residual_BLD.dtype == jnp.dtype(self.dtype):
        return self._pallas(x_BLD, comms, residual_BLD)
      h_BLD = residual_BLD + x_BLD
      return self(h_BLD, comms), h_BLD
    if self.impl == "pallas":
      return self._pallas(x_BLD, comms)
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return (x.astype(self.dtype) * self.scale[...].astype(self.dtype))

  def _pallas(self, x_BLD: jax.Array, comms: Seam, residual_BLD=None):
    capability = None if self.interpret else attn_lib.compute_capability(comms.kernel_device())

    def norm(x, weight_D, residual=None):  # leading dims flattened to rows; weight cast to x's
      if norm_backend(x.shape, self.dtype, capability)[0] == "hopper":
        from pallas_kernels.rms_norm import hopper
        return hopper.rms_norm(x, weight_D, eps=self.eps, residual_ND=residual)
      return rms_norm(x, weight_D, eps=self.eps, residual_ND=residual, interpret=self.interpret)

    args = (x_BLD.astype(self.dtype), self.scale[...])
    names = (_NORM_ROWS, (None,))
    if residual_BLD is not None:
      args, names = args + (residual_BLD,), names + (_NORM_ROWS,)
    if x_BLD.ndim != len(_NORM_ROWS):
      return norm(*args)
    return comms.kernel(norm, args, names, _NORM_ROWS)  # (normed, h) share the rows' layout


def einsum(spec: str, x: jax.Array, w: nnx.Param, dtype,
           dot_general: Any = jax.lax.dot_general, seam: Seam = LOCAL) -> jax.Array:
  """`x @ w` in the compute dtype, forward and backward (`jscale.model.matmul`; the product is
  `dot_general`'s, the layer's from `matmul.for_linear`, bound to `seam` by `matmul.on_seam`);
  master weights may be fp32.

  The cast weight is named like ZeRO-3's gathered weights, so no remat policy saves a
  compute-dtype copy of every layer's weights for the backward (it is recast there)."""
  w = checkpoint_name(w[...].astype(dtype), GATHERED)
  return matmul.einsum(spec, x, w, dtype, matmul.on_seam(dot_general, seam))
