"""AdamW with global-norm clipping folded in, linear warmup + cosine decay (an optax transform).

The clip factor and Adam's (1 - beta) coefficients are scalars applied inside each leaf's moment
update, so no clipped or squared copy of the gradients is ever materialised: besides params,
gradients and the two moments, the optimizer step needs no gradient-sized buffer (the ZeRO
memory formulas assume exactly that). Matches `optax.chain(clip_by_global_norm, adamw)`.

The moments may be stored in bf16 (`train.moments_dtype`), as DeepSeek-V3 trained (its report,
§3.3.2): each update reads them, computes in fp32 and rounds the new moments to nearest. bf16
keeps 8 significant bits, so a change below 2^-8 of a stored value can round away: the second
moment's decay per step, (1 - b2)·v, registers only when 1 - b2 >= 2^-8 (b2 <= 0.996;
`jscale.validate.values` refuses larger b2 with bf16 moments).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jscale.config import TrainConfig


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> lr over warmup_steps, then cosine down to lr * min_lr_ratio at train.steps."""
  warmup = min(cfg.warmup_steps, cfg.steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
      decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params) -> Any:
  """Weight decay on matrices only: norm scales (named *norm*) are left alone."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params)


def sumsq(x: jax.Array, shards: int = 1, by_slice: bool = True) -> jax.Array:
  """sum(x * x) in fp32. `by_slice`: arrays with 3+ dims (stacked layers) are reduced one slice
  of the leading dim at a time, for backends that do not fuse the square into the reduction
  (XLA:CPU: each loop trip holds one layer's g*g, not the whole model's). Where they do
  (XLA:GPU), one reduction over the whole array also fuses the conversion of a bf16 gradient
  (`step.compute_copies`), which a loop would make XLA write out in fp32 first. `shards`: how
  many ways a global (GSPMD) array's leading dim is split (pipeline stages): the loop then takes
  one slice of every shard at a time, each on its own device, where slicing the split dim would
  make XLA all-gather the whole array on every iteration."""
  square = lambda s: jnp.sum(jnp.square(s.astype(jnp.float32)))
  if x.ndim >= 3 and by_slice:
    if shards > 1 and x.shape[0] % shards == 0:
      x = x.reshape(shards, x.shape[0] // shards, *x.shape[1:]).swapaxes(0, 1)
    return jnp.sum(jax.lax.map(square, x))
  return square(x)


def global_norm(tree, shards: Any = None, by_slice: bool = True) -> jax.Array:
  """sqrt(sum of squares) over all leaves, in fp32 (see `sumsq`; `shards`: a tree like `tree`
  of each leaf's leading-dim split, or None)."""
  leaves = jax.tree.leaves(tree)
  splits = jax.tree.leaves(shards) if shards is not None else [1] * len(leaves)
  return jnp.sqrt(sum((sumsq(x, n, by_slice) for x, n in zip(leaves, splits)),
                      jnp.zeros((), jnp.float32)))


class AdamWState(NamedTuple):
  count: jax.Array  # int32 updates applied (a skipped non-finite step is not one)
  mu: Any  # first moment, like params
  nu: Any  # second moment, like params


def adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float, weight_decay: float,
          clip_norm: float = 0.0, moments_dtype: Any = None
          ) -> optax.GradientTransformationExtraArgs:
  """Decoupled-weight-decay Adam; gradients are first scaled to global norm <= clip_norm (> 0).
  `moments_dtype`: how the moments are stored (None: as the parameters); they are updated in
  fp32 whatever it is."""

  def init(params):
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros_like(p, dtype=moments_dtype), params)
    return AdamWState(jnp.zeros((), jnp.int32), zeros(), zeros())

  def update(grads, state, params, grad_norm=None, finite=None):
    # `grad_norm`: the caller's global_norm(grads), when it has one (saves a pass over them).
    # `finite`: a bool scalar; where false the update is dropped: moments and count unchanged,
    # a zero update. Only the new moments are selected elementwise; a select on the gradient
    # itself made XLA:GPU keep extra fp32 gradient-sized buffers (+8 GiB on an 8B-shaped step).
    count = state.count + 1 if finite is None else state.count + finite.astype(jnp.int32)
    scale = jnp.ones((), jnp.float32)
    if clip_norm > 0:
      norm = global_norm(grads) if grad_norm is None else grad_norm
      scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
    c1, c2 = (1 - b1) * scale, (1 - b2) * scale * scale
    bc1 = 1 - b1 ** count.astype(jnp.float32)
    bc2 = 1 - b2 ** count.astype(jnp.float32)
    lr = jnp.asarray(schedule(state.count))
    if finite is not None:  # a dropped step: lr 0, and no 0/0 before the first update
      lr = jnp.where(finite, lr, 0.0)
      bc1, bc2 = jnp.where(count == 0, 1.0, bc1), jnp.where(count == 0, 1.0, bc2)

    def leaf(g, m_stored, v_stored, p, decay):
      # in fp32 (or wider: the parameters' dtype); stored back rounded to the moments' dtype
      wide = jnp.promote_types(jnp.promote_types(m_stored.dtype, p.dtype), jnp.float32)
      m, v = m_stored.astype(wide), v_stored.astype(wide)
      m_new = b1 * m + c1.astype(wide) * g
      v_new = b2 * v + c2.astype(wide) * (g * g)
      if finite is not None:  # old moments are finite, so u below is too, and lr * u is 0
        m_new, v_new = jnp.where(finite, m_new, m), jnp.where(finite, v_new, v)
      u = (m_new / bc1) / (jnp.sqrt(v_new / bc2) + eps)
      if decay and weight_decay:
        u = u + weight_decay * p
      return (-lr * u).astype(p.dtype), m_new.astype(m_stored.dtype), v_new.astype(
          v_stored.dtype)

    out = jax.tree.map(leaf, grads, state.mu, state.nu, params, decay_mask(params))
    is_out = lambda x: isinstance(x, tuple) and len(x) == 3 and not isinstance(x, AdamWState)
    pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=is_out)
    return pick(0), AdamWState(count, pick(1), pick(2))

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
  """The optimizer; its moments are stored in `cfg.moments_dtype` (the fp32 master parameters'
  by default)."""
  return adamw(lr_schedule(cfg), cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.clip_norm,
               jnp.dtype(cfg.moments_dtype))
