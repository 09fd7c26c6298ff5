"""Grouped-query attention (Llama's): q / k / v projections, RoPE, the seam's attention, output.

One of the block's swappable attention modules (`jscale.model.llama.Block`): constructed as
`GQA(cfg, rngs, dot_general=...)` (each projection's product is
`matmul.for_linear(dot_general, <weight name>)`), called as
`(h_BLD, positions, inv_freq, comms) -> out_BLD` (`positions.Positions`) on the normed input
inside the tensor-parallel region; the output is the row-parallel partial sum the block takes
out of the region. `cached` is the generation path (a KV cache, `jscale.model.kv_cache`).

Shape suffixes: B batch, L sequence, D d_model, H query heads, G kv heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.config import ModelConfig
from jscale.model import kv_cache, matmul
from jscale.model.layers import einsum, param
from jscale.model.positions import Positions
from jscale.model.rope import apply_rope
from jscale.model.seam import LOCAL, EntersTensorParallel, Seam


class GQA(EntersTensorParallel, nnx.Module):
  """H query heads sharing G key/value heads (H a multiple of G; G == H is plain MHA)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    d, h, g, k = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
    # Creation order is the random draws' order: wq, wk, wv, wo (seeded inits stay the same).
    self.wq = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), std, pd)
    self.wk = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pd)
    self.wv = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std, pd)
    self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), std, pd)
    self.dtype = cfg.dtype
    self.attention_impl = cfg.attention_impl
    self.kernel_interpret = cfg.kernel_interpret
    self.wq_dot, self.wk_dot, self.wv_dot, self.wo_dot = (
        matmul.for_linear(dot_general, n) for n in ("wq", "wk", "wv", "wo"))

  def __call__(self, h_BLD: jax.Array, positions: Positions, inv_freq: jax.Array,
               comms: Seam) -> jax.Array:
    q, k, v = self.project(h_BLD, positions.rope_BL, inv_freq, comms)
    ctx_BLHK = comms.attention(q, k, v, positions, self.attention_impl, self.kernel_interpret)
    return self.output(ctx_BLHK, comms)

  def project(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
              comms: Seam = LOCAL) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [B, L, H, K], k [B, L, G, K], v [B, L, G, K]): projections, RoPE on q and k."""
    dt, c = self.dtype, comms
    q, k, v = comms.tp_column(h_BLD, [
        lambda h: einsum("BLD,DHK->BLHK", h, self.wq, dt, self.wq_dot, c),
        lambda h: einsum("BLD,DGK->BLGK", h, self.wk, dt, self.wk_dot, c),
        lambda h: einsum("BLD,DGK->BLGK", h, self.wv, dt, self.wv_dot, c)])
    q, k, v = (checkpoint_name(x, n) for x, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
    q, k = apply_rope(q, positions_BL, inv_freq), apply_rope(k, positions_BL, inv_freq)
    q = comms.activation(q, ("batch", "seq", "heads", "head_dim"))
    k = comms.activation(k, ("batch", "seq", "kv_heads", "head_dim"))
    v = comms.activation(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v

  def output(self, ctx_BLHK: jax.Array, comms: Seam = LOCAL) -> jax.Array:
    """The output projection (row-parallel) and the tensor-parallel region's exit (the block
    names the reduced output "attn_out")."""
    return comms.tp_row(ctx_BLHK, lambda x: einsum("BLHK,HKD->BLD", x, self.wo, self.dtype,
                                                   self.wo_dot, comms))

  def cached(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
             cache: kv_cache.KVCache, layer: jax.Array, prefill: bool
             ) -> tuple[jax.Array, kv_cache.KVCache]:
    """Attention for generation (one device, or GSPMD-sharded: no seam): stores this call's
    K / V in layer `layer` of `cache` at `positions_BL` and attends (`kv_cache.attend`).
    Returns (out [B, L, D], the updated cache)."""
    q, k, v = self.project(h_BLD, positions_BL, inv_freq)
    cache = kv_cache.write(cache, layer, k, v, positions_BL)
    ctx_BLHK = kv_cache.attend(q, k, v, cache, layer, positions_BL, prefill,
                               self.attention_impl, self.kernel_interpret)
    return self.output(ctx_BLHK), cache
