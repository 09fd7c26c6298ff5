"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from jscale.config import TrainConfig


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> lr over warmup_steps, then cosine down to lr * min_lr_ratio at train.steps."""
  warmup = min(cfg.warmup_steps, cfg.steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
      decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
  # Weight decay on matrices only: norm scales (named *norm*) are left alone.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """The optimizer; its state has the dtype of the (fp32 master) parameters."""
  adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw
