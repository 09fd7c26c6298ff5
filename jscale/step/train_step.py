"""The jitted train and eval steps: the loss of a micro-batch, its gradient (accumulated over
micro-batches, `jscale.step.accumulate`, or through the pipeline, `jscale.step.pipelined`),
the once-per-step reduction and the optimizer update. With FP8's delayed scaling the state's
`dot_state` (amax histories) gets its new values out of the backward. Nothing in the step
synchronises with the host.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jscale.config import Config
from jscale.model import layer_microbatches
from jscale.model import moe as moe_lib
from jscale.model import positions as positions_lib
from jscale.optim import lr_schedule, make_optimizer
from jscale.parallel.comms import LOCAL, Comms
from jscale.step import compute_copies, pipelined, router_bias
from jscale.step.accumulate import Batch, accumulate_grads
from jscale.step.loss import Logits, head_loss_sums, mtp_terms
from jscale.step.state import State, merge


def make_loss_fn(graphdef: nnx.GraphDef, cfg: Config, comms: Comms = LOCAL) -> Callable:
  """(params, micro-batch, comms=comms, dot_state=None) -> (sum of token losses, token count,
  MoE terms). `dot_state`: the products' state (FP8's amax histories), if the model has any.

  MoE terms ({} for a dense model): the router statistics averaged over layers and
  "moe_loss", their weighted sum to add to the mean token loss (already a mean over tokens);
  with `model.mtp` also "mtp_loss" (each depth's) and "mtp_objective" (`loss.mtp_terms`:
  token sums, which the step scales as the token loss, `accumulate.TOKEN_SUMS`).
  """
  moe = cfg.model.moe
  turns = layer_microbatches.Turns.of(cfg)

  def loss_fn(params, mb: Batch, comms: Comms = comms, dot_state: Any = None):
    with jax.named_scope("forward"):
      model = merge(graphdef, params, dot_state)
      positions = positions_lib.from_batch(mb)
      x_BLD, stats, embed_VD = model.trunk(mb["tokens"], positions, comms=comms,
                                           remat=cfg.train.remat, turns=turns)
      h_BLD, head_DV = model.head_inputs(x_BLD, comms, embed_VD)
      loss_sum, count = head_loss_sums(h_BLD, head_DV, mb["labels"], mb["loss_mask"], comms,
                                       Logits.of(cfg.train), model.head_dot,
                                       model.head_stored)
      stats = moe_lib.with_objective(stats, moe) if moe is not None else stats
      if cfg.model.mtp is not None:
        stats = {**stats, **mtp_terms(model, x_BLD, mb["labels"], mb["loss_mask"],
                                      positions, comms, cfg.train.remat,
                                      Logits.of(cfg.train), embed_VD, head_DV, turns)}
    return loss_sum, count, stats

  return loss_fn


def _check_positions(batch: Batch, batch_sharding: Any, documents: bool) -> None:
  # Documents unmarked would train across them silently.
  if documents and "doc_starts" not in batch:
    raise ValueError("data.document_mask needs batches with 'doc_starts' (the windows' "
                     "document starts: jscale.data's iterators add them)")
  # Split over `sequence`, a device cannot tell its tokens' positions from their index.
  if (batch_sharding is not None and batch_sharding.mesh.shape["sequence"] > 1
      and "positions" not in batch):
    raise ValueError("mesh.sequence > 1 needs batches with 'positions' in the context layout: "
                     "apply Runtime.reorder() to each batch (the train loop does)")


def _differentiated(state: State, dtype: Any, copies: bool) -> Any:
  """What the step differentiates: the masters, or where `compute_copies.applies` bf16 copies of
  the layer stacks' matrices (bf16 gradients): the state's own, kept from the last update, or
  cast here where it keeps none."""
  params = state["params"]
  if not copies:
    return params
  if compute_copies.KEY in state:
    return compute_copies.merged(params, state[compute_copies.KEY])
  return compute_copies.compute_copies(params, dtype)


def make_train_step(cfg: Config, graphdef: nnx.GraphDef, comms: Comms = LOCAL,
                    state_shardings: Any = None, batch_sharding: Any = None) -> Callable:
  """Returns jitted `step(state, batch) -> (state, metrics)`; the state buffers are donated.

  With shardings the state keeps its layout across steps; in xla mode XLA partitions the rest,
  in manual mode `comms.program` runs the step on each device's shards (one shard_map).
  """
  optimizer = make_optimizer(cfg.train)
  schedule = lr_schedule(cfg.train)
  loss_fn = make_loss_fn(graphdef, cfg, comms)
  stages = pipelined.Settings.of(cfg)
  balance = router_bias.balanced(cfg.model.moe)
  copies = compute_copies.applies(cfg.fp8.enabled, cfg.parallel.zero_stage,
                                  compute_copies.fsdp_of(cfg.mesh), comms.stages)

  def step(state: State, batch: Batch):
    _check_positions(batch, batch_sharding, cfg.data.document_mask)
    params = state["params"]
    if comms.stages > 1:
      out = pipelined.grads(stages, graphdef, comms, params, batch, state.get("dot_state"))
    else:
      wrt = _differentiated(state, cfg.model.dtype, copies)
      out = accumulate_grads(loss_fn, wrt, batch, cfg.train.step_microbatches, comms,
                             state.get("dot_state"))
    loss, count, stats, dot_state = out.loss, out.count, out.stats, out.dot_state
    grads = comms.sync_grads(out.grads)
    loads, grads = grads, (router_bias.without_loads(grads) if balance else grads)
    with jax.named_scope("optimizer"):
      grad_norm = comms.grad_norm(grads)
      # Never apply a NaN or inf: loss and norm are global (every device decides alike); the
      # loop stops or counts the step (train.on_nan).
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      mine = comms.params_for_update(params)
      updates, opt_state = optimizer.update(grads, state["opt_state"], mine, grad_norm=grad_norm,
                                            finite=finite)
      if balance:  # the routers' bias: moved by its load, not by the optimizer
        tokens = comms.batch_sum(jnp.asarray(batch["tokens"].size, jnp.float32))
        updates = router_bias.bias_steps(updates, loads, tokens, cfg.model.moe, finite)
      params = comms.gather_updated_params(optax.apply_updates(mine, updates), params)
      if dot_state:  # FP8 amax histories: keep the last finite ones
        dot_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), dot_state,
                                 state["dot_state"])
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": ~finite,
               "lr": schedule(state["step"]), "tokens": count,
               **{f"moe_{k}" if "loss" in k and not k.startswith("mtp_") else k: v
                  for k, v in stats.items()}}
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": state["rng"]}
    if dot_state:
      new_state["dot_state"] = dot_state
    if compute_copies.KEY in state:  # the next step's copies, cast from the new masters
      new_state[compute_copies.KEY] = compute_copies.stored(params, cfg.model.dtype)
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
  stages = pipelined.Settings.of(cfg)

  def evaluate(params, batch: Batch, dot_state: Any = None):
    _check_positions(batch, batch_sharding, cfg.data.document_mask)
    if comms.stages > 1:
      return pipelined.loss_sums(stages, graphdef, comms, params, batch, dot_state)
    loss_sum, count, _ = loss_fn(params, batch, dot_state=dot_state)
    return comms.batch_sum(loss_sum), comms.batch_sum(count)

  if param_shardings is None:
    return jax.jit(evaluate)
  replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
  ins = (param_shardings, batch_sharding) + ((dot_state_shardings,) if dot_state_shardings
                                             else ())
  return jax.jit(comms.program(evaluate, ins, replicated), in_shardings=ins,
                 out_shardings=replicated)
