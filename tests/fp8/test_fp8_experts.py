"""FP8 experts (`fp8.targets: [experts]`, `jscale.fp8.grouped`): the tiled grouped matmul's
products with e4m3 / e5m2 operands and a scale per expert, against the same products
dequantised (exact), against the bf16-free reference (FP8's rounding only), per-expert
scales against a tensor-wide one, FP8 operands in the lowered step of the tiny DeepSeek and in
XLA:GPU's H100 program, expert parallelism against one device, and the refusals; the same for
a scale per row of every operand (`fp8.experts_scaling: row`, all e4m3). The 200-step
loss beside bf16 (8 seeds; a CI test of one seed took 11 minutes here and would bound little:
single seeds' pairs differ by up to 7% at the config's lr 3e-3, under 1% at 1e-3):
scripts/fp8_experts.py [--lr 1e-3] -> results/fp8_experts_loss.md."""

import re

import deepseek_case
import jax
import jax.numpy as jnp
import numpy as np
import parity
import pytest
from conftest import small_config

from jscale import runtime
from jscale.analysis import dots, gpu_target, introspect
from jscale.analysis.introspect import abstract_batch
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.fp8 import grouped, scaling
from jscale.model import grouped_tiles

A, K, N = 96, 64, 48
SIZES = np.array([30, 20, 0, 40])  # expert 2 gets no rows; 6 rows past the groups
STARTS = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
# Expert 1's weights 10^5 times smaller than expert 2's: a tensor-wide e4m3 scale flushes them.
MAGNITUDE = np.array([1.0, 1e-4, 10.0, 1.0])
TILE = 16


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(A, K)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, K, N)) * MAGNITUDE[:, None, None], jnp.float32)
  return x, w, jnp.asarray(SIZES, jnp.int32), jnp.asarray(rng.normal(size=(A, N)), jnp.float32)


def _dot(products):
  return lambda x, w, sizes: grouped_tiles.grouped_dot(x, w, sizes, jnp.float32, tile=TILE,
                                                       products=products)


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_forward_is_the_dequantised_product_exactly(case):
  x, w, sizes, _ = case
  y = _dot(grouped.tile_products)(x, w, sizes)
  for e, (s, n) in enumerate(zip(STARTS, SIZES)):
    if n:
      xe, we = x[s:s + n], w[e]
      sx = scaling.scale_for(jnp.max(jnp.abs(xe)), scaling.E4M3)
      sw = scaling.scale_for(jnp.max(jnp.abs(we)), scaling.E4M3)
      want = (scaling.dequantize(scaling.quantize(xe, sx, scaling.E4M3), sx, jnp.float32) @
              scaling.dequantize(scaling.quantize(we, sw, scaling.E4M3), sw, jnp.float32))
      np.testing.assert_allclose(y[s:s + n], want, rtol=1e-5, atol=1e-6 * float(jnp.abs(
          want).max()))
  assert float(jnp.abs(y[SIZES.sum():]).max()) == 0.0  # rows past the groups


def test_values_and_gradients_within_fp8_rounding_of_the_reference(case):
  x, w, sizes, c = case
  loss = lambda products: lambda x, w: jnp.sum(_dot(products)(x, w, sizes) * c)
  (l8, (dx8, dw8)) = jax.value_and_grad(loss(grouped.tile_products), (0, 1))(x, w)
  (l, (dx, dw)) = jax.value_and_grad(loss(None), (0, 1))(x, w)
  y8, y = _dot(grouped.tile_products)(x, w, sizes), _dot(None)(x, w, sizes)
  for e, (s, n) in enumerate(zip(STARTS, SIZES)):
    if n:  # every expert alike, whatever its magnitude: e4m3 forward, e5m2 gradients
      assert _rel(y8[s:s + n], y[s:s + n]) < 0.06
      assert _rel(dx8[s:s + n], dx[s:s + n]) < 0.1
      assert _rel(dw8[e], dw[e]) < 0.1
  assert float(jnp.abs(dw8[2]).max()) == 0.0  # no rows, no gradient
  assert abs(float(l8 - l)) < 0.06 * float(jnp.abs(y * c).sum())


