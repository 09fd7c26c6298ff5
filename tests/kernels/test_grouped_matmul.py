"""The Hopper grouped matmul kernels (MoE experts) against ragged_dot and a per-group loop.

On CPU the kernels run in JAX's Mosaic GPU interpreter (warp-specialised pipeline, TMA,
mbarriers, wgmma all simulated; operands the GPU reads transposed out of shared memory are
transposed in HBM there), and lower for `cuda` through the real Mosaic GPU pipeline with the
transposed reads and register layouts the GPU uses. On an H100 they also run compiled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_HOPPER
from close import assert_close
from pallas_kernels.grouped_matmul import (DEFAULT, GmmBlocks, check_shapes, grouped_matmul,
                                           loop_reference, reference)
from pallas_kernels.grouped_matmul import hopper_config as C

SMALL = GmmBlocks(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, grid_tile_width=1)
M, K, N = 256, 128, 128
# Uneven groups straddling tiles, an empty group, and rows past the last group (zero out).
SIZES = {"uneven_empty_tail": [60, 0, 70, 100], "one_group_all": [0, 256, 0, 0],
         "aligned": [64, 64, 64, 64]}


def _operands(dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (M, K), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (4, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
  dout = jax.random.normal(keys[2], (M, N), jnp.float32).astype(dtype)
  return lhs, rhs, dout


@pytest.mark.parametrize("sizes", [[60, 0, 70, 100, 26], [0, 256, 0, 0, 0], [0, 0, 0, 0, 256],
                                   [128, 0, 0, 0, 128], list(np.random.default_rng(0).multinomial(
                                       2000, [1 / 65] * 65))])
def test_each_row_is_stored_by_exactly_one_visit_of_its_group(sizes):
  """The visits' table (`RowTile.table`, computed before the kernel): every row of every group,
  the tail of rows past them included (the last entry), falls in exactly one visit of its own
  group, within cdiv(M, tile) + groups visits; the other visits store nothing."""
  tile, m = 128, sum(sizes)
  visits = -(-m // tile) + len(sizes) - 1
  t = C.RowTile.table(jnp.asarray(sizes), tile, visits)
  owner = np.full(m, -1)
  for group, block, start, size in zip(*(np.asarray(f) for f in t.fields())):
    rows = np.arange(block * tile + start, block * tile + start + size)
    assert (owner[rows] == -1).all()  # no row twice
    owner[rows] = group
  np.testing.assert_array_equal(owner, np.repeat(np.arange(len(sizes)), sizes))


@pytest.mark.parametrize("case", list(SIZES))
def test_values_match_ragged_dot_and_loop(case):
  lhs, rhs, _ = _operands()
  sizes = jnp.array(SIZES[case], jnp.int32)
  got = grouped_matmul(lhs, rhs, sizes, blocks=SMALL, interpret=True)
  assert got.dtype == jnp.bfloat16 and got.shape == (M, N)
  assert_close(f"{case} vs ragged_dot", got, reference(lhs, rhs, sizes), 1e-2)
  assert_close(f"{case} vs loop", got, loop_reference(lhs, rhs, sizes), 1e-2)
  if sum(SIZES[case]) < M:  # ragged_dot's contract: rows no group holds are zero
    assert not np.any(np.asarray(got[sum(SIZES[case]):], np.float32))


def test_gradients_match_ragged_dot():
  lhs, rhs, dout = _operands()
  sizes = jnp.array(SIZES["uneven_empty_tail"], jnp.int32)
  f = lambda a, b: grouped_matmul(a, b, sizes, blocks=SMALL, interpret=True)
  _, vjp = jax.vjp(f, lhs, rhs)
  dlhs, drhs = vjp(dout)
  f32 = lambda x: x.astype(jnp.float32)
  _, ref_vjp = jax.vjp(lambda a, b: reference(a, b, sizes), f32(lhs), f32(rhs))
  want_dlhs, want_drhs = ref_vjp(f32(dout))
  assert dlhs.dtype == drhs.dtype == jnp.bfloat16
  assert_close("dlhs", dlhs, want_dlhs, 1e-2)
  assert_close("drhs", drhs, want_drhs, 1e-2)
  assert not np.any(np.asarray(drhs[1], np.float32))  # the empty group's weights get zero


def test_widths_between_whole_tiles_values_and_gradients():
  """An output width that is not whole CUDA-block tiles runs as whole tiles plus a launch on
  64-column ones (384 = 256 + 128, as DeepSeek-V3's 1408 = 5 x 256 + 128), forward (N) and
  dlhs (K): ragged_dot's values and gradients."""
  blocks = dataclasses.replace(SMALL, tile_n=128)
  w = 384
  keys = jax.random.split(jax.random.key(1), 3)
  lhs = jax.random.normal(keys[0], (M, w), jnp.float32).astype(jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (4, w, w), jnp.float32) / np.sqrt(w)).astype(jnp.bfloat16)
  dout = jax.random.normal(keys[2], (M, w), jnp.float32).astype(jnp.bfloat16)
  sizes = jnp.array(SIZES["uneven_empty_tail"], jnp.int32)
  assert C.column_parts(w, blocks) == ((0, 256), (256, 128))
  out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, blocks=blocks, interpret=True),
                     lhs, rhs)
  f32 = lambda x: x.astype(jnp.float32)
  want, ref_vjp = jax.vjp(lambda a, b: reference(a, b, sizes), f32(lhs), f32(rhs))
  assert out.shape == (M, w)
  assert_close("forward", out, want, 1e-2)
  for name, got, ref in zip(("dlhs", "drhs"), vjp(dout), ref_vjp(f32(dout))):
    assert got.shape == ref.shape
    assert_close(name, got, ref, 1e-2)


