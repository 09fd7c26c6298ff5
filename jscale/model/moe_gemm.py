"""Which grouped matmul runs an MoE's experts (`model.moe.gemm`), and the call itself.

  * tiled: a batched matmul over tiles of each expert's rows, in plain XLA
    (`jscale.model.grouped_tiles`; any backend, any dtype, ~1.1-1.3x the products' FLOPs);
    the one FP8 experts run in (its per-tile products from `jscale.fp8.grouped`).
  * ragged_dot: `jax.lax.ragged_dot`. XLA:GPU and XLA:CPU expand it into one dense dot
    against every expert's weights: E times the FLOPs (`tests/plan/test_gpu_compile.py`).
  * pallas: the Hopper Mosaic GPU kernels (`pallas_kernels.grouped_matmul`): persistent, warp
    specialised, tiles that never mix two experts' weights; bf16 / fp16, widths that tile.
    With model.kernel_interpret they run in JAX's Mosaic GPU interpreter (CPU tests).
  * auto: pallas on compute capability 9.x where it tiles the experts, tiled elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jscale.model import grouped_tiles
from jscale.model.attention import compute_capability

GEMMS = ("auto", "tiled", "ragged_dot", "pallas")


def kernel_fits(dtype, d_model: int, d_ff: int, n_experts: int) -> str | None:
  """None if the Pallas kernels tile this MoE's expert matmuls (gate / up: d_model -> d_ff,
  down: d_ff -> d_model; forward and backward), else why not (naming the fix)."""
  from pallas_kernels import grouped_matmul as gm
  s = jax.ShapeDtypeStruct
  sizes = s((n_experts,), jnp.int32)
  return next((why for k, n in ((d_model, d_ff), (d_ff, d_model))
               if (why := gm.why_not(s((256, k), dtype), s((n_experts, k, n), dtype), sizes))
               is not None), None)


def auto_gemm(dtype, d_model: int, d_ff: int, n_experts: int,
              cc: str | None) -> tuple[str, str]:
  """(impl, why) that `model.moe.gemm: auto` runs on a device of compute capability `cc`."""
  if cc is None or not str(cc).startswith("9"):
    return "tiled", (f"compute capability {cc}: the Pallas grouped matmul is for Hopper; "
                     f"tiled XLA matmuls (ragged_dot would cost {n_experts}x the FLOPs)")
  why_not = kernel_fits(dtype, d_model, d_ff, n_experts)
  if why_not is not None:
    return "tiled", f"the Pallas kernel does not apply ({why_not}): tiled XLA matmuls"
  return "pallas", f"Hopper (sm_{str(cc).replace('.', '')}): Mosaic GPU grouped matmul"


@dataclasses.dataclass(frozen=True)
class GroupedDot:
  """The experts' grouped matmul: rows sorted by expert (sizes_E each), weights [E, K, N]."""
  impl: str = "ragged_dot"  # tiled | ragged_dot | pallas (resolved: never auto)
  interpret: bool = False
  # tiled only: the per-tile products (None: `grouped_tiles.tile_products`; FP8 experts:
  # `jscale.fp8.grouped.tile_products`, from the model's `matmul.for_experts`)
  products: Callable | None = None

  def __call__(self, x_AK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array,
               dtype) -> jax.Array:
    """[A, N] in `dtype` (so are the backward's products); rows past sum(sizes_E) zero."""
    x, w = x_AK.astype(dtype), w_EKN.astype(dtype)
    if self.impl == "pallas":
      from pallas_kernels.grouped_matmul import grouped_matmul
      return grouped_matmul(x, w, sizes_E, interpret=self.interpret)
    if self.impl == "tiled":
      return grouped_tiles.grouped_dot(x, w, sizes_E, dtype, products=self.products)
    return jax.lax.ragged_dot(x, w, sizes_E)


def for_model(gemm: str, dtype, d_model: int, d_ff: int, n_experts: int,
              interpret: bool = False, products: Callable | None = None) -> GroupedDot:
  """The GroupedDot `model.moe.gemm` asks for (auto: decided for this process's devices; with
  other per-tile `products`, e.g. FP8's, tiled: the other impls take no such products)."""
  if gemm == "auto":
    gemm = "tiled" if interpret or products else auto_gemm(dtype, d_model, d_ff, n_experts,
                                                           compute_capability())[0]
  return GroupedDot(gemm, interpret and gemm == "pallas", products)