def test_a_scale_per_expert_keeps_what_a_tensor_wide_scale_flushes(case):
  _, w, _, _ = case
  per_expert = grouped.expert_scales(w, jnp.arange(4), 4, scaling.E4M3)
  whole = scaling.scale_for(jnp.max(jnp.abs(w)), scaling.E4M3)
  back = lambda s: scaling.dequantize(scaling.quantize(w[1], s, scaling.E4M3), s, jnp.float32)
  assert _rel(back(per_expert[1]), w[1]) < 0.05
  assert _rel(back(whole), w[1]) > 0.5  # mostly flushed to zero


DEEPSEEK = ["model.dtype=bfloat16", "fp8.enabled=true", "fp8.targets=[experts]",
            "train.seq_len=32", "train.batch_size=2", "model.n_layers=2"]


def test_the_routed_experts_take_fp8_operands_in_the_lowered_step():
  cfg = load_config("configs/deepseek_v3_tiny.yaml", DEEPSEEK)
  rt = runtime.build(cfg, jax.devices()[:1])
  found = dots.dot_generals(rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)))
  f8 = [d for d in found if any(t.startswith("f8") for t in d.operands)]
  # One MoE layer (the first is dense), main model and MTP module share the layer code:
  # [gate | up] (one product) and down, each forward, dx and dw, in cuBLASLt's three FP8 pairs.
  assert {d.operands for d in f8} == {("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"),
                                      ("f8E4M3FN", "f8E5M2")}
  assert len(f8) % 6 == 0 and f8, found
  assert all("grouped_tiles" in d.location for d in f8)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.gemm=pallas"], "set fp8.experts_scaling=row, or model.moe.gemm=tiled"),
    (["model.moe.gemm=ragged_dot"], "ragged_dot takes no FP8 scales"),
    (["model.moe.dispatch=capacity"], "set model.moe.dispatch=dropless"),
    (["fp8.targets=[experts,mlp]"], "set fp8.recipe=current"),
])
def test_fp8_experts_refusals_name_the_key_and_the_fix(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config("configs/deepseek_v3_tiny.yaml", [*DEEPSEEK, *overrides])


@pytest.mark.parametrize("expert", ["2", "-1"])  # -1: the axis takes the devices left
def test_fp8_experts_on_xla_split_experts_are_refused_on_the_mesh(expert):
  cfg = load_config("configs/deepseek_v3_tiny.yaml", [*DEEPSEEK, "mesh.data=1",
                                                       f"mesh.expert={expert}"])
  with pytest.raises(ConfigError, match="slot buffer.*set parallel.collectives=manual"):
    runtime.build(cfg, jax.devices()[:2])


def test_fp8_experts_need_experts():
  with pytest.raises(ConfigError, match=r"fp8.targets=\[experts\] needs routed experts"):
    small_config(None, "fp8.enabled=true", "fp8.targets=[experts]")


def test_fp8_experts_under_expert_parallelism_match_one_device():
  """Manual EP over 2 devices against one: each expert's rows all reach its device, so its
  scales are the single device's (2 steps' loss and gradient norm, `tests/parity.py`)."""
  ds = (*deepseek_case.DS, "train.batch_size=8", "train.seq_len=16", "fp8.enabled=true",
        "fp8.targets=[experts]")
  want = parity.losses((*ds, "mesh.data=1"), jax.devices()[:1], 2)
  got = parity.losses((*ds, "mesh.data=1", "mesh.expert=2", "parallel.collectives=manual"),
                      jax.devices()[:2], 2)
  np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.skipif(not gpu_target.available(), reason="needs JAX's CUDA plugin and cuDNN to "
                    "compile for GPUs: pip install -e '.[gpu-compile]' (.ci/run does)")
def test_xla_gpu_keeps_the_expert_products_fp8_on_an_h100():
  """The step compiled for an H100 as the trainer launches it: every routed-expert product a
  gemm on FP8 operands (Triton's, in XLA's deviceless compile), none upcast."""
  cfg = load_config("configs/deepseek_v3_tiny.yaml", DEEPSEEK)
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices("h100x1"))
  # The tiles' products are batched (T, M, K); the 2-D one sums each expert's tiles' dW.
  products = [d for d in dots.compiled_dots(compiled)
              if "grouped_tiles" in d.location and d.lhs_shape.count("x") == 2]
  assert len(products) >= 12 and all(d.lhs.startswith("f8") and d.rhs.startswith("f8")
                                     for d in products), products
  # XLA may swap a product's operands: e5m2 gradients against e4m3 weights or activations
  assert {tuple(sorted((d.lhs, d.rhs))) for d in products} == {("f8e4m3fn", "f8e4m3fn"),
                                                               ("f8e4m3fn", "f8e5m2")}
  # The tiles' FP8 weights are gathered as 32-bit words (`grouped._weights_per_tile`): one
  # byte at a time, the H200 ran the 16B proxy's at ~5% of its bandwidth.
  gathered = re.findall(r"= (\w+)\[[\d,]*\][^ ]* gather\(", compiled.as_text())
  assert "u32" in gathered and not {"u8", "f8e4m3fn", "f8e5m2"} & set(gathered), gathered