def test_deepseek_width_runs_whole_tiles_and_a_narrow_launch():
  """DeepSeek-V3 16B's experts (2048 -> 1408): dlhs of the down product (1408 wide) launches on
  1280 columns of whole 128-column warpgroup tiles and 128 of 64-column ones, reading the
  weight stack where it lies: no padded copy of it (0.24 ms a layer on the H200)."""
  text = _lowered(1024, 1408, 2048, 8)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 4
  assert "tensor<1024x1280xbf16>" in text and "tensor<1024x128xbf16>" in text
  assert "stablehlo.pad" not in text and "1536" not in text


def _lowered(m, k, n, g, blocks=DEFAULT):
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

  def fwd_bwd(lhs, rhs, sizes, dout):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, blocks=blocks), lhs, rhs)
    return out, vjp(dout)

  return jax.jit(fwd_bwd).trace(spec(m, k), spec(g, k, n), jax.ShapeDtypeStruct((g,), jnp.int32),
                                spec(m, n)).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_for_hopper_at_the_moe_shape():
  # The expert shape (d_model 2048 -> d_ff 2048, 8 experts), 4096 rows.
  text = _lowered(4096, 2048, 2048, 8)
  # Forward, dlhs (rhs read transposed from shared memory) and drhs: three Mosaic GPU kernels;
  # no XLA matmul of any kind beside them.
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3, text[:2000]
  assert "ragged_dot" not in text and "dot_general" not in text


def test_shared_memory_budget_is_checked_when_lowering():
  too_big = GmmBlocks(tile_m=256, tile_n=128, tile_k=128, max_concurrent_steps=4)
  with pytest.raises(ValueError, match="shared memory"):
    check_shapes(jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
                 jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16),
                 jax.ShapeDtypeStruct((4,), jnp.int32), too_big)


@pytest.mark.parametrize("lhs, rhs, sizes, match", [
    ((256, 128), (4, 128, 128), (3,), "group_sizes must be int \\[4\\]"),
    ((256, 96), (4, 96, 128), (4,), "K=96 is not a multiple of 64"),
    ((256, 128), (4, 128, 96), (4,), "N=96 is not a multiple"),
    ((256, 128), (4, 64, 128), (4,), "disagree on the contraction"),
])
def test_bad_shapes_name_the_fix(lhs, rhs, sizes, match):
  s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  with pytest.raises(ValueError, match=match):
    check_shapes(s(lhs), s(rhs), s(sizes, jnp.int32), SMALL)


def test_fp32_operands_are_refused():
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  with pytest.raises(ValueError, match="model.dtype=bfloat16 or model.moe.gemm=tiled"):
    check_shapes(s((256, 128), jnp.float32), s((4, 128, 128), jnp.float32),
                 s((4,), jnp.int32), SMALL)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an H100 (sm_90)")
@pytest.mark.parametrize("case", list(SIZES))
def test_compiled_on_hopper(case):
  lhs, rhs, dout = _operands()
  lhs, rhs, dout = (jnp.tile(x, (8,) + (1,) * (x.ndim - 1)) if x.shape[0] == M else x
                    for x in (lhs, rhs, dout))
  sizes = jnp.array(SIZES[case], jnp.int32) * 8
  f = lambda a, b: grouped_matmul(a, b, sizes, blocks=SMALL)
  out, vjp = jax.vjp(f, lhs, rhs)
  f32 = lambda x: x.astype(jnp.float32)
  want, ref_vjp = jax.vjp(lambda a, b: reference(a, b, sizes), f32(lhs), f32(rhs))
  for name, got, ref in zip(("out", "dlhs", "drhs"), (out, *vjp(dout)),
                            (want, *ref_vjp(f32(dout)))):
    assert_close(name, got, ref, 1e-2)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an H100 (sm_90)")
def test_deepseek_width_compiled_on_hopper():
  """DeepSeek-V3 16B's 1408-wide products on the GPU (whole tiles and a 64-column launch,
  forward and dlhs; `hopper_config.column_parts`): ragged_dot's values and gradients."""
  keys = jax.random.split(jax.random.key(2), 3)
  m, k, n = 4096, 2048, 1408
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (8, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dout = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
  sizes = jnp.array([700, 0, 900, 300, 500, 600, 400, 600], jnp.int32)
  out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes), lhs, rhs)
  f32 = lambda x: x.astype(jnp.float32)
  want, ref_vjp = jax.vjp(lambda a, b: reference(a, b, sizes), f32(lhs), f32(rhs))
  for name, got, ref in zip(("out", "dlhs", "drhs"), (out, *vjp(dout)),
                            (want, *ref_vjp(f32(dout)))):
    assert_close(name, got, ref, 1e-2)


def test_benchmark_script_runs_its_kernel_table_on_cpu(tmp_path):
  # The GPU benchmark's plumbing (interpreted kernels, bf16 and FP8, tiled, ragged_dot, dense;
  # timings meaningless).
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "bench_moe_gpu.md"
  proc = subprocess.run([sys.executable, "scripts/bench_moe_gpu.py", "--quick", "--part",
                         "kernels", "--out", str(out)], cwd=root, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  table = (tmp_path / "bench_moe_gpu_kernels.md").read_text()
  for impl in ("pallas default", "pallas FP8 rows", "tiled (XLA)", "ragged_dot",
               "dense (same FLOPs)"):
    assert f"| {impl} |" in table
  assert "failed" not in table
