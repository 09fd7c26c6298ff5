"""The train / eval step's pipeline path: the model cut into stage functions, the executor
(`jscale.parallel.pipeline.executor`) run on this stage's shards, and the result in the same
contract as gradient accumulation (`accumulate.Grads`), FP8's new amax histories included.

It reads only what the pipeline needs of a config (`Settings`): the model, the schedule, the
recomputation policy and the loss's chunking.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jscale.config import Config, ModelConfig, PipelineConfig
from jscale.model import llama
from jscale.model import moe as moe_lib
from jscale.model import positions as positions_lib
from jscale.parallel.comms import Comms
from jscale.parallel.pipeline import executor, lockstep, placement, schedules
from jscale.parallel.pipeline import program as prog_lib
from jscale.step.accumulate import Grads, batch_sums, split_microbatches, token_count
from jscale.step.loss import Logits, head_loss_sums, mtp_terms


class Settings(NamedTuple):
  """What the pipeline path reads of a config."""
  model: ModelConfig
  pipeline: PipelineConfig
  remat: str  # train.remat
  logits: Logits  # train.logits_chunk_mb, train.logits_dtype

  @classmethod
  def of(cls, cfg: Config) -> "Settings":
    return cls(cfg.model, cfg.pipeline, cfg.train.remat, Logits.of(cfg.train))

  @property
  def chunk_remat(self) -> str:
    """A chunk's layers' policy: `offload` keeps selective's residuals, and the executor moves
    the chunk's stored residuals to host memory until its B (`executor.run(offload=...)`)."""
    return "selective" if self.remat == "offload" else self.remat


@functools.lru_cache(maxsize=64)
def _program(name: str, p: int, m: int, v: int, train: bool) -> prog_lib.Program:
  table = (lockstep.executed_table(name, p, m, v) if train else
           schedules.forward_table(p, m, v, placement.placement_of(name)))
  schedules.validate(table)
  return prog_lib.compile_program(table)


def program_for(pipeline: PipelineConfig, p: int, train: bool = True) -> prog_lib.Program:
  """The compiled (and validated) schedule `pipeline` runs on p stages."""
  return _program(pipeline.schedule, p, pipeline.microbatches, pipeline.virtual_stages, train)


def stage_fns(s: Settings, graphdef: nnx.GraphDef, comms: Comms, params: Any,
              dot_state: Any, unroll: bool = False) -> executor.StageFns:
  """Embed / a chunk's layers / head + loss as pure functions of param dicts. `params` and
  `dot_state` (this stage's) only supply a layer stack to merge with: embed and head never
  read it. `unroll`: a chunk's layers as straight-line code (schedules with forward +
  backward pairs: the two halves' layers interleave only so; every branch alike, since one
  branch's forward stores the residuals another's backward reads)."""
  extra = [dot_state] if dot_state else []
  model = lambda shared: nnx.merge(graphdef, {**shared, "blocks": params["blocks"]}, *extra)
  block_graphdef = nnx.split(nnx.merge(graphdef, params, *extra).blocks)[0]

  def embed(shared, tokens_bL, positions):  # and the dense prefix (model.moe.first_dense)
    m = model(shared)
    return m.dense_prefix(m.embed_tokens(tokens_bL, comms), positions, comms, s.remat)

  moe = s.model.moe
  stack = s.model.stack_layers // (moe.every if moe is not None else 1)

  def layers(chunk, dots, x_bLD, positions):
    y, stats = llama.run_layers(block_graphdef, chunk, x_bLD, positions, s.model, comms,
                                s.chunk_remat, with_stats=True, dot_state=dots or None,
                                unroll=unroll)
    if moe is None:
      return y, {}
    # This chunk's share of the step's statistics (a mean over layers and micro-batches).
    share = jax.tree.leaves(chunk)[0].shape[0] / (stack * s.pipeline.microbatches)
    return y, moe_lib.with_objective(jax.tree.map(lambda v: v * share, stats), moe)

  def head_loss(shared, x_bLD, labels_bL, mask_bL, positions):
    m = model(shared)
    h_bLD, head_DV = m.head_inputs(x_bLD, comms)
    loss, _ = head_loss_sums(h_bLD, head_DV, labels_bL, mask_bL, comms, s.logits,
                             m.head_dot)
    if s.model.mtp is None:
      return loss, 0.0, {}
    # Token sums, as the loss: the executor scales all three by the step's 1 / token count.
    terms = mtp_terms(m, x_bLD, labels_bL, mask_bL, positions, comms, s.remat,
                      s.logits, head_DV=head_DV)
    return loss, terms["mtp_objective"], {"mtp_loss": terms["mtp_loss"]}

  return executor.StageFns(embed, layers, head_loss)


