"""Shared by the pipeline tests (and scripts/sweep_pipeline.py): one step's loss and gradients
through the pipeline, and the single-device reference on the same batch."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import small_config
from jscale import runtime
from jscale.parallel.pipeline import placement
from jscale.step import accumulate, pipelined, state as state_lib
from jscale.step import train_step as ts

# 8 layers: p x v = 4 x 2 chunks of one layer. kv_heads 4: tensor=2 divides everything.
BASE = ("model.n_layers=8", "model.n_kv_heads=4", "train.batch_size=16", "train.seq_len=16")


SCHEDULE = {"afab": (), "1f1b": (), "zero_bubble": (),
            **{name: ("pipeline.virtual_stages=2",) for name in ("interleaved", "zbv",
                                                                  "dualpipev")}}


def overrides(mode, schedule, p, m, extra=()):
  """The config of a case (mode, schedule, p, m, extra overrides) on top of BASE."""
  data = () if any(e.startswith("mesh.data") for e in extra) else ("mesh.data=1",)
  return (f"parallel.collectives={mode}", f"pipeline.schedule={schedule}", f"mesh.stage={p}",
          f"pipeline.microbatches={m}", *SCHEDULE[schedule], *data, *extra)


def case_id(case):
  mode, schedule, p, m, extra = case
  return "-".join([mode, schedule, f"p{p}", f"m{m}", *(e.split(".")[-1] for e in extra)])


class Result(NamedTuple):
  loss: float
  grads: Any  # in model layer order
  codes: np.ndarray  # executed codes [p, T]
  rt: runtime.Runtime
  compiled: jax.stages.Compiled  # the step's program: loss, synced gradients, codes


def batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  mask = np.ones((b, l), np.float32)
  mask[0, l // 2:] = 0.0
  return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}


def _to_model_order(cfg, grads, p):
  return {**grads, "blocks": placement.to_model(grads["blocks"], cfg.model.n_layers, p,
                                             cfg.pipeline.virtual_stages,
                                             placement.placement_of(cfg.pipeline.schedule))}


@functools.lru_cache(maxsize=None)
def _params(*model):
  """The reference's initial parameters (model layer order, on the host) of BASE with `model`
  overrides. Every layout starts from these, put in its storage order and sharding: no
  per-layout init to compile (sharded init is checked by the pipeline tests that run
  `rt.init_state()`)."""
  return jax.device_get(state_lib.init_state(small_config(None, *BASE, *model))["params"])


@functools.lru_cache(maxsize=None)
def pipeline_grads(*overrides) -> Result:
  """One step of the layout `overrides` on BASE; cached, so tests of the same layout (values,
  compiled text) share one compile."""
  cfg = small_config(None, *BASE, *overrides)
  n = int(np.prod([int(o.split("=")[1]) for o in overrides
                   if o.split("=")[0] in ("mesh.stage", "mesh.data", "mesh.tensor", "mesh.fsdp",
                                          "mesh.expert")]))
  rt = runtime.build(cfg, jax.devices()[:n])
  p = rt.mesh.shape["stage"]
  comms, params_sh = rt.comms, rt.state_shardings["params"]
  repl = NamedSharding(rt.mesh, P())
  model = tuple(o for o in overrides if o.startswith("model."))
  params = jax.device_put(state_lib.params_to_storage(_params(*model), cfg.model.n_layers, p,
                                                      cfg.pipeline), params_sh)

  def fn(params, b):
    out, codes = pipelined.grads_and_codes(pipelined.Settings.of(cfg), rt.graphdef, comms,
                                           params, b)
    return comms.sync_grads(out.grads), out.loss, codes

  codes_sh = NamedSharding(rt.mesh, P("stage"))
  # Synced gradients: whole, or (manual ZeRO-1/2) reduce-scattered to the optimizer's shards.
  grads_sh = (rt.layouts.named(rt.layouts.opt) if comms.mode == "manual" and
              cfg.parallel.zero_stage >= 1 else params_sh)
  ins, outs = (params_sh, rt.layouts.batch()), (grads_sh, repl, codes_sh)
  if comms.mode == "manual":
    body = lambda params, b: (lambda g, l, c: (g, l, c[None]))(*fn(params, b))
    f = jax.jit(comms.program(body, ins, outs), in_shardings=ins, out_shardings=outs)
  else:
    f = jax.jit(fn, in_shardings=ins, out_shardings=outs)
  b = jax.device_put(batch(cfg), rt.layouts.batch())
  compiled = f.lower(params, b).compile()
  grads, loss, codes = compiled(params, b)
  grads = _to_model_order(cfg, jax.device_get(grads), p)
  return Result(float(loss), grads, np.asarray(codes), rt, compiled)


@functools.lru_cache(maxsize=None)
def reference(*model, microbatches: int = 1):
  """Single device, fp32, no pipeline: (mean loss, grads) of the same batch and init, for BASE
  with `model` overrides. An MoE model's router losses are per micro-batch: `microbatches`
  accumulates as many (`accumulate.accumulate_grads`), like the pipeline's."""
  cfg = small_config(None, *BASE, *model)
  loss_fn = ts.make_loss_fn(state_lib.model_graphdef(cfg), cfg)
  b = jax.tree.map(jnp.asarray, batch(cfg))
  if microbatches > 1:
    out = jax.jit(lambda p: accumulate.accumulate_grads(loss_fn, p, b, microbatches))(
        _params(*model))
    return float(out.loss), jax.device_get(out.grads)

  def mean_loss(params):
    loss_sum, count, _ = loss_fn(params, b)
    return loss_sum / count

  loss, grads = jax.jit(jax.value_and_grad(mean_loss))(_params(*model))
  return float(loss), jax.device_get(grads)


def max_rel_err(grads, ref) -> float:
  """Largest |g - r| / max|r| over leaves (relative to each leaf's scale)."""
  errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)),
                      grads, ref)
  return max(jax.tree.leaves(errs))
