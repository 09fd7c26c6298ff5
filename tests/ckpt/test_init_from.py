"""checkpoint.init_from: the model config comes from the checkpoint (params checkpoint or HF
dir), shape mismatches in one error, the tokenizer rule, and the fine-tune recipe end to end
(HF Llama + its tokenizer -> convert -> train: the first loss is transformers' loss)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import os
import shutil
import textwrap
import unittest

import numpy as np
import pytest
import tokenizers
import torch
import transformers
import yaml
from flax import nnx

from jscale.ckpt import init_from
from jscale.ckpt import params_io
from jscale import train as train_lib
from jscale import validate
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.convert.__main__ import main as convert_main
from jscale.data import make_train_iterator
from jscale.model import llama

VOCAB = 384  # the BPE tokenizer's size: 256 byte symbols, the specials, ~120 merges
SEQ, BATCH = 32, 8  # batch: a multiple of the 8 simulated devices (mesh.data=-1)
# The HF model's numerics, all unlike jscale's defaults and presets (rope_theta 10000,
# norm_eps 1e-5, max_seq_len 2048, init_std 0.02).
THETA, EPS = 500000.0, 1e-6


def _corpus_text() -> str:
  """A few hundred KB of real text: stdlib sources, no download."""
  return "".join(open(inspect.getsourcefile(m), encoding="utf-8").read()
                 for m in (textwrap, inspect, unittest.case, json.decoder))


def _train_tokenizer(text: str, vocab: int) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer with an end-of-text token, trained on `text`."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=["</s>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainer)
  return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{text: corpus dir, hf: HF Llama dir with tokenizer files, ckpt: its conversion,
  model: the HF model (fp32, eval)}, built once for the module."""
  root = tmp_path_factory.mktemp("init_from")
  text = _corpus_text()
  (root / "text").mkdir()
  (root / "text" / "corpus.txt").write_text(text, encoding="utf-8")
  tok = _train_tokenizer(text[:60000], VOCAB)
  assert tok.get_vocab_size() == VOCAB
  hf_cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
      rms_norm_eps=EPS, rope_theta=THETA, initializer_range=0.05, tie_word_embeddings=False)
  hf_cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(hf_cfg).eval()
  with torch.no_grad():  # O(1) activations and non-trivial norms: rope / eps mistakes show
    for name, p in model.named_parameters():
      p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
  hf = root / "hf"
  model.save_pretrained(hf)
  tok.save(str(hf / "tokenizer.json"))
  (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  ckpt = root / "ckpt"
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert convert_main(["hf-to-jscale", "--hf", str(hf), "--out", str(ckpt)]) == 0
  assert f"data.tokenizer={ckpt}/tokenizer.json" in out.getvalue()
  return {"root": root, "text": str(root / "text"), "hf": str(hf), "ckpt": str(ckpt),
          "model": model}


def _cfg(out, cache, init, *extra, path=None):
  """A run config of the kind a user writes: a preset, fp32, and init_from."""
  return load_config(path, [
      "model.preset=tiny", "model.dtype=float32", f"checkpoint.init_from={init}",
      f"train.batch_size={BATCH}", f"train.seq_len={SEQ}", "train.steps=1", "train.eval_every=0",
      "checkpoint.every=0", "logging.progress=false", "logging.every=1",
      "logging.tensorboard=false", f"train.output_dir={out}", f"data.cache_dir={cache}", *extra])


def test_convert_copies_the_tokenizer(files):
  for f in ("tokenizer.json", "tokenizer_config.json"):
    assert open(os.path.join(files["ckpt"], f), "rb").read() == \
        open(os.path.join(files["hf"], f), "rb").read()


@pytest.mark.parametrize("kind", ["ckpt", "hf"])
def test_model_config_comes_from_the_checkpoint(files, tmp_path, data_cache, kind):
  cfg = _cfg(tmp_path, data_cache, files[kind])
  m = cfg.model
  assert (m.rope_theta, m.norm_eps, m.max_seq_len, m.init_std) == (THETA, EPS, 256, 0.05)
  assert (m.vocab_size, m.d_model, m.n_layers, m.n_kv_heads, m.d_ff) == (VOCAB, 64, 2, 2, 128)
  assert m.preset is None and m.dtype == "float32"  # the user's dtype wins
  assert init_from.overrides(cfg) == ["model.dtype=float32 (checkpoint: bfloat16)"]
  # A model key the user writes wins, and is listed; kernel choices are not listed.
  cfg = _cfg(tmp_path, data_cache, files[kind], "model.rope_theta=10000",
             "model.attention_impl=xla", "model.rope_scaling.rope_type=llama3",
             "model.rope_scaling.factor=4")
  assert cfg.model.rope_theta == 10000.0 and cfg.model.rope_scaling.factor == 4.0
  assert init_from.overrides(cfg) == [
      "model.rope_theta=10000.0 (checkpoint: 500000.0)",
      "model.rope_scaling={rope_type: llama3, factor: 4.0, low_freq_factor: 1.0, "
      "high_freq_factor: 4.0, original_max_position_embeddings: 8192, beta_fast: 32.0, "
      "beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 0.0} (checkpoint: null)",
      "model.dtype=float32 (checkpoint: bfloat16)"]


def test_yaml_model_keys_apply_but_not_its_preset(files, tmp_path, data_cache):
  path = tmp_path / "run.yaml"
  path.write_text(yaml.safe_dump({"model": {"preset": "llama3_8b", "norm_eps": 1e-5,
                                            "d_model": 64}}))
  cfg = _cfg(tmp_path, data_cache, files["ckpt"], path=str(path))
  # llama3_8b's shapes and rope_scaling are not applied: the checkpoint is the model.
  assert (cfg.model.d_ff, cfg.model.rope_scaling, cfg.model.norm_eps) == (128, None, 1e-5)
  assert "model.norm_eps=1e-05 (checkpoint: 1e-06)" in init_from.overrides(cfg)


def test_every_differing_shape_key_in_one_error(files, tmp_path, data_cache):
  with pytest.raises(ConfigError) as e:
    _cfg(tmp_path, data_cache, files["ckpt"], "model.d_model=128", "model.n_layers=4",
         "model.head_dim=32", "model.tie_embeddings=true", "model.moe.n_experts=4")
  msg = str(e.value)
  for line in ("model.d_model=128 (checkpoint: 64)", "model.n_layers=4 (checkpoint: 2)",
               "model.head_dim=32 (checkpoint: 16)", "model.tie_embeddings=true "
               "(checkpoint: false)", "model.moe={n_experts: 4", "(checkpoint: null)",
               "Remove these keys, or set them to the checkpoint's values"):
    assert line in msg, msg
  # Writing the checkpoint's own shape values is fine; a config built another way (not
  # through load_config) is caught by the runtime check, all keys at once too.
  cfg = _cfg(tmp_path, data_cache, files["ckpt"], "model.d_model=64", "model.head_dim=16",
             "data.source=text", f"data.path={files['text']}",
             f"data.tokenizer={files['ckpt']}/tokenizer.json")
  wrong = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_ff=96, n_heads=2))
  with pytest.raises(ConfigError, match=r"model.n_heads=2 \(checkpoint: 4\).*model.d_ff=96"):
    validate.check_runtime(wrong)


