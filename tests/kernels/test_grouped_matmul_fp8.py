"""FP8 experts on the Hopper grouped matmul kernel (`jscale.fp8.grouped_kernel`): e4m3 operands
scaled per row, forward and dx in the kernel's FP8 path, dW in bf16.

On CPU the kernel runs in JAX's Mosaic GPU interpreter, and lowers for `cuda` through the real
Mosaic GPU pipeline, which refuses an 8-bit operand read transposed (wgmma's rule): the lowering
test is what shows the K-major layouts are the ones the GPU takes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from close import assert_close
from jscale.fp8 import grouped, grouped_kernel, scaling, wire
from jscale.model import grouped_tiles
from pallas_kernels.grouped_matmul import GmmBlocks, check_shapes, fp8_matmul, reference

SMALL = GmmBlocks(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2, grid_tile_width=1)
M, K, N = 256, 128, 256
SIZES = [60, 0, 70, 100]  # an empty expert, groups straddling tiles, 26 rows past the groups
E4M3 = scaling.E4M3


@pytest.fixture(scope="module")
def case():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(jnp.bfloat16)
  # Expert 2's weights 10^4 times smaller: its own column scales keep them.
  scale = jnp.array([1.0, 1.0, 1e-4, 1.0])[:, None, None] / np.sqrt(K)
  w = (jax.random.normal(keys[1], (4, K, N), jnp.float32) * scale).astype(jnp.bfloat16)
  g = jax.random.normal(keys[2], (M, N), jnp.float32).astype(jnp.bfloat16)
  return x, w, jnp.array(SIZES, jnp.int32), g


@pytest.fixture(scope="module")
def kernel_vjp(case):
  x, w, sizes, g = case
  f = lambda a, b: grouped_kernel.row_scaled_matmul(a, b, sizes, blocks=SMALL, interpret=True)
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(g))


def _dequantised(v, axis):
  s = grouped_kernel.row_scales(v, axis)
  return scaling.dequantize(scaling.quantize(v, s, E4M3), s, jnp.float32)


def _within_rounding(name, got, want):
  """got is want rounded to bf16 (8 significant bits), up to fp32 summation order."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = np.abs(got - want) / (np.abs(want) + 1e-30 * np.max(np.abs(want)))
  print(f"{name}: largest error {float(np.max(err)):.3g} of each value")
  np.testing.assert_array_less(np.abs(got - want), 2.0**-8 * np.abs(want) + 1e-6 * np.max(
      np.abs(want)), err_msg=name)


def test_forward_is_the_dequantised_product(case, kernel_vjp):
  x, w, sizes, _ = case
  want = reference(_dequantised(x, 1), _dequantised(w, 1), sizes)
  y = kernel_vjp[0]
  assert y.dtype == jnp.bfloat16
  _within_rounding("y", y, want)
  # Expert 2's weights, 10^4 times smaller, keep their values: their own columns' scales.
  _within_rounding("y of expert 2", y[60:130], want[60:130])
  assert not np.any(np.asarray(y[sum(SIZES):], np.float32))  # rows no expert holds


def test_dx_is_the_dequantised_product_and_dw_the_bf16_one(case, kernel_vjp):
  x, w, sizes, g = case
  _, rv = jax.vjp(lambda a: reference(a, _dequantised(w, 2), sizes), x.astype(jnp.float32))
  (want_dx,) = rv(_dequantised(g, 1))
  _, dx, dw = kernel_vjp
  _within_rounding("dx", dx, want_dx)
  f32 = lambda t: t.astype(jnp.float32)
  _, rv = jax.vjp(lambda b: reference(f32(x), b, sizes), f32(w))
  assert dw.dtype == jnp.bfloat16
  assert_close("dw", dw, rv(f32(g))[0], 1e-2)
  assert not np.any(np.asarray(dw[1], np.float32))  # the empty expert's weights


def test_equals_the_tiled_row_scaled_path(case, kernel_vjp):
  # The same scales as `fp8.experts_scaling: row` in the tiled XLA products: one recipe, two
  # engines. dx's operand scales match; dW is FP8 there, bf16 here.
  x, w, sizes, g = case
  f = lambda a, b: grouped_tiles.grouped_dot(a, b, sizes, jnp.bfloat16, tile=64,
                                             products=grouped.row_products)
  y, vjp = jax.vjp(f, x, w)
  dx = vjp(g)[0]
  assert_close("y vs tiled", kernel_vjp[0], y, 2**-7)
  assert_close("dx vs tiled", kernel_vjp[1], dx, 2**-7)


