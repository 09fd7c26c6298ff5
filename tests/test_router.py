"""DeepSeek-V3's routing (`jscale.model.router`): group-limited top-k, gates and bias against
transformers' router, the bias's cotangent as the expert loads, the sequence-wise balance
loss against its formula, the train step's bias update, and a tiny DeepSeek run: loss
falling, bias moved, MTP metrics logged, resumed bit-exactly from its checkpoint."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import deepseek_case
import parity
from jscale import runtime
from jscale import train as train_lib
from jscale.config import MoeConfig
from jscale.model import router
from jscale.model.seam import LOCAL
from jscale.step import router_bias, train_step as ts

MOE = MoeConfig(n_experts=16, top_k=4, router="sigmoid", n_group=4, topk_group=2,
                routed_scaling_factor=2.5)


def _inputs(t=64, d=24, e=16, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(t, d)).astype(np.float32), rng.normal(size=(e, d)).astype(np.float32),
          (rng.normal(size=(e,)) * 0.3).astype(np.float32))


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (4, 1), (1, 1)])
def test_route_matches_transformers_router(n_group, topk_group):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
  x, w, bias = _inputs()
  moe = MoeConfig(**{**MOE.__dict__, "n_group": n_group, "topk_group": topk_group})
  hf_cfg = transformers.DeepseekV3Config(hidden_size=24, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=n_group,
                                         topk_group=topk_group, routed_scaling_factor=2.5)
  hf = DeepseekV3TopkRouter(hf_cfg)
  with torch.no_grad():
    hf.weight.copy_(torch.from_numpy(w))
    hf.e_score_correction_bias.copy_(torch.from_numpy(bias))
    _, want_gates, want_ids = (t.numpy() for t in hf(torch.from_numpy(x)))
  _, ids, gates = router.route(jnp.asarray(x @ w.T)[None], jnp.asarray(bias), moe)
  ids, gates = np.asarray(ids[0]), np.asarray(gates[0])
  order, want_order = np.argsort(ids, 1), np.argsort(want_ids, 1)
  np.testing.assert_array_equal(np.take_along_axis(ids, order, 1),
                                np.take_along_axis(want_ids, want_order, 1))
  np.testing.assert_allclose(np.take_along_axis(gates, order, 1),
                             np.take_along_axis(want_gates, want_order, 1), rtol=1e-5)
  groups = ids // (16 // n_group)  # every token's experts lie in at most topk_group groups
  assert max(len(set(row)) for row in groups.tolist()) <= topk_group


def test_bias_cotangent_is_the_expert_load_and_gates_ignore_the_bias():
  x, w, bias = _inputs()
  logits = jnp.asarray(x @ w.T)[None]

  def loss(b, logits):
    _, _, gates = router.route(logits, b, MOE)
    return jnp.sum(gates ** 2)

  g_bias, g_logits = jax.grad(loss, (0, 1))(jnp.asarray(bias), logits)
  _, ids, _ = router.route(logits, jnp.asarray(bias), MOE)
  np.testing.assert_array_equal(g_bias, np.bincount(np.asarray(ids).ravel(), minlength=16))
  # The logits' gradient is that of the gates of the chosen experts, bias held fixed.
  chosen = lambda logits: jnp.take_along_axis(jax.nn.sigmoid(logits), ids, -1)
  want = jax.grad(lambda l: jnp.sum((chosen(l) / jnp.sum(chosen(l), -1, keepdims=True) * 2.5)
                                    ** 2))(logits)
  np.testing.assert_allclose(g_logits, want, rtol=1e-5, atol=1e-7)


def test_sequence_balance_loss_equals_its_formula():
  rng = np.random.default_rng(0)
  b, l, e, k = 3, 10, 8, 2
  scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, l, e)), jnp.float32))
  ids = jax.lax.top_k(scores, k)[1]
  got = router.sequence_balance_loss(scores, ids, LOCAL)
  s = np.asarray(scores)
  s_norm = s / s.sum(-1, keepdims=True)
  want = 0.0
  for i in range(b):
    f = e / (k * l) * np.bincount(np.asarray(ids[i]).ravel(), minlength=e)
    want += np.sum(f * s_norm[i].mean(0)) / b
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_train_step_moves_the_bias_by_the_sign_of_the_load_error():
  """One step on one device: each router's bias becomes rate · sign(mean load - load), the
  loads being its cotangent (complete: they sum to tokens · top_k per layer), untouched by
  Adam and weight decay; the other weights are Adam's."""
  # (2 layers, no MTP: the cheapest model with a routed layer; its compiles dominate)
  cfg = deepseek_case.config("mesh.data=1", *parity.BASE, "model.n_layers=2", "model.mtp=null")
  rt = runtime.build(cfg, jax.devices()[:1])
  state = rt.init_state()
  batch = jax.device_put(parity.batches(cfg)[0], rt.layouts.batch())
  loss_fn = ts.make_loss_fn(rt.graphdef, cfg)
  grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))(state["params"])
  loads = grads["blocks"]["mlp"][router.BIAS]  # [MoE layers, E]
  tokens = cfg.train.batch_size * cfg.train.seq_len
  np.testing.assert_allclose(np.sum(loads, -1), tokens * cfg.model.moe.top_k)
  before = jax.device_get(state["params"])
  new, _ = rt.train_step()(state, batch)
  mean = tokens * cfg.model.moe.top_k / cfg.model.moe.n_experts
  want = cfg.model.moe.bias_update_rate * np.sign(mean - np.asarray(loads))
  np.testing.assert_allclose(new["params"]["blocks"]["mlp"][router.BIAS], want, atol=1e-7)
  assert np.abs(want).sum() > 0
  assert not np.allclose(new["params"]["blocks"]["mlp"]["router"],
                         before["blocks"]["mlp"]["router"])
  assert router_bias.balanced(cfg.model.moe)


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory, data_cache):
  out = tmp_path_factory.mktemp("deepseek")
  cfg = deepseek_case.config(f"train.output_dir={out}", f"data.cache_dir={data_cache}",
                             "checkpoint.every=3", "train.steps=6", "train.lr=1e-2")
  return cfg, out, train_lib.run(cfg)


