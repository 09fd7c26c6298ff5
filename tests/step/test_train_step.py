"""Train step numerics: gradient accumulation and rematerialisation against the plain step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from jscale.analysis import introspect
from jscale.step import train_step as ts
from jscale.step import state as state_lib
from jscale.step.accumulate import accumulate_grads

# Long sequence, many small heads: the L x L attention scores dominate activation memory.
ACTIVATION_HEAVY = ("model.d_model=64", "model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=8",
                    "model.n_layers=2", "train.seq_len=512", "train.batch_size=2",
                    "mesh.data=1")


def _batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  mask = np.ones((b, l), np.float32)
  mask[-1, l // 2:] = 0.0  # a padded tail: must not count
  return {"tokens": jnp.asarray(t[:, :-1]), "labels": jnp.asarray(t[:, 1:]),
          "loss_mask": jnp.asarray(mask)}


@pytest.fixture(scope="module")
def setup():
  cfg = small_config()
  graphdef = state_lib.model_graphdef(cfg)
  params = state_lib.init_state(cfg)["params"]
  return cfg, graphdef, params, _batch(cfg)


def _grads(cfg, graphdef, params, batch, microbatches, remat="none"):
  cfg = small_config(None, f"train.microbatches={microbatches}", f"train.remat={remat}")
  loss_fn = ts.make_loss_fn(graphdef, cfg)
  fn = jax.jit(lambda p, b: accumulate_grads(loss_fn, p, b, microbatches))
  return fn(params, batch)[:3]


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_grad_accumulation_equals_full_batch(setup):
  cfg, graphdef, params, batch = setup
  g1, l1, n1 = _grads(cfg, graphdef, params, batch, 1)
  g4, l4, n4 = _grads(cfg, graphdef, params, batch, 4)
  assert float(n1) == float(n4) == 8 * 32 - 16
  np.testing.assert_allclose(float(l1), float(l4), rtol=1e-6)  # a few ulp: summation order
  assert _max_diff(g1, g4) <= 1e-6


def test_masked_positions_do_not_count(setup):
  cfg, graphdef, params, batch = setup
  other = dict(batch)
  labels = np.asarray(batch["labels"]).copy()
  labels[-1, 16:] = (labels[-1, 16:] + 7) % cfg.model.vocab_size  # change only masked labels
  other["labels"] = jnp.asarray(labels)
  ga, la, _ = _grads(cfg, graphdef, params, batch, 1)
  gb, lb, _ = _grads(cfg, graphdef, params, other, 1)
  assert float(la) == float(lb) and _max_diff(ga, gb) == 0.0


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_remat_gives_same_gradients(setup, remat):
  cfg, graphdef, params, batch = setup
  g_ref, l_ref, _ = _grads(cfg, graphdef, params, batch, 1)
  g, l, _ = _grads(cfg, graphdef, params, batch, 1, remat)
  assert abs(float(l) - float(l_ref)) < 1e-6
  assert _max_diff(g, g_ref) <= 1e-6


def test_loss_is_reference_cross_entropy(setup):
  cfg, graphdef, params, batch = setup
  from flax import nnx
  logits = np.asarray(nnx.merge(graphdef, params)(batch["tokens"]), np.float64)
  labels, mask = np.asarray(batch["labels"]), np.asarray(batch["loss_mask"])
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
  ref = (nll * mask).sum() / mask.sum()
  _, loss, _ = _grads(cfg, graphdef, params, batch, 1)
  assert abs(float(loss) - ref) < 1e-5


def test_train_steps_reduce_loss(setup):
  cfg, graphdef, _, batch = setup
  state = state_lib.init_state(cfg)
  step = ts.make_train_step(cfg, graphdef)
  losses = []
  for _ in range(5):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0]
  assert int(state["step"]) == 5


def temp_bytes(remat: str) -> int:
  """Compiled temp memory of one train step; attention activations dominate at this shape."""
  cfg = small_config(None, *ACTIVATION_HEAVY, f"train.remat={remat}")
  compiled, _ = introspect.compile_train_step(cfg, jax.devices()[:1])
  return introspect.memory(compiled)["temp"]


def test_remat_reduces_compiled_temp_memory():
  none, selective, full = (temp_bytes(r) for r in ("none", "selective", "full"))
  print(f"temp bytes: none={none} selective={selective} full={full}")
  assert none > selective > full


def test_bf16_compute_with_fp32_master_weights(setup):
  cfg, graphdef, params, batch = setup
  _, l32, _ = _grads(cfg, graphdef, params, batch, 1)
  cfg16 = small_config(None, "model.dtype=bfloat16")
  graphdef16 = state_lib.model_graphdef(cfg16)
  loss_fn = ts.make_loss_fn(graphdef16, cfg16)
  g16, l16, _, _, _ = jax.jit(lambda p, b: accumulate_grads(loss_fn, p, b, 1))(params, batch)
  assert abs(float(l16) - float(l32)) < 2e-2 * float(l32)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))  # grads of fp32 masters
