"""Model shape presets, selected with `model.preset: NAME`; explicit model keys override them.

Llama 3.x shapes follow the published Hugging Face configs (3.2 for 1B/3B, 3.1 for 8B/70B/405B).
DeepSeek-V3 follows deepseek-ai/DeepSeek-V3's config.json (671B total, 37B active per token);
`deepseek_v3_16b` is a DeepSeek-V2-Lite / Moonlight-sized shape (~16B total, ~3B active) with
V3's routing, for one GPU node; `deepseek_v3_tiny` has every feature on and trains on a CPU.
"""

from __future__ import annotations

from typing import Any

from jscale.config import ConfigError

_LLAMA3_ROPE = dict(rope_theta=500000.0, max_seq_len=131072, vocab_size=128256, n_kv_heads=8,
                    norm_eps=1e-5)


def _scaling(factor: float) -> dict:
  return dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


def _yarn(factor: float, original: int) -> dict:
  return dict(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


# DeepSeek-V3's routing and balancing (aux-loss-free bias, a tiny sequence-wise loss).
_DEEPSEEK_ROUTING = dict(router="sigmoid", norm_topk_prob=True, bias_update_rate=1e-3,
                         seq_aux_loss_weight=1e-4, aux_loss_weight=0.0, z_loss_weight=0.0)


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
    # Every DeepSeek-V3 feature at CPU size (~2M parameters): MLA with a low-rank query and
    # YaRN, 8 sigmoid-routed experts in 2 groups (top-2 from 1 group) + a shared one, the
    # first layer dense, one MTP module.
    "deepseek_v3_tiny": dict(
        vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384,
        max_seq_len=2048, rope_theta=10000.0, rope_scaling=_yarn(4.0, 512), norm_eps=1e-6,
        tie_embeddings=False,
        mla=dict(q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32),
        moe=dict(_DEEPSEEK_ROUTING, n_experts=8, top_k=2, d_ff=96, shared_d_ff=96, n_group=2,
                 topk_group=1, routed_scaling_factor=1.0, first_dense=1),
        mtp=dict(depth=1, loss_weight=0.3)),
    # ~16B total / ~2.8B active: DeepSeek-V2-Lite's shape (27 layers, d 2048, 16 heads, MLA
    # without q_lora, 64 experts of 1408 + 2 shared, top-6, first layer dense) with V3's
    # routing (sigmoid, 8 groups, top-4 groups) and one MTP module.
    "deepseek_v3_16b": dict(
        vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, n_kv_heads=16, d_ff=10944,
        max_seq_len=32768, rope_theta=10000.0, rope_scaling=_yarn(40.0, 4096), norm_eps=1e-6,
        tie_embeddings=False,
        mla=dict(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128),
        moe=dict(_DEEPSEEK_ROUTING, n_experts=64, top_k=6, d_ff=1408, shared_d_ff=2816,
                 n_group=8, topk_group=4, routed_scaling_factor=1.0, first_dense=1),
        mtp=dict(depth=1, loss_weight=0.3)),
    # DeepSeek-V3 (671B, deepseek-ai/DeepSeek-V3 config.json).
    "deepseek_v3_671b": dict(
        vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, d_ff=18432,
        max_seq_len=163840, rope_theta=10000.0, rope_scaling=_yarn(40.0, 4096), norm_eps=1e-6,
        tie_embeddings=False,
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128),
        moe=dict(_DEEPSEEK_ROUTING, n_experts=256, top_k=8, d_ff=2048, shared_d_ff=2048,
                 n_group=8, topk_group=4, routed_scaling_factor=2.5, first_dense=3),
        mtp=dict(depth=1, loss_weight=0.3)),
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
