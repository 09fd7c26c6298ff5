"""The "xla" mode: each seam operation is a sharding annotation and XLA (GSPMD) inserts the
collectives. Arrays are global; the mesh and the logical rules (`jscale.sharding.Layouts`)
decide every layout. This file only composes the per-axis halves: DP / ZeRO (`zero`), TP / SP
(`tensor`), CP (`context`), EP (`expert`) and PP (`pipeline.region`).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jscale.model.seam import Names
from jscale.parallel.comms import Comms
from jscale.parallel.context.modes import XlaContext
from jscale.parallel.context.ulysses import XlaUlysses
from jscale.parallel.expert import XlaExpert
from jscale.parallel.pipeline.region import XlaStages
from jscale.parallel.tensor import XlaTensor
from jscale.parallel.zero import XlaZero
from jscale.sharding import Layouts, without_axes


class XlaComms(XlaZero, XlaTensor, XlaUlysses, XlaContext, XlaExpert, XlaStages,
               Comms):
  """Sharding constraints from the logical rules of `layouts`."""

  mode = "xla"

  def __init__(self, layouts: Layouts, manual_axes: frozenset[str] = frozenset()):
    self.layouts = layouts
    # Inside a shard_map manual over `manual_axes` (the pipeline's stage region; the gradient
    # loop over the batch axes, `over_batch`) arrays are those axes' shards: constraints are
    # bare specs without them, resolved against the region's mesh, and sums over the batch
    # include the other shards explicitly.
    self.manual_axes = frozenset(manual_axes)

  def with_manual_axes(self, axes: frozenset[str]) -> "XlaComms":
    """This mode inside a shard_map manual over `axes` (the stage region, the batch loop)."""
    return type(self)(self.layouts, manual_axes=axes)

  @property
  def in_stage_region(self) -> bool:
    return "stage" in self.manual_axes

  @property
  def local_batch_axes(self) -> tuple[str, ...]:
    """The batch axes whose shards the gradient loop keeps apart (`over_batch`): `data`, and
    `fsdp` below ZeRO-2 (the weights are whole there, so a shard's gradient is its own until
    the step's one reduction); only axes of size > 1, in the batch rule's (major-first) order."""
    size, zero = self.layouts.mesh.shape, self.layouts.zero_stage
    ok = {"data"} | ({"fsdp"} if zero < 2 else set())
    return tuple(a for a in self.layouts.rules["batch"] if a in ok and size[a] > 1)

  def _spec(self, s: P) -> P:
    return without_axes(s, self.manual_axes)

  def _sharding(self, s: P) -> NamedSharding | P:
    if self.manual_axes:
      return self._spec(s)
    return NamedSharding(self.layouts.mesh, s)

  def _shard_map(self, fn, in_specs, out_specs):
    """shard_map over every axis not already manual (nested in a region: its mesh)."""
    mesh = None if self.manual_axes else self.layouts.mesh
    axes = set(self.layouts.mesh.axis_names) - self.manual_axes
    strip = lambda t: jax.tree.map(self._spec, t, is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(fn, mesh=mesh, in_specs=strip(in_specs), out_specs=strip(out_specs),
                         axis_names=axes, check_vma=False)

  def _over_manual_batch(self, reduce, x):
    axes = tuple(a for a in self.local_batch_axes if a in self.manual_axes)
    return reduce(x, axes) if axes else x

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self._sharding(self.layouts.activation(names).spec))

  def local_shape(self, shape, names):
    spec = self._spec(self.layouts.activation(names).spec)
    return tuple(NamedSharding(self.layouts.mesh, spec).shard_shape(tuple(shape)))

  def kernel(self, fn, args, in_names, out_names):
    # shard_map over the logical layouts: XLA reshards the operands to them if needed, the
    # kernel sees one device's block (in a region: nested in its shard_map).
    spec = lambda names: self.layouts.activation(names).spec
    return self._shard_map(fn, tuple(spec(n) for n in in_names), spec(out_names))(*args)

  def kernel_device(self):
    return self.layouts.mesh.devices.flat[0]

  def amax(self, x: jax.Array) -> jax.Array:
    return self._over_manual_batch(jax.lax.pmax, super().amax(x))

  def batch_sum(self, x: jax.Array) -> jax.Array:
    return self._over_manual_batch(jax.lax.psum, x)
