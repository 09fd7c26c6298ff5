"""Multi-head latent attention and YaRN: the module against a plain materialised-scores
reference (values and gradients, with and without the low-rank query), YaRN's frequencies and
scales against transformers', and the absorbed decode against the expanded attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from close import assert_close
import deepseek_case
from jscale.config import Fp8Config
from jscale.fp8 import linears as fp8_linears
from jscale.model import kv_cache, rope
from jscale.model.mla import MLA, LATENT_EPS
from jscale.model.positions import Positions
from jscale.model.seam import LOCAL

HI = jax.lax.Precision.HIGHEST


def _cfg(q_lora=32):
  cfg = deepseek_case.config().model
  return dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, q_lora_rank=q_lora),
                             attention_impl="xla")


def _norm(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + LATENT_EPS) * w


def _rope(x_BLHP, pos_BL, inv, scale):
  ang = pos_BL[..., None] * inv
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  x1, x2 = jnp.split(x_BLHP, 2, -1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1) * scale


def _reference(p, h_BLD, cfg):
  """DeepSeek-V3's MLA written out: per-head keys [nope; shared rope], scores with the
  YaRN-scaled softmax scale, causal mask, fp32 throughout."""
  m, rs = cfg.mla, cfg.rope_scaling
  n, r = m.qk_nope_head_dim, m.kv_lora_rank
  b, l, _ = h_BLD.shape
  pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.float32), (b, l))
  inv = rope.inv_frequencies(m.qk_rope_head_dim, cfg.rope_theta, rs)
  if "wq" in p:
    q = jnp.einsum("bld,dhk->blhk", h_BLD, p["wq"], precision=HI)
  else:
    cq = _norm(jnp.einsum("bld,dq->blq", h_BLD, p["wq_a"], precision=HI), p["q_norm"]["scale"])
    q = jnp.einsum("blq,qhk->blhk", cq, p["wq_b"], precision=HI)
  kv = jnp.einsum("bld,dx->blx", h_BLD, p["wkv_a"], precision=HI)
  c = _norm(kv[..., :r], p["kv_norm"]["scale"])
  k_rope = _rope(kv[..., None, r:], pos, inv, rope.yarn_rope_scale(rs))
  q = jnp.concatenate([q[..., :n], _rope(q[..., n:], pos, inv, rope.yarn_rope_scale(rs))], -1)
  k_nope = jnp.einsum("blr,rhn->blhn", c, p["wk_b"], precision=HI)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + k_rope.shape[-1:])],
                      -1)
  v = jnp.einsum("blr,rhv->blhv", c, p["wv_b"], precision=HI)
  scale = rope.yarn_softmax_scale(rs) / np.sqrt(q.shape[-1])
  s = jnp.einsum("blhk,bshk->bhls", q, k, precision=HI) * scale
  s = jnp.where(jnp.tril(jnp.ones((l, l), bool)), s, -jnp.inf)
  ctx = jnp.einsum("bhls,bshv->blhv", jax.nn.softmax(s, -1), v, precision=HI)
  return jnp.einsum("blhv,hvd->bld", ctx, p["wo"], precision=HI)


@pytest.mark.parametrize("q_lora", [32, 0], ids=["q_lora", "direct_q"])
def test_mla_values_and_grads_equal_the_plain_reference(q_lora):
  cfg = _cfg(q_lora)
  mla = MLA(cfg, nnx.Rngs(params=0))
  graphdef, params = nnx.split(mla)
  pure = nnx.to_pure_dict(params)
  # A non-trivial norm scale, so its gradient path is checked too.
  pure["kv_norm"]["scale"] = 1.0 + 0.1 * jnp.arange(cfg.mla.kv_lora_rank, dtype=jnp.float32)
  h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, cfg.d_model)), jnp.float32)
  pos = Positions(jnp.broadcast_to(jnp.arange(12), (2, 12)))
  inv = rope.for_model(cfg)

  def ours(pure, h):
    state = nnx.state(mla)
    nnx.replace_by_pure_dict(state, pure)
    return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(h, pos, inv, LOCAL)))

  ref = lambda pure, h: jnp.sum(jnp.sin(_reference(pure, h, cfg)))
  got = jax.jit(jax.value_and_grad(ours, (0, 1)))(pure, h)
  want = jax.jit(jax.value_and_grad(ref, (0, 1)))(pure, h)  # (jitted: eager op by op is slower)
  assert_close("value", got[0], want[0], 1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got[1])[0],
                          jax.tree.leaves(want[1])):
    assert_close(f"grad {jax.tree_util.keystr(path)}", a, b, 1e-4)


def test_yarn_matches_transformers():
  """Inverse frequencies, cos / sin scale and softmax scale of DeepSeek-V3's YaRN (factor 40,
  mscale = mscale_all_dim = 1) and of an uneven one, against transformers' own functions."""
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
  for factor, mscale, all_dim in ((40.0, 1.0, 1.0), (8.0, 0.707, 0.0)):
    params = dict(rope_type="yarn", rope_theta=10000.0, factor=factor,
                  original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                  mscale=mscale, mscale_all_dim=all_dim)
    hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=params,
                                           max_position_embeddings=163840)
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours = dataclasses.replace(deepseek_case.config().model.rope_scaling, factor=factor,
                               original_max_position_embeddings=4096, mscale=mscale,
                               mscale_all_dim=all_dim)
    np.testing.assert_allclose(rope.inv_frequencies(64, 10000.0, ours), inv.numpy(), rtol=1e-6)
    assert rope.yarn_rope_scale(ours) == pytest.approx(attention_factor, rel=1e-7)
    assert rope.yarn_softmax_scale(ours) == pytest.approx(
        hf.yarn_apply_mscale(params, 1.0), rel=1e-7)


