"""`model.moe.gemm`: the Hopper grouped matmul kernel (interpreted on CPU) and the tiled XLA
one inside the MoE layer against ragged_dot, what `auto` picks and why, bad choices refused
before compile, and the dispatch's data movement (gathers both ways: no scatter-add of token
rows in the step)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from close import assert_close
from conftest import small_config
from jscale import runtime
from jscale.config import ConfigError
from jscale.model import moe_dispatch as md
from jscale.model import moe_gemm
from jscale.model.moe_gemm import GroupedDot

E, D, F, T, K = 4, 128, 128, 64, 2


def _inputs(dtype=jnp.bfloat16, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (T, D), jnp.float32).astype(dtype)
  w = md.ExpertWeights(*(jax.random.normal(k, s, jnp.float32) / np.sqrt(s[1])
                         for k, s in zip(keys[1:4], ((E, D, F), (E, D, F), (E, F, D)))))
  # Skewed routing: expert 3 never chosen (an empty group), expert 0 most.
  logits = jax.random.normal(keys[4], (T, E)) + jnp.array([2.0, 1.0, 0.5, -1e9])
  top, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
  return x, ids, top / top.sum(-1, keepdims=True), w


@pytest.mark.parametrize("gemm,y_tol,grad_tol", [
    (GroupedDot("pallas", interpret=True), 2e-2, 3e-2), (GroupedDot("tiled"), 1e-2, 2e-2)],
    ids=["pallas", "tiled"])
def test_experts_match_ragged_dot_values_and_gradients(gemm, y_tol, grad_tol):
  """The MoE layer (bf16) with the Hopper kernel (interpreted) or the tiled XLA matmul against
  XLA's ragged_dot."""
  x, ids, gates, w = _inputs()
  assert not np.any(np.asarray(ids) == 3)

  def loss(gemm):
    def f(x, gates, w):
      y = md.dropless(x, ids, gates, w, jnp.bfloat16, gemm)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
    return jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))

  (_, y), grads = loss(gemm)(x, gates, w)
  (_, y_ref), grads_ref = loss(GroupedDot("ragged_dot"))(x, gates, w)
  assert_close("y", y, y_ref, y_tol)
  for name, g, r in zip(("dx", "dgates", "dw_gate", "dw_up", "dw_down"),
                        jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert_close(name, g, r, grad_tol)
  assert not np.any(np.asarray(grads[2].gate_EDF[3]))  # the unchosen expert's weights: zero


def test_dispatch_moves_rows_by_gathers_only():
  # The permutation into expert order and back are gathers with gather transposes: the only
  # scatters left in the differentiated step are of int32 indices (the sort's inverse and the
  # group sizes), never of [tokens, D] activations or their fp32 sum.
  x, ids, gates, w = _inputs(jnp.float32)
  f = lambda x, g, w: jnp.sum(md.dropless(x, ids, g, w, jnp.bfloat16).astype(jnp.float32))
  text = jax.jit(jax.grad(f, (0, 1, 2))).lower(x, gates, w).as_text()
  scatters = re.findall(r'"stablehlo.scatter".*?\}\) : \(tensor<([^>]*)>', text, re.S)
  assert scatters and all(s.endswith("i32") for s in scatters), scatters


def test_auto_picks_the_kernel_on_hopper_where_it_tiles():
  assert moe_gemm.auto_gemm(jnp.bfloat16, 2048, 2048, 8, "9.0") == (
      "pallas", "Hopper (sm_90): Mosaic GPU grouped matmul")
  impl, why = moe_gemm.auto_gemm(jnp.bfloat16, 2048, 2048, 8, "8.0")
  assert impl == "tiled" and "for Hopper" in why and "8x the FLOPs" in why
  impl, why = moe_gemm.auto_gemm(jnp.float32, 2048, 2048, 8, "9.0")
  assert impl == "tiled" and "bf16 or fp16" in why
  impl, why = moe_gemm.auto_gemm(jnp.bfloat16, 2048, 96, 8, "9.0")
  assert impl == "tiled" and "not a multiple" in why
  assert moe_gemm.for_model("auto", jnp.bfloat16, 2048, 2048, 8) == GroupedDot("tiled")


MOE = ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_ff=128", "mesh.data=1")


def test_runtime_reports_what_the_experts_run():
  cfg = small_config(None, *MOE)
  rt = runtime.build(cfg, jax.devices()[:1])
  impl, why = rt.kernels.moe_gemm
  assert impl == "tiled" and "compute capability None" in why
  assert rt.cfg.model.moe.gemm == "tiled"  # resolved for the mesh's devices, not the process's
  cfg = small_config(None, *MOE, "model.moe.dispatch=capacity")
  assert runtime.moe_gemm(cfg, rt.mesh)[0] == ""


@pytest.mark.parametrize("overrides, match", [
    (("model.moe.gemm=pallas",), r"model.moe.gemm=pallas cannot run on backend 'cpu'"),
    (("model.moe.gemm=pallas", "model.kernel_interpret=true"),
     r"model.moe.gemm=pallas cannot run this MoE .*model.dtype=float32.*bf16 or fp16"),
    (("model.moe.gemm=pallas", "model.kernel_interpret=true", "model.dtype=bfloat16",
      "model.moe.d_ff=96"), r"expert width 96 per device.*not a multiple"),
    (("model.moe.gemm=pallas", "model.kernel_interpret=true", "model.dtype=bfloat16",
      "train.remat=full"), r"train.remat=full.*set train.remat=none"),
])
def test_bad_gemm_choices_fail_before_compile(overrides, match):
  with pytest.raises(ConfigError, match=match):
    runtime.build(small_config(None, *MOE, *overrides), jax.devices()[:1])


def test_one_device_xla_mode_runs_the_sorted_grouped_matmul():
  # No GShard slot buffer (dropless C = T: E / K times the products) on a single device.
  cfg = small_config(None, *MOE, "parallel.collectives=xla")
  rt = runtime.build(cfg, jax.devices()[:1])
  from jscale.analysis import introspect  # pylint: disable=import-outside-toplevel
  text = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(rt.cfg)).as_text()
  t, d = cfg.train.batch_size * cfg.train.seq_len, cfg.model.d_model
  assert "stablehlo.sort" in text  # the assignments sorted by expert
  assert f"x{E}x{t}x{d}x" not in text and f"<{E}x{t}x{d}x" not in text  # no [G, E, C = T, D]


