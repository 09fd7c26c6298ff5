"""Row-grouped matmul on Mosaic GPU: out[rows of group i] = lhs[rows of group i] @ rhs[i].

The forward of an MoE's expert matmuls, and (with `transpose_rhs`) their input gradient
dlhs = dout @ rhs[i]^T. Output tiles are tile_m rows x 2 * tile_n columns; a row tile that
straddles a group boundary is visited once per group and each visit stores only its group's
rows (megablox's scheme, JAX's `ragged_dot_mgpu.py`), so no tile mixes two groups' weights and
no padding is computed. Rows past sum(group_sizes) come out zero, as jax.lax.ragged_dot's do.
Which group and rows each visit owns is a table XLA computes before the launch
(`hopper_config.RowTile.table`), read in O(1) per visit however many groups there are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import hopper_config as C

# Mosaic GPU's accumulator ref, not in its module's __all__.
_ACC = plgpu.ACC  # pyright: ignore[reportPrivateImportUsage]


def gmm(lhs_MK: jax.Array, rhs: jax.Array, sizes_G: jax.Array, *, blocks: C.GmmBlocks,
        transpose_rhs: bool = False, out_dtype=None, columns: tuple[int, int] | None = None,
        interpret: bool = False) -> jax.Array:
  """[M, N] grouped product of lhs_MK (rows sorted by group) with rhs [G, K, N] ([G, N, K] read
  transposed if `transpose_rhs`), its output columns `columns` = (first, N) in whole CUDA blocks
  (default: all), in `out_dtype` (default lhs's; fp32 accumulation). Shapes pass `C.problem`."""
  if transpose_rhs and interpret:  # the interpreter has no transposed wgmma operand
    rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
  (m, k), g = lhs_MK.shape, rhs.shape[0]
  tm, tn, tk = blocks.tile_m, blocks.tile_n, blocks.tile_k
  cta_n = C.COMPUTE_WGS * tn
  first, n = columns or (0, rhs.shape[1] if transpose_rhs else rhs.shape[2])
  before, grid_n = C.column_blocks(first, n, cta_n)  # rhs's blocks before this launch's, its own
  # One more group for the rows past sum(sizes): its visits skip the products and store zeros.
  sizes = jnp.concatenate([sizes_G, (m - jnp.sum(sizes_G))[None]]).astype(jnp.int32)
  visits, max_rows, layout = pl.cdiv(m, tm) + g, min(tm, m), C.transforms(lhs_MK.dtype)

  def pipeline(tile, ni, step, context):
    b_block = (cta_n, tk) if transpose_rhs else (tk, cta_n)
    b_index = (lambda kk: (before + ni, kk)) if transpose_rhs else (lambda kk: (kk, before + ni))
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(k // tk,), memory_registers=C.MEMORY_REGISTERS,
        in_specs=[plgpu.BlockSpec((tm, tk), lambda kk: (tile.block, kk), transforms=layout),
                  plgpu.BlockSpec(b_block, b_index, transforms=layout)],
        wg_axis="wg", num_compute_wgs=C.COMPUTE_WGS,
        max_concurrent_steps=blocks.max_concurrent_steps, compute_context=context)

  def grouped_matmul(groups_gmem, blocks_gmem, starts_gmem, sizes_gmem, lhs_gmem, rhs_gmem,
                     out_gmem):  # the name GPU profiles show
    unused = lambda *_, **__: None
    zero_tile = C.RowTile(*(jnp.int32(0),) * 4)
    allocs = pipeline(zero_tile, 0, unused, unused).get_allocations(lhs_gmem, rhs_gmem.at[0])

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((C.COMPUTE_WGS, tm, tn), out_gmem.dtype),
                       collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((visits * grid_n,), collective_axes="sm")
      def _visit(info):
        mi, ni = plgpu.planar_snake(info.index[0], (visits, grid_n), 1, blocks.grid_tile_width)
        tile = C.RowTile.at((groups_gmem, blocks_gmem, starts_gmem, sizes_gmem), mi)
        # The tail group (rows past the last group) and empty visits multiply nothing.
        live = (tile.group < g) & (tile.size > 0)

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc=_ACC((tm, tn), jnp.float32))
          def _acc(acc):
            run_pipeline(acc)
            out = acc[...].astype(out_gmem.dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last visit's rows are out
            out_smem[wg] = out
            plgpu.commit_smem()
            C.store_rows(out_smem.at[wg], out_gmem.at[:, pl.ds(ni * cta_n + wg * tn, tn)],
                         tile.block * tm, tile.start, tile.size, max_rows)

        def step(_, a_smem, b_smem, acc):
          b = (plgpu.transpose_ref(b_smem.at[pl.ds(wg * tn, tn), :], (1, 0)) if transpose_rhs
               else b_smem.at[:, pl.ds(wg * tn, tn)])

          @pl.when(live)
          def _mma():
            plgpu.wgmma(acc, a_smem, b)
          # The slot is released when this step returns, so its product must be done: with a
          # delayed release the last step's slot would never be, and the next tile's prologue
          # (same allocations) could refill it in flight. The other warpgroup's wgmma overlaps.
          plgpu.wgmma_wait(0)
          return acc

        group = jnp.minimum(tile.group, g - 1)
        pipeline(tile, ni, step, context)(lhs_gmem, rhs_gmem.at[group], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(grouped_matmul,
                        out_type=jax.ShapeDtypeStruct((m, n), out_dtype or lhs_MK.dtype),
                        **C.kernel_args(interpret))
  return kernel(*C.RowTile.table(sizes, tm, visits).fields(), lhs_MK, rhs)
