"""Aux-loss-free balancing (DeepSeek-V3 §2.1.2) in the train step: the routers' bias moves by
the sign of each expert's load error instead of by the optimizer.

The bias (`jscale.model.router.BIAS`, in the params, fp32) reaches the step with its layer's
per-expert assignment counts as its "gradient" (`router.carry_load`), already summed over
micro-batches, pipeline stages and devices by the gradient path and laid out like the bias.
`without_loads` zeroes them before the gradient norm and the optimizer; `bias_steps` replaces
the optimizer's update of each bias by rate · sign(mean load - load), the mean load being the
step's tokens · top_k / experts per layer, and nothing where the step is dropped (non-finite).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jscale.config import MoeConfig
from jscale.model.router import BIAS


def _is_bias(path) -> bool:
  return any(getattr(k, "key", None) == BIAS for k in path)


def balanced(moe: MoeConfig | None) -> bool:
  """Whether the model's routers carry a balancing bias (DeepSeek's sigmoid router)."""
  return moe is not None and moe.router == "sigmoid"


def without_loads(grads: Any) -> Any:
  """`grads` with the biases' entries (their loads) zeroed: what the norm and optimizer see."""
  return jax.tree_util.tree_map_with_path(
      lambda p, g: jnp.zeros_like(g) if _is_bias(p) else g, grads)


def bias_steps(updates: Any, loads: Any, tokens: jax.Array, moe: MoeConfig,
               finite: jax.Array) -> Any:
  """`updates` with each bias's entry replaced by its balancing step; `loads`: the synced
  gradients (the biases' entries are their loads); `tokens`: the step's routed tokens per
  layer (the global batch's)."""
  mean = tokens * moe.top_k / moe.n_experts

  def step(path, u, load):
    if not _is_bias(path):
      return u
    return jnp.where(finite, moe.bias_update_rate * jnp.sign(mean - load), 0.0).astype(u.dtype)

  return jax.tree_util.tree_map_with_path(step, updates, loads)
