"""Data parallelism and ZeRO-1/2/3 (playbook: "Data parallelism", "ZeRO"), in both modes.

Leaves too small to split over fsdp (`sharding.add_fsdp`) stay whole and are all-reduced.

xla (`XlaZero`): the layouts (`jscale.sharding.Layouts`) store optimizer state (ZeRO-1),
gradients (ZeRO-2) and weights (ZeRO-3) split over fsdp; GSPMD inserts the collectives. Per
layer, inside the scan, the weight's cotangent is pinned to its shard (a reduce-scatter as soon
as it is computed) and ZeRO-3 asks for the whole weight right before use (an all-gather).

manual (`ManualZero`), inside the step's shard_map, collectives written by hand:
  * DP / ZeRO-0: gradients accumulate locally over micro-batches, then one bucketed all-reduce
    over dp + fsdp per optimizer step (`jscale.parallel.buckets`).
  * ZeRO-1: one bucketed reduce-scatter over fsdp (+ all-reduce over dp) per step; each device
    updates its slice of the weights and optimizer state; all-gather of the updated weights.
  * ZeRO-2: as ZeRO-1, but the gradient is taken with respect to the shards: each layer's
    stored full weights are used as they are and its gradient is reduce-scattered inside the
    backward scan (`StoredLayers`); the rest is reduce-scattered per micro-batch. Only shards
    are kept between layers and between micro-batches.
  * ZeRO-3: weights stored as shards; each layer's are all-gathered (in the compute dtype) right
    before use and gathered again in the backward; the gather's transpose reduce-scatters that
    layer's gradient inside the backward scan.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jscale.model.moe_dispatch import ROUTED_WEIGHT_AXES
from jscale.model.seam import GATHERED
from jscale.optim import global_norm, sumsq
from jscale.parallel import major
from jscale.parallel.buckets import Plan, reduce_buckets
from jscale.parallel.comms import Comms
from jscale.parallel.zero_prefetch import Chunked
from jscale.sharding import Layouts, add_fsdp, spec, spec_axes

_POST = 1 << 30  # forward position of leaves after the layer stack (final norm, head)


def _fsdp_dim(s: P, alone: bool = False) -> int:
  """The dim a ZeRO layout `s` splits over `fsdp` (-1: none). `alone`: only if fsdp is that
  dim's one axis, so that a reduce-scatter over fsdp yields exactly its shard."""
  for i, e in enumerate(s):
    axes = (e,) if isinstance(e, str) else tuple(e or ())
    if "fsdp" in axes and (not alone or axes == ("fsdp",)):
      return i
  return -1


