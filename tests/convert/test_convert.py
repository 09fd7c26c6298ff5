"""HF interop: parity with transformers' LlamaForCausalLM, exact round trips, the CLI, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_case import (LLAMA3, SEQ, VOCAB, assert_bitwise, hf_logits, hf_model, jscale_logits,
                     param_arrays, safetensors_in)

from jscale.config import ConfigError
from jscale.convert import config_from_hf, config_to_hf, load_hf, save_hf
from jscale.convert.__main__ import main
from jscale.model import llama

# name -> (LlamaConfig kwargs, save_pretrained kwargs)
CASES = {
    "mha": (dict(num_attention_heads=4, num_key_value_heads=4), {}),
    "gqa_tied": (dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), {}),
    "llama3": (dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3), {}),
    "head_dim": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32), {}),
    "sharded": (dict(num_attention_heads=4, num_key_value_heads=1), {"max_shard_size": "100KB"}),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """name -> (HF checkpoint dir, HF logits), built once for the module."""
  out = {}
  for i, (name, (cfg_kw, save_kw)) in enumerate(CASES.items()):
    model = hf_model(i, **cfg_kw)
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, **save_kw)
    out[name] = (path, hf_logits(model))
  return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(hf_dirs, name):
  path, ref = hf_dirs[name]
  if name == "sharded":
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  cfg, model = load_hf(path)
  assert cfg.tie_embeddings == (name == "gqa_tied")
  assert (cfg.rope_scaling is not None) == (name == "llama3")
  assert cfg.resolved_head_dim == (32 if name == "head_dim" else 16)
  got = jscale_logits(model)
  assert got.shape == ref.shape == (2, SEQ, VOCAB)
  assert np.abs(ref).max() > 1.0  # logits large enough for the tolerance to mean something
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_llama3_scaling_changes_logits(hf_dirs):
  """The llama3 case has teeth: dropping the scaling moves the logits far past the tolerance."""
  path, ref = hf_dirs["llama3"]
  cfg, model = load_hf(path)
  unscaled = llama.create(dataclasses.replace(cfg, rope_scaling=None))
  nnx.update(unscaled, nnx.state(model, nnx.Param))
  assert np.abs(jscale_logits(unscaled) - ref).max() > 1e-2


def test_pre_v5_config_loads_the_same(hf_dirs, tmp_path):
  src, ref = hf_dirs["llama3"]
  old = str(tmp_path / "old")
  shutil.copytree(src, old)
  with open(os.path.join(old, "config.json"), encoding="utf-8") as f:
    hf = json.load(f)
  rope = hf.pop("rope_parameters")
  hf["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")  # the oldest spelling
  hf["rope_scaling"] = rope
  with open(os.path.join(old, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf, f)
  cfg_new, model_new = load_hf(src)
  cfg_old, model_old = load_hf(old)
  assert cfg_old == cfg_new
  np.testing.assert_allclose(jscale_logits(model_old), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "gqa_tied"])
def test_export_roundtrip_is_exact(hf_dirs, tmp_path, name):
  src, ref = hf_dirs[name]
  cfg, model = load_hf(src)
  out = str(tmp_path / "export")
  save_hf(model, cfg, out, max_shard_bytes=40_000)  # small shards: exercises the index too
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  cfg2, model2 = load_hf(out)
  assert cfg2 == cfg
  assert_bitwise(param_arrays(model), param_arrays(model2))
  # Every HF tensor survives HF -> jscale -> HF bit for bit (a tied model stores no lm_head).
  assert_bitwise(safetensors_in(src), safetensors_in(out))
  hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  np.testing.assert_allclose(hf_logits(hf), ref, atol=1e-6, rtol=0)


def test_bfloat16_checkpoints(hf_dirs, tmp_path):
  """Real Llama checkpoints are bf16: they load exactly (upcast) and export back bit for bit."""
  src, _ = hf_dirs["mha"]
  bf16 = str(tmp_path / "bf16")
  hf = transformers.LlamaForCausalLM.from_pretrained(src).to(torch.bfloat16)
  hf.save_pretrained(bf16)
  cfg, model = load_hf(bf16)
  embed = safetensors_in(bf16)["model.embed_tokens.weight"]
  assert embed.dtype == jnp.bfloat16
  assert_bitwise(param_arrays(model)["embed"], embed.astype(np.float32))
  exported = str(tmp_path / "exported")
  save_hf(model, cfg, exported, dtype="bfloat16")
  with open(os.path.join(exported, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["dtype"] == "bfloat16"
  assert_bitwise(safetensors_in(bf16), safetensors_in(exported))


def test_cli_roundtrip(hf_dirs, tmp_path, capsys):
  src, ref = hf_dirs["gqa_tied"]
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
  assert main(["hf-to-jscale", "--hf", src, "--out", ckpt]) == 0
  assert os.path.isfile(os.path.join(ckpt, "model.yaml"))
  assert main(["jscale-to-hf", "--ckpt", ckpt, "--out", out]) == 0
  assert_bitwise(safetensors_in(src), safetensors_in(out))
  _, model = load_hf(out)
  np.testing.assert_allclose(jscale_logits(model), ref, atol=1e-4, rtol=0)
  capsys.readouterr()
  # User mistakes: a clear message and status 2, no traceback.
  missing = str(tmp_path / "missing")
  assert main(["hf-to-jscale", "--hf", missing, "--out", str(tmp_path / "x")]) == 2
  assert "no such directory" in capsys.readouterr().err
  assert main(["hf-to-jscale", "--hf", src, "--out", ckpt]) == 2
  assert "already holds" in capsys.readouterr().err
  assert main(["jscale-to-hf", "--ckpt", ckpt, "--out", out]) == 2
  assert "exists and is not empty" in capsys.readouterr().err
  assert main(["jscale-to-hf", "--ckpt", src, "--out", str(tmp_path / "y")]) == 2
  assert "already a Hugging Face dir" in capsys.readouterr().err


def test_cli_help():
  r = subprocess.run([sys.executable, "-m", "jscale.convert", "--help"], capture_output=True,
                     text=True, check=False, timeout=60)
  assert r.returncode == 0, r.stderr
  assert "hf-to-jscale" in r.stdout and "jscale-to-hf" in r.stdout


def _base_hf() -> dict:
  return config_to_hf(config_from_hf({
      "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 96}), dtype="float32")


@pytest.mark.parametrize("edit, key", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_configs_error_clearly(edit, key):
  with pytest.raises(ConfigError, match=key):
    config_from_hf({**_base_hf(), **edit})


def test_config_roundtrip_and_defaults():
  hf = _base_hf()
  del hf["num_key_value_heads"], hf["head_dim"]  # optional in config.json
  cfg = config_from_hf(hf, dtype="bfloat16")
  assert (cfg.n_kv_heads, cfg.resolved_head_dim, cfg.dtype) == (4, 16, "bfloat16")
  scaled = dataclasses.replace(cfg, head_dim=32, rope_theta=5e5, rope_scaling=config_from_hf(
      {**hf, "rope_parameters": LLAMA3}).rope_scaling)
  assert config_from_hf(config_to_hf(scaled, dtype="float32"), dtype="bfloat16") == scaled
  # transformers itself reads what config_to_hf writes.
  hf_cfg = transformers.LlamaConfig(**config_to_hf(scaled, dtype="float32"))
  assert hf_cfg.rope_parameters["rope_type"] == "llama3" and hf_cfg.head_dim == 32


def test_missing_weights_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(str(tmp_path))
  with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
    json.dump(_base_hf(), f)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_hf(str(tmp_path))
