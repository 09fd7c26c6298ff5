"""The train state and the jitted train / eval steps.

State is a plain pytree, `{"params", "opt_state", "step", "rng"}`, with params as a pure nested
dict of fp32 master weights (nnx.to_pure_dict layout), so orbax saves it as is; with FP8's
delayed scaling also `"dot_state"`, the linear layers' amax histories (`matmul.DotState`), whose
new values come out of the backward. One optimizer step scans over micro-batches (gradient
accumulation) and reduces gradients once, at the end (xla mode: over the axes `over_batch`
keeps apart). Nothing in the step synchronises with the host.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jscale.config import Config
from jscale.fp8 import linears as fp8_linears
from jscale.step.loss import head_loss_sums
from jscale.model import llama, matmul
from jscale.model import moe as moe_lib
from jscale.optim import lr_schedule, make_optimizer
from jscale.parallel.comms import LOCAL, Comms
from jscale.parallel.pipeline import executor, layout
from jscale.step import pipeline as pipeline_step

State = dict[str, Any]
Batch = dict[str, jax.Array]


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


def init_state(cfg: Config, shardings: Any = None, stages: int = 1) -> State:
  """Random parameters and fresh optimizer state, created inside one jit.

  With `shardings` (from `jscale.sharding.Layouts.state`) every array is created directly in
  its final layout, so a model larger than one device's memory never exists unsharded.
  `stages`: the mesh's pipeline stages (interleaved pipelines store the layers in chunk order).
  """
  optimizer = make_optimizer(cfg.train)

  def init():
    model = create_model(cfg)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # Interleaved pipelines store the layer stack in chunk order (pipeline.layout).
    params = layout.params_to_storage(params, cfg.model.n_layers, stages,
                                      cfg.pipeline.virtual_stages)
    return state_from_params(params, optimizer, cfg.train.seed, initial_dot_state(model))

  return jax.jit(init, out_shardings=shardings)()


def initial_dot_state(model: llama.Llama) -> Any:
  """The model's `matmul.DotState` as a pure dict ({} without: no FP8 delayed scaling)."""
  return nnx.to_pure_dict(nnx.state(model, matmul.DotState))


def state_from_params(params, optimizer: optax.GradientTransformation, seed: int,
                      dot_state: Any = None) -> State:
  state = {"params": params, "opt_state": optimizer.init(params),
           "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))}
  if dot_state:
    state["dot_state"] = dot_state
  return state


def make_loss_fn(graphdef: nnx.GraphDef, cfg: Config, comms: Comms = LOCAL) -> Callable:
  """(params, micro-batch, comms=comms, dot_state=None) -> (sum of token losses, token count,
  MoE terms). `dot_state`: the products' state (FP8's amax histories), if the model has any.

  MoE terms ({} for a dense model): the router statistics averaged over layers and
  "moe_loss", their weighted sum to add to the mean token loss (already a mean over tokens).
  """
  moe = cfg.model.moe

  def loss_fn(params, mb: Batch, comms: Comms = comms, dot_state: Any = None):
    with jax.named_scope("forward"):
      model = merge(graphdef, params, dot_state)
      x_BLD, stats, embed_VD = model.trunk(mb["tokens"], mb.get("positions"), comms=comms,
                                           remat=cfg.train.remat)
      h_BLD, head_DV = model.head_inputs(x_BLD, comms, embed_VD)
      loss_sum, count = head_loss_sums(h_BLD, head_DV, mb["labels"], mb["loss_mask"], comms,
                                       cfg.train.logits_chunk_mb, model.head_dot,
                                       model.head_stored)
    return loss_sum, count, (moe_lib.with_objective(stats, moe) if moe is not None else stats)

  return loss_fn


def _check_positions(batch: Batch, batch_sharding: Any) -> None:
  # Split over `sequence`, a device cannot tell its tokens' positions from their index.
  if (batch_sharding is not None and batch_sharding.mesh.shape["sequence"] > 1
      and "positions" not in batch):
    raise ValueError("mesh.sequence > 1 needs batches with 'positions' in the context layout: "
                     "apply Runtime.reorder() to each batch (the train loop does)")


def accumulate_grads(loss_fn: Callable, params, batch: Batch, microbatches: int,
                     comms: Comms = LOCAL, dot_state: Any = None):
  """Gradient of the mean token loss over the whole batch, summed over micro-batches (a scan).

  The token count is known before the backward (it is the mask's sum), so each micro-batch
  differentiates its loss sum divided by the total count: the summed gradients are the
  full-batch mean gradient (up to summation order), with no extra pass over them to divide.
  An MoE model's router losses are added per micro-batch, divided by their number.

  `dot_state` (FP8's amax histories) is differentiated too: its "gradient" is its new value
  (`jscale.fp8.dot`), combined over micro-batches by a max (each micro-batch pushes its amaxes
  onto the same old history: the max keeps the step's amax).
  Returns (grads, mean token loss, token count, MoE statistics averaged over micro-batches,
  the new dot_state).
  """
  count = comms.batch_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32)))
  scale = 1.0 / jnp.maximum(count, 1.0)
  with jax.named_scope("backward"):
    if microbatches == 1:  # (xla mode: XLA reduces each layer's gradient in the backward)
      grads, loss, stats, new_dots = _grad_loop(comms, loss_fn, params, dot_state or {},
                                                batch, scale, 1)
    else:  # each batch shard sums its micro-batches' gradients, reduced once (`over_batch`)
      grads, loss, stats, new_dots = comms.over_batch(
          lambda c, *a: _grad_loop(c, loss_fn, *a, microbatches), params, dot_state or {},
          batch, scale)
  return grads, comms.batch_sum(loss), count, stats, new_dots


