"""HF interop for Mixtral: parity with transformers' MixtralForCausalLM in both directions, both
on-disk expert layouts (per-expert w1/w2/w3 and transformers 5's fused gate_up_proj), errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

# The Llama tests' tokens, logits and tensor helpers (VOCAB 128, SEQ 64).
from hf_case import (SEQ, VOCAB, assert_bitwise, hf_logits, jscale_logits, param_arrays, reinit,
                     safetensors_in, tokens)
from safetensors.numpy import save_file

from jscale.config import ConfigError, ModelConfig, MoeConfig
from jscale.convert import config_from_hf, config_to_hf, load_hf, save_hf
from jscale.convert.__main__ import main
from jscale.model import llama

E, K, F = 4, 2, 96


def _hf_mixtral(seed: int) -> transformers.MixtralForCausalLM:
  cfg = transformers.MixtralConfig(
      vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K, intermediate_size=F,
      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
      router_jitter_noise=0.0, router_aux_loss_coef=0.02)
  cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(seed)
  # As for Llama: O(1) activations and non-trivial norms, so mistakes cannot hide. The router
  # logits come out O(1) too, so routing is far from uniform.
  return reinit(transformers.MixtralForCausalLM(cfg).eval())


def _min_routing_margin(model) -> float:
  """Smallest gap between a token's k-th and (k+1)-th router probability over all layers: far
  above fp32 noise means both implementations must pick the same experts."""
  with torch.no_grad():
    out = model(torch.from_numpy(tokens()).long(), output_router_logits=True)
  probs = torch.cat(out.router_logits).float().softmax(-1).sort(-1, descending=True).values
  return float((probs[:, K - 1] - probs[:, K]).min())


def _write_legacy(state: dict[str, torch.Tensor], config_json: str, path: str) -> None:
  """A checkpoint in the published Mixtral layout (block_sparse_moe, experts.{j}.w1/w2/w3),
  written by hand from transformers 5's fused module weights."""
  out = {}
  for name, w in state.items():
    w = w.numpy()
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows, then up rows
      pre = name[:-len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts."
      for j in range(E):
        out[f"{pre}{j}.w1.weight"], out[f"{pre}{j}.w3.weight"] = w[j, :F], w[j, F:]
    elif name.endswith("mlp.experts.down_proj"):  # [E, D, F]
      pre = name[:-len("mlp.experts.down_proj")] + "block_sparse_moe.experts."
      for j in range(E):
        out[f"{pre}{j}.w2.weight"] = w[j]
    else:
      out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = w
  os.makedirs(path)
  save_file({k: np.ascontiguousarray(v) for k, v in out.items()},
            os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(config_json, os.path.join(path, "config.json"))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  """(layout -> HF checkpoint dir, HF logits) for one random Mixtral, saved three ways."""
  model = _hf_mixtral(0)
  assert _min_routing_margin(model) > 1e-4
  root = tmp_path_factory.mktemp("mixtral")
  dirs = {"save_pretrained": str(root / "save_pretrained"), "fused": str(root / "fused"),
          "legacy": str(root / "legacy")}
  model.save_pretrained(dirs["save_pretrained"])
  config_json = os.path.join(dirs["save_pretrained"], "config.json")
  state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
  assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * F, 64)
  os.makedirs(dirs["fused"])  # transformers 5's module names and layouts, as they are in memory
  save_file({k: v.numpy() for k, v in state.items()},
            os.path.join(dirs["fused"], "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(config_json, os.path.join(dirs["fused"], "config.json"))
  _write_legacy(state, config_json, dirs["legacy"])
  return dirs, hf_logits(model)


@pytest.mark.parametrize("layout", ["save_pretrained", "fused", "legacy"])
def test_mixtral_logits_match_transformers(mixtral, layout):
  dirs, ref = mixtral
  names = safetensors_in(dirs[layout])
  fused = any(n.endswith("experts.gate_up_proj") for n in names)
  assert fused == (layout == "fused")
  if layout == "legacy":
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
  cfg, model = load_hf(dirs[layout])
  assert cfg.moe == MoeConfig(n_experts=E, top_k=K, d_ff=None, aux_loss_weight=0.02,
                              z_loss_weight=0.0)
  assert cfg.d_ff == F and cfg.rope_theta == 1e6
  got = jscale_logits(model)
  assert got.shape == ref.shape == (2, SEQ, VOCAB)
  assert np.abs(ref).max() > 1.0  # logits large enough for the tolerance to mean something
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_mixtral_layouts_load_the_same_and_export_exactly(mixtral, tmp_path):
  """Both layouts give bit-identical parameters; the export is the per-expert layout, bit for
  bit what transformers' own save_pretrained writes, and HF loads it to the same logits."""
  dirs, ref = mixtral
  cfg, model = load_hf(dirs["fused"])
  _, legacy = load_hf(dirs["legacy"])
  assert_bitwise(param_arrays(model), param_arrays(legacy))
  out = str(tmp_path / "export")
  save_hf(model, cfg, out, max_shard_bytes=100_000)  # sharded: experts split across files
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  assert_bitwise(safetensors_in(dirs["save_pretrained"]), safetensors_in(out))
  cfg2, model2 = load_hf(out)
  assert cfg2 == cfg
  assert_bitwise(param_arrays(model), param_arrays(model2))
  hf = transformers.MixtralForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  np.testing.assert_allclose(hf_logits(hf), ref, atol=1e-6, rtol=0)


def test_jscale_moe_model_exports_to_transformers(tmp_path):
  """A jscale MoE model (expert width unlike d_ff) -> save_hf -> MixtralForCausalLM: same
  logits, and the config fields HF reads are ours."""
  cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    d_ff=128, max_seq_len=256, rope_theta=5e5, init_std=0.15,
                    moe=MoeConfig(n_experts=E, top_k=K, d_ff=F, aux_loss_weight=0.02),
                    dtype="float32", param_dtype="float32")
  model = llama.create(cfg, seed=3)
  ours = jscale_logits(model)
  out = str(tmp_path / "hf")
  save_hf(model, cfg, out)
  hf = transformers.MixtralForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  c = hf.config
  assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size) == (E, K, F)
  assert c.router_aux_loss_coef == 0.02 and c.sliding_window is None
  assert _min_routing_margin(hf) > 1e-4
  assert np.abs(ours).max() > 1.0
  np.testing.assert_allclose(hf_logits(hf), ours, atol=1e-4, rtol=0)
  # Back in jscale: the same model, expert width now as d_ff (z-loss: HF has none).
  cfg2, model2 = load_hf(out)
  assert cfg2 == dataclasses.replace(cfg, d_ff=F, moe=dataclasses.replace(
      cfg.moe, d_ff=None, z_loss_weight=0.0))
  assert_bitwise(param_arrays(model), param_arrays(model2))


def test_mixtral_cli_roundtrip(mixtral, tmp_path, capsys):
  dirs, _ = mixtral
  src = dirs["save_pretrained"]
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
  assert main(["hf-to-jscale", "--hf", src, "--out", ckpt]) == 0
  assert main(["jscale-to-hf", "--ckpt", ckpt, "--out", out]) == 0
  assert "MixtralForCausalLM" in capsys.readouterr().out
  assert_bitwise(safetensors_in(src), safetensors_in(out))


def test_mixtral_bad_checkpoints_error_clearly(mixtral, tmp_path):
  dirs, _ = mixtral
  bad = str(tmp_path / "bad")
  shutil.copytree(dirs["legacy"], bad)
  f = os.path.join(bad, "model.safetensors")
  tensors = safetensors_in(bad)
  missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
  save_file({k: v for k, v in tensors.items() if k != missing}, f, metadata={"format": "pt"})
  with pytest.raises(ConfigError, match=missing.replace(".", r"\.")):
    load_hf(bad)
  with open(os.path.join(bad, "config.json"), encoding="utf-8") as fh:
    hf = json.load(fh)
  with open(os.path.join(bad, "config.json"), "w", encoding="utf-8") as fh:
    json.dump({**hf, "num_local_experts": 2}, fh)  # fewer experts than the checkpoint holds
  with pytest.raises(ConfigError, match="gate.weight has shape"):
    load_hf(bad)


def _mixtral_hf() -> dict:
  return config_to_hf(config_from_hf({
      "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
      "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256}),
      dtype="float32")


@pytest.mark.parametrize("edit, key", [
    ({"sliding_window": 255}, "sliding_window"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
    ({"model_type": "qwen2_moe"}, "model_type"),
])
def test_unsupported_mixtral_configs_error_clearly(edit, key):
  with pytest.raises(ConfigError, match=key):
    config_from_hf({**_mixtral_hf(), **edit})


def test_mixtral_config_roundtrip_and_defaults():
  hf = _mixtral_hf()
  cfg = config_from_hf(hf)
  assert cfg.moe == MoeConfig(n_experts=4, top_k=2, d_ff=None, aux_loss_weight=0.001,
                              z_loss_weight=0.0)
  assert config_from_hf(config_to_hf(cfg, dtype="float32")) == cfg
  # A window covering max_position_embeddings is plain causal attention: accepted.
  assert config_from_hf({**hf, "sliding_window": 256}) == cfg
  # Keys config.json may leave out mean what transformers' MixtralConfig says they mean.
  sparse = {k: hf[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                               "intermediate_size")}
  sparse["num_attention_heads"] = 16  # a multiple of Mixtral's default 8 kv heads
  ref = transformers.MixtralConfig(**sparse)
  got = config_from_hf(sparse)
  assert (got.n_kv_heads, got.rope_theta, got.norm_eps, got.max_seq_len, got.moe.n_experts,
          got.moe.top_k, got.moe.aux_loss_weight, got.tie_embeddings) == (
              ref.num_key_value_heads, ref.rope_parameters["rope_theta"], ref.rms_norm_eps,
              ref.max_position_embeddings, ref.num_local_experts, ref.num_experts_per_tok,
              ref.router_aux_loss_coef, ref.tie_word_embeddings)
  # transformers reads what config_to_hf writes.
  hf_cfg = transformers.MixtralConfig(**config_to_hf(cfg, dtype="float32"))
  assert (hf_cfg.num_local_experts, hf_cfg.head_dim) == (4, 16)
  # A shared expert has no Mixtral equivalent.
  with pytest.raises(ConfigError, match="shared_d_ff"):
    config_to_hf(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_d_ff=32)),
                 dtype="float32")


def test_sliding_window_bound_matches_transformers():
  """Why sliding_window >= max_position_embeddings is accepted: in transformers a window as
  long as the sequence changes nothing, and one shorter does."""
  model = _hf_mixtral(1)
  ref = hf_logits(model)
  model.config.sliding_window = SEQ
  np.testing.assert_array_equal(hf_logits(model), ref)
  model.config.sliding_window = SEQ - 1
  assert np.abs(hf_logits(model) - ref).max() > 1e-3


def test_save_hf_refuses_shared_experts_before_writing(tmp_path):
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                    moe=MoeConfig(n_experts=2, top_k=1, shared_d_ff=16), dtype="float32")
  out = tmp_path / "out"
  with pytest.raises(ConfigError, match="shared_d_ff"):
    save_hf(nnx.eval_shape(lambda: llama.create(cfg)), cfg, str(out))
  assert not any(out.iterdir())
