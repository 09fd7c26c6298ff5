"""Expert parallelism by hand (inside shard_map): tokens go to the devices holding their experts
with `all_to_all` over the expert axis, are computed there, and come back the same way.
Autodiff transposes each all_to_all into the reverse one, so gradients flow back alike.

Device j of the n_ep devices on `axis` holds experts [j·E_l, (j+1)·E_l), E_l = E / n_ep.

  * capacity: the [E, C, D] slot buffer is split by expert owner: one tiled all_to_all
    sends C·E_l slots to each device. Bytes per direction: E·C·D, i.e. capacity_factor ·
    T·K·D — the minimum (T·K·D) at factor 1.
  * dropless: rows sorted by expert go out in one ragged all-to-all (per-destination sizes,
    the per-expert counts exchanged first), landing in a buffer with room for the most a
    device can receive (T·min(K, E_l) rows per source: a token picks an expert at most once);
    the receiver regroups the rows by local expert for one grouped matmul. On GPU it is
    `ragged_all_to_all` and moves only the real rows; it has no CPU implementation, so there
    the same semantics run as padded blocks through `all_to_all` (n_ep·min(K, E_l)/K times
    the minimum bytes).

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


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axis: str, rows: int, native: bool):
  """`jax.lax.ragged_all_to_all` (native: GPU, which moves only the real rows) or the same
  semantics on any backend: `rows`-padded blocks through a tiled all_to_all, written at the
  senders' output offsets. Differentiable either way (the native one by JAX's transpose)."""
  if native:
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axis)
  i_R = jnp.arange(rows)
  src_NR = jnp.minimum(input_offsets[:, None] + i_R, operand.shape[0] - 1)
  blocks_NRD = jnp.where((i_R < send_sizes[:, None])[..., None], operand[src_NR], 0)
  got_NRD = jax.lax.all_to_all(blocks_NRD, axis, 0, 0, tiled=True)
  at_N = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # where each source's go
  dest_NR = jnp.where(i_R < recv_sizes[:, None], at_N[:, None] + i_R, output.shape[0])
  return output.at[dest_NR].set(got_NRD.astype(output.dtype), mode="drop")


def dropless_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, axis: str,
                      n_ep: int, native_ragged: bool = False):
  """Dropless experts over `axis`: output [T, D] (nothing is dropped). `native_ragged`: use
  the backend's ragged_all_to_all (GPU), else its padded emulation."""
  e_l = w.gate_EDF.shape[0]
  t, k = ids_TK.shape
  d = x_TD.shape[1]
  s = md.sort_by_expert(ids_TK, gates_TK, e_l * n_ep)
  rows = t * min(k, e_l)  # the most rows one device can be sent by this one
  # Sorted rows are contiguous per destination device: block j starts at start_N[j].
  per_dev_N = s.sizes_E.reshape(n_ep, e_l).sum(axis=1)
  start_N = jnp.cumsum(per_dev_N) - per_dev_N
  sizes_NE = jax.lax.all_to_all(s.sizes_E.reshape(n_ep, e_l), axis, 0, 0, tiled=True)
  recv_N = sizes_NE.sum(axis=1)
  # Both directions land in a padded [n_ep * rows, D] layout: source (or expert device) j's
  # rows at j * rows, so the receiver never needs the senders' offsets.
  mine_N = jnp.full((n_ep,), jax.lax.axis_index(axis) * rows, jnp.int32)
  block_N = jnp.arange(n_ep, dtype=jnp.int32) * rows
  exchange = lambda x, in_off, send, recv: ragged_all_to_all(
      x, jnp.zeros((n_ep * rows, d), x.dtype), in_off, send, mine_N, recv, axis, rows,
      native_ragged)
  recv_RD = exchange(x_TD.astype(dtype)[s.token_A], start_N, per_dev_N, recv_N)
  # Each source's block is sorted by local expert; padding rows get expert e_l (last).
  i_R = jnp.arange(rows)
  local_NR = jax.vmap(lambda c: jnp.searchsorted(c, i_R, side="right"))(jnp.cumsum(sizes_NE, 1))
  order = jnp.argsort(local_NR.reshape(-1), stable=True)
  out = md.ragged_ffn(recv_RD[order], sizes_NE.sum(0), w, dtype)
  out_RD = jnp.zeros_like(out).at[order].set(out)
  back_NRD = exchange(out_RD, block_N, recv_N, per_dev_N).reshape(n_ep, rows, d)
  # Sorted assignment r went to device j = expert // e_l as row r - start_N[j].
  dev_A = s.expert_A // e_l
  out_AD = back_NRD[dev_A, jnp.arange(t * k) - start_N[dev_A]]
  return md.combine_sorted(out_AD, s, t)
