"""Shared by the DeepSeek-V3 tests: the tiny DeepSeek model at test size (every feature on:
MLA with a low-rank query and YaRN, sigmoid routing in 2 groups with the balancing bias, a
shared expert, the first layer dense, one MTP module)."""

from conftest import small_config

# On top of conftest.small_config (d_model 64, fp32): 3 layers = 1 dense + 2 MoE.
DS = ("model.preset=deepseek_v3_tiny", "model.n_layers=3", "model.n_kv_heads=4",
      "model.moe.d_ff=32", "model.moe.shared_d_ff=32", "model.mla.q_lora_rank=32",
      "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
      "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16",
      "model.rope_scaling.original_max_position_embeddings=16",
      "model.moe.bias_update_rate=0.01", "model.moe.seq_aux_loss_weight=0.01")


def config(*overrides: str, tmp_path=None):
  """The tiny DeepSeek test config with `overrides`."""
  return small_config(tmp_path, *DS, *overrides)
