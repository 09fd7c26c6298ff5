"""Checkpoints written before the experts' gate and up became one parameter
(`jscale.ckpt.legacy_experts`): a resume, a params/ checkpoint and a training checkpoint read
for evaluation give what the same state saved in the new layout gives, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import deepseek_case
from conftest import small_config
from jscale import runtime
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.ckpt import legacy_experts, model_source, params_io
from jscale.data import make_train_iterator
from jscale.model import llama
from jscale.step import state as state_lib

# The tiny DeepSeek-V3: a dense first layer (its own w_gate / w_up, never stacked), routed
# experts in the layer stack and in the MTP block.
DEEPSEEK = (*deepseek_case.DS, "train.batch_size=8", "checkpoint.async_save=false")


def _old(tree, target):
  """`tree` (new layout) as a checkpoint from before held it: each w_gate_up split in two."""
  if isinstance(target, dict):
    out = {k: _old(tree[k], v) for k, v in target.items() if k != legacy_experts.NEW}
    if legacy_experts.NEW in target:
      pair = tree[legacy_experts.NEW]
      out.update({name: jnp.take(pair, i, axis=-2) for i, name in
                  enumerate(legacy_experts.OLD)})
    return out
  if isinstance(target, tuple) and hasattr(target, "_fields"):
    return type(target)(*(_old(a, b) for a, b in zip(tree, target)))
  if isinstance(target, (list, tuple)):
    return type(target)(_old(a, b) for a, b in zip(tree, target))
  return tree


def _same(a, b, what: str) -> None:
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(la) == len(lb), what
  for (path, x), y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype, (what, path)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _saved_old(cfg):
  """(runtime, checkpointer, the run's initial state as saved, data iterator) with that state
  saved as step 1 in the old layout."""
  rt = runtime.build(cfg)
  state = state_lib.as_saved(rt.init_state())
  data = make_train_iterator(cfg.data, cfg.train.seq_len, cfg.train.batch_size, 0, 1)
  ckptr = ckpt_lib.Checkpointer(cfg, {"config": {}})
  assert ckptr.save(1, _old(state, state), data, force=True)
  ckptr.wait()
  return rt, ckptr, state, data


def test_targets_split_only_the_experts_pair():
  """`old_target` names the experts' pair as before and leaves the dense MLP's alone."""
  cfg = small_config(None, *DEEPSEEK)
  abstract = runtime.build(cfg).abstract_state()
  params = legacy_experts.old_target(abstract)["params"]
  e, d, f = cfg.model.moe.n_experts, cfg.model.d_model, cfg.model.moe.d_ff
  for node in (params["blocks"]["mlp"], params["mtp"]["block"]["mlp"]):
    assert legacy_experts.NEW not in node
    assert node["w_gate"].shape[-3:] == node["w_up"].shape[-3:] == (e, d, f)
  assert params["dense_blocks"]["mlp"]["w_gate"].shape == \
      abstract["params"]["dense_blocks"]["mlp"]["w_gate"].shape
  mu = legacy_experts.old_target(abstract)["opt_state"]
  assert "w_gate" in str(jax.tree_util.tree_structure(mu))


def test_an_old_checkpoint_resumes_as_the_new_one(tmp_path, data_cache):
  """A state saved in the old layout (params and Adam's moments) restores, through a new run's
  `Checkpointer.restore`, to the state itself: same values, dtypes and shardings."""
  cfg = small_config(None, *DEEPSEEK, f"train.output_dir={tmp_path}/run",
                     f"data.cache_dir={data_cache}")
  rt, ckptr, state, data = _saved_old(cfg)
  ckptr.close()
  ckptr = ckpt_lib.Checkpointer(cfg, {"config": {}})  # a new run's: it saved nothing itself
  back = ckptr.restore(1, state_lib.as_saved(rt.abstract_state()), data)
  ckptr.close()
  _same(back, state, "resumed")
  assert jax.tree.map(lambda x: x.sharding, back) == jax.tree.map(lambda x: x.sharding, state)


def test_old_params_and_training_checkpoints_load_for_evaluation(tmp_path, data_cache):
  """A params/ checkpoint and a training checkpoint in the old layout load (`model_source`, as
  evaluation and generation read them) to the parameters saved."""
  cfg = small_config(None, *DEEPSEEK, f"train.output_dir={tmp_path}/run",
                     f"data.cache_dir={data_cache}")
  model = llama.create(cfg.model)
  want = jax.tree.map(np.asarray, _params(model))
  params_io.save_params(str(tmp_path / "old"), model, cfg.model)  # model.yaml, params/ ...
  with ocp.StandardCheckpointer() as ckptr:  # ... params/ as before
    ckptr.save(str(tmp_path / "old" / "params"), _old(want, want), force=True)
  _, loaded = model_source.load(str(tmp_path / "old"))
  _same(_params(loaded), want, "params/ checkpoint")
  _, ckptr, state, _ = _saved_old(cfg)
  ckptr.close()
  step_dir = f"{ckptr.directory}/1"
  src = model_source.Source("step", step_dir, step_dir, cfg, 1, 1)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state["params"])
  _same(model_source._restore_train_params(src, abstract), state["params"],
        "training checkpoint")


def _params(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))
