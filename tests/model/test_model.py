"""Model pieces against plain references: attention (GQA), RoPE scaling, parameter/FLOP counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from jscale import metrics
from jscale.config import RopeScalingConfig
from jscale.model import llama
from jscale.model.attention import xla_attention
from jscale.model.rope import inv_frequencies


def _reference_attention(q, k, v):
  """Dense causal MHA in float64 numpy with K/V repeated per query group."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  rep = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  s = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhls,bshk->blhk", p, v)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_xla_attention_matches_reference(heads, kv_heads):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 16, heads, 8))
  k = jax.random.normal(keys[1], (2, 16, kv_heads, 8))
  v = jax.random.normal(keys[2], (2, 16, kv_heads, 8))
  np.testing.assert_allclose(xla_attention(q, k, v), _reference_attention(q, k, v), atol=1e-5)
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(xla_attention(q, k, v), ref, atol=1e-5)


def test_llama3_rope_scaling_bands():
  base = inv_frequencies(64, 500000.0)
  scaled = inv_frequencies(64, 500000.0, RopeScalingConfig(factor=8.0))
  wavelen = 2 * np.pi / base
  assert np.allclose(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high freq kept
  assert np.allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8)  # low freq slowed
  mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
  assert mid.any() and np.all(scaled[mid] <= base[mid]) and np.all(scaled[mid] >= base[mid] / 8)


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_matches_model(tied):
  cfg = small_config(None, f"model.tie_embeddings={str(tied).lower()}").model
  model = nnx.eval_shape(lambda: llama.create(cfg))
  actual = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert metrics.param_counts(cfg)["total"] == actual


def test_flops_per_token_formula():
  cfg = small_config(None).model
  n = metrics.param_counts(cfg)["matmul"]
  attn = 6 * cfg.n_layers * 128 * cfg.n_heads * cfg.resolved_head_dim
  assert metrics.flops_per_token(cfg, 128) == 6 * n + attn


def test_peak_table():
  class Dev:
    def __init__(self, kind):
      self.device_kind = kind
  assert metrics.device_peak_flops(Dev("NVIDIA H100 80GB HBM3")) == 989.5e12
  assert metrics.device_peak_flops(Dev("NVIDIA H100 PCIe")) == 756e12
  assert metrics.device_peak_flops(Dev("NVIDIA H200"), "fp8") == 1979e12
  assert metrics.device_peak_flops(Dev("NVIDIA A100-SXM4-80GB")) == 312e12
  assert metrics.device_peak_flops(Dev("cpu")) is None


def test_layers_are_stacked_and_named():
  cfg = small_config(None).model
  state = nnx.state(nnx.eval_shape(lambda: llama.create(cfg)), nnx.Param)
  specs = nnx.get_partition_spec(state)
  assert tuple(specs["blocks"]["attn"]["wq"].get_value()) == ("layers", "embed", "heads",
                                                               "head_dim")
  assert tuple(specs["embed"].get_value()) == ("vocab", "embed")
  assert state["blocks"]["attn"]["wq"].get_value().shape[0] == cfg.n_layers
