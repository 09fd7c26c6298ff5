"""Where a trained model comes from: one PATH for `jscale.generate`, `jscale.eval` and
`jscale.convert jscale-to-hf`.

PATH is one of (`describe` decides, in this order):

- "run": a training run's output_dir (it has run.json): its latest complete checkpoint, or
  `step`; the model config is the run's.
- "step": one checkpoint step directory of a run (`<run>/checkpoints/<step>`, it has state/);
  the config is the run.json two levels up.
- "params": a params checkpoint (params/ + model.yaml, from `convert hf-to-jscale`).
- "hf": a Hugging Face Llama / Mixtral dir (config.json + safetensors).

From a training checkpoint only the parameters are read (orbax partial restore: the optimizer
state is never loaded), put back in model layer order (`placement.to_model`: an interleaved
pipeline stores its layers in chunk order), onto one device, or straight onto each parameter's
shards: its tensor-parallel ones (`mesh`), or any layout given as `shardings` (`jscale.eval`
reads onto the training layout), so a model too large for one device is never whole on one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jscale import sharding as sharding_lib
from jscale.ckpt import integrity, legacy_experts, params_io
from jscale.ckpt.checkpoint import complete_steps
from jscale.ckpt.init_from import checkpoint_model, is_hf_dir
from jscale.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from jscale.config_dict import from_dict
from jscale.convert import load_hf
from jscale.model import llama
from jscale.parallel.pipeline import placement

KINDS = ("run", "step", "params", "hf")
_HINT = ("give a training run's output_dir, one of its checkpoints/<step> dirs, a params "
         "checkpoint (`python -m jscale.convert hf-to-jscale`) or a Hugging Face model dir")


@dataclasses.dataclass(frozen=True)
class Source:
  """What PATH holds. `weights`: the dir the parameters are read from (a run's step dir for
  "run"); `config`: the run's whole Config ("run" / "step"), else None."""
  kind: str
  path: str
  weights: str
  config: Config | None = None
  step: int | None = None
  stages: int = 1  # the run's pipeline stage count (its layer storage order depends on it)

  def label(self) -> str:
    """One line for messages: what is loaded from where."""
    if self.kind in ("run", "step"):
      return f"step {self.step} of run {self.path if self.kind == 'run' else self.weights}"
    return f"{'params checkpoint' if self.kind == 'params' else 'HF model'} {self.path}"


def describe(path: str, step: int | None = None) -> Source:
  """Classifies `path` (see the module doc); ConfigError naming the fix if it is none of them."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--model {path}: no such directory; {_HINT}")
  if step is not None and not os.path.isfile(os.path.join(path, "run.json")):
    raise ConfigError(f"--step {step} applies to a training run's output_dir; {path} is not one "
                      "(it has no run.json)")
  if os.path.isfile(os.path.join(path, "run.json")):
    cfg, stages = _run_config(path)
    steps_dir = _checkpoints_dir(path, cfg)
    steps = complete_steps(steps_dir)
    if not steps:
      raise ConfigError(f"--model {path}: the run has no complete checkpoint in {steps_dir}; "
                        "train with checkpoint.every > 0 (the last step is always saved then)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ConfigError(f"--step {step}: not a checkpoint of {path}; it has steps "
                        f"{', '.join(map(str, steps))}")
    return Source("run", path, os.path.join(steps_dir, str(step)), cfg, step, stages)
  if os.path.isdir(os.path.join(path, "state")):
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if not os.path.isfile(os.path.join(run_dir, "run.json")):
      raise ConfigError(f"--model {path}: a training checkpoint, but no run.json in {run_dir} "
                        "to read its model config from; pass the run's output_dir")
    name = os.path.basename(os.path.normpath(path))
    cfg, stages = _run_config(run_dir)
    return Source("step", path, path, cfg, int(name) if name.isdigit() else None, stages)
  if os.path.isfile(os.path.join(path, "model.yaml")):
    return Source("params", path, path)
  if is_hf_dir(path):
    return Source("hf", path, path)
  raise ConfigError(f"--model {path}: not a model directory (no run.json, state/, model.yaml or "
                    f"config.json there); {_HINT}")


def _run_config(run_dir: str) -> tuple[Config, int]:
  """The run's Config (from run.json) and its resolved pipeline stage count."""
  with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
    info = json.load(f)
  cfg = from_dict(info["config"])
  # The run's attention and MoE matmul were resolved for its devices (e.g. cudnn, the Hopper
  # kernel): pick again where it runs.
  moe = cfg.model.moe and dataclasses.replace(cfg.model.moe, gemm="auto")
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="auto",
                                                           moe=moe))
  return cfg, int(info.get("mesh", {}).get("stage", max(cfg.mesh.stage, 1)))


def _checkpoints_dir(run_dir: str, cfg: Config) -> str:
  """The run's checkpoint dir: `<run>/checkpoints` (found even if the run dir was moved), else
  the checkpoint.dir it was trained with."""
  beside = os.path.join(run_dir, "checkpoints")
  if os.path.isdir(beside) or not cfg.checkpoint.dir:
    return beside
  return cfg.checkpoint.dir


