"""Params-only checkpoints: what `python -m jscale.convert` writes and `checkpoint.init_from` reads.

Layout: `<dir>/params/` (an orbax checkpoint of the model's parameters as a pure nested dict)
and `<dir>/model.yaml` (the ModelConfig that shapes them).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from jscale.ckpt import legacy_experts
from jscale.config import ConfigError, ModelConfig
from jscale.config_dict import from_dict


def save_params(path: str, model: nnx.Module, cfg: ModelConfig) -> None:
  """Writes the model's parameters and config to `path` (must not exist yet)."""
  path = os.path.abspath(path)
  if os.path.exists(os.path.join(path, "params")):
    raise FileExistsError(f"{path}/params exists; choose a new output directory")
  os.makedirs(path, exist_ok=True)
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, "params"), pure)
  with open(os.path.join(path, "model.yaml"), "w", encoding="utf-8") as f:
    yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)


def load_model_config(path: str) -> ModelConfig:
  """The ModelConfig saved beside a params checkpoint."""
  f = os.path.join(path, "model.yaml")
  if not os.path.isfile(f):
    raise ConfigError(f"checkpoint.init_from={path}: no model.yaml there; create it with "
                      "`python -m jscale.convert hf-to-jscale`")
  with open(f, encoding="utf-8") as fh:
    return from_dict({"model": yaml.safe_load(fh)}).model


def load_params_into(path: str, model: nnx.Module) -> None:
  """Restores parameters from `path` into `model` in place (shapes must match)."""
  state = nnx.state(model, nnx.Param)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(
      x, "sharding", None)), nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, restore_pure(path, target))
  nnx.update(model, state)


def restore_pure(path: str, target: dict) -> dict:
  """The pure params dict stored at `path`, read as `target`'s ShapeDtypeStructs say (onto
  their shardings; host arrays where they have none)."""
  params = os.path.join(os.path.abspath(path), "params")
  with ocp.StandardCheckpointer() as ckptr:
    if not legacy_experts.is_old(target, ckptr.metadata(params).item_metadata.tree):
      return ckptr.restore(params, target)
    return legacy_experts.upgraded(ckptr.restore(params, legacy_experts.old_target(target)),
                                   target)