# fp8.experts_scaling: row (`grouped.row_products`): a scale per row of every operand, all e4m3.

def _q(x, scale):
  """x quantised to e4m3 with `scale` (broadcast) and back, in fp32."""
  return (x / scale).astype(scaling.E4M3).astype(jnp.float32) * scale


def _row_scale(x, axis):
  return scaling.scale_for(jnp.max(jnp.abs(x), axis=axis, keepdims=True), scaling.E4M3)


def test_row_scaling_is_its_dequantised_products_exactly(case):
  x, w, sizes, c = case
  y, pull = jax.vjp(lambda x, w: _dot(grouped.row_products)(x, w, sizes), x, w)
  dx, dw = pull(c)
  for e, (s, n) in enumerate(zip(STARTS, SIZES)):
    if not n:
      continue
    xe, we, ge = x[s:s + n], w[e], c[s:s + n]
    close = lambda got, want: np.testing.assert_allclose(
        got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
    # forward: x per token, w per output column; dx: g per token, w per input row; dw: x and
    # g per column over the expert's rows
    close(y[s:s + n], _q(xe, _row_scale(xe, 1)) @ _q(we, _row_scale(we, 0)))
    close(dx[s:s + n], _q(ge, _row_scale(ge, 1)) @ _q(we, _row_scale(we, 1)).T)
    close(dw[e], _q(xe, _row_scale(xe, 0)).T @ _q(ge, _row_scale(ge, 0)))
  assert float(jnp.abs(y[SIZES.sum():]).max()) == 0.0
  assert float(jnp.abs(dw[2]).max()) == 0.0  # no rows, no gradient


def test_row_scaling_keeps_small_rows_and_rounds_gradients_finer(case):
  x, w, sizes, c = case
  # Every other token 10^-6 of its neighbours: past e4m3's range under its expert's scale.
  small = np.arange(A) % 2 == 1
  x = x * jnp.asarray(np.where(small, 1e-6, 1.0), jnp.float32)[:, None]
  y = _dot(None)(x, w, sizes)
  rows = slice(0, int(SIZES.sum()))
  row_err = lambda p: (jnp.linalg.norm(_dot(p)(x, w, sizes) - y, axis=1) /
                       jnp.linalg.norm(y, axis=1))[rows][small[rows] & (y[rows] != 0).any(1)]
  assert float(row_err(grouped.tile_products).min()) == 1.0  # flushed to zero
  assert float(row_err(grouped.row_products).max()) < 0.07
  # Gradients: e4m3 (3 mantissa bits) against e5m2's 2.
  loss = lambda products: lambda x, w: jnp.sum(_dot(products)(x, w, sizes) * c)
  ref = jax.grad(loss(None), (0, 1))(x, w)
  err = {p: [_rel(a, b) for a, b in zip(jax.grad(loss(p), (0, 1))(x, w), ref)]
         for p in (grouped.tile_products, grouped.row_products)}
  for row, expert in zip(err[grouped.row_products], err[grouped.tile_products]):
    assert row < 0.75 * expert, err


def test_row_scaling_takes_e4m3_operands_in_every_expert_product():
  cfg = load_config("configs/deepseek_v3_tiny.yaml", [*DEEPSEEK, "fp8.experts_scaling=row"])
  rt = runtime.build(cfg, jax.devices()[:1])
  found = dots.dot_generals(rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)))
  f8 = [d for d in found if any(t.startswith("f8") for t in d.operands)]
  assert {d.operands for d in f8} == {("f8E4M3FN", "f8E4M3FN")}
  assert len(f8) % 6 == 0 and f8  # [gate | up] and down: forward, dx and dW each
