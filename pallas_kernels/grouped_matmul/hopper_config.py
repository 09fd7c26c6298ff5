"""Tile sizes, validation and shared pieces of the grouped matmul kernels (Mosaic GPU, Hopper).

Both kernels are persistent and warp specialised the way JAX's `hopper_matmul_mgpu.py` is: one
CUDA block per SM loops over output tiles; in each, one memory warpgroup streams the operands'
K blocks through `max_concurrent_steps` shared-memory slots with TMA, and two compute
warpgroups each own `tile_n` of the block's 2 * tile_n output columns (fp32 accumulators in
registers, wgmma). Rows are sorted by group (an MoE's tokens by expert); group sizes are an
input, so the tiling is decided on the device.

In interpret mode (CPU, jax's Mosaic GPU interpreter) the same kernels run with two
substitutions the interpreter needs: operands the GPU reads transposed out of shared memory
(`plgpu.transpose_ref`) are transposed in HBM first, and register layouts are not annotated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_env

COMPUTE_WGS = 2  # compute warpgroups per CUDA block; the memory warpgroup is the third
MEMORY_REGISTERS = 40  # per thread for the memory warpgroup; compute gets (512 - 40) / 2
INTERPRET_SMS = 2  # CUDA blocks in interpret mode: enough to exercise the persistent loop


@dataclasses.dataclass(frozen=True)
class GmmBlocks:
  """Tiles of the grouped matmuls (hashable: a custom_vjp nondiff argument).

  tile_m: rows per output tile (one group's rows; a tile across a group boundary is visited
    once per group); tile_n: output columns per compute warpgroup (a CUDA block covers
    2 * tile_n); tile_k: contraction per pipeline step; max_concurrent_steps: shared-memory
    slots; grid_tile_width: output tiles walked in snake order in bands this wide (L2 reuse).
  The dW kernel (`tgmm`) uses tile_m for its output rows (over K) and tile_k for the row
  blocks it streams of each group.
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  grid_tile_width: int = 8

  def smem_bytes(self, itemsize: int = 2, out_itemsize: int | None = None) -> int:
    """Shared memory of the forward kernel: operand slots plus each warpgroup's output tile."""
    slot = (self.tile_m * self.tile_k + self.tile_k * COMPUTE_WGS * self.tile_n) * itemsize
    out = COMPUTE_WGS * self.tile_m * self.tile_n * (out_itemsize or itemsize)
    return self.max_concurrent_steps * slot + out


# 128 x 256 per CUDA block (CUTLASS's Hopper GEMM shape: 128 fp32 accumulator registers per
# thread); 3 slots of 48 KiB + 64 KiB of output staging fit the 227 KiB of shared memory.
# A starting point, not yet tuned on a GPU: scripts/bench_moe.py --kernels sweeps it.
DEFAULT = GmmBlocks(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=3)
# FP8 operands: a 128-byte swizzled row is 128 of them, so tile_k doubles at the same bytes;
# 3 slots of 48 KiB + 64 KiB of bf16 output staging. Untuned, as DEFAULT.
DEFAULT_FP8 = GmmBlocks(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=3)
SMEM_LIMIT = 227 * 1024
# wgmma reads 8-bit operands only K-major (PTX: no transposed FP8 operand), so the kernel takes
# them only with `transpose_rhs` (rhs stored [G, N, K]); e4m3, as DeepSeek-V3's every tensor.
FP8 = (jnp.dtype(jnp.float8_e4m3fn),)
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def row_elems(dtype) -> int:
  """Elements in one 128-byte swizzled shared-memory row: the smallest tile_k."""
  return 128 // jnp.dtype(dtype).itemsize


def defaults(dtype) -> GmmBlocks:
  """The starting tiles for operands of `dtype`."""
  return DEFAULT_FP8 if jnp.dtype(dtype) in FP8 else DEFAULT


def fit(blocks: GmmBlocks, k: int, n: int, dtype=jnp.bfloat16) -> GmmBlocks:
  """`blocks` with tile_n halved (down to 64) and tile_k (down to one 128-byte swizzled row of
  `dtype`, at least 64) until they divide n and k."""
  tn, tk, floor = blocks.tile_n, blocks.tile_k, max(64, row_elems(dtype))
  while tn > 64 and n % (COMPUTE_WGS * tn):
    tn //= 2
  while tk > floor and k % tk:
    tk //= 2
  return dataclasses.replace(blocks, tile_n=tn, tile_k=tk)