@pytest.mark.parametrize("layout", [("mesh.data=2", "mesh.fsdp=2", "parallel.zero_stage=3")])
def test_xla_data_parallel_dropless_runs_per_device_and_matches_one_device(layout):
  # Experts not split (mesh.expert = tensor = 1): each device sorts and multiplies its own
  # token groups in a shard_map; no [G, E, C = T, D] slot buffer, and one device's losses.
  import parity  # pylint: disable=import-outside-toplevel
  from jscale.analysis import introspect  # pylint: disable=import-outside-toplevel
  moe = ("model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=32")
  overrides = (*moe, "parallel.collectives=xla", *layout)
  got = parity.losses(overrides, jax.devices()[:4])
  np.testing.assert_allclose(got, parity.reference(*moe), rtol=1e-4)
  cfg = small_config(None, *overrides)
  rt = runtime.build(cfg, jax.devices()[:4])
  text = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(rt.cfg)).as_text()
  t = cfg.train.batch_size * cfg.train.seq_len // 4
  assert f"x8x{t}x{cfg.model.d_model}x" not in text and "stablehlo.sort" in text


def test_moe_layer_with_the_kernel_lowers_for_hopper():
  # The model's path (MoE module -> seam -> GroupedDot -> kernels) compiled for a GPU: forward
  # gate / up / down, their dx and dW — nine Mosaic GPU kernels, no XLA grouped matmul left.
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jscale.model.moe import MoE  # pylint: disable=import-outside-toplevel
  from jscale.model.seam import LOCAL  # pylint: disable=import-outside-toplevel
  cfg = small_config(None, "model.preset=tiny_moe", "model.dtype=bfloat16", "model.d_model=256",
                     "model.moe.d_ff=256", "model.moe.gemm=pallas").model
  graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0)))

  def loss(state, h):
    y, stats = nnx.merge(graphdef, state)(h, LOCAL)
    return jnp.sum(y.astype(jnp.float32)) + stats["aux_loss"]

  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  text = jax.jit(jax.grad(loss, (0, 1))).trace(
      jax.tree.map(spec, state), jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 9
  assert "chlo.ragged_dot" not in text and "stablehlo.ragged_dot" not in text