def gather_layers_in_place(new: jax.Array, old: jax.Array,
                           gather_layer: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """ZeRO-1/2's weight all-gather for a stacked [layers, ...] leaf: `gather_layer` makes one
  layer whole, written over the old (donated) weights in place, so the gather buffer is one
  layer, not the largest stacked leaf (GBs at 8B)."""

  def body(i, out):
    return jax.lax.dynamic_update_index_in_dim(out, gather_layer(new[i]), i, 0)

  return jax.lax.fori_loop(0, new.shape[0], body, old)


# ==================================================================== xla mode


class XlaZero:
  """ZeRO as sharding constraints (mixed into `XlaComms`: uses `layouts`, `_sharding`,
  `in_stage_region`, `manual_axes`, `local_batch_axes`)."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  layouts: Layouts
  manual_axes: frozenset[str]
  in_stage_region: bool
  local_batch_axes: tuple[str, ...]
  _sharding: Callable[[P], Any]
  with_manual_axes: Callable[[frozenset[str]], Any]
  norm_by_slice: Callable[[], bool]  # `Comms.norm_by_slice`


  def gather_layer(self, layer: Any, dtype: Any, depth: int) -> Any:
    return self._gather(layer, dtype, major.pays(depth, self.layouts.mesh.shape["fsdp"]))

  def gather_params(self, params: Any, dtype: Any) -> Any:
    return self._gather(params, dtype, False)

  def _gather(self, params: Any, dtype: Any, along_major: bool) -> Any:
    # ZeRO-2/3 per layer, inside the layer scan. Backward: the layer's gradient is constrained
    # to its fsdp shard, so it is reduce-scattered as soon as it is computed and the scan never
    # stacks full-size gradients. ZeRO-3 forward: weights are stored split over fsdp; ask for the
    # compute layout right before use, so XLA all-gathers one layer at a time (and frees it).
    # In a pipeline stage (ZeRO-2 at most) each chunk's gradient is sharded by `stage_grads`.
    if self.layouts.zero_stage < 2 or self.in_stage_region:
      return params
    rules, fsdp = self.layouts.rules, self.layouts.mesh.shape["fsdp"]

    def gather(v: nnx.Variable):
      names = [n for n in v.get_metadata()["out_sharding"] if n != "layers"]
      compute = spec(names, rules)
      sharded = add_fsdp(names, v.shape, compute, fsdp)
      shard = self._sharding(sharded)
      if along_major and self.layouts.zero_stage == 2 and _fsdp_dim(sharded) >= 0:
        x = self._scatter_major(v[...], sharded)
      else:
        x = _shard_cotangent(v[...], shard)
      # A leaf too small to split is used as stored, as in manual mode (never cast: DeepSeek's
      # fp32 balancing bias routes in fp32).
      if self.layouts.zero_stage >= 3 and _fsdp_dim(sharded) >= 0:
        # Cast the shard (the model casts at use anyway): a bf16 gather moves half the bytes.
        x = jax.lax.with_sharding_constraint(x.astype(dtype), shard)
        if along_major:
          x = self._gather_major(x, sharded, compute)
        else:
          # The barrier keeps the gather's operand this layer's slice: otherwise XLA:CPU
          # re-lays out the whole stacked shard before the loop (a copy of every layer's shard).
          x = jax.lax.optimization_barrier(x)
          x = jax.lax.with_sharding_constraint(x, self._sharding(compute))
        x = checkpoint_name(x, GATHERED)
      return v.replace(x)

    return jax.tree.map(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def _gather_major(self, x: jax.Array, sharded: P, compute: P) -> jax.Array:
    """`x` (laid out as `sharded`) made whole as `compute`, gathered along a new major axis
    (`major.split`; the barrier keeps that the gather's operand)."""
    dim, rest = _split_spec(sharded, x.ndim)
    first = major.split(x, dim, self.layouts.mesh.shape["fsdp"])
    first = jax.lax.optimization_barrier(
        jax.lax.with_sharding_constraint(first, self._sharding(P("fsdp", *rest))))
    whole = jax.lax.with_sharding_constraint(first, self._sharding(P(None, *rest)))
    return jax.lax.with_sharding_constraint(major.unsplit(whole, dim), self._sharding(compute))

  def _scatter_major(self, x: jax.Array, sharded: P) -> jax.Array:
    """Identity whose cotangent is reduce-scattered into `sharded` along a new major axis
    (ZeRO-2's per-layer gradient; `_shard_cotangent` along the dim itself)."""
    dim, rest = _split_spec(sharded, x.ndim)

    def bwd(_, g):
      first = major.split(g, dim, self.layouts.mesh.shape["fsdp"])
      first = jax.lax.with_sharding_constraint(first, self._sharding(P("fsdp", *rest)))
      return (jax.lax.with_sharding_constraint(major.unsplit(first, dim),
                                               self._sharding(sharded)),)

    identity = jax.custom_vjp(lambda x: x)
    identity.defvjp(lambda x: (x, None), bwd)
    return identity(x)

  def weight_grad(self, g: jax.Array, names, stored_names) -> jax.Array:
    # ZeRO-2/3: the fsdp shard of the stored weight (its dims named as `g`'s); without it XLA
    # all-reduced the chunked loss's fp32 head gradient, whole, and sliced it afterwards.
    if self.layouts.zero_stage < 2 or self.in_stage_region:
      return g
    rules, fsdp = self.layouts.rules, self.layouts.mesh.shape["fsdp"]
    shape = [g.shape[list(names).index(n)] for n in stored_names]
    stored = add_fsdp(stored_names, shape, spec(stored_names, rules), fsdp)
    by_name = dict(zip(stored_names, list(stored) + [None] * (len(shape) - len(stored))))
    return jax.lax.with_sharding_constraint(g, self._sharding(P(*(by_name[n] for n in names))))

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
      layer, shard = spec(names[1:], layouts.rules), P(*tuple(sharded)[1:])
      if _fsdp_dim(shard) < 0:
        return gather_layers_in_place(
            new, old, lambda x: jax.lax.with_sharding_constraint(x, named(layer)))
      # Along a new major axis: else XLA:GPU lays the whole written stack out with the
      # gathered dim major, and copies it back after the loop (`_gather_major`).
      return gather_layers_in_place(new, old, lambda x: self._gather_major(x, shard, layer))

    return jax.tree.map(gather, new_params, old_params, layouts.names, layouts.sharded,
                        layouts.compute, is_leaf=lambda x: isinstance(x, tuple))

  def grad_accumulator(self, grads: Any) -> Any:
    return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, self._sharding(s)),
                        grads, self.layouts.grads, is_leaf=lambda x: isinstance(x, P))

  def stage_grads(self, grads: Any) -> Any:
    # Inside the stage region (manual over `stage`): the ZeRO-2 shard layout minus `stage`.
    if self.layouts.zero_stage < 2:
      return grads
    specs = {k: self.layouts.grads[k] for k in grads}
    return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, self._sharding(s)),
                        grads, specs, is_leaf=lambda x: isinstance(x, P))

  def sync_grads(self, grads: Any) -> Any:
    # ZeRO-1: the optimizer's layout (each device updates its fsdp shard: a slice of reduced
    # gradients, or already the reduce-scatter's output under accumulation, `over_batch`).
    layout = self.layouts.opt if self.layouts.zero_stage == 1 else self.layouts.grads
    return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, self._sharding(s)),
                        grads, layout, is_leaf=lambda x: isinstance(x, P))

  def grad_norm(self, grads):
    # Stacked gradients split over `stage` along the layers: reduce each stage's slices where
    # they live (`optim.sumsq`).
    size = self.layouts.mesh.shape
    lead = lambda s: math.prod(size[a] for a in spec_axes(P(s[0]) if len(s) else P()))
    shards = jax.tree.map(lead, self.layouts.grads, is_leaf=lambda x: isinstance(x, P))
    return global_norm(grads, shards, self.norm_by_slice())

  def over_batch(self, fn, params, dot_state, batch, scale):
    """`fn(comms, params, dot_state, batch, scale) -> (grads, loss, stats, new dot_state)`, the
    gradient loop over micro-batches, manual over `local_batch_axes`: each shard accumulates its
    own rows' gradient in fp32 and the shards are summed once, at the end. (Under GSPMD the
    accumulator's layout makes XLA reduce every micro-batch's gradient, layer by layer, in the
    compute dtype: XLA:GPU showed 16 all-reduces of 48 MiB for one of fp32 at data=8 and 4
    micro-batches.) Statistics and amaxes are already global (`token_sum`, `amax`)."""
    axes = self.local_batch_axes
    if not axes or self.manual_axes:
      return fn(self, params, dot_state, batch, scale)
    inner = self.with_manual_axes(frozenset(axes))
    # ZeRO-1: each fsdp shard's optimizer needs only its slice of the sum, so the sum is
    # reduce-scattered over fsdp (the playbook's ZeRO-1 traffic), then all-reduced over data.
    is_spec = lambda x: isinstance(x, P)
    dims = jax.tree.map(lambda s: _fsdp_dim(s, alone=True) if "fsdp" in axes else -1,
                        self.layouts.opt, is_leaf=is_spec)
    data = tuple(a for a in axes if a != "fsdp")

    def reduce(g, dim):
      if dim < 0:
        return jax.lax.psum(g, axes)
      g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
      return jax.lax.psum(g, data) if data else g

    def region(params, dot_state, batch, scale):
      grads, loss, stats, new_dots = fn(inner, params, dot_state, batch, scale)
      return jax.tree.map(reduce, grads, dims), jax.lax.psum(loss, axes), stats, new_dots

    rows = jax.tree.map(lambda x: P(axes, *([None] * (x.ndim - 1))), batch)
    grad_specs = jax.tree.map(lambda d: P() if d < 0 else P(*[None] * d, "fsdp"), dims)
    return jax.shard_map(region, mesh=self.layouts.mesh, in_specs=(P(), P(), rows, P()),
                         out_specs=(grad_specs, P(), P(), P()), axis_names=set(axes),
                         check_vma=False)(params, dot_state, batch, scale)


