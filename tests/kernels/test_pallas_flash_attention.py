"""Pallas flash attention (interpret mode on CPU) against the plain-jnp reference.

Few cases, each covering several features (interpret mode is slow): fp32 must match to 1e-5
of the reference's largest value, bf16 to 2e-2 (compared with the fp32 reference on the same
bf16 inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import BlockSizes, flash_attention, reference
from close import assert_close

B64 = BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                 block_kv_dq=64)
B_MIXED = BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=128,
                     block_q_dq=128, block_kv_dq=64)


def _inputs(seq, heads, kv_heads, head_dim, dtype, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  q, do = normal(1, seq, heads, head_dim), normal(1, seq, heads, head_dim)
  k, v = normal(1, seq, kv_heads, head_dim), normal(1, seq, kv_heads, head_dim)
  cast = lambda x: x.astype(dtype)
  return cast(q), cast(k), cast(v), cast(do), normal(1, heads, seq)


def _segments(seq, boundaries):
  """int32 [1, seq] segment ids changing at `boundaries` (deliberately not block-aligned)."""
  return jnp.asarray(np.searchsorted(boundaries, np.arange(seq), side="right")[None],
                     jnp.int32)


# (seq, heads, kv_heads, head_dim, causal, segments, dtype, blocks, with_lse)
CASES = {
    "s128_d64_mha_causal_f32": (128, 2, 2, 64, True, None, jnp.float32, B64, False),
    "s128_d128_gqa_full_f32_defaultblocks": (128, 4, 2, 128, False, None, jnp.float32,
                                             BlockSizes(), False),
    "s256_d64_gqa_causal_seg_lse_f32": (256, 4, 2, 64, True, "shared", jnp.float32, B_MIXED,
                                        True),
    "s256_d64_gqa_full_segpair_f32": (256, 4, 1, 64, False, "pair", jnp.float32, B64, False),
    "s256_d128_mha_causal_bf16": (256, 2, 2, 128, True, None, jnp.bfloat16, B_MIXED, False),
    "s256_d64_gqa_full_seg_bf16": (256, 4, 2, 64, False, "shared", jnp.bfloat16, B64, True),
    "s1024_d64_gqa_causal_seg_lse_f32_defaultblocks": (1024, 2, 1, 64, True, "shared",
                                                       jnp.float32, BlockSizes(), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients(case):
  seq, h, g, d, causal, segs, dtype, blocks, with_lse = CASES[case]
  q, k, v, do, dlse = _inputs(seq, h, g, d, dtype)
  if segs == "shared":
    segment_ids = _segments(seq, [37, 150])
  elif segs == "pair":  # kv has no segment 0: queries 0..36 see no key at all (output 0)
    segment_ids = (_segments(seq, [37, 150]), _segments(seq, [37, 150]).at[:, :37].set(1))
  else:
    segment_ids = None

  def kernel_fn(q, k, v):
    return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, block_sizes=blocks,
                           interpret=True, return_lse=True)

  def reference_fn(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)  # bf16 is judged against fp32 math on its inputs
    return reference(f32(q), f32(k), f32(v), causal=causal, segment_ids=segment_ids)

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v)
      total = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
      return total + (jnp.sum(lse * dlse) if with_lse else 0.0)
    return f

  value_and_grads = lambda fn: jax.jit(lambda *a: (fn(*a), jax.grad(loss(fn), (0, 1, 2))(*a)))
  (out, lse), grads = value_and_grads(kernel_fn)(q, k, v)
  (ref_out, ref_lse), ref_grads = value_and_grads(reference_fn)(q, k, v)
  assert out.dtype == dtype and out.shape == q.shape and lse.shape == (1, h, seq)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert_close(f"{case} out", out, ref_out, tol)
  if segs == "pair":  # lse is -inf on the rows that see nothing, like the reference
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    lse, ref_lse = lse[:, :, 37:], ref_lse[:, :, 37:]
  assert_close(f"{case} lse", lse, ref_lse, tol)
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert got.dtype == dtype
    assert_close(f"{case} {name}", got, want, tol)


def test_lse_matches_logsumexp_of_scores():
  q, k, v, _, _ = _inputs(128, 2, 2, 64, jnp.float32)
  _, lse = flash_attention(q, k, v, causal=False, sm_scale=0.3, block_sizes=B64,
                           interpret=True, return_lse=True)
  scores = jnp.einsum("blhk,bshk->bhls", q, k, precision=jax.lax.Precision.HIGHEST) * 0.3
  assert_close("lse vs logsumexp", lse, jax.nn.logsumexp(scores, axis=-1), 1e-5)


def test_scores_never_materialised():
  """Outside the kernels no [L, S]-sized array exists (checked on the traced program)."""
  q, k, v, do, _ = _inputs(256, 2, 2, 64, jnp.float32)
  fn = lambda q, k, v: flash_attention(q, k, v, block_sizes=B64, interpret=True)
  jaxpr = jax.make_jaxpr(lambda q, k, v: jax.vjp(fn, q, k, v)[1](do))(q, k, v)
  sizes = [np.prod(var.aval.shape) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars]
  assert max(sizes) < 256 * 256


@pytest.mark.parametrize("seq, blocks, match", [
    (100, BlockSizes(block_q=64), r"seq_len 100 is not a multiple of block_q=64"),
    (192, BlockSizes(), r"seq_len 192 is not a multiple of block_q=128"),
    (48, BlockSizes(), r"block_q=48 \(clamped to seq_len 48\) must be a power of two"),
])
def test_untileable_sequence_rejected(seq, blocks, match):
  q, k, v = (jnp.zeros((1, seq, 2, 64)),) * 3
  with pytest.raises(ValueError, match=match):
    flash_attention(q, k, v, block_sizes=blocks, interpret=True)


def test_short_sequence_clamps_blocks():
  q, k, v, _, _ = _inputs(64, 2, 2, 64, jnp.float32)  # 64 < every default block of 128
  out = flash_attention(q, k, v, interpret=True)
  assert_close("s64 clamped out", out, reference(q, k, v)[0], 1e-5)


def test_bad_shapes_rejected():
  kv = jnp.zeros((1, 128, 2, 64))
  with pytest.raises(ValueError, match="not a multiple of the 2 kv heads"):
    flash_attention(jnp.zeros((1, 128, 3, 64)), kv, kv, interpret=True)
  kv96 = jnp.zeros((1, 128, 2, 96))
  with pytest.raises(ValueError, match="head_dim 96 must be a power of two"):
    flash_attention(jnp.zeros((1, 128, 2, 96)), kv96, kv96, interpret=True)
  with pytest.raises(ValueError, match="causal attention needs q_len == kv_len"):
    flash_attention(jnp.zeros((1, 64, 2, 64)), kv, kv, interpret=True)
  with pytest.raises(ValueError, match="segment ids must be"):
    flash_attention(kv, kv, kv, segment_ids=jnp.zeros((1, 64), jnp.int32), interpret=True)
