"""Attention of one query block against one key/value block, returning the log-sum-exp.

The unit that ring attention (and any blockwise scheme) composes: partial outputs of the same
queries against different key blocks merge exactly through their log-sum-exps. A `BlockFns`
pairs a forward with its backward; this file holds the plain-jnp pair (the default and the
reference); a fused kernel (Pallas flash attention) plugs in with the same contract.

Shapes: q [B, L, H, K], k [B, S, G, K] and v [B, S, G, V] with H a multiple of G (GQA: K/V
never repeated; V's head size may differ from K's), out [B, L, H, V] fp32, lse / delta
[B, L, H] fp32. `causal` means the square block on the
diagonal (L == S, query i sees keys 0..i); off-diagonal blocks are either full or skipped by
the caller, never masked here by index. Documents (`q_docs` [B, L], `k_docs` [B, S]: each
token's document, `jscale.model.positions`) mask pairs across documents in every block; a row
that sees no key of the block has output 0 and lse -inf, so merging it changes nothing.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class BlockFns(NamedTuple):
  """forward(q, k, v, causal, q_docs, k_docs) -> (out, lse); backward(q, k, v, dout, lse,
  delta, causal, q_docs, k_docs) -> (dq, dk, dv), all fp32, where delta = sum(dout * out, -1)
  of the *final* output; the docs None without document masking."""
  forward: Callable
  backward: Callable


def _grouped(q_BLHK: jax.Array, g: int) -> jax.Array:
  b, l, h, k = q_BLHK.shape
  return q_BLHK.reshape(b, l, g, h // g, k)


def _scores(q_BLGRK, k_BSGK, causal: bool, q_docs_BL=None, k_docs_BS=None) -> jax.Array:
  scale = 1.0 / jnp.sqrt(jnp.float32(q_BLGRK.shape[-1]))
  s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                       preferred_element_type=jnp.float32) * scale
  if causal:
    l, s = s_BGRLS.shape[-2:]
    if l != s:
      raise ValueError(f"a causal (diagonal) block must be square, got {l} x {s}")
    s_BGRLS = jnp.where(jnp.tril(jnp.ones((l, s), bool)), s_BGRLS, -jnp.inf)
  if q_docs_BL is not None:
    same_BLS = q_docs_BL[:, :, None] == k_docs_BS[:, None, :]
    s_BGRLS = jnp.where(same_BLS[:, None, None], s_BGRLS, -jnp.inf)
  return s_BGRLS


def _to_BLH(x_BGRL: jax.Array) -> jax.Array:
  b, g, r, l = x_BGRL.shape
  return x_BGRL.transpose(0, 3, 1, 2).reshape(b, l, g * r)


def _to_BGRL(x_BLH: jax.Array, g: int) -> jax.Array:
  b, l, h = x_BLH.shape
  return x_BLH.reshape(b, l, g, h // g).transpose(0, 2, 3, 1)


def forward(q_BLHK, k_BSGK, v_BSGV, causal: bool, q_docs_BL=None, k_docs_BS=None):
  """Softmax attention of the block [B, L, H, V] and the log-sum-exp of its scores (fp32)."""
  g = k_BSGK.shape[2]
  s_BGRLS = _scores(_grouped(q_BLHK, g), k_BSGK, causal, q_docs_BL, k_docs_BS)
  m_BGRL = jnp.max(s_BGRLS, axis=-1)
  # A row that sees no key (documents): every p is 0; its output 0, its lse -inf.
  p_BGRLS = jnp.exp(s_BGRLS - jnp.where(jnp.isfinite(m_BGRL), m_BGRL, 0.0)[..., None])
  l_BGRL = jnp.sum(p_BGRLS, axis=-1)
  probs_BGRLS = p_BGRLS / jnp.where(l_BGRL > 0, l_BGRL, 1.0)[..., None]
  out_BLGRV = jnp.einsum("BGRLS,BSGV->BLGRV", probs_BGRLS.astype(v_BSGV.dtype),
                         v_BSGV, preferred_element_type=jnp.float32)
  out_BLHV = out_BLGRV.reshape(*q_BLHK.shape[:3], v_BSGV.shape[-1])
  return out_BLHV.astype(jnp.float32), _to_BLH(m_BGRL + jnp.log(l_BGRL))


def backward(q_BLHK, k_BSGK, v_BSGV, dout_BLHV, lse_BLH, delta_BLH, causal: bool,
             q_docs_BL=None, k_docs_BS=None):
  """Gradients of the block's share of the final output, given the final lse and delta."""
  g, dt = k_BSGK.shape[2], q_BLHK.dtype
  q_BLGRK = _grouped(q_BLHK, g)
  do_BLGRV = _grouped(dout_BLHV.astype(dt), g)
  s_BGRLS = _scores(q_BLGRK, k_BSGK, causal, q_docs_BL, k_docs_BS)
  p_BGRLS = jnp.exp(s_BGRLS - _to_BGRL(lse_BLH, g)[..., None])
  f32 = dict(preferred_element_type=jnp.float32)
  dv_BSGV = jnp.einsum("BGRLS,BLGRV->BSGV", p_BGRLS.astype(dt), do_BLGRV, **f32)
  dp_BGRLS = jnp.einsum("BLGRV,BSGV->BGRLS", do_BLGRV, v_BSGV, **f32)
  ds_BGRLS = p_BGRLS * (dp_BGRLS - _to_BGRL(delta_BLH, g)[..., None])
  ds_BGRLS = (ds_BGRLS / jnp.sqrt(jnp.float32(q_BLHK.shape[-1]))).astype(dt)
  dq_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", ds_BGRLS, k_BSGK, **f32)
  dk_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", ds_BGRLS, q_BLGRK, **f32)
  return dq_BLGRK.reshape(q_BLHK.shape), dk_BSGK, dv_BSGV


JNP = BlockFns(forward, backward)
