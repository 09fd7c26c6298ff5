"""`grouped_matmul`: jax.lax.ragged_dot's contract on Hopper kernels, differentiable.

out[rows of group i] = lhs[rows of group i] @ rhs[i], rows sorted by group, group sizes an
input (an MoE's tokens sorted by expert). The backward is two more grouped products:
dlhs = dout @ rhs[i]^T (the row-grouped kernel reading rhs transposed) and
drhs[i] = lhs_i^T @ dout_i (the transposed kernel, `tgmm`), both in the operands' dtype with
fp32 accumulation, as the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import hopper_config as C
from pallas_kernels.grouped_matmul.hopper_gmm import gmm
from pallas_kernels.grouped_matmul.hopper_tgmm import tgmm


@dataclasses.dataclass(frozen=True)
class _Static:
  blocks: C.GmmBlocks
  interpret: bool


def _launched(lhs, rhs, sizes, blocks: C.GmmBlocks, interpret: bool, transpose_rhs=False,
              out_dtype=None):
  """`gmm` over all of rhs's output columns, in the launches of `C.column_parts` (XLA fuses
  their concatenation into the result's reader)."""
  axis = 1 if transpose_rhs else 2
  n, k = rhs.shape[axis], rhs.shape[3 - axis]
  outs = [gmm(lhs, rhs, sizes, blocks=C.fit(blocks, k, width, lhs.dtype),
              transpose_rhs=transpose_rhs, out_dtype=out_dtype, columns=(first, width),
              interpret=interpret)
          for first, width in C.column_parts(n, blocks)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, sizes, cfg: _Static):
  return _launched(lhs, rhs, sizes, cfg.blocks, cfg.interpret)


def _gmm_fwd(lhs, rhs, sizes, cfg):
  return _gmm(lhs, rhs, sizes, cfg), (lhs, rhs, sizes)


def _gmm_bwd(cfg, res, dout):
  lhs, rhs, sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = _launched(dout, rhs, sizes, cfg.blocks, cfg.interpret, transpose_rhs=True)
  drhs = weight_gradient(lhs, dout, sizes, blocks=cfg.blocks, interpret=cfg.interpret)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def why_not(lhs, rhs, group_sizes, blocks: C.GmmBlocks | None = None,
            fp8: bool = False) -> str | None:
  """Why the kernels cannot run these shapes, forward or backward, naming the fix; None when
  they can. `lhs`, `rhs`, `group_sizes` may be arrays or ShapeDtypeStructs. `fp8`: also the
  forward and dlhs products on e4m3 operands (`fp8_matmul`, its default tiles)."""
  blocks = blocks or C.DEFAULT
  forward = C.problem(lhs, rhs, group_sizes,
                      C.fit(blocks, *rhs.shape[1:]) if rhs.ndim == 3 else blocks)
  if forward is not None:
    return forward
  g, k, n = rhs.shape
  dout = jax.ShapeDtypeStruct((lhs.shape[0], n), lhs.dtype)
  dlhs = C.problem(dout, rhs, group_sizes, C.fit(blocks, n, k), transpose_rhs=True)
  if dlhs is not None:
    return dlhs
  # As launched (`_launched`), forward and dlhs.
  for rows, contract, out in ((lhs, k, n), (dout, n, k)):
    if (launched := _launch_problem(rows, contract, out, g, rhs.dtype, group_sizes,
                                    blocks)) is not None:
      return launched
  if k % blocks.tile_m:
    return (f"K={k} is not a multiple of tile_m={blocks.tile_m} (the weight "
            f"gradient's output rows): use model.moe.gemm=tiled for this width")
  return _fp8_why_not(lhs, rhs, group_sizes) if fp8 else None


def _launch_problem(rows, contract: int, out: int, g: int, dtype, group_sizes,
                    blocks: C.GmmBlocks) -> str | None:
  """What the kernel cannot run of the launches `_launched` makes for `out` columns."""
  for _, width in C.column_parts(out, blocks):
    why = C.problem(rows, jax.ShapeDtypeStruct((g, contract, width), dtype), group_sizes,
                    C.fit(blocks, contract, width))
    if why is not None:
      return why
  return None


