"""The comms seam in "xla" mode: each operation is a sharding annotation; XLA (GSPMD) inserts
the collectives. Arrays are global; the mesh and the logical rules decide every layout.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jscale.parallel.comms import Comms, Names
from jscale.sharding import Layouts, spec


class XlaComms(Comms):
  """Sharding constraints from the logical rules of `layouts`."""

  mode = "xla"

  def __init__(self, layouts: Layouts):
    self.layouts = layouts

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self.layouts.activation(names))

  def gather_params(self, layer_params: Any) -> Any:
    # ZeRO-3: weights are stored split over fsdp; ask for the compute layout right before use,
    # so XLA all-gathers one layer at a time inside the layer scan (and frees it after).
    if self.layouts.zero_stage < 3:
      return layer_params

    def gather(v: nnx.Variable):
      names = [n for n in v.get_metadata()["out_sharding"] if n != "layers"]
      sharding = jax.sharding.NamedSharding(self.layouts.mesh, spec(names, self.layouts.rules))
      return v.replace(jax.lax.with_sharding_constraint(v[...], sharding))

    return jax.tree.map(gather, layer_params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    # With sequence parallelism this is the all-gather along the sequence (playbook's g).
    return self.activation(x_BLD, ("batch", "seq", "embed"))

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    # All-reduce of the row-parallel partial sums, or reduce-scatter along sequence under SP.
    return self.activation(y_BLD, ("batch", "res_seq", "embed"))

  def grad_accumulator(self, grads: Any) -> Any:
    return jax.lax.with_sharding_constraint(grads, self.layouts.named(self.layouts.grads))

  def sync_grads(self, grads: Any) -> Any:
    return self.grad_accumulator(grads)
