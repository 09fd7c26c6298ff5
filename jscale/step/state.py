"""The train state: the model a config trains, its parameters as stored, and the optimizer's.

State is a plain pytree, `{"params", "opt_state", "step", "rng"}`, with params as a pure nested
dict of fp32 master weights (nnx.to_pure_dict layout), so orbax saves it as is; with FP8's
delayed scaling also `"dot_state"`, the linear layers' amax histories (`matmul.DotState`),
stacked with the layers they belong to; where the step differentiates compute-dtype copies of
the layer stacks' matrices, also `"copies"`, kept across steps and never checkpointed
(`jscale.step.compute_copies`).

Under a pipeline with several chunks per stage the layer stack is stored in chunk order, as
the schedule places them (`jscale.parallel.pipeline.placement`); `params_to_storage` is the one
place a tree in model layer order (parameters or their `dot_state`) is put in the stored order,
whatever it comes from: random init, `checkpoint.init_from`, or a model loaded for evaluation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jscale.config import Config, PipelineConfig
from jscale.fp8 import linears as fp8_linears
from jscale.model import llama, matmul
from jscale.optim import make_optimizer
from jscale.parallel.pipeline import placement
from jscale.step import compute_copies

State = dict[str, Any]


def create_model(cfg: Config) -> llama.Llama:
  """The model the config trains: `cfg.model` with its linear layers' products (FP8 on
  `fp8.targets` when fp8.enabled), randomly initialised."""
  dot_general = fp8_linears.from_config(cfg.fp8) or jax.lax.dot_general
  return llama.create(cfg.model, cfg.train.seed, dot_general=dot_general)


def model_graphdef(cfg: Config) -> nnx.GraphDef:
  """The model's static structure (no arrays are allocated)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: create_model(cfg)))
  return graphdef


def merge(graphdef: nnx.GraphDef, params: Any, dot_state: Any = None) -> llama.Llama:
  """The model from its params (and its products' state, if it has any)."""
  return nnx.merge(graphdef, params, *([dot_state] if dot_state else []))


def initial_dot_state(model: llama.Llama) -> Any:
  """The model's `matmul.DotState` as a pure dict ({} without: no FP8 delayed scaling)."""
  return nnx.to_pure_dict(nnx.state(model, matmul.DotState))


def params_to_storage(tree: dict, n_layers: int, stages: int, pipeline: PipelineConfig) -> dict:
  """`tree` (params or dot_state, a pure dict whose layer stack, if any, is "blocks", in model
  layer order) as stored on a mesh of `stages` pipeline stages (v = 1 without a pipeline)."""
  if "blocks" not in tree:
    return tree
  v = pipeline.virtual_stages if stages > 1 else 1
  return {**tree, "blocks": placement.to_storage(tree["blocks"], n_layers, stages, v,
                                              placement.placement_of(pipeline.schedule))}


def restack(state: State, n_layers: int, stages: int, saved: PipelineConfig,
            now: PipelineConfig) -> State:
  """`state` (params, optimizer moments, dot_state: every array under a "blocks" key) stored
  by a pipeline of `saved`'s placement, in the order a pipeline of `now`'s stores (the same
  stage count and chunks per stage): a checkpoint of an interleaved run resumed by ZB-V or
  DualPipeV, or back. Identity when the placements agree."""
  v = now.virtual_stages if stages > 1 else 1
  before, after = (placement.placement_of(c.schedule) for c in (saved, now))
  if v == 1 or before == after:
    return state

  def move(path, x):
    if not any(getattr(k, "key", None) == "blocks" for k in path):
      return x
    in_model_order = placement.to_model(x, n_layers, stages, v, before)
    return placement.to_storage(in_model_order, n_layers, stages, v, after)

  return jax.tree_util.tree_map_with_path(move, state)


def state_from_params(params, optimizer: optax.GradientTransformation, seed: int,
                      dot_state: Any = None, copies_dtype: Any = None) -> State:
  """A fresh train state around `params`; `copies_dtype`: also the compute-dtype copies the
  step differentiates (`compute_copies.kept`), cast from them."""
  state = {"params": params, "opt_state": optimizer.init(params),
           "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))}
  if dot_state:
    state["dot_state"] = dot_state
  if copies_dtype is not None and (copies := compute_copies.stored(params, copies_dtype)):
    state[compute_copies.KEY] = copies
  return state


def as_saved(state: State) -> State:
  """`state` as checkpoints hold it: without the compute copies (cast again on restore)."""
  return {k: v for k, v in state.items() if k != compute_copies.KEY}


def from_saved(saved: State, abstract_state: State) -> State:
  """A state restored from a checkpoint (`as_saved`), with the compute copies the run's
  `abstract_state` (ShapeDtypeStructs with shardings) holds cast from its masters."""
  abstract = abstract_state.get(compute_copies.KEY)
  if abstract is None:
    return saved
  dtype = jax.tree.leaves(abstract)[0].dtype
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  copies = jax.jit(lambda p: compute_copies.stored(p, dtype),
                   out_shardings=shardings)(saved["params"])
  return {**saved, compute_copies.KEY: copies}


def copies_dtype(cfg: Config, stages: int) -> Any:
  """The dtype of the state's compute copies (`compute_copies.kept`), None where it keeps
  none."""
  keep = compute_copies.kept(cfg.fp8.enabled, cfg.parallel.zero_stage,
                             compute_copies.fsdp_of(cfg.mesh), stages, cfg.model.dtype)
  return jnp.dtype(cfg.model.dtype) if keep else None


def init_state(cfg: Config, shardings: Any = None, stages: int = 1) -> State:
  """Random parameters and fresh optimizer state, created inside one jit.

  With `shardings` (from `jscale.sharding.Layouts.state`) every array is created directly in
  its final layout, so a model larger than one device's memory never exists unsharded.
  `stages`: the mesh's pipeline stages (pipelines with several chunks per stage store the
  layers in chunk order).
  """
  optimizer = make_optimizer(cfg.train)

  def init():
    model = create_model(cfg)
    stored = lambda tree: params_to_storage(tree, cfg.model.stack_layers, stages,
                                           cfg.pipeline)
    params = stored(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return state_from_params(params, optimizer, cfg.train.seed,
                             stored(initial_dot_state(model)), copies_dtype(cfg, stages))

  return jax.jit(init, out_shardings=shardings)()
