"""load_hf / save_hf: whole-model conversion between HF Llama / Mixtral / DeepSeek-V3 dirs and
jscale models."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jscale.config import ConfigError, ModelConfig
from jscale.convert import hf_deepseek, hf_weights
from jscale.convert.hf_config import config_from_hf, config_to_hf, read_hf_config
from jscale.model import llama

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size


def model_from_pure(cfg: ModelConfig, pure: dict,
                    shardings: Callable[[nnx.Module], Any] | None = None) -> llama.Llama:
  """A Llama holding the arrays of `pure`, built abstractly so no random init is paid for.
  `shardings(abstract model)`: where each parameter goes (host arrays are put straight onto
  their shards); default: the default device."""
  abstract = nnx.eval_shape(lambda: llama.create(cfg))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  want = nnx.to_pure_dict(params)
  if jax.tree.structure(want) != jax.tree.structure(pure):
    raise ConfigError("converted parameters do not fit the model: tree structures differ")
  mismatch = [f"{jax.tree_util.keystr(p)}: {a.shape} vs {b.shape}" for (p, a), b in zip(
      jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(pure)) if a.shape != b.shape]
  if mismatch:
    raise ConfigError(f"converted parameters do not fit the model: {'; '.join(mismatch)}")
  if shardings is None:
    placed = jax.tree.map(jnp.asarray, pure)
  else:
    placed = jax.tree.map(jax.device_put, pure, shardings(abstract))
  nnx.replace_by_pure_dict(params, placed)
  return nnx.merge(graphdef, params, rest)


def load_hf(path: str, *, dtype: str = "float32", param_dtype: str = "float32",
            shardings: Callable[[nnx.Module], Any] | None = None
            ) -> tuple[ModelConfig, llama.Llama]:
  """Reads a transformers Llama or Mixtral checkpoint dir (config.json + safetensors, sharded
  or not); a Mixtral one gives a model with `cfg.moe` set.

  `dtype` is the model's compute dtype and `param_dtype` the dtype weights are stored in (bf16
  checkpoints are upcast exactly); `shardings`: see `model_from_pure`. Returns (ModelConfig,
  model); raises ConfigError for configs jscale cannot reproduce and FileNotFoundError for
  missing files.
  """
  cfg = config_from_hf(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
  with hf_weights.SafetensorsReader(path) as reader:
    cfg = hf_deepseek.without_absent_mtp(cfg, reader.files)
    pure = hf_weights.hf_to_pure(reader, cfg, jnp.dtype(param_dtype))
  return cfg, model_from_pure(cfg, pure, shardings)


def save_hf(model: nnx.Module, config: ModelConfig, path: str, *, dtype: str | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
  """Writes `model` as a transformers dir: config.json + model.safetensors (or shards), for
  LlamaForCausalLM, or MixtralForCausalLM when `config.moe` is set.

  `dtype` (e.g. "bfloat16") casts the stored weights; None keeps the parameters' own dtype.
  Refuses to write over an existing checkpoint in `path`, as stale shards would mix in.
  Arrays must be addressable from this process (single-host).
  """
  os.makedirs(path, exist_ok=True)
  clash = [f for f in os.listdir(path) if f == "config.json" or f.endswith(".safetensors")
           or f == hf_weights.INDEX]
  if clash:
    raise FileExistsError(f"{path} already holds {', '.join(sorted(clash))}; choose an empty "
                          "output directory")
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  stored = jnp.dtype(dtype) if dtype is not None else None
  # Before any weights are written: a model HF cannot express fails with nothing left behind.
  hf_config = config_to_hf(config, dtype=(stored or pure["embed"].dtype).name)
  hf_weights.write_safetensors(hf_weights.pure_to_hf(pure, config, stored), path,
                               max_shard_bytes)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
    json.dump(hf_config, fh, indent=2)
    fh.write("\n")