def test_tiny_deepseek_trains_logs_mtp_and_moves_the_bias(deepseek_run):
  cfg, out, summary = deepseek_run
  rows = [json.loads(l) for l in open(out / "metrics.jsonl", encoding="utf-8")]
  rows = [r for r in rows if "loss" in r]
  assert len(rows[-1]["mtp_loss"]) == 1 and rows[-1]["mtp_loss"][0] > 0
  assert "moe_seq_aux_loss" in rows[-1] and len(rows[-1]["expert_load"]) == 8
  assert summary["losses"][6] < summary["losses"][1]
  bias = np.asarray(summary["state"]["params"]["blocks"]["mlp"][router.BIAS])
  rate = cfg.model.moe.bias_update_rate
  assert np.abs(bias).max() > 0 and np.abs(bias).max() <= 6 * rate + 1e-6
  np.testing.assert_allclose(bias / rate, np.round(bias / rate), atol=1e-4)  # whole steps


def test_bias_and_mtp_weights_resume_from_the_checkpoint(deepseek_run):
  """The run's last checkpoint removed, the same config resumes from step 3: steps 4-6 and the
  final bias and MTP weights bit for bit those of the uninterrupted run (after the test
  above, which reads the run's own files)."""
  cfg, out, full = deepseek_run
  shutil.rmtree(out / "checkpoints" / "6")
  second = train_lib.run(cfg)
  assert sorted(second["losses"]) == [4, 5, 6]
  assert second["losses"] == {s: full["losses"][s] for s in second["losses"]}
  a, b = full["state"]["params"], second["state"]["params"]
  for key in (("blocks", "mlp", router.BIAS), ("mtp",)):
    x, y = a, b
    for k in key:
      x, y = x[k], y[k]
    assert all(np.array_equal(p, q) for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