def test_stored_param_shapes_all_reported_before_compile(tmp_path, data_cache):
  """A params/ that model.yaml does not describe: every mismatched parameter in one error,
  from orbax's metadata, before anything is compiled (and again at restore)."""
  small = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.n_kv_heads=2", "model.d_ff=48"]).model
  params_io.save_params(str(tmp_path / "ckpt"), llama.create(small), small)
  with open(tmp_path / "ckpt" / "model.yaml", encoding="utf-8") as f:
    saved = yaml.safe_load(f)
  saved.update(d_ff=64, n_kv_heads=1)  # not what params/ holds
  with open(tmp_path / "ckpt" / "model.yaml", "w", encoding="utf-8") as f:
    yaml.safe_dump(saved, f)
  cfg = _cfg(tmp_path / "run", data_cache, tmp_path / "ckpt")
  with pytest.raises(ConfigError) as e:
    train_lib.run(cfg)
  msg = str(e.value)
  assert "5 stored parameters do not fit" in msg, msg
  for line in ("blocks/mlp/w_gate: stored (1, 32, 48), model (1, 32, 64)",
               "blocks/mlp/w_up: stored (1, 32, 48), model (1, 32, 64)",
               "blocks/mlp/w_down: stored (1, 48, 32), model (1, 64, 32)",
               "blocks/attn/wk: stored (1, 32, 2, 16), model (1, 32, 1, 16)",
               "blocks/attn/wv: stored (1, 32, 2, 16), model (1, 32, 1, 16)"):
    assert line in msg, msg
  assert not os.path.exists(tmp_path / "run" / "run.json")  # failed before the runtime build
  model = nnx.eval_shape(lambda: llama.create(cfg.model))
  with pytest.raises(ConfigError, match="5 stored parameters"):
    init_from.load_into(cfg, model)


