"""Generation: the KV-cache path equals recomputing the prefix, greedy decoding equals
transformers' generate token for token, sampling, EOS, one compiled decode step, tensor
parallelism, the cache updated in place. The CLI on trained runs: tests/ckpt/test_model_use.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_case import LLAMA3, assert_greedy_equals_transformers, reinit

from jscale.config import ModelConfig, MoeConfig
from jscale.convert import load_hf
from jscale.infer import sampling as sampling_lib
from jscale.infer.generator import Generator
from jscale.infer.sampling import Sampling
from jscale.model import llama

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 10


def _cfg(**kw) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
              dtype="float32", max_seq_len=256, init_std=0.2)
  return ModelConfig(**{**base, **kw})


def _recomputed(model, prompts: list[list[int]], n: int) -> list[list[int]]:
  """Greedy continuations by running the whole prefix through the model for every token. The
  prefix is zero-padded to one width (causal, dropless: the padding changes no earlier
  position), so the forward compiles once, not once per length."""
  width = max(map(len, prompts)) + n
  forward = jax.jit(lambda t_BL, i: model(t_BL)[0, i])
  out = []
  for prompt in prompts:
    seq = list(prompt)
    for _ in range(n):
      padded = jnp.asarray([seq + [0] * (width - len(seq))])
      seq.append(int(jnp.argmax(forward(padded, len(seq) - 1))))
    out.append(seq[len(prompt):])
  return out


@pytest.mark.parametrize("moe", [None, MoeConfig(n_experts=4, top_k=2, every=2)],
                         ids=["dense_gqa", "moe_every2"])
def test_cache_equals_recompute(moe):
  model = llama.create(_cfg(moe=moe), seed=1)
  gen = Generator(model)
  out = gen.generate(PROMPTS, NEW)
  assert out.tokens == _recomputed(model, PROMPTS, NEW)
  # Other prompt lengths (same bucket), token budgets, sampling settings and an EOS: nothing
  # compiles at all after the first call (no per-step or per-length helper either).
  gen.generate(PROMPTS, NEW, eos_id=3)  # the EOS check's few ops compile once, here
  compiles = []
  listener = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for n in (5, 19):
      gen.generate([[3, 1, 4, 1, 5, 9, 2, 6], [2], [7, 1]], n,
                   Sampling(temperature=0.7, top_k=5, top_p=0.9), seed=n, eos_id=3)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert gen.compiled_decode_steps() == 1
  assert compiles == []


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
  """A small random transformers Llama (GQA, llama3 RoPE) saved to disk, and jscale's load."""
  cfg = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      rms_norm_eps=1e-5, rope_parameters=LLAMA3, tie_word_embeddings=False)
  cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  hf = reinit(transformers.LlamaForCausalLM(cfg).eval())
  path = tmp_path_factory.mktemp("hf_llama")
  hf.save_pretrained(path)
  _, model = load_hf(str(path), dtype="float32")
  return hf, model


def test_greedy_equals_transformers_generate(hf_pair):
  hf, model = hf_pair
  assert_greedy_equals_transformers(hf, model, 16)


def test_eos_ends_a_row():
  model = llama.create(_cfg(), seed=1)
  free = Generator(model).generate(PROMPTS, NEW).tokens
  eos = free[0][3]  # the first row's fourth token
  out = Generator(model).generate(PROMPTS, NEW, eos_id=eos)
  for row, got, done in zip(free, out.tokens, out.finished):
    cut = row.index(eos) if eos in row else len(row)
    assert got == row[:cut] and done == (eos in row)
  assert out.finished[0] and len(out.tokens[0]) == 3


def test_sampling_truncation_and_seed():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
  kept = lambda k, p: np.isfinite(np.asarray(sampling_lib.truncate(logits, k, p)))[0].tolist()
  assert kept(0, 1.0) == [True] * 4
  assert kept(2, 1.0) == [True, True, False, False]
  assert kept(0, 0.5) == [True, False, False, False]  # 0.5 alone reaches top_p
  assert kept(0, 0.7) == [True, True, False, False]
  assert kept(3, 0.9) == [True, True, True, False]
  model = llama.create(_cfg(), seed=1)
  gen = Generator(model)
  greedy = gen.generate(PROMPTS, NEW).tokens
  assert gen.generate(PROMPTS, NEW, Sampling(temperature=1.0, top_k=1)).tokens == greedy
  hot = Sampling(temperature=1.5)
  a, b = (gen.generate(PROMPTS, NEW, hot, seed=s).tokens for s in (3, 3))
  assert a == b and a != greedy and gen.generate(PROMPTS, NEW, hot, seed=4).tokens != a
  with pytest.raises(ValueError, match="top_p"):
    Sampling(top_p=0.0).check()
  # A tokenizer smaller than the model's (padded) vocabulary: no id beyond it is ever drawn,
  # greedy or hot; below it, greedy is unchanged where its choice was allowed.
  for s in (Sampling(ids=20), Sampling(temperature=1.5, ids=20)):
    assert max(max(row) for row in gen.generate(PROMPTS, NEW, s, seed=5).tokens) < 20
  assert gen.generate(PROMPTS, NEW, Sampling(ids=97)).tokens == greedy


def test_tensor_parallel_equals_one_device():
  from jscale.infer import setup  # pylint: disable=import-outside-toplevel
  model = llama.create(_cfg(vocab_size=98, n_layers=2), seed=1)
  gen = Generator(model, setup.tensor_mesh(2))
  wq = gen.state["blocks"]["attn"]["wq"][...]
  assert wq.sharding.spec[2] == "tensor"  # heads split over the devices
  assert gen.generate(PROMPTS, NEW).tokens == Generator(model).generate(PROMPTS, NEW).tokens


def test_too_long_is_refused_naming_the_limit():
  model = llama.create(_cfg(max_seq_len=16), seed=1)
  with pytest.raises(ValueError, match="max_seq_len=16"):
    Generator(model).generate(PROMPTS, 10)


def test_decode_step_updates_the_cache_in_place():
  """The donated cache is the step's output buffer, and no copy of it is made: temporaries
  stay within about one layer's slice (a per-layer copy of the stack would be the whole)."""
  from jscale.model import kv_cache  # pylint: disable=import-outside-toplevel
  cfg = _cfg(d_model=64, n_heads=4, n_kv_heads=2, n_layers=4, max_seq_len=4096)
  gen = Generator(llama.create(cfg))
  cache = jax.eval_shape(lambda: kv_cache.init(cfg, 8, 2048))
  tokens_B = jax.ShapeDtypeStruct((8,), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  mem = gen._decode.lower(  # pylint: disable=protected-access
      gen.state, tokens_B, cache, tokens_B, key, Sampling().arrays()).compile().memory_analysis()
  cache_bytes = sum(c.size * c.dtype.itemsize for c in cache)
  assert mem.alias_size_in_bytes == cache_bytes
  assert mem.temp_size_in_bytes < 2 * cache_bytes / cfg.n_layers
