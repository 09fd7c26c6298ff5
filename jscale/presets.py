"""Model shape presets, selected with `model.preset: NAME`; explicit model keys override them.

Llama 3.x shapes follow the published Hugging Face configs (3.2 for 1B/3B, 3.1 for 8B/70B/405B).
"""

from __future__ import annotations

from typing import Any

from jscale.config import ConfigError

_LLAMA3_ROPE = dict(rope_theta=500000.0, max_seq_len=131072, vocab_size=128256, n_kv_heads=8,
                    norm_eps=1e-5)


def _scaling(factor: float) -> dict:
  return dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


PRESETS: dict[str, dict] = {
    # ~3M parameters: trains on a 2-core CPU in minutes on byte-level text.
    "tiny": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768,
                 max_seq_len=2048, rope_theta=10000.0, tie_embeddings=False),
    # tiny with 8 SwiGLU experts of half the width, top-2: the same active MLP width as tiny.
    "tiny_moe": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                     d_ff=768, max_seq_len=2048, rope_theta=10000.0, tie_embeddings=False,
                     moe=dict(n_experts=8, top_k=2, d_ff=384)),
    # Mixtral 8x7B (HF mistralai/Mixtral-8x7B-v0.1 config).
    "mixtral_8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         d_ff=14336, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                         tie_embeddings=False, moe=dict(n_experts=8, top_k=2)),
    "llama3_1b": dict(_LLAMA3_ROPE, d_model=2048, n_layers=16, n_heads=32, head_dim=64,
                      d_ff=8192, tie_embeddings=True, rope_scaling=_scaling(32.0)),
    "llama3_3b": dict(_LLAMA3_ROPE, d_model=3072, n_layers=28, n_heads=24, head_dim=128,
                      d_ff=8192, tie_embeddings=True, rope_scaling=_scaling(32.0)),
    "llama3_8b": dict(_LLAMA3_ROPE, d_model=4096, n_layers=32, n_heads=32, d_ff=14336,
                      rope_scaling=_scaling(8.0)),
    "llama3_70b": dict(_LLAMA3_ROPE, d_model=8192, n_layers=80, n_heads=64, d_ff=28672,
                       rope_scaling=_scaling(8.0)),
    "llama3_405b": dict(_LLAMA3_ROPE, d_model=16384, n_layers=126, n_heads=128, d_ff=53248,
                        rope_scaling=_scaling(8.0)),
}


def apply(model: dict[str, Any]) -> dict[str, Any]:
  """The raw `model` section with its `preset`'s keys filled in where not given explicitly."""
  name = model.get("preset")
  if name is None:
    return model
  if name not in PRESETS:
    raise ConfigError(f"model.preset={name!r} is unknown: choose one of {sorted(PRESETS)}")
  # Nested sections (model.moe) merge key by key: an override keeps the preset's others.
  return {k: ({**PRESETS[name][k], **v} if isinstance(v, dict) and
              isinstance(PRESETS[name].get(k), dict) else v)
          for k, v in {**PRESETS[name], **model}.items()}