def test_fp8_operands_lower_for_hopper_k_major():
  s = jax.ShapeDtypeStruct

  def fwd_bwd(x, w, sizes, g):
    y, vjp = jax.vjp(lambda a, b: grouped_kernel.row_scaled_matmul(a, b, sizes), x, w)
    return y, vjp(g)

  text = jax.jit(fwd_bwd).trace(
      s((4096, 2048), jnp.bfloat16), s((8, 2048, 1024), jnp.bfloat16), s((8,), jnp.int32),
      s((4096, 1024), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  # forward and dx take e4m3 operands; dW (the transposed kernel) bf16
  assert len(calls) == 3, text[:2000]
  assert sum("f8E4M3FN" in line for line in calls) == 2
  assert "dot_general" not in text and "ragged_dot" not in text


def test_fp8_operands_must_be_k_major_and_tile_a_swizzled_row():
  s = jax.ShapeDtypeStruct
  x, sizes = s((256, 256), E4M3), s((4,), jnp.int32)
  with pytest.raises(ValueError, match="K-major"):  # the bf16 entry reads rhs [G, K, N]
    check_shapes(x, s((4, 256, 256), E4M3), sizes)
  with pytest.raises(ValueError, match="tile_k=64 must be a multiple of 128"):
    fp8_matmul(jnp.zeros((256, 256), E4M3), jnp.zeros((4, 256, 256), E4M3),
               jnp.zeros((4,), jnp.int32), out_dtype=jnp.bfloat16,
               blocks=GmmBlocks(tile_m=64, tile_n=64, tile_k=64))
  with pytest.raises(ValueError, match="out_dtype"):
    fp8_matmul(jnp.zeros((256, 256), E4M3), jnp.zeros((4, 256, 256), E4M3),
               jnp.zeros((4,), jnp.int32), out_dtype=jnp.float32)


def test_a_width_between_whole_tiles_runs_whole_tiles_and_a_narrow_launch():
  """e4m3 operands at 384 output columns = 256 on whole 128-column warpgroup tiles + 128 on
  64-column ones (`hopper_config.column_parts`, DeepSeek-V3's 1408 = 5 x 256 + 128): the
  unscaled product of the e4m3 values, rounded to bf16."""
  keys = jax.random.split(jax.random.key(3), 2)
  m, k, n = 256, 128, 384
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(E4M3)
  w = jax.random.normal(keys[1], (4, n, k), jnp.float32).astype(E4M3)  # [G, N, K]
  sizes = jnp.array(SIZES, jnp.int32)
  y = fp8_matmul(x, w, sizes, out_dtype=jnp.bfloat16, interpret=True,
                 blocks=GmmBlocks(tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=2))
  f32 = lambda t: t.astype(jnp.float32)
  want = reference(f32(x), jnp.swapaxes(f32(w), 1, 2), sizes)
  assert y.shape == (m, n)
  _within_rounding("y", y, want)


def test_rows_read_from_the_wire_give_what_quantising_them_gives(case, kernel_vjp):
  """`wire_MW`: x's e4m3 operand and row scales read from the FP8 wire's bytes (what the
  expert exchange delivered) instead of quantising x: the same product bit for bit (encoding
  quantises x per row as the kernel does), and the backward's dx and dW, which read x, too;
  the forward never reads x (so no amax or quantising pass over it runs)."""
  x, w, sizes, g = case
  b = wire.e4m3_rows(jnp.bfloat16).encode(x)
  f = lambda a, c: grouped_kernel.row_scaled_matmul(a, c, sizes, blocks=SMALL, interpret=True,
                                                    wire_MW=b)
  y, vjp = jax.vjp(f, x, w)
  for name, got, want in zip(("y", "dx", "dw"), (y, *vjp(g)), kernel_vjp):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  name)
  unread = f(jnp.full_like(x, jnp.nan), w)
  np.testing.assert_array_equal(np.asarray(unread, np.float32), np.asarray(y, np.float32))
