"""Transposed grouped matmul on Mosaic GPU: out[i] = lhs[rows of group i]^T @ rhs[rows of group i].

The weight gradient of an MoE's expert matmuls (dW[i] = x_i^T dout_i), contracting over each
group's rows. Output tiles are tile_m x 2 * tile_n of one group's [K, N]; the pipeline streams
only that group's row blocks (tile_k rows each; a dynamic number of steps), and the rows of its
first and last block that belong to a neighbouring group are zeroed in shared memory before the
product (each compute warpgroup zeroes its own columns of the rhs block: no race). An empty
group's tiles are zeros. As JAX's `transposed_ragged_dot_mgpu.py`, warp specialised.
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


def _keep_rows(ref, row0, start, end, interpret: bool) -> None:
  """Zeroes the rows of the shared-memory block `ref` (first row: global row row0) outside
  [start, end)."""
  rows = lax.broadcasted_iota(jnp.int32, ref.shape, 0) + row0
  keep = (rows >= start) & (rows < end)
  if not interpret:  # the layout wgmma reads; the interpreter has no layouts
    keep = plgpu.layout_cast(keep, plgpu.Layout.WGMMA)
  ref[...] = jnp.where(keep, ref[...], jnp.zeros((), ref.dtype))
  plgpu.commit_smem()  # visible to the wgmma's async proxy


def tgmm(lhs_MK: jax.Array, rhs_MN: jax.Array, sizes_G: jax.Array, *, blocks: C.GmmBlocks,
         interpret: bool = False) -> jax.Array:
  """[G, K, N]: for each group i, lhs_MK[rows of i]^T @ rhs_MN[rows of i] (rows sorted by
  group; rows past sum(sizes) are ignored). K must divide by tile_m, N by 2 * tile_n."""
  k, n, g = lhs_MK.shape[1], rhs_MN.shape[1], sizes_G.shape[0]
  tm, tn, tr = blocks.tile_m, blocks.tile_n, blocks.tile_k  # tr: rows per pipeline step
  cta_n = C.COMPUTE_WGS * tn
  sizes = sizes_G.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = lax.div(starts, tr)
  steps = jnp.where(sizes > 0, pl.cdiv(ends, tr) - first, 0)
  # The interpreter has no transposed wgmma operand: it gets lhs^T [K, M] from HBM instead.
  lhs = lhs_MK.T if interpret else lhs_MK
  grid_k, grid_n = k // tm, n // cta_n
  layout = C.transforms(lhs_MK.dtype)

  def pipeline(n_steps, first_block, ki, ni, step, context):
    a_spec = (plgpu.BlockSpec((tm, tr), lambda s: (ki, first_block + s), transforms=layout)
              if interpret else
              plgpu.BlockSpec((tr, tm), lambda s: (first_block + s, ki), transforms=layout))
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(n_steps,), memory_registers=C.MEMORY_REGISTERS,
        in_specs=[a_spec, plgpu.BlockSpec((tr, cta_n), lambda s: (first_block + s, ni),
                                          transforms=layout)],
        wg_axis="wg", num_compute_wgs=C.COMPUTE_WGS,
        max_concurrent_steps=blocks.max_concurrent_steps, compute_context=context)

  def transposed_grouped_matmul(starts_gmem, ends_gmem, first_gmem, steps_gmem, lhs_gmem,
                                rhs_gmem, out_gmem):  # the name GPU profiles show
    unused = lambda *_, **__: None
    zero = jnp.int32(0)
    allocs = pipeline(steps_gmem[0], zero, zero, zero, unused, unused).get_allocations(
        lhs_gmem, rhs_gmem)

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((C.COMPUTE_WGS, tm, tn), out_gmem.dtype,
                                           transforms=layout),
                       collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g, grid_k * grid_n), collective_axes="sm")
      def _tile(info):
        gi = info.index[0]
        ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, blocks.grid_tile_width)
        start, end, first_block, n_steps = (starts_gmem[gi], ends_gmem[gi], first_gmem[gi],
                                            steps_gmem[gi])

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc=_ACC((tm, tn), jnp.float32))
          def _acc(acc):
            run_pipeline(acc)
            out = acc[...].astype(out_gmem.dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile is out
            out_smem[wg] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg],
                out_gmem.at[gi, pl.ds(ki * tm, tm), pl.ds(ni * cta_n + wg * tn, tn)])

        def step(idx, a_smem, b_smem, acc):
          (s,) = idx
          b = b_smem.at[:, pl.ds(wg * tn, tn)]

          @pl.when((s == 0) | (s == n_steps - 1))  # blocks shared with another group
          def _mask():
            _keep_rows(b, (first_block + s) * tr, start, end, interpret)

          a = a_smem if interpret else plgpu.transpose_ref(a_smem, (1, 0))
          plgpu.wgmma(acc, a, b)
          # The slot is released when this step returns, so its product must be done: with a
          # delayed release the last step's slot would never be, and the next tile's prologue
          # (same allocations) could refill it in flight. The other warpgroup's wgmma overlaps.
          plgpu.wgmma_wait(0)
          return acc

        pipeline(n_steps, first_block, ki, ni, step, context)(lhs_gmem, rhs_gmem,
                                                              allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(transposed_grouped_matmul,
                        out_type=jax.ShapeDtypeStruct((g, k, n), lhs_MK.dtype),
                        **C.kernel_args(interpret))
  return kernel(starts, ends, first, steps, lhs, rhs_MN)
