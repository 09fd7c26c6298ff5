"""The key / value cache of generation: every layer's K and V at every position written so far.

One buffer per K and V for the whole stack, [N, B, S, G, K] (N layers in model order, S the
cache length), carried through the layer scan and updated in place (a scatter into the carry,
never a per-layer copy), so a decode step moves only the cache bytes attention reads.

Rows are right-padded prompts and slot s of a row holds that row's position s: a query at
position p attends to slots 0..p, so whatever a slot beyond a row's last written position
holds (zeros, a padded prompt's filler) is never seen. The prefill (positions 0..P-1 of every
row) attends over its own fresh K / V with the model's attention impl (causal by index, so
right padding cannot reach a real token); a decode step attends over the cache by position.

MLA (`jscale.model.mla`) caches its compressed latent instead (`LatentCache`): the normed
kv latent and the RoPE key shared by the heads, kv_lora_rank + rope values per token and
layer whatever the head count (`bytes_per_token` compares the layouts).

Shape suffixes: N layers, B batch, S cache length, L new tokens, H query heads, G kv heads,
K head dim, R kv_lora_rank, P rope dims.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jscale.config import ModelConfig
from jscale.model import attention as attn_lib


class KVCache(NamedTuple):
  """K [N, B, S, G, K] and V [N, B, S, G, K] of every layer (a pytree: jit carries it)."""
  k: jax.Array
  v: jax.Array

  @property
  def length(self) -> int:
    return self.k.shape[2]


class LatentCache(NamedTuple):
  """MLA's cache: the normed kv latent [N, B, S, R] and the RoPE key [N, B, S, P] (RoPE
  applied) of every layer."""
  latent: jax.Array
  rope: jax.Array

  @property
  def length(self) -> int:
    return self.latent.shape[2]


# What `init` makes for a model: GQA's keys and values, or MLA's latent.
Cache = KVCache | LatentCache

# Logical names of the cache's dims (`jscale.sharding` maps kv_heads over tensor).
NAMES = (None, "batch", None, "kv_heads", "head_dim")
LATENT_NAMES = (None, "batch", None, None)  # shared by the heads: whole on every tensor rank


def names(cfg: ModelConfig) -> tuple:
  """The logical names of every array of the model's cache."""
  return NAMES if cfg.mla is None else LATENT_NAMES


def init(cfg: ModelConfig, batch: int, length: int) -> Cache:
  """A zero cache for `batch` rows of `length` positions, in the compute dtype."""
  if cfg.mla is not None:
    lead = (cfg.n_layers, batch, length)
    return LatentCache(jnp.zeros((*lead, cfg.mla.kv_lora_rank), cfg.dtype),
                       jnp.zeros((*lead, cfg.mla.qk_rope_head_dim), cfg.dtype))
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.resolved_head_dim)
  return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def bytes_per_token(cfg: ModelConfig) -> int:
  """Cache bytes one token takes over all layers: 2·G·K per layer for GQA (G = H: MHA),
  kv_lora_rank + rope for MLA, times the compute dtype's size."""
  per_layer = (2 * cfg.n_kv_heads * cfg.resolved_head_dim if cfg.mla is None
               else cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
  return cfg.n_layers * per_layer * jnp.dtype(cfg.dtype).itemsize


def write(cache: KVCache, layer: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
          positions_BL: jax.Array) -> KVCache:
  """`cache` with layer `layer`'s K / V of these tokens stored at their positions."""
  rows_B1 = jnp.arange(k_BLGK.shape[0])[:, None]
  return KVCache(cache.k.at[layer, rows_B1, positions_BL].set(k_BLGK.astype(cache.k.dtype)),
                 cache.v.at[layer, rows_B1, positions_BL].set(v_BLGK.astype(cache.v.dtype)))


def write_latent(cache: LatentCache, layer: jax.Array, c_BLR: jax.Array, k_rope_BLP: jax.Array,
                 positions_BL: jax.Array) -> LatentCache:
  """`cache` with layer `layer`'s latent and RoPE key of these tokens at their positions."""
  rows_B1 = jnp.arange(c_BLR.shape[0])[:, None]
  return LatentCache(
      cache.latent.at[layer, rows_B1, positions_BL].set(c_BLR.astype(cache.latent.dtype)),
      cache.rope.at[layer, rows_B1, positions_BL].set(k_rope_BLP.astype(cache.rope.dtype)))


def attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, cache: KVCache,
           layer: jax.Array, positions_BL: jax.Array, prefill: bool, impl: str,
           interpret: bool = False) -> jax.Array:
  """Attention of the new queries: over their own K / V, causal by index, with the model's
  impl for a prefill (positions 0..L-1); over layer `layer` of the cache, masked by position
  (query p sees slots <= p), for a decode step."""
  if prefill:
    impl = "xla" if impl == "ring" else impl  # one device: the ring is plain attention
    return attn_lib.attention(q_BLHK, k_BLGK, v_BLGK, impl=impl, causal=True,
                              interpret=interpret)
  k_BSGK, v_BSGK = cache.k[layer], cache.v[layer]
  b, s = k_BSGK.shape[:2]
  slots_BS = jnp.broadcast_to(jnp.arange(s, dtype=positions_BL.dtype), (b, s))
  return attn_lib.xla_attention(q_BLHK, k_BSGK, v_BSGK, causal=True,
                                positions=(positions_BL, slots_BS))
