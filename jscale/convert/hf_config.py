"""Hugging Face Llama / Mixtral `config.json` <-> jscale ModelConfig.

Mixtral (`model_type: mixtral`) is Llama with every MLP a routed set of SwiGLU experts: it maps
to a ModelConfig with `moe` set, and a ModelConfig with `moe` exports as Mixtral.

Reads both rope layouts: transformers >= 5 nests rope settings in `rope_parameters`; earlier
versions put `rope_theta` and `rope_scaling` (with `type` or `rope_type`) at the top level.
Anything jscale's model cannot reproduce exactly (biases, other activations or rope types)
is rejected with the HF key that caused it, rather than converted into a silently different model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jscale.config import ConfigError, ModelConfig, MoeConfig, RopeScalingConfig
from jscale.convert import hf_deepseek

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")

# What transformers assumes for keys a config.json leaves out (LlamaConfig / MixtralConfig).
_DEFAULTS = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001},
}


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


def _rope(hf: dict[str, Any], default_theta: float) -> tuple[float, RopeScalingConfig | None]:
  """(rope_theta, scaling) from either the v5 or the pre-v5 layout."""
  if hf.get("rope_parameters"):
    rp, where = dict(hf["rope_parameters"]), "rope_parameters"
    theta = rp.get("rope_theta", hf.get("rope_theta", default_theta))
  else:
    rp, where = dict(hf.get("rope_scaling") or {}), "rope_scaling"
    theta = hf.get("rope_theta", default_theta)
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


def _mixtral_moe(hf: dict[str, Any], max_seq_len: int) -> MoeConfig:
  """The MoeConfig of a Mixtral config dict; raises ConfigError for what jscale cannot express."""
  defaults = _DEFAULTS["mixtral"]
  window = hf.get("sliding_window")
  # HF masks keys more than `sliding_window - 1` positions back; a window no shorter than any
  # sequence (train.seq_len <= max_seq_len) is plain causal attention, which is all jscale has.
  if window is not None and int(window) < max_seq_len:
    raise ConfigError(f"sliding_window={window} is shorter than max_position_embeddings="
                      f"{max_seq_len}: jscale has no sliding-window attention (null, or a window "
                      "of at least max_position_embeddings, is plain causal attention)")
  if hf.get("router_jitter_noise"):
    raise ConfigError(f"router_jitter_noise={hf['router_jitter_noise']}: jscale's router has no "
                      "input jitter (0.0 converts)")
  n_experts = int(hf.get("num_local_experts", defaults["num_local_experts"]))
  top_k = int(hf.get("num_experts_per_tok", defaults["num_experts_per_tok"]))
  if n_experts < 1 or not 1 <= top_k <= n_experts:
    raise ConfigError(f"num_experts_per_tok={top_k} with num_local_experts={n_experts}: need "
                      "1 <= num_experts_per_tok <= num_local_experts")
  aux = float(hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"]))
  if aux < 0:
    raise ConfigError(f"router_aux_loss_coef={aux} must be >= 0")
  # Mixtral's routing (softmax over all experts, top-k, renormalised) is jscale's, dropless.
  # router_aux_loss_coef is carried over as is, but the losses it weighs differ: HF's
  # load-balancing loss is top_k times jscale's (its expert fractions sum to top_k, not 1) and
  # pools the fractions and mean probabilities over all layers' tokens before taking their
  # product, where jscale averages per-layer losses. HF Mixtral has no router z-loss: 0 here.
  return MoeConfig(n_experts=n_experts, top_k=top_k, d_ff=None, aux_loss_weight=aux,
                   z_loss_weight=0.0)


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32",
                   param_dtype: str = "float32") -> ModelConfig:
  """A ModelConfig equivalent to the HF Llama or Mixtral config dict `hf`; raises ConfigError
  otherwise. DeepSeek-V3 (`model_type: deepseek_v3`): `jscale.convert.hf_deepseek`."""
  model_type = hf.get("model_type")
  if model_type == hf_deepseek.MODEL_TYPE:
    return hf_deepseek.config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
  if model_type not in _DEFAULTS:
    raise ConfigError(f"model_type={model_type!r}: only 'llama', 'mixtral' and 'deepseek_v3' "
                      "checkpoints convert")
  defaults = _DEFAULTS[model_type]
  if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # HF treats swish as silu
    raise ConfigError(f"hidden_act={hf['hidden_act']!r}: jscale's MLP is SwiGLU (silu) only")
  if model_type == "llama":  # (transformers' Mixtral has no such keys: it never has biases)
    for key in ("attention_bias", "mlp_bias"):
      if hf.get(key):
        raise ConfigError(f"{key}=true: jscale's Llama has no bias terms")
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size"):
    if key not in hf:
      raise ConfigError(f"config.json lacks {key}")
  theta, scaling = _rope(hf, defaults["rope_theta"])
  n_heads = int(hf["num_attention_heads"])
  # Absent: the model type's default (Mixtral: 8); null: one kv head per query head.
  n_kv_heads = int(hf.get("num_key_value_heads", defaults.get("num_key_value_heads"))
                   or n_heads)
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  if n_heads % n_kv_heads:
    raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of "
                      f"num_key_value_heads={n_kv_heads}")
  if head_dim % 2:
    raise ConfigError(f"head_dim={head_dim} must be even for RoPE")
  max_seq_len = int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
      n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads, n_kv_heads=n_kv_heads,
      # Keep head_dim explicit only where it differs from the default, so configs stay tidy.
      head_dim=None if head_dim * n_heads == hf["hidden_size"] else int(head_dim),
      d_ff=int(hf["intermediate_size"]),  # Mixtral: each expert's hidden size
      max_seq_len=max_seq_len,
      rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)),
      moe=_mixtral_moe(hf, max_seq_len) if model_type == "mixtral" else None,
      dtype=dtype, param_dtype=param_dtype)


def config_to_hf(cfg: ModelConfig, *, dtype: str) -> dict[str, Any]:
  """The transformers-5 `config.json` dict for `cfg`, with `dtype` as the stored weight dtype:
  LlamaForCausalLM, or MixtralForCausalLM when `cfg.moe` is set.

  Also writes top-level `rope_theta` / `rope_scaling` so transformers 4.x reads the same rope.
  A model with `cfg.mla` exports as DeepseekV3ForCausalLM (`jscale.convert.hf_deepseek`).
  """
  if hf_deepseek.is_deepseek(cfg):
    return hf_deepseek.config_to_hf(cfg, dtype=dtype)
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    rs = cfg.rope_scaling
    rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
  legacy_scaling = None if cfg.rope_scaling is None else {
      k: v for k, v in rope.items() if k != "rope_theta"}
  m = cfg.moe
  if m is not None and m.shared_d_ff:
    raise ConfigError(f"model.moe.shared_d_ff={m.shared_d_ff}: Mixtral has no shared expert, "
                      "so this model has no Hugging Face equivalent")
  if m is not None and m.every != 1:
    raise ConfigError(f"model.moe.every={m.every}: Mixtral has experts in every layer, so this "
                      "model has no Hugging Face equivalent")
  hf: dict[str, Any] = {
      "architectures": ["LlamaForCausalLM" if m is None else "MixtralForCausalLM"],
      "model_type": "llama" if m is None else "mixtral",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff if m is None else m.d_ff or cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "initializer_range": cfg.init_std,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_dropout": 0.0,
  }
  if m is None:
    hf.update({"attention_bias": False, "mlp_bias": False})
  else:
    # Only the weights and the routing carry over; dispatch (HF is dropless), capacity_factor
    # and z_loss_weight have no HF counterpart, and the aux loss differs (see _mixtral_moe).
    hf.update({"num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
               "router_aux_loss_coef": m.aux_loss_weight, "router_jitter_noise": 0.0,
               "output_router_logits": False, "sliding_window": None})
  hf.update({
      "use_cache": True,
      "dtype": dtype,
      "rope_parameters": rope,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": legacy_scaling,
  })
  return hf
