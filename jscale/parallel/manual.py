"""The "manual" mode: the whole step runs in one `jax.shard_map`, arrays are per-device shards,
and every communication is a collective written by hand. This file only composes the per-axis
halves: DP / ZeRO (`zero`), TP / SP (`tensor`), CP (`context`), EP (`expert`) and PP
(`pipeline.region`); `dp` below = the data, expert and sequence axes of size > 1, over which
gradients are summed (CP: every axis that splits the tokens).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from jscale.model.seam import Names
from jscale.parallel.comms import Comms
from jscale.parallel.context.modes import ManualContext
from jscale.parallel.context.ulysses import ManualUlysses
from jscale.parallel.expert import ManualExpert
from jscale.parallel.pipeline.region import ManualStages
from jscale.parallel.tensor import ManualTensor
from jscale.parallel.zero import ManualZero
from jscale.sharding import Layouts


class ManualComms(ManualZero, ManualTensor, ManualUlysses, ManualContext, ManualExpert,
                  ManualStages, Comms):
  """Hand-written collectives for the layouts of `layouts` (same state layout as xla mode)."""

  mode = "manual"

  def __init__(self, layouts: Layouts, bucket_mb: float, collective_matmul: bool = False,
               expert_chunks: int = 1):
    self.layouts, self.mesh = layouts, layouts.mesh
    size = dict(layouts.mesh.shape)
    self.tp, self.fsdp, self.cp = size["tensor"], size["fsdp"], size["sequence"]
    self.sp = self.tp > 1 and "tensor" in layouts.rules["res_seq"]
    self.collective_matmul = collective_matmul
    self.expert_chunks = expert_chunks
    self.batch_axes = tuple(a for a in ("data", "fsdp", "expert", "sequence") if size[a] > 1)
    # Gradients are summed over every axis that splits the tokens (CP: `sequence` too).
    self.dp_axes = tuple(a for a in ("data", "expert", "sequence") if size[a] > 1)
    self.amax_axes = tuple(a for a, n in size.items() if n > 1 and a != "stage")
    self._init_zero(bucket_mb)

  def kernel_device(self):
    return self.mesh.devices.flat[0]

  def program(self, fn: Callable, in_shardings: Any, out_shardings: Any) -> Callable:
    specs = lambda t: jax.tree.map(lambda s: s.spec, t,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_shardings),
                         out_specs=specs(out_shardings), check_vma=False)

  def batch_sum(self, x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, self.batch_axes) if self.batch_axes else x

  def amax(self, x: jax.Array) -> jax.Array:
    # A shard's max, then the max over every axis that may split the tensor (batch, sequence,
    # heads / hidden, experts). Not over `stage`: stages hold different layers.
    local = super().amax(x)
    return jax.lax.pmax(local, self.amax_axes) if self.amax_axes else local

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    del names  # already a per-device shard
    return x
