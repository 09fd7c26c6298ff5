"""The "xla" mode: each seam operation is a sharding annotation and XLA (GSPMD) inserts the
collectives. Arrays are global; the mesh and the logical rules (`jscale.sharding.Layouts`)
decide every layout. This file only composes the per-axis halves: DP / ZeRO (`zero`), TP / SP
(`tensor`), CP (`context`), EP (`expert`) and PP (`pipeline.region`).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jscale.model.seam import Names
from jscale.parallel.comms import Comms
from jscale.parallel.context.modes import XlaContext
from jscale.parallel.expert import XlaExpert
from jscale.parallel.pipeline.region import XlaStages
from jscale.parallel.tensor import XlaTensor
from jscale.parallel.zero import XlaZero
from jscale.sharding import Layouts


class XlaComms(XlaZero, XlaTensor, XlaContext, XlaExpert, XlaStages, Comms):
  """Sharding constraints from the logical rules of `layouts`."""

  mode = "xla"

  def __init__(self, layouts: Layouts, in_stage_region: bool = False):
    self.layouts = layouts
    # Inside the pipeline's shard_map (manual over `stage` only) constraints are bare specs,
    # resolved against that region's mesh.
    self.in_stage_region = in_stage_region

  def _sharding(self, s: P) -> NamedSharding | P:
    return s if self.in_stage_region else NamedSharding(self.layouts.mesh, s)

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self._sharding(self.layouts.activation(names).spec))

  def local_shape(self, shape, names):
    return tuple(self.layouts.activation(names).shard_shape(tuple(shape)))

  def kernel(self, fn, args, in_names, out_names):
    # shard_map over the logical layouts: XLA reshards the operands to them if needed, the
    # kernel sees one device's block (pipeline stage region: nested in the stage shard_map).
    spec = lambda names: self.layouts.activation(names).spec
    mesh = None if self.in_stage_region else self.layouts.mesh
    axes = set(self.layouts.mesh.axis_names) - ({"stage"} if self.in_stage_region else set())
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(n) for n in in_names),
                         out_specs=spec(out_names), axis_names=axes, check_vma=False)(*args)
