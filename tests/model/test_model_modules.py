"""The model's injection points: the blocks' attention module (swappable class) and the linear
layers' dot_general (the hook a low-precision matmul uses), on real JAX, no mocks."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from conftest import small_config
from jscale.model import llama
from jscale.model.gqa import GQA
from jscale.model.mlp import Mlp
from jscale.model.moe import MoE

MOE = ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.shared_d_ff=32")


def _cfg(*overrides):
  return small_config(None, "model.tie_embeddings=false", *overrides).model


def _tokens(cfg):
  return jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)


def _loss_and_grads(model, tokens):
  graphdef, state = nnx.split(model)

  def loss(state):
    logits, _ = nnx.merge(graphdef, state).forward(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return logits, nnx.to_pure_dict(grads)


def _hook_names(jaxpr) -> list[str]:
  """Names starting with "hook " in a jaxpr and every jaxpr nested in it, one per call site."""
  names = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name" and eqn.params["name"].startswith("hook "):
      names.append(eqn.params["name"])
    for v in eqn.params.values():
      for x in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(x, "jaxpr", x)
        names += _hook_names(sub) if hasattr(sub, "eqns") else []
  return names


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe_shared"])
def test_dot_general_sees_exactly_the_linear_layers(moe):
  """A dot_general that records its operands' dtypes and the weight's shape (in the traced
  program: jnp.einsum caches its trace per signature, so a Python-side list would see wk and
  wv once) runs once per linear layer of the (scanned) block and once for the head, on
  compute-dtype operands; attention scores and the router do not go through it (MoE: the
  routed experts run in the comms seam)."""
  cfg = _cfg("model.dtype=bfloat16", *(MOE if moe else ()))

  def recording(lhs, rhs, *args, **kwargs):
    tag = f"hook {lhs.dtype.name} {rhs.dtype.name} {tuple(rhs.shape)}"
    return checkpoint_name(jax.lax.dot_general(lhs, rhs, *args, **kwargs), tag)

  model = llama.create(cfg, dot_general=recording)
  names = _hook_names(jax.make_jaxpr(lambda t: model(t))(_tokens(cfg)).jaxpr)
  d, h, g, k, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim,
                      cfg.d_ff, cfg.vocab_size)
  mlp = [(d, 32), (d, 32), (32, d)] if moe else [(d, f), (d, f), (f, d)]
  want = [(d, h, k), (d, g, k), (d, g, k), (h, k, d), *mlp, (d, v)]
  assert sorted(names) == sorted(f"hook bfloat16 bfloat16 {s}" for s in want)


def test_doubling_dot_general_equals_doubled_weights():
  """2 * (x @ w) == x @ (2w) exactly: a dot_general doubling its output gives the logits of
  the default model with every linear weight (head included) doubled, and twice its
  gradients for those weights (the hook runs in the backward too); nothing else changes."""
  cfg = _cfg()
  doubled = lambda *a, **kw: 2 * jax.lax.dot_general(*a, **kw)
  a = llama.create(cfg, dot_general=doubled)
  b = llama.create(cfg)
  linear = {("blocks", "attn", n) for n in ("wq", "wk", "wv", "wo")} | {
      ("blocks", "mlp", n) for n in ("w_gate", "w_up", "w_down")} | {("lm_head",)}
  state = nnx.state(b, nnx.Param)
  flat = nnx.to_flat_state(state)
  assert {p for p, _ in flat} >= linear
  for path, var in flat:
    if path in linear:
      var.set_value(2 * var.get_value())
  nnx.update(b, state)
  logits_a, grads_a = _loss_and_grads(a, _tokens(cfg))
  logits_b, grads_b = _loss_and_grads(b, _tokens(cfg))
  np.testing.assert_allclose(logits_a, logits_b, rtol=1e-6, atol=1e-6)
  flat_a = dict(jax.tree_util.tree_flatten_with_path(grads_a)[0])
  for path, gb in jax.tree_util.tree_flatten_with_path(grads_b)[0]:
    keys = tuple(p.key for p in path)
    want = 2 * gb if keys in linear else gb
    np.testing.assert_allclose(flat_a[path], want, rtol=1e-5, atol=1e-7, err_msg=str(keys))


def test_default_dot_general_is_bit_identical():
  """The hook itself changes nothing: a pass-through wrapper gives bit-identical logits and
  gradients (bf16; the MoE shared expert's products are checked by the recording test)."""
  cfg = _cfg("model.dtype=bfloat16")
  passthrough = lambda *a, **kw: jax.lax.dot_general(*a, **kw)
  logits_a, grads_a = _loss_and_grads(llama.create(cfg), _tokens(cfg))
  logits_b, grads_b = _loss_and_grads(llama.create(cfg, dot_general=passthrough), _tokens(cfg))
  np.testing.assert_array_equal(logits_a, logits_b)
  for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_array_equal(ga, gb)


class ZeroAttention(nnx.Module):
  """An attention module of another kind: one parameter, output scale * h (zeros at init)."""

  def __init__(self, cfg, rngs, dot_general=jax.lax.dot_general):
    del rngs, dot_general
    self.scale = nnx.Param(jnp.zeros((cfg.d_model,)), out_sharding=("embed",),
                           eager_sharding=False)

  def __call__(self, h_BLD, positions, inv_freq, comms):
    del positions, inv_freq, comms
    return h_BLD * self.scale[...]


def test_attention_module_is_swappable():
  """`attention=` replaces GQA in every block (its parameters under blocks.attn): a zero
  attention gives the logits of the default model with wo zeroed and the same other weights."""
  cfg = _cfg()
  swapped = llama.create(cfg, attention=ZeroAttention)
  default = llama.create(cfg)
  assert set(nnx.to_pure_dict(nnx.state(swapped, nnx.Param))["blocks"]["attn"]) == {"scale"}
  assert isinstance(default.blocks.attn, GQA)
  pure = nnx.to_pure_dict(nnx.state(default, nnx.Param))
  for name, value in nnx.to_pure_dict(nnx.state(swapped, nnx.Param)).items():
    if name != "blocks":
      pure[name] = value
  pure["blocks"] = {**pure["blocks"], **{n: v for n, v in
                                         nnx.to_pure_dict(nnx.state(swapped.blocks)).items()
                                         if n != "attn"}}
  pure["blocks"]["attn"]["wo"] = jnp.zeros_like(pure["blocks"]["attn"]["wo"])
  state = nnx.state(default, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(default, state)
  tokens = _tokens(cfg)
  np.testing.assert_array_equal(swapped(tokens), default(tokens))


@pytest.mark.parametrize("module, contract", [
    (GQA, llama.CachedAttention), (ZeroAttention, llama.AttentionModule),
    (Mlp, llama.MlpModule), (MoE, llama.MlpModule)], ids=lambda x: x.__name__)
def test_the_blocks_modules_keep_their_contract(module, contract):
  """The modules `Block` takes take and return what its Protocols say (parameter names)."""
  for name in ("__init__", "__call__", "cached"):
    if name in {n for c in contract.__mro__ if c is not object for n in vars(c)}:
      want = list(inspect.signature(getattr(contract, name)).parameters)
      assert list(inspect.signature(getattr(module, name)).parameters) == want, name