def column_parts(n: int, blocks: GmmBlocks) -> tuple[tuple[int, int], ...]:
  """How the row-grouped kernel launches n output columns: (first, width) parts, each whole
  CUDA-block tiles of its own tile_n (`fit`). Whole tiles of `blocks` first; the rest (whole
  64-column warpgroup tiles, or `problem` refuses n) is a second launch on narrower ones.

  DeepSeek-V3 16B's 1408 = 5 x 256 + 128: 91% of the products at the 128-column tiles' 732
  TFLOP/s, 9% at the 64-column ones' 477 (jscale.predict.rates, H200). Padding the width to
  1536 instead copied the weight stack on every use: down's dx, 0.24 ms a layer in the H200's
  2026-11-30 trace, more than its 9% of extra products; all of it on 64-column tiles would run
  at 477."""
  cta = COMPUTE_WGS * blocks.tile_n
  whole = n - n % cta
  return tuple((first, width) for first, width in ((0, whole), (whole, n - whole)) if width)


def column_blocks(first: int, width: int, cta_n: int) -> tuple[int, int]:
  """A launch's output columns [first, first + width) as CUDA blocks of cta_n columns: (blocks
  before it, blocks in it). ValueError unless both are whole blocks."""
  if first % cta_n or width % cta_n:
    raise ValueError(f"columns {first}..{first + width} are not whole CUDA blocks of {cta_n}")
  return first // cta_n, width // cta_n


def problem(lhs, rhs, group_sizes, blocks: GmmBlocks, transpose_rhs: bool = False,
            out_dtype=None) -> str | None:
  """What the grouped matmul kernels cannot run, naming the fix (None: they can); arrays or
  ShapeDtypeStructs, before tracing. FP8 operands need `transpose_rhs` and a 16-bit
  `out_dtype`."""
  if lhs.ndim != 2 or rhs.ndim != 3:
    return f"expected lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}"
  (_, k), (g, k2, n) = lhs.shape, rhs.shape
  if transpose_rhs:
    k2, n = n, k2
  if k != k2:
    return f"lhs {lhs.shape} and rhs {rhs.shape} disagree on the contraction size"
  if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    return (f"group_sizes must be int [{g}] (one per rhs group), got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}")
  if (why := _dtype_problem(lhs.dtype, rhs.dtype, transpose_rhs, out_dtype)) is not None:
    return why
  for name, size, tile in (("K", k, blocks.tile_k), ("N", n, COMPUTE_WGS * blocks.tile_n)):
    if size % tile:
      return (f"{name}={size} is not a multiple of {tile} (the kernel's tiles): use "
              f"model.moe.gemm=tiled for this width, or a width that is")
  floor = {"tile_m": 64, "tile_n": 64, "tile_k": max(64, row_elems(lhs.dtype))}
  for name, least in floor.items():
    if getattr(blocks, name) % least:
      return (f"GmmBlocks.{name}={getattr(blocks, name)} must be a multiple of {least} "
              f"(one wgmma tile, one 128-byte swizzled row of {jnp.dtype(lhs.dtype)})")
  if blocks.max_concurrent_steps < 2:
    return (f"GmmBlocks.max_concurrent_steps={blocks.max_concurrent_steps} must be "
            f">= 2 (one slot loads while the other is multiplied)")
  used = blocks.smem_bytes(jnp.dtype(lhs.dtype).itemsize,
                          jnp.dtype(out_dtype or lhs.dtype).itemsize)
  if used > SMEM_LIMIT:
    return (f"{blocks} needs {used // 1024} KiB of shared memory, over "
            f"the H100's {SMEM_LIMIT // 1024}: lower max_concurrent_steps or the tiles")
  return None


def _dtype_problem(lhs_dtype, rhs_dtype, transpose_rhs: bool, out_dtype) -> str | None:
  lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
  if lhs_dtype != rhs_dtype or lhs_dtype not in HALF + FP8:
    return (f"the grouped matmul kernel takes bf16 or fp16 operands of one dtype (or e4m3 "
            f"ones: fp8_matmul), got {lhs_dtype} and {rhs_dtype}: set model.dtype=bfloat16 "
            f"or model.moe.gemm=tiled")
  if lhs_dtype in FP8 and not transpose_rhs:
    return ("FP8 operands must be read K-major (wgmma has no transposed 8-bit operand): use "
            "fp8_matmul, which takes rhs as [G, N, K]")
  if lhs_dtype in FP8 and jnp.dtype(out_dtype or lhs_dtype) not in HALF:
    return f"FP8 products come out in bf16 or fp16: pass out_dtype, got {out_dtype}"
  return None


