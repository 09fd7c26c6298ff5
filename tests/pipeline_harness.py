"""Shared by the pipeline tests: one step's loss and gradients through the pipeline, and the
single-device reference on the same batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import small_config
from jscale import runtime
from jscale import train_step as ts
from jscale.parallel.pipeline import layout, step as pipeline_step

# 8 layers: p x v = 4 x 2 chunks of one layer. kv_heads 4: tensor=2 divides everything.
BASE = ("model.n_layers=8", "model.n_kv_heads=4", "train.batch_size=16", "train.seq_len=16")


def batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  mask = np.ones((b, l), np.float32)
  mask[0, l // 2:] = 0.0
  return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}


def _to_model_order(cfg, grads, p):
  return {**grads, "blocks": layout.to_model(grads["blocks"], cfg.model.n_layers, p,
                                             cfg.pipeline.virtual_stages)}


def pipeline_grads(*overrides, with_codes=False):
  """(loss, grads in model layer order, executed codes [p, T] or None, runtime)."""
  cfg = small_config(None, *BASE, *overrides)
  n = int(np.prod([int(o.split("=")[1]) for o in overrides
                   if o.split("=")[0] in ("mesh.stage", "mesh.data", "mesh.tensor", "mesh.fsdp")]))
  rt = runtime.build(cfg, jax.devices()[:n])
  state = rt.init_state()
  p = rt.mesh.shape["stage"]
  comms, params_sh = rt.comms, rt.state_shardings["params"]
  repl = NamedSharding(rt.mesh, P())

  def fn(params, b):
    out = pipeline_step.grads(cfg, rt.graphdef, comms, params, b, with_codes=True)
    grads, loss, _, _, codes = out
    return comms.sync_grads(grads), loss, codes

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
  grads, loss, codes = f(state["params"], jax.device_put(batch(cfg), rt.layouts.batch()))
  grads = _to_model_order(cfg, jax.device_get(grads), p)
  return float(loss), grads, np.asarray(codes), rt


@functools.lru_cache(maxsize=None)
def reference():
  """Single device, fp32, no pipeline: (mean loss, grads) of the same batch and init."""
  cfg = small_config(None, *BASE)
  params = ts.init_state(cfg)["params"]
  loss_fn = ts.make_loss_fn(ts.model_graphdef(cfg), cfg)
  b = jax.tree.map(jnp.asarray, batch(cfg))

  def mean_loss(params):
    loss_sum, count, _ = loss_fn(params, b)
    return loss_sum / count

  loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
  return float(loss), jax.device_get(grads)


def max_rel_err(grads, ref) -> float:
  """Largest |g - r| / max|r| over leaves (relative to each leaf's scale)."""
  errs = jax.tree.map(lambda g, r: float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)),
                      grads, ref)
  return max(jax.tree.leaves(errs))
