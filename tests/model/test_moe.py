"""Mixture of experts: routing and dispatch against plain references, router losses against
their formulas, expert parallelism (both modes) against one device, and what communicates."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parity
from conftest import small_config
from jscale import runtime
from jscale.analysis import hlo, introspect
from jscale.step import state as state_lib
from jscale.convert import hf_config
from jscale.config import ConfigError, MoeConfig
from jscale.model import moe as moe_lib
from jscale.model import moe_dispatch as md
from jscale.model.layers import param
from jscale.parallel.comms import LOCAL

MOE = ("model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=64")


def _inputs(t=24, d=16, f=12, e=4, k=2, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  logits = jnp.asarray(rng.normal(size=(t, e)) * 2, jnp.float32)
  gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
                    for s in ((e, d, f), (e, d, f), (e, f, d)))
  w = md.ExpertWeights(jnp.stack([gate, up], axis=2), down)
  _, ids, gates = moe_lib.route(logits[None], k)
  return x, ids[0], gates[0], w, logits


def _reference(x, ids, gates, w, kept=None):
  """y_t = Σ_k gate_tk · expert_{e_tk}(x_t) (kept: drop mask): every expert on every token,
  then each token's k outputs picked and weighted (dense, no dispatch)."""
  h_TEF = (jax.nn.silu(jnp.einsum("TD,EDF->TEF", x, w.gate_up_EDXF[:, :, 0])) *
           jnp.einsum("TD,EDF->TEF", x, w.gate_up_EDXF[:, :, 1]))
  y_TED = jnp.einsum("TEF,EFD->TED", h_TEF, w.down_EFD)
  picked_TKD = jnp.take_along_axis(y_TED, jnp.asarray(ids)[:, :, None], axis=1)
  weight_TK = gates if kept is None else jnp.where(kept, gates, 0.0)
  return jnp.einsum("TK,TKD->TD", weight_TK, picked_TKD)


def test_route_is_renormalised_softmax_top_k():
  x, ids, gates, w, logits = _inputs()
  probs = np.asarray(jax.nn.softmax(logits, -1))
  want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :2]
  np.testing.assert_array_equal(np.sort(ids, 1), np.sort(want_ids, 1))
  top = np.take_along_axis(probs, np.asarray(ids), 1)
  np.testing.assert_allclose(gates, top / top.sum(1, keepdims=True), rtol=1e-6)


