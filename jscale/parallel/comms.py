"""The train step's seam: what one optimizer step needs from a parallel layout besides the
model's forward operations (`jscale.model.seam.Seam`, which `Comms` extends).

Three groups, each with its single-device default here: the step as one program and the
pipeline's stage region; gradients (accumulation, the once-per-step reduction, the norm); and
the optimizer's side of ZeRO (which part a device updates, gathering the updated weights).
`jscale.parallel.xla.XlaComms` and `jscale.parallel.manual.ManualComms` compose the per-axis
implementations (`zero`, `tensor`, `context`, `expert`, `pipeline`) into the two modes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jscale.model.seam import Seam
from jscale.optim import global_norm


class Comms(Seam):
  """One device: the model's seam plus the step's operations, all without communication."""

  # ---------------------------------------------------------------- the step's program

  def program(self, fn: Callable, in_shardings: Any, out_shardings: Any) -> Callable:
    """The function a step jits: `fn` on global arrays, or (manual) on each device's shards."""
    del in_shardings, out_shardings
    return fn

  def batch_sum(self, x: jax.Array) -> jax.Array:
    """Sums a per-batch quantity (loss, token count) over the devices holding other rows."""
    return x

  # ---------------------------------------------------------------- pipeline stages

  @property
  def stages(self) -> int:
    """Pipeline stages (the `stage` mesh axis size)."""
    return 1

  def in_pipeline(self) -> "Comms":
    """The seam to use inside `over_stages` (xla mode: constraints as bare specs)."""
    return self

  def over_stages(self, fn: Callable, params: Any, dots: Any, microbatches: Any,
                  scale: jax.Array, grads: bool = True):
    """Runs `fn(params, dots, microbatches, scale) -> (grads, loss, codes, new dots)` on each
    stage's shards: layer weights, their gradients and their product state (`dots`, stacked
    like them: FP8's amax histories, {} without) split over `stage` (the pipeline's executor
    runs in it). `grads=False`: forward only, `fn` returns None for the gradients and the new
    dots."""
    raise NotImplementedError("pipeline parallelism needs a mesh with a stage axis")

  # ---------------------------------------------------------------- gradients

  def over_batch(self, fn: Callable, params: Any, dot_state: Any, batch: Any,
                 scale: jax.Array) -> Any:
    """Runs the gradient loop over micro-batches, `fn(comms, params, dot_state, batch, scale)
    -> (grads, loss sum, statistics, new dot_state)`, with gradients summed over the whole
    batch (xla mode: in a region where each batch shard accumulates its own, reduced once)."""
    return fn(self, params, dot_state, batch, scale)

  def grad_target(self, params: Any) -> tuple[Any, "Comms"]:
    """(what the gradient is taken with respect to, the seam its forward runs through); manual
    ZeRO-2: the layer weights' fsdp shards, and a seam whose layer scan reads the stored
    full weights (`jscale.parallel.zero.StoredLayers`)."""
    return params, self

  def zero_grads(self, params: Any) -> Any:
    """The fp32 gradient accumulator before the first micro-batch."""
    return self.grad_accumulator(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def grad_accumulator(self, grads: Any) -> Any:
    """One micro-batch's gradient, in the accumulator's layout (ZeRO-2: reduced to a shard)."""
    return grads

  def stage_grads(self, grads: Any) -> Any:
    """One pipeline (micro-batch, chunk) gradient in the stage accumulator's layout: a dict with
    some of the parameters' top-level keys, stacked leaves holding one chunk's layers (ZeRO-2:
    reduced to this device's fsdp shard, so the accumulators are shard-sized)."""
    return grads

  def sync_grads(self, grads: Any) -> Any:
    """Reduces gradients over the data-parallel axes, once per optimizer step."""
    return grads

  def grad_norm(self, grads: Any) -> jax.Array:
    """Global L2 norm of the synced gradients (whatever devices their pieces live on)."""
    return global_norm(grads, by_slice=self.norm_by_slice())

  def norm_by_slice(self) -> bool:
    """Whether the gradient norm reduces a stacked gradient layer by layer (`optim.sumsq`):
    where the step runs on XLA:CPU, which does not fuse the square into the reduction."""
    return self.kernel_device().platform == "cpu"

  # ---------------------------------------------------------------- the optimizer's ZeRO

  def params_for_update(self, params: Any) -> Any:
    """The part of the parameters this device updates (ZeRO-1/2 manual: its fsdp shard)."""
    return params

  def gather_updated_params(self, new_params: Any, old_params: Any) -> Any:
    """ZeRO-1/2: parameters updated shard by shard, made whole again (may reuse `old_params`)."""
    del old_params
    return new_params


LOCAL = Comms()
