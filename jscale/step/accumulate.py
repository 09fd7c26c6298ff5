"""Gradient accumulation (playbook: "Gradient accumulation"): one optimizer step's gradient
summed over micro-batches in a `lax.scan`, reduced over devices once, at the end; and `Grads`,
what both step paths (this one and the pipeline's, `jscale.step.pipelined`) hand the optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jscale.model import layer_microbatches
from jscale.parallel.comms import LOCAL, Comms

Batch = dict[str, jax.Array]
# The loss function's statistics that are terms of the objective: MoE's weighted router
# losses, multi-token prediction's.
OBJECTIVE = ("moe_loss", "mtp_objective")
# Those that are sums over this device's tokens of the micro-batch, as the token loss is
# (multi-token prediction's): scaled alike by the step's 1 / token count and summed over the
# batch's devices, so that they do not depend on the micro-batch split (a micro-batch mean
# would weigh a micro-batch of few unmasked tokens as much as a full one). The others (the
# router statistics, already global means over the micro-batch's tokens or sequences) are
# averaged over micro-batches.
TOKEN_SUMS = ("mtp_loss", "mtp_objective")


class Grads(NamedTuple):
  """One step's gradient contract, the same with or without pipeline stages."""
  grads: Any  # fp32, not yet reduced over the data-parallel axes (`Comms.sync_grads`)
  loss: jax.Array  # mean token loss over the global batch
  count: jax.Array  # tokens in the global batch
  stats: dict  # MoE router statistics, averaged over layers and micro-batches ({} if dense);
  # TOKEN_SUMS as means over the global batch's tokens
  dot_state: Any  # the products' new state (FP8's amax histories; {} without)


def split_microbatches(batch: Batch, m: int) -> Batch:
  """[B, ...] -> [m, B/m, ...] (gradient accumulation and the pipeline): micro-batch j takes
  rows j, j+m, ...; with the batch split over devices in blocks every device keeps its own rows
  (no data moves), each micro-batch drawing from all devices."""
  return layer_microbatches.split(batch, m)


def token_count(batch: Batch, comms: Comms) -> jax.Array:
  """The global batch's token count (the loss mask's sum), known before any backward."""
  return comms.batch_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32)))


def accumulate_grads(loss_fn: Callable, params, batch: Batch, microbatches: int,
                     comms: Comms = LOCAL, dot_state: Any = None) -> Grads:
  """Gradient of the mean token loss over the whole batch, summed over micro-batches (a scan).

  The token count is known before the backward (it is the mask's sum), so each micro-batch
  differentiates its loss sum divided by the total count: the summed gradients are the
  full-batch mean gradient (up to summation order), with no extra pass over them to divide.
  An MoE model's router losses are added per micro-batch, divided by their number; MTP's
  token sums are scaled as the token loss (`TOKEN_SUMS`).

  `dot_state` (FP8's amax histories) is differentiated too: its "gradient" is its new value
  (`jscale.fp8.dot`), combined over micro-batches by a max (each micro-batch pushes its amaxes
  onto the same old history: the max keeps the step's amax).
  """
  count = token_count(batch, comms)
  scale = 1.0 / jnp.maximum(count, 1.0)
  with jax.named_scope("backward"):
    if microbatches == 1:  # (xla mode: XLA reduces each layer's gradient in the backward)
      grads, loss, stats, new_dots = _grad_loop(comms, loss_fn, params, dot_state or {},
                                                batch, scale, 1)
    else:  # each batch shard sums its micro-batches' gradients, reduced once (`over_batch`)
      grads, loss, stats, new_dots = comms.over_batch(
          lambda c, p, d, b, s: _grad_loop(c, loss_fn, p, d, b, s, microbatches), params,
          dot_state or {}, batch, scale)
  return Grads(grads, comms.batch_sum(loss), count, stats, new_dots)


def batch_sums(stats: dict, comms: Comms) -> dict:
  """`stats` with the `TOKEN_SUMS` (already scaled by 1 / the step's token count) summed over
  the devices holding other rows (`comms`: the gradient loop's, which inside xla mode's
  per-shard region sums over its manual batch axes; the other statistics leave it as global
  values, `XlaZero.over_batch`)."""
  return {k: comms.batch_sum(v) if k in TOKEN_SUMS else v for k, v in stats.items()}


def _grad_loop(comms: Comms, loss_fn: Callable, params, dot_state, batch: Batch, scale,
               microbatches: int):
  """(grads, loss sum, statistics, new dot_state) of `batch` in `microbatches` (a scan)."""
  wrt, step_comms = comms.grad_target(params)

  def scaled_loss(p, d, mb):
    loss_sum, _, stats = loss_fn(p, mb, comms=step_comms, dot_state=d)
    stats = {k: v * scale if k in TOKEN_SUMS else v / microbatches for k, v in stats.items()}
    return (loss_sum * scale + sum(stats.pop(k, 0.0) for k in OBJECTIVE),
            (loss_sum * scale, stats))

  grad_fn = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)

  def one(mb):
    (_, aux), (g, new_dots) = grad_fn(wrt, dot_state, mb)
    g = comms.grad_accumulator(jax.tree.map(lambda x: x.astype(jnp.float32), g))
    return g, new_dots, aux

  if microbatches == 1:
    grads, new_dots, (loss, stats) = one(batch)
    return grads, loss, batch_sums(stats, comms), new_dots

  def body(carry, mb):
    g, d, aux = one(mb)
    acc_g, acc_d, acc_aux = carry
    return (jax.tree.map(jnp.add, acc_g, g), jax.tree.map(jnp.maximum, acc_d, d),
            jax.tree.map(jnp.add, acc_aux, aux)), None

  mbs = split_microbatches(batch, microbatches)
  first = jax.tree.map(lambda x: x[0], mbs)
  stats = jax.eval_shape(lambda: loss_fn(wrt, first, comms=step_comms,
                                         dot_state=dot_state)[2])  # forward only
  stats0 = {k: jnp.zeros(v.shape, v.dtype) for k, v in stats.items() if k not in OBJECTIVE}
  zeros = (comms.zero_grads(params), jax.tree.map(jnp.zeros_like, dot_state),
           (jnp.zeros((), jnp.float32), stats0))
  (grads, new_dots, (loss, stats)), _ = jax.lax.scan(body, zeros, mbs)
  return grads, loss, batch_sums(stats, comms), new_dots
