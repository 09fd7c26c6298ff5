"""HF interop for DeepSeek-V3: a tiny random DeepseekV3ForCausalLM with every feature on (low-rank
query, YaRN, 4 expert groups with top-2 groups, the balancing bias, a shared expert, the first
layer dense, interleaved rope weights) against jscale in both directions (logits, fp32), greedy
generation from jscale's latent cache against transformers' generate, and MTP weights kept
through jscale's export (transformers itself builds no MTP module)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_case import (SEQ, VOCAB, assert_bitwise, assert_greedy_equals_transformers, hf_logits,
                     jscale_logits, param_arrays, reinit, safetensors_in)

from jscale.config import MtpConfig
from jscale.convert import load_hf, save_hf
from jscale.convert.__main__ import mtp_note
from jscale.model import llama, router

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _hf_deepseek(seed: int) -> transformers.DeepseekV3ForCausalLM:
  cfg = transformers.DeepseekV3Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
      num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
      qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
      topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
      max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=YARN,
      tie_word_embeddings=False)
  cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(seed)
  model = reinit(transformers.DeepseekV3ForCausalLM(cfg).eval())
  with torch.no_grad():  # a non-zero balancing bias (a buffer, which reinit leaves at 0)
    for layer in model.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
  return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  """(HF model, its checkpoint dir, HF logits, jscale config and model loaded from it)."""
  hf = _hf_deepseek(0)
  path = str(tmp_path_factory.mktemp("deepseek_hf"))
  hf.save_pretrained(path)
  cfg, model = load_hf(path)
  return hf, path, hf_logits(hf), cfg, model


def test_deepseek_logits_match_transformers(deepseek):
  _, _, ref, cfg, model = deepseek
  assert cfg.mla.q_lora_rank == 32 and cfg.mla.v_head_dim == 16 and cfg.first_dense == 1
  assert (cfg.moe.router, cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.shared_d_ff) == (
      "sigmoid", 4, 2, 32)
  assert cfg.rope_scaling.rope_type == "yarn" and cfg.mtp is None  # HF saved no MTP weights
  assert np.abs(np.asarray(model.blocks.mlp.router_bias[...])).max() > 0.01
  got = jscale_logits(model)
  assert got.shape == ref.shape == (2, SEQ, VOCAB) and np.abs(ref).max() > 1.0
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_jscale_deepseek_exports_to_transformers_with_its_mtp(deepseek, tmp_path):
  """The loaded model plus an MTP module -> save_hf: transformers loads it to the same logits
  (dropping the MTP layer, model.layers.3), and load_hf gives back every parameter bit for
  bit, the balancing bias and the MTP module included."""
  _, _, ref, cfg, model = deepseek
  mtp_cfg = dataclasses.replace(cfg, mtp=MtpConfig(depth=1))
  ours = llama.create(mtp_cfg, seed=1)
  pure = nnx.to_pure_dict(nnx.state(ours, nnx.Param))
  pure.update({k: v for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items()})
  state = nnx.state(ours, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(ours, state)
  out = str(tmp_path / "export")
  save_hf(ours, mtp_cfg, out)
  names = safetensors_in(out)
  assert "model.layers.3.eh_proj.weight" in names
  assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
  hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert not any(k.startswith("model.layers.3.") for k in hf.state_dict())
  # ... which `jscale.convert jscale-to-hf` says is expected, naming the layer.
  assert "model.layers.3.*" in mtp_note(mtp_cfg) and "UNEXPECTED; that is expected" in \
      mtp_note(mtp_cfg)
  np.testing.assert_allclose(hf_logits(hf.eval()), ref, atol=1e-4, rtol=0)
  cfg2, back = load_hf(out)
  assert cfg2 == mtp_cfg
  assert_bitwise(param_arrays(ours), param_arrays(back))
  assert np.abs(param_arrays(back)["mtp"]["eh_proj"]).max() > 0
  np.testing.assert_array_equal(param_arrays(back)["blocks"]["mlp"][router.BIAS],
                                param_arrays(model)["blocks"]["mlp"][router.BIAS])


def test_greedy_from_the_latent_cache_equals_transformers(deepseek):
  hf, _, _, _, model = deepseek
  assert_greedy_equals_transformers(hf, model, 12)
