"""Expert parallelism by hand (inside shard_map): tokens go to the devices holding their experts
with `all_to_all` over the expert axis, are computed there, and come back the same way.
Autodiff transposes each all_to_all into the reverse one, so gradients flow back alike.

Device j of the n_ep devices on `axis` holds experts [j·E_l, (j+1)·E_l), E_l = E / n_ep.

  * capacity: the [E, C, D] slot buffer is split by expert owner: one tiled all_to_all
    sends C·E_l slots to each device. Bytes per direction: E·C·D, i.e. capacity_factor ·
    T·K·D — the minimum (T·K·D) at factor 1.
  * dropless: rows sorted by expert are sent in per-destination blocks padded to the most a
    device can receive (T·min(K, E_l) rows: a token picks an expert at most once), with the
    per-expert counts alongside; the receiver regroups the rows by local expert for one
    grouped matmul. Static shapes make the padding n_ep·min(K, E_l)/K times the minimum;
    `ragged_all_to_all` would move only the real rows, but it has no CPU implementation.

Shape suffixes: T local tokens, K experts per token, A = T·K, E experts, D model, C slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jscale.model import moe_dispatch as md


def capacity_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, factor: float,
                      axis: str, n_ep: int):
  """Capacity-mode experts over `axis`: (output [T, D], dropped assignments)."""
  e = w.gate_EDF.shape[0] * n_ep
  cap = md.capacity(x_TD.shape[0], ids_TK.shape[1], e, factor)
  pos_TK = md.slots(ids_TK, e)
  buf_ECD = md.dispatch(x_TD.astype(dtype), ids_TK, pos_TK, e, cap)
  # [E, C, D] -> this device's experts' slots from every source: [E_l, n_ep * C, D].
  mine = jax.lax.all_to_all(buf_ECD, axis, split_axis=0, concat_axis=1, tiled=True)
  y = md.dense_ffn(mine, w, dtype)
  y_ECD = jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
  return md.combine(y_ECD, ids_TK, pos_TK, gates_TK), jnp.sum(pos_TK >= cap)


def dropless_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, axis: str,
                      n_ep: int):
  """Dropless experts over `axis`: output [T, D] (nothing is dropped)."""
  e_l = w.gate_EDF.shape[0]
  t, k = ids_TK.shape
  s = md.sort_by_expert(ids_TK, gates_TK, e_l * n_ep)
  rows = t * min(k, e_l)  # the most rows one device can be sent by this one
  # Sorted rows are contiguous per destination device: block d starts at start_N[d].
  per_dev_N = s.sizes_E.reshape(n_ep, e_l).sum(axis=1)
  start_N = jnp.cumsum(per_dev_N) - per_dev_N
  i_R = jnp.arange(rows)
  src_NR = start_N[:, None] + i_R[None, :]
  valid_NR = i_R[None, :] < per_dev_N[:, None]
  xs_AD = x_TD.astype(dtype)[s.token_A]
  send_NRD = jnp.where(valid_NR[..., None], xs_AD[jnp.minimum(src_NR, t * k - 1)], 0)
  recv_NRD = jax.lax.all_to_all(send_NRD, axis, split_axis=0, concat_axis=0, tiled=True)
  sizes_NE = jax.lax.all_to_all(s.sizes_E.reshape(n_ep, e_l), axis, 0, 0, tiled=True)
  # Each source's block is sorted by local expert; padding rows get expert e_l (last).
  local_NR = jax.vmap(lambda c: jnp.searchsorted(c, i_R, side="right"))(jnp.cumsum(sizes_NE, 1))
  order = jnp.argsort(local_NR.reshape(-1), stable=True)
  out = md.ragged_ffn(recv_NRD.reshape(-1, x_TD.shape[1])[order], sizes_NE.sum(0), w, dtype)
  out_NRD = jnp.zeros_like(out).at[order].set(out).reshape(recv_NRD.shape)
  back_NRD = jax.lax.all_to_all(out_NRD, axis, split_axis=0, concat_axis=0, tiled=True)
  # Sorted assignment r went to device d = expert // e_l as row r - start_N[d].
  dev_A = s.expert_A // e_l
  out_AD = back_NRD[dev_A, jnp.arange(t * k) - start_N[dev_A]]
  return md.combine_sorted(out_AD, s, t)