def _grad_loop(comms: Comms, loss_fn: Callable, params, dot_state, batch: Batch, scale,
               microbatches: int):
  """(grads, loss sum, statistics, new dot_state) of `batch` in `microbatches` (a scan)."""
  wrt, step_comms = comms.grad_target(params)

  def scaled_loss(p, d, mb):
    loss_sum, _, stats = loss_fn(p, mb, comms=step_comms, dot_state=d)
    stats = jax.tree.map(lambda x: x / microbatches, stats)
    return loss_sum * scale + stats.pop("moe_loss", 0.0), (loss_sum * scale, stats)

  grad_fn = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)

  def one(mb):
    (_, aux), (g, new_dots) = grad_fn(wrt, dot_state, mb)
    g = comms.grad_accumulator(jax.tree.map(lambda x: x.astype(jnp.float32), g))
    return g, new_dots, aux

  if microbatches == 1:
    grads, new_dots, (loss, stats) = one(batch)
    return grads, loss, stats, new_dots

  def body(carry, mb):
    g, d, aux = one(mb)
    acc_g, acc_d, acc_aux = carry
    return (jax.tree.map(jnp.add, acc_g, g), jax.tree.map(jnp.maximum, acc_d, d),
            jax.tree.map(jnp.add, acc_aux, aux)), None

  first = jax.tree.map(lambda x: x[0], executor.split_microbatches(batch, microbatches))
  stats = jax.eval_shape(lambda: loss_fn(wrt, first, comms=step_comms,
                                         dot_state=dot_state)[2])  # forward only
  stats0 = {k: jnp.zeros(v.shape, v.dtype) for k, v in stats.items() if k != "moe_loss"}
  zeros = (comms.zero_grads(params), jax.tree.map(jnp.zeros_like, dot_state),
           (jnp.zeros((), jnp.float32), stats0))
  (grads, new_dots, (loss, stats)), _ = jax.lax.scan(
      body, zeros, executor.split_microbatches(batch, microbatches))
  return grads, loss, stats, new_dots


def make_train_step(cfg: Config, graphdef: nnx.GraphDef, comms: Comms = LOCAL,
                    state_shardings: Any = None, batch_sharding: Any = None) -> Callable:
  """Returns jitted `step(state, batch) -> (state, metrics)`; the state buffers are donated.

  With shardings the state keeps its layout across steps; in xla mode XLA partitions the rest,
  in manual mode `comms.program` runs the step on each device's shards (one shard_map).
  """
  optimizer = make_optimizer(cfg.train)
  schedule = lr_schedule(cfg.train)
  loss_fn = make_loss_fn(graphdef, cfg, comms)

  def step(state: State, batch: Batch):
    _check_positions(batch, batch_sharding)
    params = state["params"]
    if comms.stages > 1:
      grads, loss, count, stats = pipeline_step.grads(cfg, graphdef, comms, params, batch)
      dot_state = None  # validate: no FP8 delayed scaling with pipeline stages yet
    else:
      grads, loss, count, stats, dot_state = accumulate_grads(
          loss_fn, params, batch, cfg.train.microbatches, comms, state.get("dot_state"))
    grads = comms.sync_grads(grads)
    with jax.named_scope("optimizer"):
      grad_norm = comms.grad_norm(grads)
      # Never apply a NaN or inf: loss and norm are global (every device decides alike); the
      # loop stops or counts the step (train.on_nan).
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      mine = comms.params_for_update(params)
      updates, opt_state = optimizer.update(grads, state["opt_state"], mine, grad_norm=grad_norm,
                                            finite=finite)
      params = comms.gather_updated_params(optax.apply_updates(mine, updates), params)
      if dot_state:  # FP8 amax histories: keep the last finite ones
        dot_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), dot_state,
                                 state["dot_state"])
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": ~finite,
               "lr": schedule(state["step"]), "tokens": count,
               **{f"moe_{k}" if "loss" in k else k: v for k, v in stats.items()}}
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": state["rng"]}
    if dot_state:
      new_state["dot_state"] = dot_state
    return new_state, metrics

  if state_shardings is None:
    return jax.jit(step, donate_argnums=(0,))
  # One sharding for every batch array (a pytree prefix): [B, L] over batch and sequence.
  replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
  ins, outs = (state_shardings, batch_sharding), (state_shardings, replicated)
  return jax.jit(comms.program(step, ins, outs), donate_argnums=(0,), in_shardings=ins,
                 out_shardings=outs)


def make_eval_step(cfg: Config, graphdef: nnx.GraphDef, comms: Comms = LOCAL,
                   param_shardings: Any = None, batch_sharding: Any = None,
                   dot_state_shardings: Any = None) -> Callable:
  """Returns jitted `eval(params, batch[, dot_state]) -> (loss sum, token count)` over the
  global batch; `dot_state` (the train state's, FP8's amax histories) if the model has one."""
  loss_fn = make_loss_fn(graphdef, cfg, comms)

  def evaluate(params, batch: Batch, dot_state: Any = None):
    _check_positions(batch, batch_sharding)
    if comms.stages > 1:
      return pipeline_step.loss_sums(cfg, graphdef, comms, params, batch)
    loss_sum, count, _ = loss_fn(params, batch, dot_state=dot_state)
    return comms.batch_sum(loss_sum), comms.batch_sum(count)

  if param_shardings is None:
    return jax.jit(evaluate)
  replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
  ins = (param_shardings, batch_sharding) + ((dot_state_shardings,) if dot_state_shardings
                                             else ())
  return jax.jit(comms.program(evaluate, ins, replicated), in_shardings=ins,
                 out_shardings=replicated)