@pytest.mark.parametrize("kind", ["ckpt", "hf"])
def test_byte_tokenizer_refused_for_an_hf_vocab(files, tmp_path, data_cache, kind):
  cfg = _cfg(tmp_path, data_cache, files[kind])  # data: stdlib, byte tokenizer (defaults)
  with pytest.raises(ConfigError) as e:
    train_lib.run(cfg)
  msg = str(e.value)
  assert "data.tokenizer=byte (data.source=stdlib)" in msg, msg
  assert f"data.source=text data.path=<text files> data.tokenizer={files[kind]}/tokenizer.json" \
      in msg
  assert not os.path.exists(tmp_path / "run.json")  # before the runtime build and any compile


def test_tokenizer_rule(files, tmp_path, data_cache):
  ckpt = files["ckpt"]
  text = ["data.source=text", f"data.path={files['text']}"]
  # The same vocabulary in another file (other formatting) is accepted: contents, not paths.
  same = tmp_path / "same" / "tokenizer.json"
  same.parent.mkdir()
  tokenizers.Tokenizer.from_file(f"{ckpt}/tokenizer.json").save(str(same), pretty=False)
  assert same.read_bytes() != open(f"{ckpt}/tokenizer.json", "rb").read()
  validate.check_runtime(_cfg(tmp_path, data_cache, ckpt, *text, f"data.tokenizer={same}"))
  with pytest.raises(ConfigError, match="data.tokenizer=.*missing.json.*no such file"):
    validate.check_runtime(_cfg(tmp_path, data_cache, ckpt, *text,
                                f"data.tokenizer={tmp_path}/missing.json"))
  # Another vocabulary of the same size is refused.
  other = tmp_path / "other.json"
  _train_tokenizer(_corpus_text()[60000:120000], VOCAB).save(str(other))
  with pytest.raises(ConfigError, match="data.tokenizer=.*other.json .*another vocabulary"):
    validate.check_runtime(_cfg(tmp_path, data_cache, ckpt, *text, f"data.tokenizer={other}"))
  # No tokenizer.json in the checkpoint: the sizes must be equal (256 != 384 here).
  bare = tmp_path / "bare"
  bare.mkdir()
  shutil.copytree(f"{ckpt}/params", bare / "params")
  shutil.copy(f"{ckpt}/model.yaml", bare)
  with pytest.raises(ConfigError, match="data.tokenizer=byte .* has 256 tokens.*vocab_size 384"):
    validate.check_runtime(_cfg(tmp_path, data_cache, bare))
  validate.check_runtime(_cfg(tmp_path, data_cache, bare, *text, f"data.tokenizer={other}"))


def _hf_loss(model, batch) -> float:
  """transformers' own loss on the batch: the window tokens + last label, labels shifted by
  HF itself, masked positions ignored."""
  window = np.concatenate([batch["tokens"], batch["labels"][:, -1:]], axis=1)
  labels = window.copy()
  labels[:, 1:][batch["loss_mask"] == 0] = -100
  with torch.no_grad():
    return float(model(input_ids=torch.from_numpy(window).long(),
                       labels=torch.from_numpy(labels).long()).loss)


@pytest.mark.parametrize("kind", ["ckpt", "hf"])
def test_finetune_recipe_first_loss_is_transformers(files, tmp_path, data_cache, kind):
  """README's recipe: the HF tokenizer on text data, init_from the conversion (or the HF dir
  itself): the first step's loss is the HF model's loss on that batch."""
  cfg = _cfg(tmp_path, data_cache, files[kind], "data.source=text",
             f"data.path={files['text']}", f"data.tokenizer={files[kind]}/tokenizer.json",
             "model.rope_theta=500000")  # written, but the checkpoint's value: not listed
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    summary = train_lib.run(cfg)
  printed = out.getvalue()
  assert (f"start     new run from checkpoint.init_from={files[kind]}: model config from the "
          "checkpoint, overridden:\n            model.dtype=float32 (checkpoint: bfloat16)\n"
          ) in printed, printed
  batch = next(make_train_iterator(cfg.data, SEQ, BATCH))
  assert batch["tokens"].max() > 256  # BPE merges in use (ids above the byte alphabet)
  ref = _hf_loss(files["model"], batch)
  assert 3.0 < ref < 20.0  # a real, untrained-looking loss
  np.testing.assert_allclose(summary["losses"][1], ref, rtol=1e-5)