def model_config(path: str, step: int | None = None) -> ModelConfig:
  """The ModelConfig of the model at `path`."""
  src = describe(path, step)
  if src.config is not None:
    return src.config.model
  if src.kind == "params":
    return params_io.load_model_config(path)
  return checkpoint_model(path)


def data_config(path: str) -> DataConfig | None:
  """The data section a run trained on (None for a params checkpoint or an HF dir)."""
  src = describe(path)
  return src.config.data if src.config is not None else None


def train_config(path: str) -> TrainConfig | None:
  """The train section of a run (seq_len, batch_size, ...); None for other kinds."""
  src = describe(path)
  return src.config.train if src.config is not None else None


def load(path: str, *, dtype: str | None = None, param_dtype: str | None = None,
         step: int | None = None, mesh: jax.sharding.Mesh | None = None,
         shardings: Any = None) -> tuple[ModelConfig, nnx.Module]:
  """(ModelConfig, model) for the model at `path`, its parameters loaded. `dtype` /
  `param_dtype` replace the compute / storage dtypes (parameters are cast on load). Each
  parameter is read straight onto its shards: `mesh` lays it out tensor-parallel
  (`sharding.tensor_parallel`); `shardings`, a tree like the model's parameters (a pure dict,
  layers stacked), any other way. Neither: one device."""
  if mesh is not None and shardings is not None:
    raise ValueError("model_source.load: give mesh or shardings, not both")
  src = describe(path, step)
  place = None
  if mesh is not None:
    place = lambda abstract: sharding_lib.tensor_parallel(abstract, mesh)
  elif shardings is not None:
    place = lambda _: shardings
  if src.kind != "hf":
    check_intact(src)
  if src.kind == "hf":
    return load_hf(path, dtype=dtype or "float32", param_dtype=param_dtype or "float32",
                   shardings=place)
  cfg = model_config(path, step)
  stored_dtype = cfg.param_dtype
  cfg = dataclasses.replace(cfg, dtype=dtype or cfg.dtype,
                            param_dtype=param_dtype or cfg.param_dtype)
  model = nnx.eval_shape(lambda: llama.create(cfg))
  state = nnx.state(model, nnx.Param)
  want = nnx.to_pure_dict(state)
  where = place(model) if place else jax.tree.map(lambda _: None, want)
  stored = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(stored_dtype),
                                                          sharding=s), want, where)
  if src.kind == "params":
    pure = params_io.restore_pure(path, stored)
  else:
    pure = _restore_train_params(src, stored)
  # A cast keeps each array where it is (on its shards).
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda x, w: jnp.asarray(x, w.dtype), pure, want))
  nnx.update(model, state)
  return cfg, model


def check_intact(src: Source) -> None:
  """ConfigError naming what is wrong, in one line, if the parameters at `src` (a run's step or
  a params checkpoint) do not read back (`integrity`); for a step, it names the newest step of
  the run that does."""
  if src.kind == "params":
    found = integrity.check_store(os.path.join(src.path, "params"), src.label())
    if found:
      raise ConfigError(f"{found.line()}; convert it again (`python -m jscale.convert`)")
    return
  found = integrity.check_store(os.path.join(src.weights, "state"), f"checkpoint {src.label()}",
                                only="params")
  if found is None:
    return
  directory = os.path.dirname(os.path.abspath(src.weights))
  others = [s for s in reversed(complete_steps(directory)) if s != src.step]
  good = next((s for s in others if integrity.check_step(directory, s, only="params") is None),
              None)
  if good is None:
    fix = "no other step of this run reads back"
  elif src.kind == "run":
    fix = f"the newest step that reads back is {good}: pass --step {good}"
  else:
    fix = f"the newest step that reads back is {os.path.join(directory, str(good))}"
  raise ConfigError(f"{found.line()}; {fix}")


def _restore_train_params(src: Source, stored: dict) -> dict:
  """The `params` of a training checkpoint as `stored` says (shapes, dtype, shardings; nothing
  else is read), in model layer order."""
  run = src.config
  state_dir = os.path.join(os.path.abspath(src.weights), "state")
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      old = legacy_experts.is_old(stored, ckptr.metadata(state_dir).item_metadata.tree)
      target = {"params": legacy_experts.old_target(stored) if old else stored}
      out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True))
  except (ValueError, KeyError) as e:
    raise ConfigError(f"--model {src.path}: the checkpoint's parameters do not fit the run's "
                      f"model config: {e}") from None
  params = legacy_experts.upgraded(out["params"], stored) if old else out["params"]
  v = run.pipeline.virtual_stages if src.stages > 1 else 1
  return {**params,
          "blocks": placement.to_model(params["blocks"], run.model.stack_layers, src.stages, v,
                                    placement.placement_of(run.pipeline.schedule))}
