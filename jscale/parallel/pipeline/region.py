"""The pipeline's stage region in both modes: where the executor (`executor.run`) runs on one
stage's shards of the layer stack."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P


class XlaStages:
  """xla mode (mixed into `XlaComms`): a shard_map manual over `stage` only, so XLA still
  partitions data / fsdp / tensor inside each stage."""

  @property
  def stages(self) -> int:
    return self.layouts.mesh.shape["stage"]

  def in_pipeline(self):
    # Inside the stage region constraints are bare specs, resolved against its mesh.
    return type(self)(self.layouts, in_stage_region=True)

  def over_stages(self, fn: Callable, params: Any, microbatches: Any, scale: jax.Array,
                  grads: bool = True):
    blocks = lambda tree: {k: jax.tree.map(lambda _: P("stage") if k == "blocks" else P(), v)
                           for k, v in tree.items()}
    region = jax.shard_map(
        lambda *a: (lambda g, loss, codes: (g, loss, codes[None]))(*fn(*a)),
        mesh=self.layouts.mesh, in_specs=(blocks(params), P(), P()),
        out_specs=(blocks(params) if grads else None, P(), P("stage")), axis_names={"stage"},
        check_vma=False)
    return region(params, microbatches, scale)


class ManualStages:
  """manual mode (mixed into `ManualComms`): the whole step already runs on each device's
  shards, the stage's layers among them."""

  @property
  def stages(self) -> int:
    return self.mesh.shape["stage"]

  def over_stages(self, fn: Callable, params: Any, microbatches: Any, scale: jax.Array,
                  grads: bool = True):
    del grads
    return fn(params, microbatches, scale)
