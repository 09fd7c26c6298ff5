"""V's head size differing from Q's (K != Kv, e.g. MLA) in every attention impl: plain XLA, the
ring's blocks (plain jnp and flash kernel) on a CPU mesh, the Pallas flash kernel (interpret
mode), each against a plain materialised-scores reference, values and gradients; cuDNN's
zero-padded V (the same padding around JAX's attention on CPU) likewise, and a V larger than Q's
refused clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from conftest import ON_HOPPER
from close import assert_close
from jscale.model import attention as attn_lib
from jscale.parallel.context import ring as ra
from jscale.parallel.context.order import token_order
from pallas_kernels.flash_attention import BlockSizes, flash_attention, reference

HI = jax.lax.Precision.HIGHEST


def _plain(q_BLHK, k_BSGK, v_BSGV, causal=True):
  """fp32 softmax attention with K/V repeated per query group: [B, L, H, Kv]."""
  rep = q_BLHK.shape[2] // k_BSGK.shape[2]
  k_BSHK, v_BSHV = (jnp.repeat(x, rep, axis=2) for x in (k_BSGK, v_BSGV))
  s_BHLS = jnp.einsum("blhk,bshk->bhls", q_BLHK, k_BSHK, precision=HI) / np.sqrt(
      q_BLHK.shape[-1])
  if causal:
    l, s = s_BHLS.shape[-2:]
    s_BHLS = jnp.where(jnp.tril(jnp.ones((l, s), bool)), s_BHLS, -jnp.inf)
  return jnp.einsum("bhls,bshv->blhv", jax.nn.softmax(s_BHLS, -1), v_BSHV, precision=HI)


def _inputs(seq, h, g, k, kv, seed=0, b=2):
  rng = np.random.default_rng(seed)
  shapes = [(b, seq, h, k), (b, seq, g, k), (b, seq, g, kv), (b, seq, h, kv)]
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _value_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out,) + vjp(do)


def _check(name, got, want, tol):
  for part, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.shape == b.shape, (name, part, a.shape, b.shape)
    assert_close(f"{name} {part}", a, b, tol)


@pytest.mark.parametrize("kv", [8, 32])
@pytest.mark.parametrize("causal", [True, False])
def test_xla_attention(kv, causal):
  q, k, v, do = _inputs(16, 4, 2, 16, kv)
  got = jax.jit(lambda *a: _value_and_grads(
      lambda q, k, v: attn_lib.xla_attention(q, k, v, causal=causal), *a))(q, k, v, do)
  assert got[0].shape == (2, 16, 4, kv)
  _check(f"xla kv={kv}", got, _value_and_grads(
      lambda q, k, v: _plain(q, k, v, causal), q, k, v, do), 1e-5)


def _ring(n, block, seq):
  """Global [B, S, ...] in natural order -> (out, dq, dk, dv) through a zigzag ring of n."""
  mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:n])
  order, back = token_order(seq, n, "zigzag"), np.argsort(token_order(seq, n, "zigzag"))
  ring = jax.shard_map(lambda q, k, v: ra.ring_attention(q, k, v, "sequence", block=block),
                       mesh=mesh, in_specs=P(None, "sequence"), out_specs=P(None, "sequence"),
                       check_vma=False)

  def f(q, k, v, do):
    out, vjp = jax.vjp(lambda *a: ring(*(x[:, order] for x in a)), q, k, v)
    return (out[:, back],) + vjp(do[:, order])

  return jax.jit(f)


@pytest.mark.parametrize("kv", [8, 32])
def test_ring_jnp_blocks(kv):
  args = _inputs(32, 4, 2, 16, kv)
  got = _ring(2, attn_lib.ring_blocks("ring"), 32)(*args)
  _check(f"ring kv={kv}", got, _value_and_grads(_plain, *args), 1e-5)


def test_ring_flash_blocks():
  """The flash kernel as the ring's block function (chunks of 16 tokens), Kv = 2K."""
  args = _inputs(64, 2, 1, 16, 32, b=1)
  got = _ring(2, attn_lib.ring_blocks("pallas", interpret=True), 64)(*args)
  _check("ring flash", got, _value_and_grads(_plain, *args), 1e-5)


B16 = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16,
                 block_kv_dq=16)


@pytest.mark.parametrize("k, kv, causal", [(16, 32, True), (32, 16, False)])
def test_flash_kernel(k, kv, causal):
  q, kk, v, do = _inputs(32, 4, 2, k, kv, b=1)
  fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=B16, interpret=True)
  got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, kk, v, do)
  ref = lambda q, k, v: reference(q, k, v, causal=causal)[0]
  want = _value_and_grads(ref, q, kk, v, do)
  _check(f"flash k={k} kv={kv}", got, want, 1e-5)
  _check(f"reference k={k} kv={kv}", want,
         _value_and_grads(lambda q, k, v: _plain(q, k, v, causal), q, kk, v, do), 1e-5)


def test_flash_rejects_untileable_v_head_dim():
  q, k = jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16))
  with pytest.raises(ValueError, match="v head_dim 8 must be a power of two"):
    flash_attention(q, k, jnp.zeros((1, 32, 2, 8)), interpret=True)
  with pytest.raises(ValueError, match=r"v \[B, S, G, Kv\]"):
    flash_attention(q, k, jnp.zeros((1, 16, 2, 16)), causal=False, interpret=True)


@pytest.mark.parametrize("k,kv", [(24, 16), (48, 32), (32, 32)])
def test_v_padded_to_q_head_size_is_exact(k, kv):
  """cuDNN's path for MLA (`with_v_padded`): V zero-padded to K's head size, the output sliced;
  here around JAX's own attention on CPU (the same call cuDNN's takes, `implementation` aside),
  values and gradients against the plain reference."""
  q, kk, v, do = _inputs(32, 4, 2, k, kv, seed=k)
  attend = attn_lib.with_v_padded(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla"))
  got = _value_and_grads(attend, q, kk, v, do)
  want = _value_and_grads(lambda q, k, v: _plain(q, k, v, True), q, kk, v, do)
  _check(f"padded v k={k} kv={kv}", got, want, 1e-5)


def test_cudnn_refuses_a_v_head_larger_than_q():
  q, k, v, _ = _inputs(16, 4, 2, 16, 32)
  with pytest.raises(ValueError, match="needs V's head size at most K's, got 32 and 16"):
    attn_lib.cudnn_attention(q, k, v)




@pytest.mark.skipif(not ON_HOPPER, reason="cuDNN's fused attention needs a (Hopper) GPU")
@pytest.mark.parametrize("k,kv", [(192, 128), (128, 128)])
def test_cudnn_attention_at_mla_head_sizes_on_hopper(k, kv):
  """`cudnn_attention` with V's 128 beside Q's 192 (cuDNN's MLA sizes, no padding, where
  `jax_compat.cudnn_mla_supported`), on a Hopper GPU: values and gradients in bf16 against
  the fp32 plain reference (bf16 operands, so a bf16 tolerance)."""
  q, kk, v, do = (x.astype(jnp.bfloat16) for x in _inputs(256, 4, 2, k, kv, seed=k))
  got = jax.jit(lambda *a: _value_and_grads(attn_lib.cudnn_attention, *a))(q, kk, v, do)
  want = _value_and_grads(lambda q, k, v: _plain(q, k, v, True),
                          *(x.astype(jnp.float32) for x in (q, kk, v, do)))
  _check(f"cudnn k={k} kv={kv}", [g.astype(jnp.float32) for g in got], want, 2e-2)
