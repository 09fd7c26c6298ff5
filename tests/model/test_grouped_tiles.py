"""`jscale.model.grouped_tiles`: the experts' grouped matmul as a batched matmul over row
tiles (`model.moe.gemm: tiled`) against XLA's ragged_dot and a loop over groups — values and
gradients, empty groups, one group holding every row, rows past the groups — and what it
lowers to: no scatter, compute-dtype dots only."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jscale.model import grouped_tiles as gt


def _loop(x, w, sizes):
  """Each group's rows times its weights, one matmul per group; rows past the groups zero."""
  out, start = np.zeros((x.shape[0], w.shape[2]), np.float64), 0
  for e, n in enumerate(sizes):
    out[start:start + n] = np.asarray(x[start:start + n], np.float64) @ np.asarray(w[e])
    start += n
  return out


# (rows, K, N, group sizes, tile): uneven groups, empty ones, one holding every row, every
# group empty, groups not filling the rows, tiles smaller than groups and larger.
CASES = [(64, 16, 24, [10, 0, 30, 20], None), (64, 16, 24, [64, 0, 0, 0], 16),
         (50, 8, 8, [0, 0, 0], None), (40, 8, 12, [7, 1, 0, 13, 9], 8),
         (96, 32, 16, [0, 33, 0, 0, 17, 46], 32)]


@pytest.mark.parametrize("rows,k,n,sizes,tile", CASES)
def test_values_and_gradients_equal_ragged_dot_and_a_loop(rows, k, n, sizes, tile):
  rng = np.random.default_rng(len(sizes))
  x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
  s = jnp.asarray(sizes, jnp.int32)
  tiled = lambda x, w: gt.grouped_dot(x, w, s, jnp.float32, tile)
  ragged = lambda x, w: jax.lax.ragged_dot(x, w, s)
  np.testing.assert_allclose(tiled(x, w), _loop(x, w, sizes), rtol=1e-5, atol=1e-5)
  loss = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
  for got, want in zip(loss(tiled), loss(ragged)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tile_rows_follow_the_average_group():
  assert gt.tile_rows(32768, 8) == 1024  # 4096 rows per group: capped
  assert gt.tile_rows(8192, 8) == 256
  assert gt.tile_rows(8, 8) == 16  # decode-sized batches: the floor


def test_lowers_to_gathers_and_compute_dtype_dots():
  """Forward and backward: no scatter (the row moves are gathers both ways, the weights' per-
  tile copies sum back by a one-hot matmul) and every dot_general in bf16."""
  x = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16)
  s = jnp.asarray([100, 0, 60, 90], jnp.int32)
  f = lambda x, w: jnp.sum(gt.grouped_dot(x, w, s, jnp.bfloat16).astype(jnp.float32))
  text = jax.jit(jax.value_and_grad(f, (0, 1))).lower(x, w).as_text()
  assert "scatter" not in text
  dots = re.findall(r"stablehlo.dot_general.*: \(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
  # The weights' tile copy and the product; the backward makes the copy again (rather than
  # keep it), then dx, the tiles' dW and their sum per expert.
  assert len(dots) == 6, dots
  assert all(a.endswith("bf16") and b.endswith("bf16") for a, b in dots), dots
