"""Plain-jnp attention with the kernel's contract: the ground truth for its tests."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def reference(q_BLHK, k_BSGK, v_BSGK, causal: bool = True, segment_ids=None,
              sm_scale: float | None = None):
  """Materialised-scores attention (fp32 softmax, HIGHEST-precision matmuls).

  Same arguments and masking as `flash_attention`; returns (out [B, L, H, Kv] in q's dtype,
  lse [B, H, L] fp32). Queries that see no key output 0 with lse -inf.
  """
  b, l, h, d = q_BLHK.shape
  s, g = k_BSGK.shape[1], k_BSGK.shape[2]
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(d)
  hi = jax.lax.Precision.HIGHEST
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, d)
  s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK, precision=hi,
                       preferred_element_type=jnp.float32) * sm_scale
  mask_BLS = jnp.ones((b, l, s), bool)
  if segment_ids is not None:
    q_seg, kv_seg = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    mask_BLS = q_seg[:, :, None] == kv_seg[:, None, :]
  if causal:
    mask_BLS = mask_BLS & jnp.tril(jnp.ones((l, s), bool))
  s_BGRLS = jnp.where(mask_BLS[:, None, None], s_BGRLS, -jnp.inf)
  m_BGRL = jnp.max(s_BGRLS, axis=-1)
  m_BGRL = jnp.where(jnp.isfinite(m_BGRL), m_BGRL, 0.0)  # fully-masked rows: avoid inf - inf
  p_BGRLS = jnp.exp(s_BGRLS - m_BGRL[..., None])
  l_BGRL = jnp.sum(p_BGRLS, axis=-1)
  o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p_BGRLS, v_BSGK.astype(jnp.float32), precision=hi)
  o_BLGRK = o_BLGRK / jnp.where(l_BGRL == 0, 1.0, l_BGRL).transpose(0, 3, 1, 2)[..., None]
  lse_BHL = (m_BGRL + jnp.log(l_BGRL)).reshape(b, h, l)
  return o_BLGRK.reshape(b, l, h, v_BSGK.shape[-1]).astype(q_BLHK.dtype), lse_BHL