def transforms(dtype):
  """The shared-memory layout TMA and wgmma share: 8-row tiles, 128-byte swizzle."""
  swizzle = 128
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def num_sms(interpret: bool) -> int:
  """CUDA blocks of the persistent grid: one per SM of the GPU in use (H100's when lowering
  without one)."""
  return INTERPRET_SMS if interpret else mosaic_gpu_env.num_sms()


def kernel_args(interpret: bool) -> dict:
  """plgpu.kernel arguments both kernels share: persistent grid, warpgroups as threads, and
  warpgroup lowering semantics (Mosaic GPU infers register layouts, as in JAX's Hopper matmul)."""
  args = dict(grid=(num_sms(interpret),), grid_names=("sm",), num_threads=COMPUTE_WGS + 1,
              thread_name="wg", compiler_params=plgpu.CompilerParams(
                  lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  if interpret:
    args["interpret"] = mosaic_gpu_env.interpret_params()
  return args


@dataclasses.dataclass(frozen=True)
class RowTile:
  """Which rows a visit of the row-grouped kernel owns: visit `v` of the grid covers row block
  `block` for group `group`; rows [start, start + size) of it are the group's (size may be 0)."""
  group: jax.Array
  block: jax.Array
  start: jax.Array  # within the block
  size: jax.Array

  @classmethod
  def table(cls, sizes, tile: int, visits: int) -> "RowTile":
    """Every visit's RowTile, each field an int32 array [visits] (`sizes`: rows per group, the
    tail group of rows past the groups last). Visits run group by group, block by block; a
    block that straddles a boundary is visited once per group it holds, so there are at most
    cdiv(M, tile) + groups - 1 of them. Computed by XLA before the kernel (megablox's group
    metadata; the transposed kernel's starts / ends), so a visit reads its four numbers: found
    in the kernel, each visit looped over every group (65 steps for DeepSeek-V3's experts)."""
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_block = lax.div(starts, jnp.int32(tile))
    n_blocks = lax.div(ends - 1, jnp.int32(tile)) + 1 - first_block  # truncating division
    first_visit = first_block + jnp.arange(sizes.shape[0], dtype=jnp.int32)
    visit = jnp.arange(visits, dtype=jnp.int32)[:, None]
    mine = (first_visit <= visit) & (visit < first_visit + n_blocks)  # [visits, groups]
    # At most one group claims a visit; none: group 0, block 0, no rows.
    claimant = jnp.max(jnp.where(mine, jnp.arange(sizes.shape[0], dtype=jnp.int32), -1), axis=1)
    found = claimant >= 0
    group = jnp.maximum(claimant, 0)
    block = jnp.where(found, visit[:, 0] - group, 0)
    g_start, g_end = (jnp.where(found, x[group], 0) for x in (starts, ends))
    row0 = block * tile
    lo, hi = jnp.maximum(g_start, row0), jnp.minimum(g_end, row0 + tile)
    return cls(group=group, block=block, start=lo - row0, size=jnp.maximum(hi - lo, 0))

  def fields(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(group, block, start, size): `table`'s arrays in the order `at` reads them."""
    return self.group, self.block, self.start, self.size

  @classmethod
  def at(cls, refs, visit) -> "RowTile":
    """Visit `visit`'s RowTile read from `table`'s four arrays (as kernel refs, same order)."""
    return cls(*(ref[visit] for ref in refs))


def store_rows(src_smem, dst_gmem, row0, start, size, max_rows: int) -> None:
  """Copies rows [start, start + size) of src_smem to rows row0 + start.. of dst_gmem (size <=
  max_rows, traced). TMA boxes are static, so the rows go out as a ladder of power-of-two boxes,
  one per set bit of `size` (JAX's ragged_dot_mgpu)."""
  rows = 1 << (max_rows.bit_length() - 1)
  offset = start
  while rows:
    @pl.when(size & rows != 0)
    def _store(rows=rows, offset=offset):
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(offset, rows)],
                              dst_gmem.at[pl.ds(row0 + offset, rows)])
    offset = offset + (size & rows)
    rows //= 2