def test_dropless_values_and_grads_equal_per_token_reference():
  x, ids, gates, w, _ = _inputs()
  # Jitted, as in a step (eagerly each of dispatch's many ops would compile on its own).
  dropless = jax.jit(lambda x, w: md.dropless(x, ids, gates, w, jnp.float32))
  np.testing.assert_allclose(dropless(x, w), _reference(x, ids, gates, w), rtol=1e-5, atol=1e-5)
  loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))
  g = jax.jit(jax.grad(loss(dropless), (0, 1)))(x, w)
  r = jax.grad(loss(lambda x, w: _reference(x, ids, gates, w)), (0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_shared_expert_adds_a_dense_swiglu():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  cfg = small_config(None, *MOE, "model.moe.shared_d_ff=32").model
  block = moe_lib.MoE(cfg, nnx.Rngs(params=0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 64)), jnp.float32)
  y, _ = block(x, LOCAL)
  logits = jnp.einsum("TD,DE->TE", x.reshape(16, 64), block.router[...])
  _, ids, gates = moe_lib.route(logits[None], 2)
  w = md.ExpertWeights(block.w_gate_up[...], block.w_down[...])
  shared = (jax.nn.silu(x @ block.shared_gate[...]) * (x @ block.shared_up[...])
            ) @ block.shared_down[...]
  want = _reference(x.reshape(16, 64), ids[0], gates[0], w).reshape(2, 8, 64) + shared
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_gate_and_up_are_one_parameter_the_grouped_matmul_reads_whole():
  """The experts' gate and up are one [E, D, 2, F] parameter, drawn as the two matrices were
  (gate, then up): its [E, D, 2F] view is the [gate | up] operand of one grouped matmul, so
  the layer's forward and backward concatenate no expert weights (a copy per use before)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  cfg = small_config(None, *MOE).model
  block = moe_lib.MoE(cfg, nnx.Rngs(params=0))
  e, d, f = 8, cfg.d_model, 64
  rngs = nnx.Rngs(params=0)
  router = param(rngs, (d, e), ("embed", "router"), cfg.init_std, jnp.float32)
  gate, up = (param(rngs, (e, d, f), ("x",) * 3, cfg.init_std, jnp.float32)[...]
              for _ in range(2))
  np.testing.assert_array_equal(block.router[...], router[...])
  np.testing.assert_array_equal(block.w_gate_up[...], jnp.stack([gate, up], axis=2))
  graphdef, params = nnx.split(block)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, d)), jnp.float32)
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x, LOCAL)[0])
  text = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).as_text()
  weights = (f"tensor<{e}x{d}x{f}x", f"tensor<{e}x{d}x2x{f}x", f"tensor<{e}x{f}x{d}x")
  concats = [ln for ln in text.splitlines() if "stablehlo.concatenate" in ln]
  assert not [c for c in concats if any(w in c for w in weights)], concats
  assert f"tensor<{e}x{d}x{2 * f}xf32>" in text  # the [gate | up] operand


def _numpy_kept(ids, e, cap):
  """Drops by hand: first choices of every token in token order, then second choices."""
  ids = np.asarray(ids)
  used, kept = np.zeros(e, int), np.zeros(ids.shape, bool)
  for j in range(ids.shape[1]):
    for t in range(ids.shape[0]):
      if used[ids[t, j]] < cap:
        kept[t, j] = True
        used[ids[t, j]] += 1
  return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_exactly_the_reference_overflow(factor):
  x, ids, gates, w, _ = _inputs(seed=1)
  cap = md.capacity(24, 2, 4, factor)
  assert cap == min(24, int(np.ceil(factor * 24 * 2 / 4)))
  kept = _numpy_kept(ids, 4, cap)
  np.testing.assert_array_equal(np.asarray(md.slots(ids, 4)) < cap, kept)
  y, dropped = md.with_capacity(x, ids, gates, w, jnp.float32, factor)
  assert int(dropped) == (~kept).sum() and (factor < 1.25) == bool((~kept).any())
  np.testing.assert_allclose(y, _reference(x, ids, gates, w, kept), rtol=1e-5, atol=1e-5)


def test_router_losses_equal_their_formulas():
  _, ids, _, _, logits = _inputs()
  probs = jax.nn.softmax(logits, -1)
  got = moe_lib.router_losses(logits[None], probs[None], ids[None], LOCAL)
  p, i, lg = np.asarray(probs, np.float64), np.asarray(ids), np.asarray(logits, np.float64)
  f = np.bincount(i.ravel(), minlength=4) / i.size
  np.testing.assert_allclose(got["expert_load"], f, rtol=1e-6)
  np.testing.assert_allclose(got["aux_loss"], 4 * np.sum(f * p.mean(0)), rtol=1e-6)
  lse = np.log(np.exp(lg).sum(1))
  np.testing.assert_allclose(got["z_loss"], np.mean(lse ** 2), rtol=1e-6)
  # Perfect balance gives 1: uniform probabilities and loads.
  flat = jnp.zeros((1, 8, 4))
  even = jnp.asarray([[0, 1], [2, 3]] * 4)[None]
  assert float(moe_lib.router_losses(flat, jax.nn.softmax(flat), even, LOCAL)["aux_loss"]) == \
      pytest.approx(1.0)


# Dropless expert parallelism reproduces one device's first losses. In each mode: one local
# expert (ep=8) and several (ep=2), with data, tensor (+SP), ZeRO and gradient accumulation;
# xla mode also ep=4 and the shared expert. scripts/sweep_moe.py runs more combinations.
EP_CASES = [("xla", 8, ()), ("xla", 4, ("model.moe.shared_d_ff=32",)),
            ("xla", 2, ("mesh.data=2",)),
            ("xla", 2, ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=1")),
            ("manual", 8, ()),
            ("manual", 2, ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=3")),
            ("manual", 2, ("train.microbatches=2",)),
            ("manual", 2, ("mesh.tensor=2", "mesh.data=2", "parallel.sequence_parallel=true"))]


def ep_overrides(mode, ep, extra):
  """(the layout's overrides, the devices it needs, the reference's overrides); shared with
  scripts/sweep_moe.py."""
  data = () if any(e.startswith("mesh.data") for e in extra) else ("mesh.data=1",)
  n = ep * int(np.prod([int(e.split("=")[1]) for e in extra if e.startswith("mesh.")]))
  # Model and numerics overrides apply to the reference too.
  same = tuple(e for e in extra if e.startswith(("model.", "train.")))
  layout = (*MOE, f"mesh.expert={ep}", f"parallel.collectives={mode}", *data, *extra)
  return layout, n, (*MOE, *same)


def ep_id(mode, ep, extra):
  return f"{mode}-ep{ep}-" + "-".join(o.split(".")[-1] for o in extra)


@pytest.mark.parametrize("mode,ep,extra", EP_CASES, ids=[ep_id(*c) for c in EP_CASES])
def test_expert_parallel_losses_equal_one_device(mode, ep, extra):
  overrides, n, ref = ep_overrides(mode, ep, extra)
  got = parity.losses(overrides, jax.devices()[:n])
  np.testing.assert_allclose(got, parity.reference(*ref), rtol=1e-4)


def _a2a_bytes(*overrides):
  cfg = small_config(None, *MOE, "mesh.data=1", "parallel.collectives=manual", *overrides)
  rt = runtime.build(cfg, jax.devices()[:4])
  params = rt.abstract_state()["params"]
  text = rt.eval_step().lower(params, introspect.abstract_batch(cfg)).compile().as_text()
  stats = hlo.summary(text)
  return stats, cfg


def test_manual_ep_all_to_all_moves_tokens_not_weights():
  # Capacity factor 1: each direction sends exactly the local tokens' k rows (one forward).
  stats, cfg = _a2a_bytes("mesh.expert=4", "model.moe.dispatch=capacity",
                          "model.moe.capacity_factor=1.0")
  tokens = cfg.train.batch_size * cfg.train.seq_len // 4
  want = cfg.model.n_layers * 2 * tokens * cfg.model.d_model * 2 * 4  # k=2, fp32
  assert abs(stats["all-to-all"]["bytes"] - want) <= 0.1 * want
  assert "all-gather" not in stats  # expert weights stay where they are
  # Dropless pads each destination's block to the most it can receive, T·min(k, E_l) rows:
  # n_ep·min(k, E_l)/k = 4x the minimum here (plus the per-expert counts).
  stats, _ = _a2a_bytes("mesh.expert=4")
  assert abs(stats["all-to-all"]["bytes"] - 4 * want) <= 0.1 * 4 * want
  assert "all-gather" not in stats


@pytest.mark.parametrize("layout,n", [((), 1), (("model.moe.dispatch=capacity",), 1),
                                      (("mesh.expert=2", "parallel.collectives=manual"), 2)],
                         ids=["dropless", "capacity", "manual-ep2"])
def test_selective_remat_reruns_no_expert_matmul_or_all_to_all(layout, n):
  """`remat: selective` keeps the experts' input rows, gate, up and output (`moe_in`,
  `mlp_gate`, `mlp_up`, `moe_out`; manual EP's exchanged counts, `moe_counts`): the backward
  reruns the router and the sort, but no expert matmul and no all-to-all, as with no remat (full remat reruns both). Before, an MoE
  layer saved nothing of its experts and recomputed their whole forward."""
  counts = {}
  for remat in ("none", "selective", "full"):
    # ragged_dot: the expert products are their own primitive, counted apart from the rest.
    cfg = small_config(None, *MOE, "model.dtype=bfloat16", "mesh.data=1", f"train.remat={remat}",
                       "model.attention_impl=pallas", "model.kernel_interpret=true",
                       "model.moe.gemm=ragged_dot", *layout)
    rt = runtime.build(cfg, jax.devices()[:n])
    text = str(jax.make_jaxpr(rt.train_step())(rt.abstract_state(),
                                               introspect.abstract_batch(cfg)))
    counts[remat] = (text.count("ragged_dot_general["), text.count("dot_general["),
                     text.count("all_to_all["))
  # The router's fp32 product is the one matmul rerun (the attention is a kernel, its forward
  # saved).
  router = (0, 1, 0)
  assert counts["selective"] == tuple(map(sum, zip(counts["none"], router))), counts
  assert counts["full"] > counts["selective"], counts


@pytest.mark.parametrize("mode,schedule,extra", [("manual", "1f1b", ("mesh.expert=2",)),
                                                  ("xla", "zero_bubble", ())])
def test_moe_in_a_pipeline_matches_one_device(mode, schedule, extra):
  # Each chunk's router losses join the objective through its own backward (their cotangent
  # is the loss weight); statistics are summed over stages. Micro-batches split as
  # train.microbatches does, so the reference accumulates the same two.
  pp = ("mesh.stage=2", "pipeline.microbatches=2", f"pipeline.schedule={schedule}",
        "mesh.data=1")
  n = 2 * (2 if extra else 1)
  got = parity.losses((*MOE, *pp, f"parallel.collectives={mode}", *extra), jax.devices()[:n])
  np.testing.assert_allclose(got, parity.reference(*MOE, "train.microbatches=2"), rtol=1e-4)


# lr 1e-4: at the default 3e-3, Adam's first update (~lr * sign(g)) turns last-bit differences
# of near-zero gradient entries into 7e-4 of step-4 grad norm, the same for every parallel
# layout (xla, manual, EP x DP, EP x ZeRO-3 measured identical) against one device; at 1e-4
# all agree to 1e-6.
EVERY2 = (*MOE, "model.moe.every=2", "model.n_layers=4", "train.lr=1e-4")


def test_moe_every_other_layer_stacks_groups_and_matches_one_device():
  cfg = small_config(None, *EVERY2)
  blocks = jax.eval_shape(lambda: state_lib.init_state(cfg))["params"]["blocks"]
  # 2 groups of (1 dense layer, 1 MoE layer).
  assert blocks["dense"]["mlp"]["w_gate"].shape == (2, 1, 64, 128)
  assert blocks["moe_block"]["mlp"]["w_gate_up"].shape == (2, 8, 64, 2, 64)
  got = parity.losses((*EVERY2, "mesh.expert=2", "mesh.fsdp=2", "parallel.zero_stage=3",
                       "mesh.data=1", "parallel.collectives=manual"), jax.devices()[:4])
  np.testing.assert_allclose(got, parity.reference(*EVERY2), rtol=1e-4)
  with pytest.raises(ConfigError, match="model.moe.every=2: Mixtral has experts in every"):
    hf_config.config_to_hf(cfg.model, dtype="float32")


def test_preset_moe_keys_merge_with_overrides():
  cfg = small_config(None, "model.preset=tiny_moe", "model.moe.dispatch=capacity")
  assert (cfg.model.moe.d_ff, cfg.model.moe.dispatch) == (384, "capacity")


@pytest.mark.parametrize("overrides,match", [
    (("mesh.expert=2", "mesh.data=1"), r"mesh.expert=2 needs an MoE model"),
    ((*MOE, "mesh.expert=3", "mesh.data=1", "train.batch_size=6"), r"not divisible by mesh.expert=3"),
    ((*MOE, "model.moe.dispatch=sparse", "mesh.data=1"),
     r"model.moe.dispatch='sparse': choose one of dropless, capacity"),
    (("model.moe.n_experts=2", "model.moe.top_k=3", "mesh.data=1"), r"1 <= top_k <= n_experts"),
    ((*MOE, "model.moe.every=3", "mesh.data=1"), r"must be >= 1 and divide model.n_layers=2"),
])
def test_bad_moe_configs_fail_before_compile(overrides, match):
  n = int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")]))
  with pytest.raises(ConfigError, match=match):
    runtime.build(small_config(None, *overrides), jax.devices()[:n])


def test_moe_config_defaults_are_mixtral_routing():
  assert (MoeConfig().top_k, MoeConfig().dispatch) == (2, "dropless")


def test_moe_trains_and_logs_router_metrics(tmp_path, data_cache):
  from jscale import train as train_lib  # pylint: disable=import-outside-toplevel
  cfg = small_config(None, *MOE, f"train.output_dir={tmp_path}",
                     f"data.cache_dir={data_cache}", "checkpoint.every=0", "train.steps=12",
                     "train.lr=1e-2")
  out = train_lib.run(cfg)
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
  rows = [r for r in rows if "loss" in r]
  assert len(rows[-1]["expert_load"]) == 8 and sum(rows[-1]["expert_load"]) == pytest.approx(1)
  assert rows[-1]["dropped_fraction"] == 0.0 and rows[-1]["moe_aux_loss"] >= 1.0 - 1e-6
  assert out["losses"][12] < out["losses"][1] - 0.5


def test_native_ragged_all_to_all_traces_forward_and_backward():
  # GPU's ragged_all_to_all has no CPU implementation: trace (not compile) the dropless
  # exchange with it, gradients included, to check shapes and JAX's transpose rule.
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from jscale.parallel import expert_exchange as ex  # pylint: disable=import-outside-toplevel
  x, ids, gates, w, _ = _inputs(t=16, e=4)
  mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))

  def loss(x, w):
    y, _ = ex.dropless_exchange(x, ids[:8], gates[:8], w, jnp.float32,
                                ex.Peers.whole("expert", 2), native_ragged=True)
    return jnp.sum(y ** 2)

  grad = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P("expert"), P("expert")),
                       out_specs=(P("expert"), P("expert")), check_vma=False)
  jaxpr = str(jax.jit(grad).trace(x, w).jaxpr)
  assert jaxpr.count("ragged_all_to_all") >= 4  # two each way, and their transposes
