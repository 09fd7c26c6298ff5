"""Which grouped matmul runs an MoE's experts (`model.moe.gemm`), and the call itself.

  * tiled: a batched matmul over tiles of each expert's rows, in plain XLA
    (`jscale.model.grouped_tiles`; any backend, any dtype, ~1.1-1.3x the products' FLOPs);
    FP8 experts run here with their per-tile products (`jscale.fp8.grouped`).
  * ragged_dot: `jax.lax.ragged_dot`. XLA:GPU and XLA:CPU expand it into one dense dot
    against every expert's weights: E times the FLOPs (`tests/plan/test_gpu_compile.py`).
  * pallas: the Hopper Mosaic GPU kernels (`pallas_kernels.grouped_matmul`): persistent, warp
    specialised, tiles that never mix two experts' weights; bf16 / fp16, widths that tile.
    With model.kernel_interpret they run in JAX's Mosaic GPU interpreter (CPU tests). FP8
    experts scaled per row run here too, forward and dx on e4m3 operands
    (`jscale.fp8.grouped_kernel`).
  * auto: pallas on compute capability 9.x where it tiles the experts (FP8 experts: where
    they are scaled per row), tiled elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jscale.model import grouped_tiles
from jscale.model.attention import compute_capability

GEMMS = ("auto", "tiled", "ragged_dot", "pallas")


def kernel_fits(dtype, d_model: int, d_ff: int, n_experts: int,
                fp8: bool = False) -> str | None:
  """None if the Pallas kernels tile this MoE's expert matmuls (gate / up: d_model -> d_ff,
  down: d_ff -> d_model; forward and backward; `fp8`: forward and dx on e4m3 operands too),
  else why not (naming the fix)."""
  from pallas_kernels import grouped_matmul as gm
  s = jax.ShapeDtypeStruct
  sizes = s((n_experts,), jnp.int32)
  return next((why for k, n in ((d_model, d_ff), (d_ff, d_model))
               if (why := gm.why_not(s((256, k), dtype), s((n_experts, k, n), dtype), sizes,
                                     fp8=fp8)) is not None), None)


def auto_gemm(dtype, d_model: int, d_ff: int, n_experts: int, cc: str | None,
              fp8: bool = False) -> tuple[str, str]:
  """(impl, why) that `model.moe.gemm: auto` runs on a device of compute capability `cc`
  (`fp8`: the experts' FP8 products, scaled per row, on the kernel)."""
  if cc is None or not str(cc).startswith("9"):
    return "tiled", (f"compute capability {cc}: the Pallas grouped matmul is for Hopper; "
                     f"tiled XLA matmuls (ragged_dot would cost {n_experts}x the FLOPs)")
  why_not = kernel_fits(dtype, d_model, d_ff, n_experts, fp8)
  if why_not is not None:
    return "tiled", f"the Pallas kernel does not apply ({why_not}): tiled XLA matmuls"
  return "pallas", (f"Hopper (sm_{str(cc).replace('.', '')}): Mosaic GPU grouped matmul"
                    + (", FP8 forward and dx" if fp8 else ""))


@dataclasses.dataclass(frozen=True)
class GroupedDot:
  """The experts' grouped matmul: rows sorted by expert (sizes_E each), weights [E, K, N]."""
  impl: str = "ragged_dot"  # tiled | ragged_dot | pallas (resolved: never auto)
  interpret: bool = False
  # tiled only: the per-tile products (None: `grouped_tiles.tile_products`; FP8 experts:
  # `jscale.fp8.grouped.tile_products`, from the model's `matmul.for_experts`)
  products: Callable | None = None
  # pallas only: the whole grouped matmul (None: the kernel in bf16; FP8 experts scaled per
  # row: `jscale.fp8.grouped_kernel.row_scaled_matmul`, from `matmul.for_expert_kernel`)
  kernel: Callable | None = None

  @property
  def reads_wire(self) -> bool:
    """Whether it takes its rows as the FP8 wire's bytes (`__call__`'s `wire_AW`): the Hopper
    kernel with FP8 experts scaled per row, whose e4m3 operand and row scales they are
    (`jscale.fp8.wire`)."""
    return self.impl == "pallas" and self.kernel is not None

  def __call__(self, x_AK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array,
               dtype, wire_AW: jax.Array | None = None) -> jax.Array:
    """[A, N] in `dtype` (so are the backward's products); rows past sum(sizes_E) zero.
    `wire_AW`: x's rows as the FP8 wire's bytes (read where `reads_wire`, else ignored)."""
    x, w = x_AK.astype(dtype), w_EKN.astype(dtype)
    if self.kernel is not None and self.reads_wire and wire_AW is not None:
      return self.kernel(x, w, sizes_E, interpret=self.interpret, wire_MW=wire_AW)
    if self.impl == "pallas":
      from pallas_kernels.grouped_matmul import grouped_matmul
      return (self.kernel or grouped_matmul)(x, w, sizes_E, interpret=self.interpret)
    if self.impl == "tiled":
      return grouped_tiles.grouped_dot(x, w, sizes_E, dtype, products=self.products)
    return jax.lax.ragged_dot(x, w, sizes_E)


def for_model(gemm: str, dtype, d_model: int, d_ff: int, n_experts: int,
              interpret: bool = False, products: Callable | None = None,
              kernel: Callable | None = None) -> GroupedDot:
  """The GroupedDot `model.moe.gemm` asks for (auto: decided for this process's devices). FP8
  experts bring other per-tile `products` (tiled) and, scaled per row, a `kernel` (pallas);
  auto runs FP8 experts on the kernel only when it has one, else tiled."""
  if gemm == "auto":
    fp8 = products is not None
    gemm = "tiled" if interpret or (fp8 and kernel is None) else auto_gemm(
        dtype, d_model, d_ff, n_experts, compute_capability(), fp8)[0]
  return GroupedDot(gemm, interpret and gemm == "pallas", products, kernel)
