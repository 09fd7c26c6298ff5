"""The key / value cache of generation: every layer's K and V at every position written so far.

One buffer per K and V for the whole stack, [N, B, S, G, K] (N layers in model order, S the
cache length), carried through the layer scan and updated in place (a scatter into the carry,
never a per-layer copy), so a decode step moves only the cache bytes attention reads.

Rows are right-padded prompts and slot s of a row holds that row's position s: a query at
position p attends to slots 0..p, so whatever a slot beyond a row's last written position
holds (zeros, a padded prompt's filler) is never seen. The prefill (positions 0..P-1 of every
row) attends over its own fresh K / V with the model's attention impl (causal by index, so
right padding cannot reach a real token); a decode step attends over the cache by position.

Shape suffixes: N layers, B batch, S cache length, L new tokens, H query heads, G kv heads,
K head dim.
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


# Logical names of the cache's dims (`jscale.sharding` maps kv_heads over tensor).
NAMES = (None, "batch", None, "kv_heads", "head_dim")


def init(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """A zero cache for `batch` rows of `length` positions, in the compute dtype."""
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.resolved_head_dim)
  return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def write(cache: KVCache, layer: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
          positions_BL: jax.Array) -> KVCache:
  """`cache` with layer `layer`'s K / V of these tokens stored at their positions."""
  rows_B1 = jnp.arange(k_BLGK.shape[0])[:, None]
  return KVCache(cache.k.at[layer, rows_B1, positions_BL].set(k_BLGK.astype(cache.k.dtype)),
                 cache.v.at[layer, rows_B1, positions_BL].set(v_BLGK.astype(cache.v.dtype)))


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
