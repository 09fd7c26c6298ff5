"""The pipeline's stage region in both modes: where the executor (`executor.run`) runs on one
stage's shards of the layer stack."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jscale.sharding import Layouts


class XlaStages:
  """xla mode (mixed into `XlaComms`): a shard_map manual over `stage` and the batch axes the
  gradient loop keeps apart (`local_batch_axes`: each shard sums its own micro-batches'
  gradients, the shards are summed once at the end), so XLA still partitions fsdp (ZeRO-2) /
  tensor inside each stage and reduces nothing per tick."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  layouts: Layouts
  local_batch_axes: tuple[str, ...]
  with_manual_axes: Callable[[frozenset[str]], Any]


  @property
  def stages(self) -> int:
    return self.layouts.mesh.shape["stage"]

  def in_pipeline(self):
    # Inside the stage region constraints are bare specs, resolved against its mesh.
    return self.with_manual_axes(frozenset({"stage", *self.local_batch_axes}))

  def over_stages(self, fn: Callable, params: Any, dots: Any, microbatches: Any,
                  scale: jax.Array, grads: bool = True):
    rows = self.local_batch_axes  # micro-batches are [m, b, ...]: b is split over them
    blocks = lambda tree: {k: jax.tree.map(lambda _: P("stage") if k == "blocks" else P(), v)
                           for k, v in tree.items()}
    # The layers' product state: stacked like them; its new value is already global (the
    # seam's `amax` reduces over the batch axes), so every row shard returns the same.
    stacked = lambda tree: jax.tree.map(lambda _: P("stage"), tree)

    def region(*args):
      g, out, codes, new_dots = fn(*args)  # out: the loss sum, or (loss sum, statistics)
      if rows:  # gradients and loss of this shard's rows only so far
        loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        g, loss = jax.lax.psum((g, loss), rows)
        out = loss if rest is None else (loss, *rest)
      return g, out, codes[None], new_dots

    mbs = jax.tree.map(lambda x: P(None, rows or None, *([None] * (x.ndim - 2))), microbatches)
    return jax.shard_map(
        region, mesh=self.layouts.mesh, in_specs=(blocks(params), stacked(dots), mbs, P()),
        out_specs=(blocks(params) if grads else None, P(), P("stage"),
                   stacked(dots) if grads else None),
        axis_names={"stage", *rows}, check_vma=False)(params, dots, microbatches, scale)


class ManualStages:
  """manual mode (mixed into `ManualComms`): the whole step already runs on each device's
  shards, the stage's layers among them."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  mesh: Mesh


  @property
  def stages(self) -> int:
    return self.mesh.shape["stage"]

  def over_stages(self, fn: Callable, params: Any, dots: Any, microbatches: Any,
                  scale: jax.Array, grads: bool = True):
    del grads
    return fn(params, dots, microbatches, scale)
