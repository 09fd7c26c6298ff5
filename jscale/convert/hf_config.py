"""Hugging Face Llama `config.json` <-> jscale ModelConfig.

Reads both rope layouts: transformers >= 5 nests rope settings in `rope_parameters`; earlier
versions put `rope_theta` and `rope_scaling` (with `type` or `rope_type`) at the top level.
Anything jscale's model cannot reproduce exactly (biases, other activations or rope types)
is rejected with the HF key that caused it, rather than converted into a silently different model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jscale.config import ConfigError, ModelConfig, RopeScalingConfig

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def read_hf_config(path: str) -> dict[str, Any]:
  """The parsed `config.json` of the HF checkpoint directory `path`."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such directory (expected a Hugging Face checkpoint dir)")
  f = os.path.join(path, "config.json")
  if not os.path.isfile(f):
    raise FileNotFoundError(f"{path}: no config.json there; is it a Hugging Face model dir?")
  with open(f, encoding="utf-8") as fh:
    try:
      return json.load(fh)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{f} is not valid JSON: {e}") from None


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig | None]:
  """(rope_theta, scaling) from either the v5 or the pre-v5 layout."""
  if hf.get("rope_parameters"):
    rp, where = dict(hf["rope_parameters"]), "rope_parameters"
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
  else:
    rp, where = dict(hf.get("rope_scaling") or {}), "rope_scaling"
    theta = hf.get("rope_theta", 10000.0)
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise ConfigError(f"{where}.rope_type={rope_type!r} is not supported: jscale implements "
                      "'default' and 'llama3' RoPE only")
  missing = [k for k in _LLAMA3_KEYS if k not in rp]
  if missing:
    raise ConfigError(f"{where} (rope_type llama3) lacks {', '.join(missing)}")
  return float(theta), RopeScalingConfig(
      factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
      high_freq_factor=float(rp["high_freq_factor"]),
      original_max_position_embeddings=int(rp["original_max_position_embeddings"]))


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32",
                   param_dtype: str = "float32") -> ModelConfig:
  """A ModelConfig equivalent to the HF Llama config dict `hf`; raises ConfigError otherwise."""
  if hf.get("model_type") != "llama":
    raise ConfigError(f"model_type={hf.get('model_type')!r}: only 'llama' checkpoints convert")
  if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # HF treats swish as silu
    raise ConfigError(f"hidden_act={hf['hidden_act']!r}: jscale's MLP is SwiGLU (silu) only")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ConfigError(f"{key}=true: jscale's Llama has no bias terms")
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size"):
    if key not in hf:
      raise ConfigError(f"config.json lacks {key}")
  theta, scaling = _rope(hf)
  n_heads = int(hf["num_attention_heads"])
  n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  if n_heads % n_kv_heads:
    raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of "
                      f"num_key_value_heads={n_kv_heads}")
  if head_dim % 2:
    raise ConfigError(f"head_dim={head_dim} must be even for RoPE")
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
      n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads, n_kv_heads=n_kv_heads,
      # Keep head_dim explicit only where it differs from the default, so configs stay tidy.
      head_dim=None if head_dim * n_heads == hf["hidden_size"] else int(head_dim),
      d_ff=int(hf["intermediate_size"]),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)), dtype=dtype, param_dtype=param_dtype)


def config_to_hf(cfg: ModelConfig, *, dtype: str) -> dict[str, Any]:
  """The transformers-5 `config.json` dict for `cfg`, with `dtype` as the stored weight dtype.

  Also writes top-level `rope_theta` / `rope_scaling` so transformers 4.x reads the same rope.
  """
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    rs = cfg.rope_scaling
    rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
  legacy_scaling = None if cfg.rope_scaling is None else {
      k: v for k, v in rope.items() if k != "rope_theta"}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "initializer_range": cfg.init_std,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "use_cache": True,
      "dtype": dtype,
      "rope_parameters": rope,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": legacy_scaling,
  }
