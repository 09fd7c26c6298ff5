"""Shared by the Hugging Face parity tests (tests/convert/, tests/infer/test_generate.py): a
small random transformers Llama, its logits beside jscale's on the same tokens, bitwise
comparisons of parameter trees, greedy generation against transformers' `generate`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from jscale.infer.generator import Generator

VOCAB, SEQ = 128, 64
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          # 32 at head_dim 16 puts one frequency in each of the kept / smoothed / scaled bands.
          "original_max_position_embeddings": 32}

def hf_model(seed: int, **overrides) -> transformers.LlamaForCausalLM:
  kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
  kw.update(overrides)
  cfg = transformers.LlamaConfig(**kw)
  cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(seed)
  return reinit(transformers.LlamaForCausalLM(cfg).eval())


def reinit(model):
  """HF's init (std 0.02, unit norms) leaves attention near uniform, which would hide RoPE and
  norm mistakes: O(1) activations and non-trivial norm scales instead (from torch's seed)."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.15)
  return model


GREEDY_PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [64, 1], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def assert_greedy_equals_transformers(hf, model, n: int, prompts=GREEDY_PROMPTS) -> None:
  """jscale's greedy continuation of each prompt (`Generator`: batched, KV or latent cache)
  equals transformers' `generate` of `hf` on that prompt alone, `n` new tokens."""
  ours = Generator(model).generate(prompts, n).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    assert got == want[0, len(prompt):].tolist()


def tokens() -> np.ndarray:
  return np.random.default_rng(0).integers(0, VOCAB, (2, SEQ), dtype=np.int32)


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens()).long()).logits.float().numpy()


def jscale_logits(model) -> np.ndarray:
  return np.asarray(model(jnp.asarray(tokens())))


def param_arrays(model) -> dict:
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def safetensors_in(path: str) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(path, f), framework="np") as fh:
        out.update({k: fh.get_tensor(k) for k in fh.keys()})
  return out


def assert_bitwise(a: dict, b: dict) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)
