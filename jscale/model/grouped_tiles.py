"""The experts' grouped matmul as a batched matmul over row tiles, in plain XLA: for GPUs the
Pallas kernel does not run on (`model.moe.gemm: tiled`, what `auto` picks there).

XLA:GPU lowers `jax.lax.ragged_dot` by expanding the rows into a zero-padded [A, E·K] matrix
and running one dense dot against all E experts' weights: E times the products' FLOPs (8x for
8 experts; `tests/plan/test_gpu_compile.py` measures it from the compiled program). Here each
expert's sorted rows are split into tiles of `tile` rows, every tile lands at a tile boundary
of a padded [T·tile, K] buffer, and one batched matmul multiplies each tile by its expert's
weights (gathered per tile by a one-hot matmul, so its transpose sums the tiles' weight
gradients per expert without a scatter). The products cost the rows actually present, plus
at most one partly filled tile per expert and the E spare tiles a static shape needs; moving
rows in and out is two gathers each way (their transposes are gathers too, `gather_rows`).

Shape suffixes: A rows (sorted by expert), K in, N out, E experts, T tiles, M rows per tile,
P = T·M padded rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jscale.model import matmul
from jscale.model.zeros import zero_from


def tile_rows(rows: int, n_experts: int) -> int:
  """Rows per tile: a power of two near a quarter of the average group (so partly filled
  tiles waste at most ~25% of the products), between 16 and 1024."""
  target = max(rows // (4 * n_experts), 1)
  return int(min(1024, max(16, 1 << (target.bit_length() - 1))))


@jax.custom_vjp
def gather_rows(x_AK, src_P, valid_P, back_A, back_valid_A):
  """[P, K]: row src_P[p] of x where valid_P[p], else zero. (back_A, back_valid_A) is the
  inverse map (row a of x sits at back_A[a] when back_valid_A[a]), so the transpose is the
  gather g[back_A] instead of a scatter-add."""
  return jnp.where(valid_P[:, None], x_AK[src_P], zero_from(src_P, x_AK.dtype))


def _gather_rows_fwd(x, src, valid, back, back_valid):
  return gather_rows(x, src, valid, back, back_valid), (src, valid, back, back_valid)


def _gather_rows_bwd(res, g_PK):
  src, valid, back, back_valid = res
  zero = lambda i: np.zeros(i.shape, jax.dtypes.float0)
  g_AK = jnp.where(back_valid[:, None], g_PK[back], zero_from(back, g_PK.dtype))
  return g_AK, zero(src), zero(valid), zero(back), zero(back_valid)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def row_experts(sizes_E: jax.Array, rows: int) -> jax.Array:
  """[rows]: the expert each row belongs to (rows sorted by expert, sizes_E each; rows past
  sum(sizes_E) get the last expert)."""
  a = jnp.arange(rows)
  return jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes_E), a, side="right"),
                     sizes_E.shape[0] - 1).astype(jnp.int32)


def _layout(sizes_E: jax.Array, rows: int, tile: int):
  """Where every row goes: the tiles' experts [T], padded row p's source row and whether it
  holds one [P], and sorted row a's padded row and whether it is a row of some group [A]."""
  e = sizes_E.shape[0]
  n_tiles = -(-rows // tile) + e  # each group's last tile may be partly filled
  tiles_E = (sizes_E + tile - 1) // tile
  tile_end_E = jnp.cumsum(tiles_E)
  first_tile_E = tile_end_E - tiles_E
  row_end_E = jnp.cumsum(sizes_E)
  row_start_E = row_end_E - sizes_E
  expert_T = jnp.searchsorted(tile_end_E, jnp.arange(n_tiles), side="right").astype(jnp.int32)
  p = jnp.arange(n_tiles * tile)
  e_P = jnp.minimum(expert_T[p // tile], e - 1)
  offset_P = p - first_tile_E[e_P] * tile
  valid_P = (expert_T[p // tile] < e) & (offset_P < sizes_E[e_P])
  src_P = jnp.clip(row_start_E[e_P] + offset_P, 0, rows - 1).astype(jnp.int32)
  a = jnp.arange(rows)
  e_A = row_experts(sizes_E, rows)
  valid_A = a < row_end_E[-1]
  dest_A = jnp.clip(first_tile_E[e_A] * tile + a - row_start_E[e_A], 0,
                    n_tiles * tile - 1).astype(jnp.int32)
  return expert_T, src_P, valid_P, dest_A, valid_A


def grouped_dot(x_AK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, dtype,
                tile: int | None = None, products=None) -> jax.Array:
  """`jax.lax.ragged_dot(x_AK, w_EKN, sizes_E)` in `dtype` (operands, result and the
  backward's products): rows sorted by expert, sizes_E rows each; rows past sum(sizes_E) come
  out zero. `tile`: rows per tile (default `tile_rows`); `products`: the per-tile products
  (default `tile_products`; FP8: `jscale.fp8.grouped.tile_products`)."""
  (rows, k), (e, _, n) = x_AK.shape, w_EKN.shape
  tile = tile or tile_rows(rows, e)
  with jax.named_scope("grouped_tiles"):  # profiles and op names show the products as such
    expert_T, src_P, valid_P, dest_A, valid_A = _layout(sizes_E.astype(jnp.int32), rows, tile)
    n_tiles = expert_T.shape[0]
    x_TMK = gather_rows(x_AK.astype(dtype), src_P, valid_P, dest_A, valid_A).reshape(
        n_tiles, tile, k)
    y_PN = (products or tile_products)(x_TMK, w_EKN.astype(dtype), expert_T).reshape(
        n_tiles * tile, n)
    return gather_rows(y_PN, dest_A, valid_A, src_P, valid_P)


def _onehot(expert_T: jax.Array, n_experts: int, dtype) -> jax.Array:
  """[T, E]: which expert each tile's rows go to (unused tiles, expert E: none)."""
  return (expert_T[:, None] == jnp.arange(n_experts)).astype(dtype)


def _per_tile(w_EKN: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, K, N]: each tile's expert's weights (a one-hot matmul, exact; unused tiles get zeros:
  their rows are zero anyway)."""
  onehot_TE = _onehot(expert_T, w_EKN.shape[0], w_EKN.dtype)
  return matmul.einsum("TE,EKN->TKN", onehot_TE, w_EKN, w_EKN.dtype)


@jax.custom_vjp
def tile_products(x_TMK: jax.Array, w_EKN: jax.Array, expert_T: jax.Array) -> jax.Array:
  """[T, M, N]: each tile's rows times its expert's weights, in the operands' dtype. The
  backward makes the per-tile weight copy again rather than keeping it (T·K·N per product,
  more than the rows), whatever the remat policy."""
  return matmul.einsum("TMK,TKN->TMN", x_TMK, _per_tile(w_EKN, expert_T), x_TMK.dtype)


def _tile_products_fwd(x, w, expert):
  return tile_products(x, w, expert), (x, w, expert)


def _tile_products_bwd(res, g_TMN):
  x_TMK, w_EKN, expert_T = res
  dtype = x_TMK.dtype
  dx_TMK = matmul.einsum("TMN,TKN->TMK", g_TMN, _per_tile(w_EKN, expert_T), dtype)
  dw_TKN = matmul.einsum("TMK,TMN->TKN", x_TMK, g_TMN, dtype)
  onehot_TE = _onehot(expert_T, w_EKN.shape[0], dtype)
  dw_EKN = matmul.einsum("TE,TKN->EKN", onehot_TE, dw_TKN, dtype)  # sums each expert's tiles
  return dx_TMK, dw_EKN.astype(w_EKN.dtype), np.zeros(expert_T.shape, jax.dtypes.float0)


tile_products.defvjp(_tile_products_fwd, _tile_products_bwd)
