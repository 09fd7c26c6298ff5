"""FP8 on chosen linear layers: the model's `dot_general` under `fp8.enabled`.

`Fp8Linears` is what `jscale.model.llama.Llama` takes as its `dot_general`: each linear layer
asks it for its product (`jscale.model.matmul.for_linear`), and gets an `Fp8Dot` if it is in
`fp8.targets`, `jax.lax.dot_general` otherwise. Under delayed scaling an `Fp8Dot` holds its
layer's amax histories (x, w, g) as `Fp8Amax` variables, a `matmul.DotState`: stacked with the
layer's weights, scanned with them, in the train state's `dot_state` (the checkpoint saves it),
and updated by the backward (`jscale.fp8.dot`). The model code is the same for every recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jscale.config import Fp8Config
from jscale.fp8 import grouped, grouped_kernel
from jscale.fp8.dot import Recipe, fp8_dot_general
from jscale.model import matmul

# `fp8.targets` groups -> the linear layers' weight names (GQA and MLA, Mlp, MoE's shared
# expert).
GROUPS = {
    "attention": ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wk_b", "wv_b"),
    "mlp": ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"),
}
# The routed experts' grouped matmuls: a target of their own, current scaling per expert
# whatever fp8.recipe says (`jscale.fp8.grouped`; no dot state).
EXPERTS = "experts"
# Matmuls FP8 never takes, with the reason `validate` gives.
NEVER = {
    "embed": "the embedding is a lookup, not a matmul",
    "lm_head": "the head's logits feed the softmax of the loss: e4m3 logits lose the loss",
    "router": "the MoE router runs in fp32 on purpose (jscale.model.matmul.FP32_MATMULS)",
}


def experts_in(fp8: Fp8Config) -> bool:
  """Whether `fp8` runs the routed experts' products in FP8 (`fp8.targets` has experts)."""
  return fp8.enabled and EXPERTS in fp8.targets


def target_names(targets) -> frozenset[str]:
  """The weight names `fp8.targets` selects (groups expanded); ValueError for unknown names."""
  names = set()
  for t in targets:
    if t in NEVER:
      raise ValueError(f"{t!r} cannot be an FP8 target: {NEVER[t]}")
    if t in GROUPS:
      names.update(GROUPS[t])
    elif t == EXPERTS or any(t in g for g in GROUPS.values()):
      names.add(t)
    else:
      known = list(GROUPS) + [EXPERTS] + [n for g in GROUPS.values() for n in g]
      raise ValueError(f"unknown FP8 target {t!r}: choose from {', '.join(known)}")
  return frozenset(names)


class Fp8Amax(matmul.DotState):
  """One operand's amax history (newest first), fp32."""


def _history(n: int) -> Fp8Amax:
  return Fp8Amax(jnp.zeros((n,), jnp.float32), out_sharding=("amax_history",),
                 eager_sharding=False)


class Fp8Dot(nnx.Module):
  """One linear layer's FP8 product; under delayed scaling it keeps the amax histories of its
  input (`x_amax`), weight (`w_amax`) and output gradient (`g_amax`)."""

  def __init__(self, recipe: Recipe, history: int):
    self.recipe = recipe
    if recipe.delayed:
      self.x_amax, self.w_amax, self.g_amax = _history(history), _history(history), \
          _history(history)

  def on(self, seam) -> Callable[..., jax.Array]:
    """This product as a `jax.lax.dot_general` whose amaxes the `seam` reduces over devices."""
    histories = ((self.x_amax[...], self.w_amax[...], self.g_amax[...])
                 if self.recipe.delayed else None)

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None):
      del precision, out_sharding  # FP8 has one precision; layouts come from the operands
      y = fp8_dot_general(lhs, rhs, dimension_numbers, self.recipe, seam.amax, histories)
      return y if preferred_element_type is None else y.astype(preferred_element_type)

    return dot_general


@dataclasses.dataclass(frozen=True)
class Fp8Linears:
  """The model's `dot_general` under FP8: an `Fp8Dot` for each linear layer in `targets` (weight
  names), the plain product for the others (the head, the attention scores)."""
  recipe: Recipe
  history: int
  targets: frozenset[str]
  experts_scaling: str = "expert"  # fp8.experts_scaling

  def for_linear(self, name: str):
    if name in self.targets:
      return Fp8Dot(self.recipe, self.history)
    return jax.lax.dot_general

  def for_experts(self):
    """The routed experts' per-tile products in FP8 if `targets` has them (scaled per expert or
    per row: `fp8.experts_scaling`), else None."""
    if EXPERTS not in self.targets:
      return None
    return grouped.row_products if self.experts_scaling == "row" else grouped.tile_products

  @property
  def expert_columns_e4m3(self) -> bool:
    """The routed experts' forward products quantise each weight column to e4m3 (scaled per
    row, on the kernel or in tiles: `matmul.expert_columns_e4m3`)."""
    return EXPERTS in self.targets and self.experts_scaling == "row"

  def for_expert_kernel(self):
    """The routed experts' whole grouped matmul on the Hopper kernel in FP8 (scaled per row:
    `jscale.fp8.grouped_kernel`) if `targets` has them and scales them per row, else None
    (per-expert scales have no kernel path)."""
    if EXPERTS not in self.targets or self.experts_scaling != "row":
      return None
    return grouped_kernel.row_scaled_matmul


def from_config(fp8: Fp8Config) -> Fp8Linears | None:
  """`Fp8Linears` for `fp8` (None unless fp8.enabled)."""
  if not fp8.enabled:
    return None
  return Fp8Linears(Recipe(delayed=fp8.recipe == "delayed", margin=fp8.margin),
                    fp8.amax_history, target_names(fp8.targets), fp8.experts_scaling)
