"""Multi-head latent attention (DeepSeek-V2/V3): keys and values from one compressed latent.

One of the block's swappable attention modules (`jscale.model.llama.Block`), chosen by
`model.mla` (GQA's call signature). Per token:

  queries: h -> [q_lora_rank] (RMSNorm) -> H x (nope + rope)      (or h -> H x (nope + rope))
  latent:  h -> [kv_lora_rank] (RMSNorm) = c,  and h -> [rope] = the RoPE key, shared by heads
  keys:    c -> H x nope, then each head's key is [nope part; the shared RoPE key]
  values:  c -> H x v_head_dim (V's head size may differ from Q's; cuDNN's impl pads V)

Training expands c into per-head keys and values and runs the seam's attention (tensor
parallelism over heads, context parallelism over the sequence, like GQA). Generation caches
only c and the RoPE key (`kv_cache.LatentCache`: kv_lora_rank + rope values per token and
layer) and decodes with the absorbed projections: q_nope · (c W_uk)ᵀ = (q_nope W_ukᵀ) · cᵀ and
softmax · (c W_uv) = (softmax · c) W_uv, so the keys and values are never expanded.

YaRN (`rope_scaling.rope_type: yarn`) as DeepSeek-V3 ships it: the rotated parts scaled by
`rope.yarn_rope_scale`, the softmax by `rope.yarn_softmax_scale` (applied to q, so every
attention impl, whose scale is 1/sqrt(head dim), runs it unchanged). The latent norms use
eps 1e-6 (DeepSeek's and transformers' RMSNorm default), not `model.norm_eps`.

Under manual tensor parallelism the down projections and latent norms are replicated inside
the tensor-parallel region; each rank's gradient of them is its heads' share, summed over
`tensor` once per step with the other gradients (their logical name "latent",
`jscale.parallel.zero`).

Shape suffixes: B batch, L sequence, S keys, D d_model, H heads, N nope dims, P rope dims,
K = N + P, V value head dim, Q q_lora_rank, R kv_lora_rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.config import ModelConfig
from jscale.model import attention as attn_lib
from jscale.model import kv_cache, matmul, rope
from jscale.model.layers import RMSNorm, einsum, param
from jscale.model.positions import Positions
from jscale.model.seam import LOCAL, Seam

LATENT_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm eps


class MLA(nnx.Module):
  """Multi-head latent attention for `cfg.mla` (heads: `cfg.n_heads`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    m, d, h = cfg.mla, cfg.d_model, cfg.n_heads
    if m is None:
      raise ValueError("multi-head latent attention needs model.mla")
    n, p, v, q, r = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank,
                     m.kv_lora_rank)
    pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
    norm = lambda dim: RMSNorm(dim, LATENT_EPS, cfg.dtype, pd, names=("latent",))
    if q:
      self.wq_a = param(rngs, (d, q), ("embed", "latent"), std, pd)
      self.q_norm = norm(q)
      self.wq_b = param(rngs, (q, h, n + p), ("latent", "heads", "head_dim"), std, pd)
    else:
      self.wq = param(rngs, (d, h, n + p), ("embed", "heads", "head_dim"), std, pd)
    self.wkv_a = param(rngs, (d, r + p), ("embed", "latent"), std, pd)
    self.kv_norm = norm(r)
    self.wk_b = param(rngs, (r, h, n), ("latent", "heads", "head_dim"), std, pd)
    self.wv_b = param(rngs, (r, h, v), ("latent", "heads", "head_dim"), std, pd)
    self.wo = param(rngs, (h, v, d), ("heads", "head_dim", "embed"), std, pd)
    self.dtype, self.nope, self.latent = cfg.dtype, n, r
    self.attention_impl, self.kernel_interpret = cfg.attention_impl, cfg.kernel_interpret
    self.rope_scale = rope.yarn_rope_scale(cfg.rope_scaling)
    # q is scaled so that the impls' 1/sqrt(N + P) becomes YaRN's softmax scale.
    self.q_scale = rope.yarn_softmax_scale(cfg.rope_scaling)
    names = [w for w in ("wq_a", "wq_b", "wq", "wkv_a", "wk_b", "wv_b", "wo") if hasattr(self, w)]
    for w in names:  # attributes, as GQA's: a product may be a module (FP8's `Fp8Dot`)
      setattr(self, f"{w}_dot", matmul.for_linear(dot_general, w))

  def _einsum(self, spec: str, x: jax.Array, w: str, comms: Seam) -> jax.Array:
    return einsum(spec, x, getattr(self, w), self.dtype, getattr(self, f"{w}_dot"), comms)

  def __call__(self, h_BLD: jax.Array, positions: Positions, inv_freq: jax.Array,
               comms: Seam) -> jax.Array:
    q, k, v = self.project(h_BLD, positions.rope_BL, inv_freq, comms)
    ctx_BLHV = comms.attention(q, k, v, positions, self.attention_impl, self.kernel_interpret)
    return self.output(ctx_BLHV, comms)

  def latents(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
              comms: Seam = LOCAL):
    """(q_nope [B, L, H, N], q_rope [B, L, H, P], c [B, L, R], k_rope [B, L, P]): the
    queries in two parts, the normed latent and the shared RoPE key, RoPE applied (YaRN's
    cos / sin scale included)."""
    if hasattr(self, "wq"):
      q_BLHK = self._einsum("BLD,DHK->BLHK", h_BLD, "wq", comms)
    else:
      c_q = self.q_norm(self._einsum("BLD,DQ->BLQ", h_BLD, "wq_a", comms))
      q_BLHK = self._einsum("BLQ,QHK->BLHK", c_q, "wq_b", comms)
    kv_BLX = self._einsum("BLD,DX->BLX", h_BLD, "wkv_a", comms)
    c_BLR = self.kv_norm(kv_BLX[..., :self.latent])
    k_rope_BL1P = rope.apply_rope(kv_BLX[..., None, self.latent:], positions_BL, inv_freq)
    q_rope_BLHP = rope.apply_rope(q_BLHK[..., self.nope:], positions_BL, inv_freq)
    if self.rope_scale != 1.0:
      q_rope_BLHP, k_rope_BL1P = q_rope_BLHP * self.rope_scale, k_rope_BL1P * self.rope_scale
    return q_BLHK[..., :self.nope], q_rope_BLHP, c_BLR, k_rope_BL1P[:, :, 0]

  def project(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
              comms: Seam = LOCAL) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [B, L, H, K], k [B, L, H, K], v [B, L, H, V]): the latent expanded per head."""
    q_nope, q_rope, c_BLR, k_rope_BLP = self.latents(h_BLD, positions_BL, inv_freq, comms)
    k_nope = self._einsum("BLR,RHN->BLHN", c_BLR, "wk_b", comms)
    v = checkpoint_name(self._einsum("BLR,RHV->BLHV", c_BLR, "wv_b", comms), "v_proj")
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    if self.q_scale != 1.0:
      q = q * jnp.asarray(self.q_scale, q.dtype)
    k_rope = jnp.broadcast_to(k_rope_BLP[:, :, None].astype(k_nope.dtype),
                              (*k_nope.shape[:3], k_rope_BLP.shape[-1]))
    q = checkpoint_name(q, "q_proj")
    k = checkpoint_name(jnp.concatenate([k_nope, k_rope], axis=-1), "k_proj")
    q = comms.activation(q, ("batch", "seq", "heads", "head_dim"))
    k = comms.activation(k, ("batch", "seq", "kv_heads", "head_dim"))
    v = comms.activation(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v

  def output(self, ctx_BLHV: jax.Array, comms: Seam = LOCAL) -> jax.Array:
    """The output projection (row-parallel: a partial sum under tensor parallelism)."""
    return self._einsum("BLHV,HVD->BLD", ctx_BLHV, "wo", comms)

  def cached(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
             cache: kv_cache.LatentCache, layer: jax.Array, prefill: bool
             ) -> tuple[jax.Array, kv_cache.LatentCache]:
    """Attention for generation: stores this call's latent and RoPE key in layer `layer` of
    `cache`; a prefill attends over its own expanded keys and values with the model's impl, a
    decode step over the cache with the absorbed projections. (out [B, L, D], cache)."""
    q_nope, q_rope, c_BLR, k_rope_BLP = self.latents(h_BLD, positions_BL, inv_freq)
    cache = kv_cache.write_latent(cache, layer, c_BLR, k_rope_BLP, positions_BL)
    if prefill:
      q, k, v = self.project(h_BLD, positions_BL, inv_freq)
      ctx_BLHV = kv_cache.attend(q, k, v, cache, layer, positions_BL, True,
                                 self.attention_impl, self.kernel_interpret)
      return self.output(ctx_BLHV), cache
    return self.output(self.absorbed(q_nope, q_rope, cache, layer, positions_BL)), cache

  def absorbed(self, q_nope_BLHN: jax.Array, q_rope_BLHP: jax.Array,
               cache: kv_cache.LatentCache, layer: jax.Array,
               positions_BL: jax.Array) -> jax.Array:
    """Attention over layer `layer` of the latent cache, masked by position, keys and values
    never expanded: one shared key [c; k_rope] and value c per position (an MQA over the
    latent), the heads' W_uk folded into the queries and W_uv applied after. [B, L, H, V]."""
    dt = self.dtype
    q_lat_BLHR = self._einsum("BLHN,RHN->BLHR", q_nope_BLHN, "wk_b", LOCAL)
    q_BLHX = jnp.concatenate([q_lat_BLHR, q_rope_BLHP.astype(dt)], axis=-1)
    # xla_attention divides by sqrt(R + P); the model's scale is q_scale / sqrt(N + P).
    scale = self.q_scale * np.sqrt(q_BLHX.shape[-1] / (self.nope + q_rope_BLHP.shape[-1]))
    q_BLHX = q_BLHX * jnp.asarray(scale, dt)
    c_BSR, k_rope_BSP = cache.latent[layer], cache.rope[layer]
    k_BS1X = jnp.concatenate([c_BSR, k_rope_BSP], axis=-1)[:, :, None].astype(dt)
    b, s = c_BSR.shape[:2]
    slots_BS = jnp.broadcast_to(jnp.arange(s, dtype=positions_BL.dtype), (b, s))
    ctx_BLHR = attn_lib.xla_attention(q_BLHX, k_BS1X, c_BSR[:, :, None].astype(dt),
                                      causal=True, positions=(positions_BL, slots_BS))
    return self._einsum("BLHR,RHV->BLHV", ctx_BLHR, "wv_b", LOCAL)
