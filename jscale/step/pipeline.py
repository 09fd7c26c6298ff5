"""The train / eval step's pipeline path: the model cut into stage functions, the executor
run on this stage's shards, gradients and loss returned in the train step's contract."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jscale.config import Config
from jscale.step.loss import head_loss_sums
from jscale.model import llama
from jscale.model import moe as moe_lib
from jscale.parallel.comms import Comms
from jscale.parallel.pipeline import executor, program as prog_lib, schedules
from jscale.step.accumulate import split_microbatches


@functools.lru_cache(maxsize=64)
def _program(name: str, p: int, m: int, v: int, train: bool) -> prog_lib.Program:
  table = schedules.make_table(name, p, m, v) if train else schedules.forward_table(p, m, v)
  schedules.validate(table)
  return prog_lib.compile_program(table)


def program_for(cfg: Config, p: int, train: bool = True) -> prog_lib.Program:
  """The compiled (and validated) schedule the config runs on p stages."""
  pc = cfg.pipeline
  return _program(pc.schedule, p, pc.microbatches, pc.virtual_stages, train)


def stage_fns(cfg: Config, graphdef: nnx.GraphDef, comms: Comms,
              params: Any) -> executor.StageFns:
  """Embed / a chunk's layers / head + loss as pure functions of param dicts. `params` (this
  stage's) only supplies a layer stack to merge with: embed and head never read it."""
  model = lambda shared: nnx.merge(graphdef, {**shared, "blocks": params["blocks"]})
  block_graphdef = nnx.split(nnx.merge(graphdef, params).blocks)[0]

  def embed(shared, tokens_bL):
    return model(shared).embed_tokens(tokens_bL, comms)

  moe = cfg.model.moe
  stack = cfg.model.n_layers // (moe.every if moe is not None else 1)

  def layers(chunk, x_bLD, positions_bL):
    y, stats = llama.run_layers(block_graphdef, chunk, x_bLD, positions_bL, cfg.model, comms,
                                cfg.train.remat, with_stats=True)
    if moe is None:
      return y, {}
    # This chunk's share of the step's statistics (a mean over layers and micro-batches).
    share = jax.tree.leaves(chunk)[0].shape[0] / (stack * cfg.pipeline.microbatches)
    return y, moe_lib.with_objective(jax.tree.map(lambda v: v * share, stats), moe)

  def head_loss(shared, x_bLD, labels_bL, mask_bL):
    m = model(shared)
    h_bLD, head_DV = m.head_inputs(x_bLD, comms)
    return head_loss_sums(h_bLD, head_DV, labels_bL, mask_bL, comms,
                          cfg.train.logits_chunk_mb, m.head_dot)[0]

  return executor.StageFns(embed, layers, head_loss)


def _microbatches(cfg: Config, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  tokens = batch["tokens"]
  positions = batch.get("positions")
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  mb = {"tokens": tokens, "labels": batch["labels"], "loss_mask": batch["loss_mask"],
        "positions": positions}
  return split_microbatches(mb, cfg.pipeline.microbatches)


def _split(params):
  return params["blocks"], {k: v for k, v in params.items() if k != "blocks"}


def grads(cfg: Config, graphdef: nnx.GraphDef, comms: Comms, params: Any,
          batch: dict[str, jax.Array], with_codes: bool = False):
  """The pipelined counterpart of `accumulate.accumulate_grads`: (grads, mean loss, token
  count), gradients not yet reduced over the data axes. With `with_codes`, also the executor
  codes [T] this stage ran (for checking the executed schedule)."""
  count = comms.batch_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32)))
  scale = 1.0 / jnp.maximum(count, 1.0)
  program = program_for(cfg, comms.stages, train=True)

  def on_stage(params, mbs, scale):
    blocks, shared = _split(params)
    inner = comms.in_pipeline()
    fns = stage_fns(cfg, graphdef, inner, params)
    dblocks, dshared, loss, codes, stats = executor.run(program, fns, blocks, shared, mbs, scale,
                                                        shard_grads=inner.stage_grads)
    # Embedding and head gradients come from the first and the last stage (both to a tied
    # embedding); every stage keeps the shared weights, so they are summed over stages.
    dshared = jax.lax.psum(dshared, "stage")
    stats.pop("moe_loss", None)  # in the gradients already
    return ({**dshared, "blocks": dblocks}, jax.lax.psum((loss, stats), "stage"), codes)

  g, (loss, stats), codes = comms.over_stages(on_stage, params, _microbatches(cfg, batch), scale)
  out = (g, comms.batch_sum(loss), count, stats)
  return out + (codes,) if with_codes else out


def loss_sums(cfg: Config, graphdef: nnx.GraphDef, comms: Comms, params: Any,
              batch: dict[str, jax.Array]):
  """Forward only (evaluation): (loss sum, token count) of the batch, through the pipeline."""
  count = comms.batch_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32)))
  program = program_for(cfg, comms.stages, train=False)

  def on_stage(params, mbs, scale):
    blocks, shared = _split(params)
    fns = stage_fns(cfg, graphdef, comms.in_pipeline(), params)
    _, _, loss, codes, _ = executor.run(program, fns, blocks, shared, mbs, scale)
    return None, jax.lax.psum(loss, "stage"), codes

  _, loss, _ = comms.over_stages(on_stage, params, _microbatches(cfg, batch),
                                 jnp.ones((), jnp.float32), grads=False)
  return comms.batch_sum(loss), count