def test_absorbed_decode_equals_expanded_attention():
  """A prefill of 7 tokens then 5 decode steps through the latent cache (absorbed W_uk, W_uv)
  give the outputs of one causal pass over the 12 tokens."""
  cfg = _cfg()
  mla = MLA(cfg, nnx.Rngs(params=1))
  h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, cfg.d_model)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  inv = rope.for_model(cfg)
  want = mla(h, Positions(pos), inv, LOCAL)
  cache = kv_cache.init(dataclasses.replace(cfg, n_layers=1), 2, 16)
  assert cache.latent.shape == (1, 2, 16, 32) and cache.rope.shape == (1, 2, 16, 16)
  step = jax.jit(lambda h, p, c, prefill: mla.cached(h, p, inv, c, 0, prefill),
                 static_argnums=3)
  out, cache = step(h[:, :7], pos[:, :7], cache, True)
  outs = [out]
  for i in range(7, 12):
    out, cache = step(h[:, i:i + 1], pos[:, i:i + 1], cache, False)
    outs.append(out)
  assert_close("prefill + absorbed decode", jnp.concatenate(outs, 1), want, 1e-5)


def test_cache_bytes_per_token_mla_gqa_mha():
  """DeepSeek-V3's latent cache against GQA (8 kv heads) and MHA (128) shapes of the same
  model: 576 values per token and layer against 2 x 8 x 128 and 2 x 128 x 128."""
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  cfg = load_config(None, ["model.preset=deepseek_v3_671b"]).model
  mla = kv_cache.bytes_per_token(cfg)
  gqa = kv_cache.bytes_per_token(dataclasses.replace(cfg, mla=None, n_kv_heads=8, head_dim=128))
  mha = kv_cache.bytes_per_token(dataclasses.replace(cfg, mla=None, head_dim=128))
  assert (mla, gqa, mha) == (61 * 576 * 2, 61 * 2 * 8 * 128 * 2, 61 * 2 * 128 * 128 * 2)
  print(f"cache bytes per token (bf16, 61 layers): MLA {mla:,}, GQA-8 {gqa:,}, MHA {mha:,}")


def test_mla_in_fp8_is_the_plain_module_within_fp8_rounding():
  """`fp8.targets: [attention]` (current scaling) takes MLA's six projections: the module's
  value and gradients within FP8's rounding of the plain module's, not equal to them."""
  cfg = _cfg()
  fp8 = fp8_linears.from_config(Fp8Config(enabled=True, recipe="current",
                                          targets=("attention",)))
  h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, cfg.d_model)), jnp.float32)
  pos = Positions(jnp.broadcast_to(jnp.arange(12), (2, 12)))
  inv = rope.for_model(cfg)

  def run(dot_general):
    graphdef, params = nnx.split(MLA(cfg, nnx.Rngs(params=0), dot_general=dot_general))
    loss = lambda p, h: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(h, pos, inv, LOCAL)) ** 2)
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, h)

  (got, got_g), (want, want_g) = run(fp8), run(jax.lax.dot_general)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert 0 < rel(got, want) < 0.05
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert 0 < rel(a, b) < 0.15, (a.shape, rel(a, b))
