"""Checkpoints from before the routed experts' gate and up became one parameter.

Until 2026-11-30 an MoE layer stored `w_gate` and `w_up`, each [..., E, D, F]; it now stores
`w_gate_up` [..., E, D, 2, F] (`moe.gate_up_param`), the pair stacked on the axis before F.
Every reader of a checkpoint (resume, `checkpoint.init_from`, evaluation and generation)
restores an old one through the old names (`old_target`) and stacks the pair (`upgraded`), so
no checkpoint from before is lost; the next save writes the new layout. The optimizer's
moments are stacked likewise: the resumed run is the one it would have been.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

NEW, OLD = "w_gate_up", ("w_gate", "w_up")
_PAIR_AXIS = -2  # [..., 2, F]


def _names(tree: Any) -> set[str]:
  return {str(getattr(k, "key", getattr(k, "name", k)))
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] for k in path}


def is_old(target: Any, stored: Any) -> bool:
  """Whether `stored` (orbax's metadata tree of a checkpoint) holds the experts as the old
  pair where `target` (what the model restores) holds `w_gate_up`."""
  return NEW in _names(target) and NEW not in _names(stored) and OLD[1] in _names(stored)


def _along(tree: Any, target: Any, pair) -> Any:
  """`tree` rebuilt along `target`'s containers (dicts, namedtuples, tuples and lists, as optax
  states nest them), each `w_gate_up` entry of a `target` dict given by `pair(tree's dict)`:
  the entries that stand for it."""
  if isinstance(target, dict):
    out = {k: _along(tree[k], v, pair) for k, v in target.items() if k != NEW}
    return {**out, **pair(tree)} if NEW in target else out
  if isinstance(target, tuple) and hasattr(target, "_fields"):
    return type(target)(*(_along(a, b, pair) for a, b in zip(tree, target)))
  if isinstance(target, (list, tuple)):
    return type(target)(_along(a, b, pair) for a, b in zip(tree, target))
  return tree


def _half(x: Any) -> Any:
  """One of the pair: `x` (a ShapeDtypeStruct of `w_gate_up` or of its moment) without the
  pair axis, on the same mesh axes."""
  shape = x.shape[:_PAIR_AXIS] + x.shape[_PAIR_AXIS + 1:]
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = list(sharding.spec) + [None] * (len(x.shape) - len(sharding.spec))
    del spec[len(x.shape) + _PAIR_AXIS]
    sharding = NamedSharding(sharding.mesh, P(*spec))
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


def old_target(target: Any) -> Any:
  """`target` (ShapeDtypeStructs) with each `w_gate_up` as the old `w_gate` and `w_up`."""
  return _along(target, target, lambda d: {name: _half(d[NEW]) for name in OLD})


def upgraded(tree: Any, target: Any) -> Any:
  """`tree`, restored as `old_target(target)`, in `target`'s layout: each old pair stacked into
  `w_gate_up` where `target` holds one (the dense layers' own `w_gate` / `w_up` stay)."""
  return _along(tree, target,
                lambda d: {NEW: jnp.stack([d[name] for name in OLD], axis=_PAIR_AXIS)})