def _fp8_fitted(lhs_MK, rhs_GNK, group_sizes, blocks, out_dtype):
  """(`blocks` fitted to an FP8 product's widths, why the kernel cannot run it or None)."""
  (_, k), n = lhs_MK.shape, rhs_GNK.shape[1]
  blocks = C.fit(blocks or C.DEFAULT_FP8, k, n, lhs_MK.dtype)
  return blocks, C.problem(lhs_MK, rhs_GNK, group_sizes, blocks, transpose_rhs=True,
                           out_dtype=out_dtype)


def _fp8_why_not(lhs, rhs, group_sizes) -> str | None:
  f8, (m, k), (g, _, n) = C.FP8[0], lhs.shape, rhs.shape
  s = jax.ShapeDtypeStruct
  for rows, contract, out in ((m, k, n), (m, n, k)):  # forward, then dlhs = dout @ rhs^T
    _, why = _fp8_fitted(s((rows, contract), f8), s((g, out, contract), f8), group_sizes,
                         None, lhs.dtype)
    if why is not None:
      return f"FP8 experts on the kernel: {why}"
  return None


def check_shapes(lhs, rhs, group_sizes, blocks: C.GmmBlocks | None = None) -> None:
  """Raises ValueError (naming the fix) unless the kernels can run these shapes (`why_not`)."""
  if (why := why_not(lhs, rhs, group_sizes, blocks)) is not None:
    raise ValueError(why)


def fp8_matmul(lhs_MK: jax.Array, rhs_GNK: jax.Array, group_sizes_G: jax.Array, *, out_dtype,
               blocks: C.GmmBlocks | None = None, interpret: bool = False) -> jax.Array:
  """[M, N] = ragged_dot(lhs_MK, rhs_GNK^T per group) for float8_e4m3fn operands, accumulated
  in fp32 and rounded to `out_dtype` (bf16 / fp16). rhs comes [G, N, K], contraction minor, as
  wgmma reads 8-bit operands; unscaled: the caller applies its scales to the result
  (`jscale.fp8.grouped_kernel`). Not differentiable. Shapes that do not tile raise ValueError."""
  _, why = _fp8_fitted(lhs_MK, rhs_GNK, group_sizes_G, blocks, out_dtype)
  if why is not None:
    raise ValueError(why)
  return _launched(lhs_MK, rhs_GNK, group_sizes_G, blocks or C.DEFAULT_FP8, interpret,
                  transpose_rhs=True, out_dtype=out_dtype)


def weight_gradient(lhs_MK: jax.Array, dout_MN: jax.Array, group_sizes_G: jax.Array, *,
                    blocks: C.GmmBlocks | None = None, interpret: bool = False) -> jax.Array:
  """[G, K, N]: lhs[rows of i]^T @ dout[rows of i] for each group i (bf16 / fp16, one dtype;
  the transposed kernel `grouped_matmul`'s backward runs), in their dtype."""
  blocks = C.fit(blocks or C.DEFAULT, 1 << 30, dout_MN.shape[1])
  return tgmm(lhs_MK, dout_MN, group_sizes_G, blocks=blocks, interpret=interpret)


def grouped_matmul(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                   blocks: C.GmmBlocks | None = None, interpret: bool = False) -> jax.Array:
  """[M, N] = ragged_dot(lhs_MK, rhs_GKN, group_sizes_G) in lhs's dtype (bf16 / fp16), rows past
  sum(group_sizes) zero; differentiable in lhs and rhs. `interpret`: run on CPU in JAX's
  Mosaic GPU interpreter (tests). Shapes that do not tile raise ValueError (`check_shapes`)."""
  blocks = blocks or C.DEFAULT
  check_shapes(lhs_MK, rhs_GKN, group_sizes_G, blocks)
  return _gmm(lhs_MK, rhs_GKN, group_sizes_G, _Static(blocks, interpret))