def _split_spec(sharded: P, ndim: int) -> tuple[int, list]:
  """(the dim `sharded` splits over fsdp, the spec of `major.split`'s other dims)."""
  dim = _fsdp_dim(sharded)
  entries = list(sharded) + [None] * (ndim - len(sharded))
  return dim, [*entries[:dim], None, *entries[dim + 1:]]


def _shard_cotangent(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Identity whose cotangent is constrained to `sharding` (a reduce-scatter point)."""

  @jax.custom_vjp
  def identity(x):
    return x

  identity.defvjp(lambda x: (x, None),
                  lambda _, g: (jax.lax.with_sharding_constraint(g, sharding),))
  return identity(x)


# ==================================================================== manual mode


class StoredLayers(NamedTuple):
  """Manual ZeRO-2's layer scan for one step: every device stores the layers' full weights
  (`full`), but the gradient is taken with respect to its fsdp shards of them. The scan runs
  over both; each layer's forward uses the stored weights as they are, and its backward
  reduce-scatters the weight's gradient onto the shard (`_stored_weight`)."""
  full: Any  # the params' "blocks", whole
  dims: Any  # each leaf's fsdp dim within one layer (-1: too small to split)

  def inputs(self, shards: Any) -> tuple[Any, Any]:
    """The layer scan's input: each slice holds a layer's shards and its stored weights."""
    return shards, self.full

  def layer(self, xs: tuple[Any, Any]) -> Any:
    """One layer's weights from its slice of `inputs`."""
    shards, full = xs
    return jax.tree.map(_stored_weight, nnx.to_pure_dict(shards), full, self.dims)


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
    return major.psum_scatter(g, "fsdp", dim, jax.lax.axis_size("fsdp")), None

  use.defvjp(lambda s, f: (f, None), bwd)
  # Named like ZeRO-3's gathered weights so no remat policy saves a copy of them.
  return checkpoint_name(use(shard, full), GATHERED)




class ManualZero:
  """ZeRO by hand (mixed into `ManualComms`: uses `layouts`, `mesh`, `fsdp`, `tp`, `sp`,
  `dp_axes`; `_init_zero` sets up the per-leaf reduction plans)."""
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  layouts: Layouts
  mesh: Mesh
  tp: int
  sp: bool
  fsdp: int
  dp_axes: tuple[str, ...]
  norm_by_slice: Callable[[], bool]  # `Comms.norm_by_slice`


  def _init_zero(self, bucket_mb: float) -> None:
    layouts = self.layouts
    self.zero = layouts.zero_stage
    self.bucket_bytes = max(1, int(bucket_mb * 2**20))
    self.stored: StoredLayers | None = None  # set on the step's seam by `grad_target`
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x)
    self.dims = jax.tree.map(_fsdp_dim, layouts.sharded,
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
    replicated = self.tp > 1 and "tensor" not in spec_axes(compute)
    if replicated and (("latent" in names) or
                       (self.sp and not {"router", "expert_bias"} & set(names))):
      # Norm weights under SP: each tensor rank saw a different sequence slice (the MoE
      # router and its bias see the gathered sequence: their gradients are already whole).
      # MLA's down projections and latent norms: each rank's gradient is its heads' share.
      axes.append("tensor")
    scatter = split and self.zero == 1
    return Plan(tuple(axes), "fsdp" if scatter else None, dim, self.fsdp if scatter else 1,
                stacked, position)

  def _zero2(self) -> bool:
    return self.zero == 2 and self.fsdp > 1

  # ---------------------------------------------------------------- weights in the forward

  def gather_params(self, params: Any, dtype: Any) -> Any:
    return self._gather(params, dtype, lambda x, dim: jax.lax.all_gather(x, "fsdp", axis=dim,
                                                                          tiled=True))

  def _gather(self, params: Any, dtype: Any, all_gather: Callable) -> Any:
    if self.zero < 3 or self.fsdp == 1:
      return params

    def gather(v: nnx.Variable):
      dim = self.dim_by_names[tuple(n for n in v.get_metadata()["out_sharding"] if n != "layers")]
      if dim < 0:
        return v
      # The gather runs in the compute dtype (half the bytes of fp32 masters); under autodiff
      # its transpose is the reduce-scatter of this layer's gradient.
      return v.replace(checkpoint_name(all_gather(v[...].astype(dtype), dim), GATHERED))

    return jax.tree.map(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def layer_inputs(self, stacked: Any) -> Any:
    return stacked if self.stored is None else self.stored.inputs(stacked)

  def gather_layer(self, layer: Any, dtype: Any, depth: int) -> Any:
    if self.stored is not None:
      return self.stored.layer(layer)
    # A leaf of its own (`gather_params`: embedding, head) and a shallow stack keep the tiled
    # gather; its XLA:GPU layout copy is the smaller there (`major.pays`).
    if not major.pays(depth, self.fsdp):
      return self.gather_params(layer, dtype)
    return self._gather(layer, dtype, lambda x, dim: major.all_gather(x, "fsdp", dim))

  def layer_chunks(self, layer: Any, dtype: Any, chunks: int,
                   e4m3_experts: bool = False) -> Chunked | None:
    if self.zero < 3 or self.fsdp == 1 or self.stored is not None:
      return None
    names = [tuple(n for n in v.get_metadata()["out_sharding"] if n != "layers")
             for v in jax.tree.leaves(layer, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    e4m3 = tuple(e4m3_experts and n in ROUTED_WEIGHT_AXES for n in names)
    return Chunked(tuple(self.dim_by_names[n] for n in names), dtype, chunks, "fsdp",
                   self.fsdp, e4m3)

  def grad_target(self, params: Any) -> tuple[Any, Any]:
    if not self._zero2():
      return params, self
    step_seam = copy.copy(self)
    step_seam.stored = StoredLayers(params["blocks"],
                                    jax.tree.map(lambda d: d - 1, self.dims["blocks"]))
    shards = self._shard(params["blocks"], self.dims["blocks"])
    return {**params, "blocks": shards}, step_seam

  # ---------------------------------------------------------------- the optimizer's side

  def _shard(self, params: Any, dims: Any) -> Any:
    index = jax.lax.axis_index("fsdp")

    def shard(p, dim):
      if dim < 0:
        return p
      k = p.shape[dim] // self.fsdp
      return jax.lax.dynamic_slice_in_dim(p, index * k, k, axis=dim)

    return jax.tree.map(shard, params, dims)

  def params_for_update(self, params: Any) -> Any:
    if self.zero not in (1, 2) or self.fsdp == 1:
      return params
    return self._shard(params, self.dims)

  def gather_updated_params(self, new_params: Any, old_params: Any) -> Any:
    if self.zero not in (1, 2) or self.fsdp == 1:
      return new_params

    def gather(new, old, dim, names):
      if dim < 0:
        return new
      if names[0] != "layers":
        return jax.lax.all_gather(new, "fsdp", axis=dim, tiled=True)
      # Along a new major axis (`major`): a tiled gather of a non-major dim would have XLA:GPU
      # lay the whole written stack out with that dim major, and copy it back after the loop.
      return gather_layers_in_place(new, old, lambda x: major.all_gather(x, "fsdp", dim - 1))

    return jax.tree.map(gather, new_params, old_params, self.dims, self.layouts.names,
                        is_leaf=lambda x: isinstance(x, tuple))

  # ---------------------------------------------------------------- gradients

  def zero_grads(self, params: Any) -> Any:
    if not self._zero2():
      return Comms.zero_grads(self, params)

    def zeros(p, dim):
      shape = list(p.shape)
      if dim >= 0:
        shape[dim] //= self.fsdp
      return jnp.zeros(shape, jnp.float32)

    return jax.tree.map(zeros, params, self.dims)

  def grad_accumulator(self, grads: Any) -> Any:
    if not self._zero2():
      return grads
    return reduce_buckets(grads, self.microbatch_plans, self.bucket_bytes)

  def stage_grads(self, grads: Any) -> Any:
    if not self._zero2():
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
      groups[axes] = groups.get(axes, 0.0) + sumsq(g, by_slice=self.norm_by_slice())
    total = sum(jax.lax.psum(v, axes) if axes else v for axes, v in groups.items())
    return jnp.sqrt(total)
