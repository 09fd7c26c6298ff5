"""DeepSeek-V3's routing (`jscale.model.router`): group-limited top-k, gates and bias against
transformers' router, the bias's cotangent as the expert loads, the sequence-wise balance
loss against its formula, and 3 steps of a tiny DeepSeek: the train step's bias update, loss
falling, MTP metrics, a resume from the Checkpointer bit-exact."""

import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepseek_case
import parity
from jscale import runtime
from jscale.ckpt.checkpoint import Checkpointer
from jscale.config import MoeConfig
from jscale.metrics import MetricsWriter
from jscale.model import router
from jscale.model.seam import LOCAL
from jscale.run import loop
from jscale.step import router_bias

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


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
  """A tiny DeepSeek (1 dense + 1 MoE layer, MTP on) on one device: 3 steps on one batch,
  the state after step 2 saved through the Checkpointer, restored and stepped again.
  (cfg, metrics of steps 1-3, host states after steps 0-3, restored state, its step-3 state and
  metrics). One compiled step serves every test below (compiles dominate)."""
  out = tmp_path_factory.mktemp("deepseek")
  cfg = deepseek_case.config("mesh.data=1", *parity.BASE, "model.n_layers=2",
                             "train.batch_size=8", "train.seq_len=16", "train.lr=1e-2",
                             f"train.output_dir={out}", "checkpoint.async_save=false")
  rt = runtime.build(cfg, jax.devices()[:1])
  step = rt.train_step()
  batch = jax.device_put(parity.batches(cfg, steps=1)[0], rt.layouts.batch())
  state = rt.init_state()
  states, metrics = [jax.device_get(state)], []
  ckptr = Checkpointer(cfg)
  data_iter = iter(grain.MapDataset.range(4).to_iter_dataset())  # the checkpoint's data item
  for i in range(3):
    if i == 2:
      assert ckptr.save(2, state, data_iter, force=True)
      ckptr.wait()
    state, m = step(state, batch)  # (donates the old state's buffers)
    states.append(jax.device_get(state))
    metrics.append(jax.device_get(m))
  restored = ckptr.restore(2, rt.abstract_state(), data_iter)
  restored_host = jax.device_get(restored)
  resumed, resumed_metrics = jax.device_get(step(restored, batch))
  ckptr.close()
  return cfg, metrics, states, restored_host, resumed, resumed_metrics


def test_train_step_moves_the_bias_by_the_sign_of_the_load_error(stepped):
  """Step 1: each router's bias becomes rate · sign(mean load - load), the loads being the
  expert assignments the step counted (its `expert_load` metric, one routed layer), untouched
  by Adam and weight decay; the other weights are Adam's. (The bias's update is made from its
  cotangent, so this checks the cotangent through the whole step.)"""
  cfg, metrics, states, *_ = stepped
  moe = cfg.model.moe
  tokens = cfg.train.batch_size * cfg.train.seq_len
  loads = np.round(np.asarray(metrics[0]["expert_load"]) * tokens * moe.top_k)
  assert loads.sum() == tokens * moe.top_k
  want = moe.bias_update_rate * np.sign(tokens * moe.top_k / moe.n_experts - loads)
  np.testing.assert_allclose(states[1]["params"]["blocks"]["mlp"][router.BIAS], want[None],
                             atol=1e-7)
  assert np.abs(want).sum() > 0
  assert np.abs(states[1]["params"]["mtp"]["block"]["mlp"][router.BIAS]).max() > 0
  assert not np.allclose(states[1]["params"]["blocks"]["mlp"]["router"],
                         states[0]["params"]["blocks"]["mlp"]["router"])
  assert router_bias.balanced(moe)


def test_tiny_deepseek_trains_reports_mtp_and_moves_the_bias(stepped):
  cfg, metrics, states, *_ = stepped
  last = metrics[-1]
  assert np.shape(last["mtp_loss"]) == (1,) and last["mtp_loss"][0] > 0
  assert "moe_seq_aux_loss" in last and len(last["expert_load"]) == 8
  assert metrics[2]["loss"] < metrics[0]["loss"]  # (the same batch each step)
  bias = np.asarray(states[3]["params"]["blocks"]["mlp"][router.BIAS])
  rate = cfg.model.moe.bias_update_rate
  assert np.abs(bias).max() > 0 and np.abs(bias).max() <= 3 * rate + 1e-6
  np.testing.assert_allclose(bias / rate, np.round(bias / rate), atol=1e-4)  # whole steps


def test_metrics_jsonl_logs_each_mtp_depth_and_the_router(stepped, tmp_path):
  # The row the run loop writes from the step's metrics (`loop._row`), through the writer.
  _, metrics, *_ = stepped
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(3, loop._row(metrics[-1]))  # pylint: disable=protected-access
  writer.close()
  row = json.loads(open(tmp_path / "metrics.jsonl", encoding="utf-8").read())
  assert row["mtp_loss"] == pytest.approx(np.asarray(metrics[-1]["mtp_loss"]).tolist())
  assert len(row["mtp_loss"]) == 1 and len(row["expert_load"]) == 8
  assert row["moe_seq_aux_loss"] > 0


def test_bias_and_mtp_weights_resume_from_the_checkpoint(stepped):
  """The state saved after step 2 restores bit for bit (bias and MTP weights included), and
  step 3 from it equals the uninterrupted step 3 bit for bit."""
  _, metrics, states, restored, resumed, resumed_metrics = stepped
  for want, got in ((states[2], restored), (states[3], resumed)):
    for key in (("blocks", "mlp", router.BIAS), ("mtp",), ()):
      x, y = want["params"], got["params"]
      for k in key:
        x, y = x[k], y[k]
      assert all(np.array_equal(p, q) for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  assert resumed_metrics["loss"] == metrics[2]["loss"]
