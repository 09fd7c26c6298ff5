"""The comms seam in "manual" mode: the whole step runs in one `jax.shard_map`, arrays are
per-device shards, and every communication below is a collective written by hand.

What runs where (playbook names; `dp` = the data, expert and sequence axes, all of size > 1):
  * DP / ZeRO-0: gradients accumulate locally over micro-batches, then one bucketed all-reduce
    over dp + fsdp per optimizer step.
  * ZeRO-1: one bucketed reduce-scatter over fsdp (+ all-reduce over dp) per step; each device
    updates its slice of the weights and optimizer state; all-gather of the updated weights.
  * ZeRO-2: as ZeRO-1, but the gradient is taken with respect to the shards: each layer's
    stored full weights are used as they are and its gradient is reduce-scattered inside the
    backward scan (`_stored_weight`); the rest is reduce-scattered per micro-batch. Only shards
    are kept between layers and between micro-batches.
  * ZeRO-3: weights stored as shards; each layer's are all-gathered (in the compute dtype) right
    before use and gathered again in the backward; the gather's transpose reduce-scatters that
    layer's gradient inside the backward scan.
  * TP: f / g (`jscale.parallel.tensor`) around column / row-parallel linears; vocab-parallel
    embedding and cross-entropy. SP: all-gather / reduce-scatter along the sequence instead, and
    the (tensor-replicated) norm weights' gradients are all-reduced over tensor.
  * CP: ring attention over `sequence` (`jscale.parallel.context.ring`); everything else is
    per token, and gradients are summed over `sequence` with the other dp axes.
Leaves too small to split over fsdp (`sharding.add_fsdp`) stay whole and are all-reduced.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jscale.model import attention as attn_lib
from jscale.optim import sumsq
from jscale.parallel import expert, tensor
from jscale.parallel.context.ring import ring_attention
from jscale.parallel.buckets import Plan, reduce_buckets
from jscale.parallel.comms import GATHERED, Comms, Names, gather_layers_in_place
from jscale.sharding import Layouts, spec_axes

_POST = 1 << 30  # forward position of leaves after the layer stack (final norm, head)


def _fsdp_dim(s: P) -> int:
  return next((i for i, e in enumerate(s) if "fsdp" in ((e,) if isinstance(e, str) else e or ())),
              -1)


class ManualComms(Comms):
  """Hand-written collectives for the layouts of `layouts` (same state layout as xla mode)."""

  mode = "manual"

  def __init__(self, layouts: Layouts, bucket_mb: float):
    self.layouts, self.mesh, self.zero = layouts, layouts.mesh, layouts.zero_stage
    size = dict(layouts.mesh.shape)
    self.tp, self.fsdp, self.cp = size["tensor"], size["fsdp"], size["sequence"]
    self.sp = self.tp > 1 and "tensor" in layouts.rules["res_seq"]
    self.bucket_bytes = max(1, int(bucket_mb * 2**20))
    self.batch_axes = tuple(a for a in ("data", "fsdp", "expert", "sequence") if size[a] > 1)
    # Gradients are summed over every axis that splits the tokens (CP: `sequence` too).
    self.dp_axes = tuple(a for a in ("data", "expert", "sequence") if size[a] > 1)
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x)
    self.dims = jax.tree.map(lambda s: _fsdp_dim(s), layouts.sharded,
                             is_leaf=lambda x: isinstance(x, P))
    # fsdp dim by logical names (without `layers`): gather_params sees Variables, not paths.
    self.dim_by_names: dict[tuple[str, ...], int] = {}
    for names, d in zip(jax.tree.leaves(layouts.names, is_leaf=is_names),
                        jax.tree.leaves(self.dims)):
      key, d = tuple(n for n in names if n != "layers"), d - (names[0] == "layers" and d >= 0)
      if self.dim_by_names.setdefault(key, d) != d:
        raise ValueError(f"parameters named {key} are split over fsdp along different dims")
    self.step_plans = jax.tree_util.tree_map_with_path(
        lambda path, names, d, c: self._plan(path, names, d, c, microbatch=False),
        layouts.names, self.dims, layouts.compute, is_leaf=is_names)
    self.microbatch_plans, self.chunk_plans = (jax.tree_util.tree_map_with_path(
        lambda path, names, d, c: self._plan(path, names, d, c, microbatch=True, chunk=chunk),
        layouts.names, self.dims, layouts.compute, is_leaf=is_names) for chunk in (False, True))

  def _plan(self, path, names, dim: int, compute: P, microbatch: bool,
            chunk: bool = False) -> Plan:
    stacked = names[0] == "layers"
    position = 1 if stacked else 0 if getattr(path[0], "key", None) == "embed" else _POST
    split = self.fsdp > 1 and dim >= 0  # this leaf has an fsdp shard
    if microbatch:  # ZeRO-2: reduce-scatter each micro-batch's gradient (layers: already done
      # in the backward scan, except for a pipeline chunk's, reduced once per chunk)
      scatter = self.zero == 2 and split and (chunk or not stacked)
      return Plan(scatter="fsdp" if scatter else None, dim=dim, n=self.fsdp if scatter else 1,
                  stacked=stacked, position=position)
    # Summed over the axes that split the tokens, except those the leaf itself is split over
    # (experts over `expert`: each device's gradient is already its experts' whole).
    axes = [a for a in self.dp_axes if a not in spec_axes(compute)]
    if self.fsdp > 1 and not (split and self.zero >= 1):
      axes.append("fsdp")  # replicated over fsdp: a plain data-parallel axis for this leaf
    if self.sp and "tensor" not in spec_axes(compute) and "router" not in names:
      # Norm weights: each tensor rank saw a different sequence slice (the MoE router sees
      # the gathered sequence: its gradient is already whole).
      axes.append("tensor")
    scatter = split and self.zero == 1
    return Plan(tuple(axes), "fsdp" if scatter else None, dim, self.fsdp if scatter else 1,
                stacked, position)

  # ---------------------------------------------------------------- the step as one program

  def program(self, fn: Callable, in_shardings: Any, out_shardings: Any) -> Callable:
    specs = lambda t: jax.tree.map(lambda s: s.spec, t,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_shardings),
                         out_specs=specs(out_shardings), check_vma=False)

  def batch_sum(self, x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, self.batch_axes) if self.batch_axes else x

  @property
  def stages(self) -> int:
    return self.mesh.shape["stage"]

  def over_stages(self, fn: Callable, params: Any, microbatches: Any, scale: jax.Array,
                  grads: bool = True):
    del grads
    return fn(params, microbatches, scale)  # already on this device's shards

  # ---------------------------------------------------------------- parameters

  def gather_params(self, layer_params: Any, dtype: Any) -> Any:
    if isinstance(layer_params, _Zero2Layer):  # ZeRO-2: the stored weights, shard gradients
      shards = nnx.to_pure_dict(layer_params.shards)
      dims = jax.tree.map(lambda d: d - 1, self.dims["blocks"])
      return jax.tree.map(_stored_weight, shards, layer_params.full, dims)
    if self.zero < 3 or self.fsdp == 1:
      return layer_params

    def gather(v: nnx.Variable):
      dim = self.dim_by_names[tuple(n for n in v.get_metadata()["out_sharding"] if n != "layers")]
      if dim < 0:
        return v
      # The gather runs in the compute dtype (half the bytes of fp32 masters); under autodiff
      # its transpose is the reduce-scatter of this layer's gradient.
      full = jax.lax.all_gather(v[...].astype(dtype), "fsdp", axis=dim, tiled=True)
      return v.replace(checkpoint_name(full, GATHERED))

    return jax.tree.map(gather, layer_params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def bind(self, params: Any) -> "ManualComms":
    if self.zero != 2 or self.fsdp == 1:
      return self
    bound = copy.copy(self)
    bound._stored_blocks = params["blocks"]
    return bound

  def params_for_grad(self, params: Any) -> Any:
    if self.zero != 2 or self.fsdp == 1:
      return params
    return {**params, "blocks": self.params_for_update({"blocks": params["blocks"]},
                                                       {"blocks": self.dims["blocks"]})["blocks"]}

  def layer_inputs(self, stacked: Any) -> Any:
    stored = getattr(self, "_stored_blocks", None)
    return stacked if stored is None else _Zero2Layer(stacked, stored)

  def params_for_update(self, params: Any, dims: Any = None) -> Any:
    if self.zero not in (1, 2) or self.fsdp == 1:
      return params
    index = jax.lax.axis_index("fsdp")

    def shard(p, dim):
      if dim < 0:
        return p
      k = p.shape[dim] // self.fsdp
      return jax.lax.dynamic_slice_in_dim(p, index * k, k, axis=dim)

    return jax.tree.map(shard, params, self.dims if dims is None else dims)

  def gather_updated_params(self, new_params: Any, old_params: Any) -> Any:
    if self.zero not in (1, 2) or self.fsdp == 1:
      return new_params

    def gather(new, old, dim, names):
      if dim < 0:
        return new
      if names[0] != "layers":
        return jax.lax.all_gather(new, "fsdp", axis=dim, tiled=True)
      return gather_layers_in_place(
          new, old, lambda x: jax.lax.all_gather(x, "fsdp", axis=dim - 1, tiled=True))

    return jax.tree.map(gather, new_params, old_params, self.dims, self.layouts.names,
                        is_leaf=lambda x: isinstance(x, tuple))

  # ---------------------------------------------------------------- context parallelism

  def attention(self, q_BLHK, k_BSGK, v_BSGK, positions_BL, impl: str,
                interpret: bool = False) -> jax.Array:
    if self.cp == 1:  # a Pallas impl runs on this device's shards as they are
      return super().attention(q_BLHK, k_BSGK, v_BSGK, positions_BL, impl, interpret)
    # Context parallelism is always the ring here; the block math is the flash kernel for
    # attention_impl=pallas, else plain jnp.
    return attn_lib.named(ring_attention(q_BLHK, k_BSGK, v_BSGK, "sequence",
                                         layout=self.layouts.context_layout,
                                         block=attn_lib.ring_blocks(impl, interpret)))

  # ---------------------------------------------------------------- expert parallelism

  def token_sum(self, x: jax.Array) -> jax.Array:
    return tensor.reduce_from_tp(x, self.batch_axes) if self.batch_axes else x

  def router_input(self, h_GTD: jax.Array) -> jax.Array:
    return tensor.scale_grad(h_GTD, 1.0 / self.tp) if self.tp > 1 else h_GTD

  def expert_gates(self, gates_GTK: jax.Array) -> jax.Array:
    return tensor.copy_to_tp(gates_GTK, "tensor") if self.tp > 1 else gates_GTK

  def experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype):
    n_ep = self.mesh.shape["expert"]
    if n_ep == 1:
      return super().experts(x_GTD, ids_GTK, gates_GTK, w, moe, dtype)
    if moe.dispatch == "dropless":
      gpu = self.mesh.devices.flat[0].platform == "gpu"  # native ragged_all_to_all there
      y_TD = expert.dropless_exchange(x_GTD[0], ids_GTK[0], gates_GTK[0], w, dtype, "expert",
                                      n_ep, native_ragged=gpu)
      return y_TD[None], jnp.zeros((), jnp.int32)
    y_TD, dropped = expert.capacity_exchange(x_GTD[0], ids_GTK[0], gates_GTK[0], w, dtype,
                                             moe.capacity_factor, "expert", n_ep)
    return y_TD[None], dropped

  # ---------------------------------------------------------------- tensor parallelism

  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    if self.tp == 1:
      return x_BLD
    if self.sp:
      return tensor.gather_sequence(x_BLD, "tensor")
    return tensor.copy_to_tp(x_BLD, "tensor")

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    if self.tp == 1:
      return y_BLD
    if self.sp:
      return tensor.scatter_sequence(y_BLD, "tensor")
    return tensor.reduce_from_tp(y_BLD, "tensor")

  def embed(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    if self.tp == 1:
      return jnp.take(table_VD, tokens_BL, axis=0)
    # Vocab-parallel: each rank looks up the tokens in its slice of the vocab (zeros for the
    # others), and the partial rows are summed like a row-parallel output (g, or SP's scatter).
    ids_BL = tokens_BL - self.vocab_offset(table_VD.shape[0])
    mine_BL = (ids_BL >= 0) & (ids_BL < table_VD.shape[0])
    rows_BLD = jnp.take(table_VD, jnp.where(mine_BL, ids_BL, 0), axis=0)
    return self.leave_tensor_parallel(jnp.where(mine_BL[..., None], rows_BLD, 0))

  def vocab_max(self, x: jax.Array) -> jax.Array:
    m = jnp.max(jax.lax.stop_gradient(x), axis=-1, keepdims=True)
    return jax.lax.pmax(m, "tensor") if self.tp > 1 else m

  def vocab_sum(self, x: jax.Array) -> jax.Array:
    s = jnp.sum(x, axis=-1, keepdims=True)
    return tensor.reduce_from_tp(s, "tensor") if self.tp > 1 else s

  def vocab_offset(self, local_size: int) -> int | jax.Array:
    return jax.lax.axis_index("tensor") * local_size if self.tp > 1 else 0

  # ---------------------------------------------------------------- gradients

  def zero_grads(self, params: Any) -> Any:
    if self.zero != 2 or self.fsdp == 1:
      return super().zero_grads(params)

    def zeros(p, dim):
      shape = list(p.shape)
      if dim >= 0:
        shape[dim] //= self.fsdp
      return jnp.zeros(shape, jnp.float32)

    return jax.tree.map(zeros, params, self.dims)

  def grad_accumulator(self, grads: Any) -> Any:
    if self.zero != 2 or self.fsdp == 1:
      return grads
    return reduce_buckets(grads, self.microbatch_plans, self.bucket_bytes)

  def stage_grads(self, grads: Any) -> Any:
    if self.zero != 2 or self.fsdp == 1:
      return grads
    return reduce_buckets(grads, {k: self.chunk_plans[k] for k in grads}, self.bucket_bytes)

  def sync_grads(self, grads: Any) -> Any:
    return reduce_buckets(grads, self.step_plans, self.bucket_bytes)

  def grad_norm(self, grads: Any) -> jax.Array:
    # Each leaf's sum of squares is summed over the axes its (synced) gradient is split over.
    groups: dict[tuple[str, ...], jax.Array] = {}
    for g, s in zip(jax.tree.leaves(grads),
                    jax.tree.leaves(self.layouts.opt, is_leaf=lambda x: isinstance(x, P))):
      axes = tuple(sorted(a for a in spec_axes(s) if self.mesh.shape[a] > 1))
      groups[axes] = groups.get(axes, 0.0) + sumsq(g)
    total = sum(jax.lax.psum(v, axes) if axes else v for axes, v in groups.items())
    return jnp.sqrt(total)

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    del names  # already a per-device shard
    return x


class _Zero2Layer(NamedTuple):
  """One scan slice under manual ZeRO-2: the layer's weight shards (differentiated) and its
  stored full weights (used in the forward)."""
  shards: Any
  full: Any


def _stored_weight(shard: jax.Array, full: jax.Array, dim: int) -> jax.Array:
  """ZeRO-2's gather without communication: the forward uses the stored full weight (every
  device has it); the backward reduce-scatters the weight's gradient onto `shard`, so the
  backward scan emits shard-sized gradients only."""
  if dim < 0:  # too small to split: `shard` is the whole (differentiated) weight
    return shard

  @jax.custom_vjp
  def use(shard, full):
    del shard
    return full

  def bwd(_, g):
    return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True), None

  use.defvjp(lambda s, f: (f, None), bwd)
  # Named like ZeRO-3's gathered weights so no remat policy saves a copy of them.
  return checkpoint_name(use(shard, full), GATHERED)
