"""The step's gradient taken with respect to bf16 copies of the layer stacks' matrices
(`jscale.step.compute_copies`): the same gradients as with respect to the fp32 masters, which
leaves are copied, and the gradient norm that reads them without a per-layer loop on GPUs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
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
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.data import make_train_iterator
from jscale.step.compute_copies import KEY, compute_copies, copied, stored

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
  """Every stacked matrix but the router's, and the untied head; the router, norms, balancing
  bias and embedding stay fp32."""
  cfg = small_config(None, *DEEPSEEK)
  params = state_lib.init_state(cfg)["params"]
  out = compute_copies(params, jnp.bfloat16)
  kept, cast = [], []
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(out)):
    name = jax.tree_util.keystr(path)
    (cast if y.dtype == jnp.bfloat16 else kept).append(name)
    stacked = x.ndim >= 3 and f"'{router.WEIGHT}'" not in name
    assert copied(path, x) == (y.dtype == jnp.bfloat16) == (stacked or name == "['lm_head']")
  assert any("w_gate" in n for n in cast) and any("wq" in n for n in cast)
  assert "['lm_head']" in cast
  assert any(f"'{router.WEIGHT}'" in n for n in kept)  # the MoE module names it so
  assert all(any(k in n for n in kept) for k in ("embed", "norm", router.BIAS))


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


def _same(a, b, what: str) -> None:
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype, (what, path)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=f"{what} {jax.tree_util.keystr(path)}")


def test_the_state_keeps_the_copies_each_step_writes_from_its_masters():
  """A bf16 model's state keeps the copies across steps: each step differentiates them and
  casts the next ones from its new masters, so they stay the masters cast, and the run is the
  one a step casting at its start makes (losses and masters bit-equal over 3 steps). An fp32
  model keeps none."""
  cfg = small_config(None, *DEEPSEEK)
  kept, cast = state_lib.init_state(cfg), state_lib.init_state(cfg)
  del cast[KEY]  # the state a step without kept copies sees: it casts the masters itself
  assert set(jax.tree.leaves(jax.tree.map(lambda x: str(x.dtype), kept[KEY]))) == {"bfloat16"}
  _same(kept[KEY], stored(kept["params"], jnp.bfloat16), "initial copies")
  step, batch = ts.make_train_step(cfg, state_lib.model_graphdef(cfg)), _batch(cfg)
  for i in range(3):
    kept, m_kept = step(kept, batch)
    cast, m_cast = step(cast, batch)
    assert float(m_kept["loss"]) == float(m_cast["loss"]) and KEY not in cast
    _same(kept["params"], cast["params"], f"masters after step {i}")
    _same(kept[KEY], stored(kept["params"], jnp.bfloat16), f"copies after step {i}")
  assert KEY not in state_lib.init_state(small_config(None))


def test_the_step_reads_no_master_it_keeps_a_copy_of():
  """In the train step's program, no kept master is cast to bf16 (the copies are the state's):
  the fp32 masters of copied leaves are read only by the optimizer's update."""
  cfg = small_config(None, *DEEPSEEK)
  state = state_lib.init_state(cfg)
  step = ts.make_train_step(cfg, state_lib.model_graphdef(cfg))
  jaxpr = jax.make_jaxpr(step)(state, _batch(cfg)).jaxpr.eqns[0].params["jaxpr"].jaxpr
  leaves = jax.tree_util.tree_leaves_with_path(state)
  masters = {v for (path, leaf), v in zip(leaves, jaxpr.invars)
             if path[0].key == "params" and copied(path[1:], leaf)}
  assert masters
  casts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
           and e.params["new_dtype"] == jnp.bfloat16 and set(e.invars) & masters]
  assert not casts, casts[:2]


def test_checkpoints_hold_no_copies_and_restoring_casts_them(tmp_path, data_cache):
  """What the run saves holds the masters only (the checkpoint format is unchanged); a restored
  state gets its copies cast from them, laid out as the run's (`state.as_saved` /
  `from_saved`, as `jscale.train` and the loop call them)."""
  cfg = small_config(None, *DEEPSEEK, "train.batch_size=8", "checkpoint.async_save=false",
                     f"train.output_dir={tmp_path}/run", f"data.cache_dir={data_cache}")
  rt = runtime.build(cfg)
  state = rt.init_state()
  data = make_train_iterator(cfg.data, cfg.train.seq_len, cfg.train.batch_size, 0, 1)
  ckptr = ckpt_lib.Checkpointer(cfg, {"config": {}})
  assert ckptr.save(1, state_lib.as_saved(state), data, force=True)
  ckptr.wait()
  saved = ocp.StandardCheckpointer().metadata(os.path.join(ckptr.directory, "1", "state"))
  assert KEY not in saved.item_metadata.tree and "params" in saved.item_metadata.tree
  abstract = rt.abstract_state()
  back = state_lib.from_saved(ckptr.restore(1, state_lib.as_saved(abstract), data), abstract)
  ckptr.close()
  assert set(back) == set(state)
  _same(back[KEY], state[KEY], "restored copies")
  assert jax.tree.map(lambda x: x.sharding, back[KEY]) == jax.tree.map(lambda x: x.sharding,
                                                                      state[KEY])


@pytest.mark.parametrize("mesh, zero, kept", [
    ("mesh.fsdp=8 mesh.data=1", 2, False), ("mesh.fsdp=-1 mesh.data=1", 3, False),
    ("mesh.fsdp=1 mesh.dcn_fsdp=2 mesh.data=-1", 2, False), ("mesh.fsdp=8 mesh.data=1", 1, True),
    ("mesh.fsdp=1", 3, True)])
def test_zero2_and_3_over_fsdp_differentiate_the_masters_however_fsdp_is_given(mesh, zero, kept):
  """ZeRO-2/3 over fsdp > 1 keep no copies, whether fsdp is given within nodes, across them
  (`mesh.dcn_fsdp`) or as -1 (the devices left): the step there differentiates the masters."""
  cfg = small_config(None, *DEEPSEEK, *mesh.split(), f"parallel.zero_stage={zero}")
  assert (state_lib.copies_dtype(cfg, 1) is not None) == kept