def _microbatches(s: Settings, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  # (No context parallelism in a pipeline: the indices are the tokens' own.)
  mb = {"tokens": batch["tokens"], "labels": batch["labels"], "loss_mask": batch["loss_mask"],
        "positions": positions_lib.from_batch(batch)}
  return split_microbatches(mb, s.pipeline.microbatches)


def _split(params):
  return params["blocks"], {k: v for k, v in params.items() if k != "blocks"}


def _dot_blocks(dot_state: Any) -> Any:
  """The layer stack's products' state ({} without): FP8 never takes the embedding or the
  head (`jscale.fp8.linears.NEVER`), so all of it is stacked with the layers."""
  if set(dot_state or {}) - {"blocks"}:
    raise ValueError(f"pipeline stages carry product state of the layers only, got "
                     f"{sorted(dot_state)}")
  return (dot_state or {}).get("blocks", {})


def grads(s: Settings, graphdef: nnx.GraphDef, comms: Comms, params: Any,
          batch: dict[str, jax.Array], dot_state: Any = None) -> Grads:
  """The pipelined counterpart of `accumulate.accumulate_grads`: `Grads`, gradients not yet
  reduced over the data axes, `dot_state` (FP8's amax histories) as the max over micro-batches
  of each one's new value."""
  return grads_and_codes(s, graphdef, comms, params, batch, dot_state)[0]


def grads_and_codes(s: Settings, graphdef: nnx.GraphDef, comms: Comms, params: Any,
                    batch: dict[str, jax.Array], dot_state: Any = None
                    ) -> tuple[Grads, jax.Array]:
  """`grads`, and the executor codes [T] this stage ran (for checking the executed schedule)."""
  count = token_count(batch, comms)
  scale = 1.0 / jnp.maximum(count, 1.0)
  program = program_for(s.pipeline, comms.stages, train=True)

  def on_stage(params, dots, mbs, scale):
    blocks, shared = _split(params)
    inner = comms.in_pipeline()
    fns = stage_fns(s, graphdef, inner, params, {"blocks": dots} if dots else {},
                    unroll=program.has_pairs)
    run = executor.run(program, fns, blocks, shared, mbs, scale, dots=dots,
                       shard_grads=inner.stage_grads, offload=s.remat == "offload")
    # Embedding and head gradients come from the first and the last stage (both to a tied
    # embedding); every stage keeps the shared weights, so they are summed over stages.
    dshared = jax.lax.psum(run.dshared, "stage")
    stats = batch_sums(dict(run.stats), inner)  # (MTP's, summed over rows as the loss)
    stats.pop("moe_loss", None)  # in the gradients already
    return ({**dshared, "blocks": run.dblocks}, jax.lax.psum((run.loss, stats), "stage"),
            run.codes, run.ddots)

  g, (loss, stats), codes, new_dots = comms.over_stages(
      on_stage, params, _dot_blocks(dot_state), _microbatches(s, batch), scale)
  out = Grads(g, comms.batch_sum(loss), count, stats, {"blocks": new_dots} if new_dots else {})
  return out, codes


def loss_sums(s: Settings, graphdef: nnx.GraphDef, comms: Comms, params: Any,
              batch: dict[str, jax.Array], dot_state: Any = None):
  """Forward only (evaluation): (loss sum, token count) of the batch, through the pipeline."""
  count = token_count(batch, comms)
  program = program_for(s.pipeline, comms.stages, train=False)

  def on_stage(params, dots, mbs, scale):
    blocks, shared = _split(params)
    fns = stage_fns(s, graphdef, comms.in_pipeline(), params, {"blocks": dots} if dots else {})
    run = executor.run(program, fns, blocks, shared, mbs, scale, dots=dots)
    return None, jax.lax.psum(run.loss, "stage"), run.codes, None

  _, loss, _, _ = comms.over_stages(on_stage, params, _dot_blocks(dot_state),
                                    _microbatches(s, batch), jnp.ones((), jnp.float32),
                                    grads=False)
  return comms.batch_sum(loss), count
