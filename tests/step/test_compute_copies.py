"""The step's gradient taken with respect to bf16 copies of the layer stacks' matrices
(`jscale.step.compute_copies`): the same gradients as with respect to the fp32 masters, which
leaves are copied, and the gradient norm that reads them without a per-layer loop on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepseek_case
from conftest import small_config
from jscale import runtime
from jscale.analysis import gpu_target
from jscale.model import router
from jscale.optim import sumsq
from jscale.step import state as state_lib
from jscale.step import train_step as ts
from jscale.step.accumulate import accumulate_grads
from jscale.step.compute_copies import compute_copies, copied

# The tiny DeepSeek-V3 at a CPU size: MLA, a dense first layer, sigmoid-routed experts with the
# balancing bias and a shared expert, and an MTP module sharing the embedding and head.
DEEPSEEK = (*deepseek_case.DS, "model.dtype=bfloat16", "train.batch_size=4")


def _batch(cfg):
  rng = np.random.default_rng(0)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  return {"tokens": jnp.asarray(t[:, :-1]), "labels": jnp.asarray(t[:, 1:]),
          "loss_mask": jnp.ones((b, l), jnp.float32)}


@pytest.mark.parametrize("overrides, microbatches", [
    (DEEPSEEK, 1), (DEEPSEEK, 2), (("model.dtype=bfloat16",), 1)])
def test_bf16_copies_give_the_fp32_masters_gradients(overrides, microbatches):
  """Differentiating with respect to the copies changes no gradient: each copied matrix's is
  one product's bf16 output either way (converted to fp32 before micro-batches are summed)."""
  cfg = small_config(None, *overrides)
  params = state_lib.init_state(cfg)["params"]
  loss_fn = ts.make_loss_fn(state_lib.model_graphdef(cfg), cfg)
  fn = jax.jit(lambda p, b: accumulate_grads(loss_fn, p, b, microbatches)[:2])
  batch = _batch(cfg)
  (g_master, loss_master), (g_copies, loss_copies) = (
      fn(params, batch), fn(compute_copies(params, cfg.model.dtype), batch))
  assert float(loss_copies) == float(loss_master)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_copies),
                          jax.tree.leaves(g_master)):
    assert a.dtype == b.dtype == jnp.float32, path
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9 * float(jnp.max(jnp.abs(b))),
                               err_msg=jax.tree_util.keystr(path))


def test_which_leaves_are_copied():
  """Every stacked matrix but the router's; the router, norms, balancing bias, embedding and
  head stay fp32."""
  cfg = small_config(None, *DEEPSEEK)
  params = state_lib.init_state(cfg)["params"]
  out = compute_copies(params, jnp.bfloat16)
  kept, cast = [], []
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(out)):
    name = jax.tree_util.keystr(path)
    (cast if y.dtype == jnp.bfloat16 else kept).append(name)
    assert copied(path, x) == (y.dtype == jnp.bfloat16) == (x.ndim >= 3 and
                                                           f"'{router.WEIGHT}'" not in name)
  assert any("w_gate" in n for n in cast) and any("wq" in n for n in cast)
  assert any(f"'{router.WEIGHT}'" in n for n in kept)  # the MoE module names it so
  assert all(any(k in n for n in kept) for k in ("embed", "lm_head", "norm", router.BIAS))


def test_the_norm_reads_a_bf16_stack_whole_on_gpus():
  """`sumsq` of a bf16 stack: the same fp32 sum layer by layer (XLA:CPU) and whole; the step
  loops only where it runs on CPUs."""
  x = jax.random.normal(jax.random.key(0), (3, 5, 7), jnp.float32).astype(jnp.bfloat16)
  want = float(jnp.sum(jnp.square(x.astype(jnp.float32))))
  for by_slice in (True, False):
    np.testing.assert_allclose(float(jax.jit(sumsq, static_argnums=(1, 2))(x, 1, by_slice)),
                               want, rtol=1e-6)
  cfg = small_config(None, "mesh.data=1")
  assert runtime.build(cfg, jax.devices()[:1]).comms.norm_by_slice()
  assert not runtime.build(cfg, gpu_target.devices("h100x1")).comms.norm_by_slice()
