"""Logical axis names -> mesh axes: one short table, and the layouts derived from it.

Parameters and activations carry logical names (`embed`, `heads`, `batch`, ...). `RULES` maps
each name to the mesh axes it is split over; `parallel.rules` overrides entries. ZeRO is a
policy on top of the table: each parameter gets one extra dimension split over `fsdp` (the
major-most that is not `layers` and divides evenly, so gathering a shard is a contiguous
concatenation with no transpose), used for the optimizer state (stage >= 1),
the gradients (>= 2) and the stored parameters themselves (3).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jscale.config import ParallelConfig
from jscale.model import matmul

Rules = dict[str, tuple[str, ...]]

RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),  # the global batch is split over every DP-like axis
    "seq": ("sequence",),  # sequence inside tensor-parallel regions
    "res_seq": ("sequence",),  # residual stream / norms; + tensor under sequence parallelism
    "embed": (),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": ("stage",),  # pipeline: each stage holds a contiguous block of the layer stack
    "sublayers": (),  # MoE every k-th layer: the k-1 dense layers inside one stacked group
    "experts": ("expert",),
    "router": (),  # the router's expert dim: every device routes its own tokens
    "expert_bias": (),  # DeepSeek's balancing bias: a few fp32s per layer, never split
    "gate_up": (),  # the experts' fused gate | up pair (`moe.gate_up_param`): never split
    "latent": (),  # MLA's latent dims: down projections replicated inside the TP region
    "amax_history": (),  # FP8's amax histories: a few floats, whole on every device
}


def make_rules(parallel: ParallelConfig) -> Rules:
  """RULES with sequence parallelism and the config's overrides applied."""
  rules = dict(RULES)
  if parallel.sequence_parallel:
    rules["res_seq"] = ("sequence", "tensor")
  for name, axes in (parallel.rules or {}).items():
    rules[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return rules


def spec(names: Sequence[str | None], rules: Rules) -> P:
  """PartitionSpec for an array whose dims carry logical `names`."""
  entries = []
  for n in names:
    axes = rules[n] if n is not None else ()
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return P(*entries)


def spec_axes(s: P) -> set[str]:
  """The mesh axes a PartitionSpec splits over."""
  out = set()
  for e in s:
    out.update((e,) if isinstance(e, str) else e or ())
  return out


def add_fsdp(names: Sequence[str], shape: Sequence[int], s: P, fsdp: int) -> P:
  """`s` with the first free, evenly divisible non-`layers` dim also split over fsdp."""
  if fsdp == 1 or "fsdp" in spec_axes(s):
    return s
  entries = list(s) + [None] * (len(shape) - len(s))
  free = [i for i, n in enumerate(names) if n not in ("layers", "sublayers", "expert_bias",
                                                      "gate_up")
          and entries[i] is None and shape[i] % fsdp == 0]
  if not free:
    return s  # tiny or odd-sized: stays replicated over fsdp
  entries[free[0]] = "fsdp"
  return P(*entries)


def logical_names(abstract_model: nnx.Module, kind: Any = nnx.Param) -> Any:
  """Pure dict of logical-name tuples, one per variable of `kind` (from its metadata)."""
  state = nnx.state(abstract_model, kind)
  return nnx.to_pure_dict(jax.tree.map(
      lambda v: tuple(v.get_metadata()["out_sharding"]), state,
      is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _at_paths(tree: dict, sub: dict) -> dict:
  """The entries of `tree` at the paths of `sub` (a nested dict with some of its keys)."""
  return {k: _at_paths(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in sub.items()}


class Layouts:
  """Every PartitionSpec of the train state for one config and mesh."""

  def __init__(self, abstract_model: nnx.Module, mesh: Mesh, parallel: ParallelConfig):
    self.mesh, self.rules, self.zero_stage = mesh, make_rules(parallel), parallel.zero_stage
    self.context_layout, self.context_impl = parallel.context_layout, parallel.context_impl
    self.names = names = logical_names(abstract_model)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param))
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x)
    # Compute layout: tensor parallel only (what a matmul sees).
    self.compute = jax.tree.map(lambda n: spec(n, self.rules), names, is_leaf=is_names)
    fsdp = mesh.shape["fsdp"]
    self.sharded = jax.tree.map(
        lambda n, x, s: add_fsdp(n, x.shape, s, fsdp), names, shapes, self.compute,
        is_leaf=is_names)
    self.params = self.sharded if self.zero_stage >= 3 else self.compute
    self.grads = self.sharded if self.zero_stage >= 2 else self.params
    self.opt = self.sharded if self.zero_stage >= 1 else self.params
    # The products' state (FP8's amax histories): laid out by its names, like the layer stack
    # it belongs to, never split over fsdp.
    self.dot_state = jax.tree.map(lambda n: spec(n, self.rules),
                                  logical_names(abstract_model, matmul.DotState),
                                  is_leaf=is_names)

  def named(self, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def state(self, optimizer: optax.GradientTransformation, abstract_state: dict,
            like_params: Sequence[str] = ()) -> dict:
    """NamedShardings for the whole train state {params, opt_state, step, rng[, dot_state]};
    `like_params`: its other keys, each a sub-tree of params laid out as they are (the step's
    compute copies, `jscale.step.compute_copies`)."""
    opt = optax.tree_map_params(optimizer, lambda _, s: s, abstract_state["opt_state"], self.opt,
                                transform_non_params=lambda _: P(),
                                is_leaf=lambda x: isinstance(x, P))
    specs = {"params": self.params, "opt_state": opt, "step": P(), "rng": P()}
    if "dot_state" in abstract_state:
      specs["dot_state"] = self.dot_state
    for key in like_params:
      specs[key] = _at_paths(self.params, abstract_state[key])
    return self.named(specs)

  def batch(self) -> NamedSharding:
    """Batch arrays [B, L]: B over the DP axes, L over sequence."""
    return NamedSharding(self.mesh, spec(("batch", "seq"), self.rules))

  def activation(self, names: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, spec(names, self.rules))


def tensor_parallel(abstract_model: nnx.Module, mesh: Mesh) -> Any:
  """NamedShardings of a model's parameters (a pure dict) for inference: split over `tensor`
  as a matmul sees them (heads, kv_heads, mlp, vocab), replicated otherwise."""
  layouts = Layouts(abstract_model, mesh, ParallelConfig())
  return layouts.named(layouts.compute)


def without_axes(s: P, axes: Any) -> P:
  """`s` with the mesh `axes` removed (a dim split only over them becomes unsplit): the spec
  inside a shard_map manual over `axes`, where arrays already are their shards."""
  if not axes:
    return s
  drop = lambda e: (e if e is None or (isinstance(e, str) and e not in axes) else None
                    if isinstance(e, str) else tuple(a for a in e if a not in axes) or None)
  return P(*(drop(e) for e in s))
