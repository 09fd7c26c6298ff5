"""The comms seam in "xla" mode: each operation is a sharding annotation; XLA (GSPMD) inserts
the collectives. Arrays are global; the mesh and the logical rules decide every layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jscale.model import attention as attn_lib
from jscale.model import moe_dispatch as md
from jscale.parallel.comms import GATHERED, Comms, Names, gather_layers_in_place
from jscale.parallel.context.ring import ring_attention
from jscale.sharding import Layouts, add_fsdp, spec


class XlaComms(Comms):
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

  @property
  def stages(self) -> int:
    return self.layouts.mesh.shape["stage"]

  def in_pipeline(self) -> "XlaComms":
    return XlaComms(self.layouts, in_stage_region=True)

  def over_stages(self, fn: Callable, params: Any, microbatches: Any, scale: jax.Array,
                  grads: bool = True):
    # Manual over `stage` only: XLA still partitions data / fsdp / tensor inside each stage.
    blocks = lambda tree: {k: jax.tree.map(lambda _: P("stage") if k == "blocks" else P(), v)
                           for k, v in tree.items()}
    region = jax.shard_map(
        lambda *a: (lambda g, loss, codes: (g, loss, codes[None]))(*fn(*a)),
        mesh=self.layouts.mesh, in_specs=(blocks(params), P(), P()),
        out_specs=(blocks(params) if grads else None, P(), P("stage")), axis_names={"stage"},
        check_vma=False)
    return region(params, microbatches, scale)

  def gather_params(self, layer_params: Any, dtype: Any) -> Any:
    # ZeRO-2/3 per layer, inside the layer scan. Backward: the layer's gradient is constrained
    # to its fsdp shard, so it is reduce-scattered as soon as it is computed and the scan never
    # stacks full-size gradients. ZeRO-3 forward: weights are stored split over fsdp; ask for the
    # compute layout right before use, so XLA all-gathers one layer at a time (and frees it).
    # In a pipeline stage (ZeRO-2 at most) each chunk's gradient is sharded by `stage_grads`.
    if self.layouts.zero_stage < 2 or self.in_stage_region:
      return layer_params
    rules, fsdp = self.layouts.rules, self.layouts.mesh.shape["fsdp"]

    def gather(v: nnx.Variable):
      names = [n for n in v.get_metadata()["out_sharding"] if n != "layers"]
      compute = spec(names, rules)
      shard = self._sharding(add_fsdp(names, v.shape, compute, fsdp))
      x = _shard_cotangent(v[...], shard)
      if self.layouts.zero_stage >= 3:
        # Cast the shard (the model casts at use anyway): a bf16 gather moves half the bytes.
        x = jax.lax.with_sharding_constraint(x.astype(dtype), shard)
        # The barrier keeps the gather's operand this layer's 2-D slice: otherwise XLA:CPU
        # re-lays out the whole stacked shard before the loop (a copy of every layer's shard).
        x = jax.lax.optimization_barrier(x)
        x = checkpoint_name(
            jax.lax.with_sharding_constraint(x, self._sharding(compute)), GATHERED)
      return v.replace(x)

    return jax.tree.map(gather, layer_params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def gather_updated_params(self, new_params: Any, old_params: Any) -> Any:
    # ZeRO-1/2 update shards with the sharded optimizer state, then all-gather the new weights.
    # Stacked weights: one layer at a time, in place (`gather_layers_in_place`).
    layouts = self.layouts
    if layouts.zero_stage not in (1, 2):
      return new_params
    named = lambda s: NamedSharding(layouts.mesh, s)

    def gather(new, old, names, sharded, compute):
      new = jax.lax.with_sharding_constraint(new, named(sharded))
      if names[0] != "layers":
        return jax.lax.with_sharding_constraint(new, named(compute))
      layer = named(spec(names[1:], layouts.rules))
      return gather_layers_in_place(new, old,
                                    lambda x: jax.lax.with_sharding_constraint(x, layer))

    return jax.tree.map(gather, new_params, old_params, layouts.names, layouts.sharded,
                        layouts.compute, is_leaf=lambda x: isinstance(x, tuple))

  def kernel(self, fn, args, in_names, out_names):
    # shard_map over the logical layouts: XLA reshards the operands to them if needed, the
    # kernel sees one device's block (pipeline stage region: nested in the stage shard_map).
    spec = lambda names: self.layouts.activation(names).spec
    mesh = None if self.in_stage_region else self.layouts.mesh
    axes = set(self.layouts.mesh.axis_names) - ({"stage"} if self.in_stage_region else set())
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(n) for n in in_names),
                         out_specs=spec(out_names), axis_names=axes, check_vma=False)(*args)

  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions_BL, impl: str,
                interpret: bool = False) -> jax.Array:
    layouts = self.layouts
    if layouts.mesh.shape["sequence"] == 1:
      return super().attention(q_BLHK, k_BSGK, v_BSGK, positions_BL, impl, interpret)
    if impl in ("ring", "pallas"):  # the hand-written ring, on the shards XLA already holds
      q_spec = layouts.activation(("batch", "seq", "heads", "head_dim")).spec
      kv_spec = layouts.activation(("batch", "seq", "kv_heads", "head_dim")).spec
      ring = functools.partial(ring_attention, axis_name="sequence",
                               layout=layouts.context_layout,
                               block=attn_lib.ring_blocks(impl, interpret))
      return attn_lib.named(jax.shard_map(
          ring, mesh=layouts.mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
          check_vma=False)(q_BLHK, k_BSGK, v_BSGK))
    # The playbook's all-gather variant: every device sees all keys and values (and their
    # positions, for the mask) and keeps its own queries.
    kv_names = ("batch", None, "kv_heads", "head_dim")
    k_BSGK, v_BSGK = self.activation(k_BSGK, kv_names), self.activation(v_BSGK, kv_names)
    pos_k_BS = self.activation(positions_BL, ("batch", None))
    ctx_BLHK = attn_lib.attention(q_BLHK, k_BSGK, v_BSGK, impl,
                                  positions=(positions_BL, pos_k_BS))
    # Pinning the output (hence its cotangent) to the queries' layout keeps GSPMD from picking a
    # layout for the backward's score matmuls that it can only reach by replicating (with SP).
    return self.activation(ctx_BLHK, ("batch", "seq", "heads", "head_dim"))

  def expert_groups(self, batch: int) -> int:
    size = self.layouts.mesh.shape
    return math.prod(size[a] for a in self.layouts.rules["batch"])

  def experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype):
    # GShard: a per-group [E, C, D] slot buffer (dropless: C = T, so nothing overflows); the
    # constraint moving its expert dim onto `expert` (and groups off it) is an all-to-all.
    rules = self.layouts.rules
    e, (t, k) = w.gate_EDF.shape[0], ids_GTK.shape[1:]
    cap = t if moe.dispatch == "dropless" else md.capacity(t, k, e, moe.capacity_factor)
    by_group = P(_axes(rules["batch"]), None, None, None)
    by_expert = P(_axes([a for a in rules["batch"] if a not in rules["experts"]]),
                  _axes(rules["experts"]), None, None)
    pin = lambda x, s: jax.lax.with_sharding_constraint(x, self._sharding(s))
    pos_GTK = jax.vmap(md.slots, in_axes=(0, None))(ids_GTK, e)
    buf = jax.vmap(md.dispatch, in_axes=(0, 0, 0, None, None))(x_GTD.astype(dtype), ids_GTK,
                                                               pos_GTK, e, cap)
    buf = pin(pin(buf, by_group), by_expert)
    y = pin(jax.vmap(md.dense_ffn, in_axes=(0, None, None))(buf, w, dtype), by_expert)
    y_GTD = jax.vmap(md.combine)(pin(y, by_group), ids_GTK, pos_GTK, gates_GTK)
    return y_GTD, jnp.sum(pos_GTK >= cap)

  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    # With sequence parallelism this is the all-gather along the sequence (playbook's g).
    return self.activation(x_BLD, ("batch", "seq", "embed"))

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    # All-reduce of the row-parallel partial sums, or reduce-scatter along sequence under SP.
    return self.activation(y_BLD, ("batch", "res_seq", "embed"))

  def grad_accumulator(self, grads: Any) -> Any:
    return jax.lax.with_sharding_constraint(grads, self.layouts.named(self.layouts.grads))

  def stage_grads(self, grads: Any) -> Any:
    # Inside the stage region (manual over `stage`): the ZeRO-2 shard layout minus `stage`.
    if self.layouts.zero_stage < 2:
      return grads
    specs = {k: self.layouts.grads[k] for k in grads}
    return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, self._sharding(_without_stage(s))),
                        grads, specs, is_leaf=lambda x: isinstance(x, P))

  def sync_grads(self, grads: Any) -> Any:
    return self.grad_accumulator(grads)


def _axes(axes) -> str | tuple[str, ...] | None:
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _without_stage(s: P) -> P:
  drop = lambda e: (None if e == "stage" else
                    tuple(a for a in e if a != "stage") or None if isinstance(e, tuple) else e)
  return P(*(drop(e) for e in s))


def _shard_cotangent(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Identity whose cotangent is constrained to `sharding` (a reduce-scatter point)."""

  @jax.custom_vjp
  def identity(x):
    return x

  identity.defvjp(lambda x: (x, None),
                  lambda _, g: (jax.lax.with_sharding_constraint(g, sharding),))
  return identity(x)
