"""Expert parallelism's hand-written exchanges (manual mode, inside shard_map): tokens go to the
devices holding their experts by all-to-all, are computed there and come back the same way.
Autodiff transposes each all-to-all into the reverse one, so gradients flow back alike.

Device j of the n_ep devices on the expert axis holds experts [j·E_l, (j+1)·E_l), E_l = E / n_ep.

  * `capacity_exchange`: the [E, C, D] slot buffer split by expert owner: one tiled all_to_all
    sends C·E_l slots to each device. Bytes per direction: E·C·D = capacity_factor · T·K·D.
  * `dropless_exchange` (flat): rows sorted by expert go out in one ragged all-to-all
    (per-destination sizes, the per-expert counts exchanged first) into a buffer with room for
    the most a device can receive (T·min(K, E_l) rows per source: a token picks an expert at
    most once); the receiver regroups them by local expert for one grouped matmul. On GPU it
    is `ragged_all_to_all`, which moves only the real rows; it has no CPU implementation, so
    there the same semantics run as padded blocks through `all_to_all`. XLA's buffers have
    static sizes, so that room is allocated whatever arrives: n·T·min(K, E_l) rows, up to n
    times the rows an even routing sends (DeepSeek-V3 671B on 32 expert devices: ~60 GB a
    buffer). With `model.moe.receive_factor` f > 0 each source's block holds f times its even
    share, ⌈f·T·K / n⌉ rows (`receive_rows`): a sender clips what it sends each device to
    that (cutting its rows for that device's last experts), and the clipped rows count as
    dropped, as capacity dispatch's overflow does.
  * `in_chunks`: any of the dropless exchanges on equal slices of the tokens, one after another
    (`parallel.expert_chunks`): each slice's all-to-alls hide under another's expert matmuls.
  * `node_limited_exchange`: DeepSeek-V3's two hops for group-limited routing (playbook:
    "Expert parallelism": tokens sent "to at most 4 nodes ... to reduce communication
    overhead"). The n_group groups of experts tile the devices, a group per node of
    m = n_ep / n_group devices. Hop 1 crosses nodes: one copy of each token per chosen group
    goes to the device at the same place in that group's node (replica groups {p, p+m, ...});
    hop 2 stays in the node (replica groups {a·m, ..., a·m+m-1}): the copy fans out to the
    devices of its experts there, and their gated sum comes back to hop 1's device as one row.
    A token choosing `topk_group` groups crosses nodes topk_group times, not K times as in the
    flat exchange, and no row goes to a node outside its chosen groups.

The dropless exchanges are written as phases (`dropless_phases`, `node_limited_phases`;
`jscale.model.phases`): they yield where the rows have arrived at the experts and where the
experts' output leaves, so that micro-batches side by side can be skewed by a phase, one's
transfers beside another's grouped matmuls (`parallel.overlap_skew`). `dropless_exchange` and
`node_limited_exchange` run them through.

Shape suffixes: T local tokens, K experts per token, A assignments (rows), E experts, D model,
C slots, N peers, R received rows, G groups.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jscale.fp8.wire import Encoded, Wires, rows_of
from jscale.model import moe_dispatch as md
from jscale.model import phases
from jscale.model.moe_gemm import GroupedDot
from jscale.model.phases import Phases
from jscale.parallel import exchange_slots as slots_lib
from jscale.parallel.ragged_exchange import Peers, landing_zeros, ragged_all_to_all


def capacity_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, factor: float,
                      axis: str, n_ep: int):
  """Capacity-mode experts over `axis`: (output [T, D], dropped assignments)."""
  e = w.n_experts * n_ep
  cap = md.capacity(x_TD.shape[0], ids_TK.shape[1], e, factor)
  pos_TK = md.slots(ids_TK, e)
  buf_ECD = md.dispatch(x_TD.astype(dtype), ids_TK, pos_TK, e, cap)
  # [E, C, D] -> this device's experts' slots from every source: [E_l, n_ep * C, D].
  mine = jax.lax.all_to_all(buf_ECD, axis, split_axis=0, concat_axis=1, tiled=True)
  y = md.dense_ffn(mine, w, dtype)
  y_ECD = jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
  return md.combine(y_ECD, ids_TK, pos_TK, gates_TK), jnp.sum(pos_TK >= cap)


def receive_rows(t: int, k: int, e_l: int, n: int, factor: float,
                 share_tokens: int | None = None) -> int:
  """Rows of a receive buffer's block per source: the most one device can send another (T
  tokens, each to at most min(K, E_l) of its E_l experts), or with `factor` > 0 that many
  times the even share T·K / n, if smaller (`model.moe.receive_factor`). `share_tokens`: the
  tokens whose assignments the share spreads, where the T rows are a padded buffer of fewer
  (the node-limited exchange's second hop)."""
  most = t * min(k, e_l)
  share = t if share_tokens is None else share_tokens
  return most if factor <= 0 else min(most, math.ceil(factor * share * k / n))


def node_rows(t: int, topk_group: int, n_group: int, factor: float) -> int:
  """Rows of the node-limited exchange's first-hop block per source: a token goes to a node at
  most once (T), or with `factor` > 0 that many times the even share T·topk_group / n_group,
  if smaller."""
  return t if factor <= 0 else min(t, math.ceil(factor * t * topk_group / n_group))


def round_trip(send: Callable, s: md.Sorted, per_device: int, peers: Peers, cap: int,
               native: bool, compute: Callable, wires: Wires = Wires()
               ) -> Phases[tuple[jax.Array, slots_lib.Slots, jax.Array]]:
  """Sends `s`'s sorted assignment rows (row r to peer s.expert_A[r] // per_device; ids past
  the peers' experts nowhere) out, runs `compute((rows, extras), sizes_NE)` -> phases of
  ([N·cap, D] result, a count) on each peer and brings the result back: (the returned [N·cap]
  rows, in per-peer blocks, zero where nothing was sent; their slots (`exchange_slots`); the
  peer's count). `send(slots)`: (the [S, D] rows to send, a pytree of more per-row values), in the
  smaller of the two layouts. `wires`: how the rows travel out, the result's gradient out in
  the backward, the result back and the rows' gradient back in the backward (`Wires`; None:
  as they are; the per-row values always as they are). Through a wire the rows reach
  `compute` as `Encoded` rows, and `Encoded` rows to send go as the bytes they came as.

  Both directions land in blocks: source (or destination) j's rows at j·cap, sorted by local
  expert (`sizes_NE`: how many per source and local expert), so no side needs the other's
  offsets. `cap`: the rows of a block; a sender's rows for one peer past it (the last of them
  in sorted order) are not sent."""
  n = peers.size
  # Sent from the smaller of the two layouts; returned into blocks (no offsets to exchange).
  in_blocks = slots_lib.blocks(s.order_A.shape[0], n, cap)
  sent = slots_lib.layout(s, per_device, n, cap, in_blocks)
  back = sent if in_blocks else slots_lib.layout(s, per_device, n, cap, True)
  sent_NE = _clipped(s.sizes_E.reshape(n, per_device), cap)
  sizes_NE = checkpoint_name(  # kept by `remat: selective`: the backward exchanges no counts
      peers.all_to_all(sent_NE), "moe_counts")
  recv_N = sizes_NE.sum(axis=1)
  mine_N = jnp.full((n,), peers.index() * cap, jnp.int32)
  exchange = lambda x, in_off, send_N, recv, as_=None, grad_as=None: ragged_all_to_all(
      x, landing_zeros((n * cap,) + rows_of(x).shape[1:], rows_of(x).dtype, recv), in_off,
      send_N, mine_N, recv, peers, cap, native, as_, grad_as)
  out = lambda x, as_=None, grad_as=None: exchange(x, sent.offsets_N, sent.sent_N, recv_N, as_,
                                                   grad_as)
  rows_SD, extras = send(sent)
  result, count = yield from compute(
      (out(rows_SD, wires.out, wires.back_grad), jax.tree.map(out, extras)), sizes_NE)
  return (rows_of(exchange(result, back.offsets_N, recv_N, sent.sent_N, wires.back,
                           wires.out_grad)), back, count)


def _clipped(sizes_NE: jax.Array, cap: int) -> jax.Array:
  """Per-destination expert counts with each destination's total cut to `cap`, from its last
  experts first (the rows are sent in sorted order, so a prefix of each destination's)."""
  kept_NE = jnp.minimum(jnp.cumsum(sizes_NE, axis=1), cap)
  return jnp.diff(kept_NE, axis=1, prepend=0).astype(sizes_NE.dtype)


def _received_by_expert(x_RD: jax.Array | Encoded, sizes_NE, cap: int, w: md.ExpertWeights,
                        dtype, gemm: GroupedDot) -> jax.Array:
  """The experts on the received [N·cap, D] rows (each source's block sorted by local expert):
  regrouped by expert for one grouped matmul and put back in place; padding rows give zero.
  `Encoded` rows reach a grouped matmul that reads the wire's bytes so (`GroupedDot.reads_wire`),
  else decoded."""
  i_R = jnp.arange(cap)
  # Padding rows get local expert E_l: sorted last, past every expert's rows.
  local_NR = jax.vmap(lambda c: jnp.searchsorted(c, i_R, side="right"))(jnp.cumsum(sizes_NE, 1))
  order = jnp.argsort(local_NR.reshape(-1), stable=True).astype(jnp.int32)
  inverse = md.inverse_permutation(order)
  x_AD = md.permute(rows_of(x_RD), order, inverse)
  wire_AW = (jnp.take(x_RD.bytes, order, axis=0) if isinstance(x_RD, Encoded) and
             gemm.reads_wire else None)
  out = md.ragged_ffn(x_AD, sizes_NE.sum(0), w, dtype, gemm, wire_AW)
  return md.permute(out, inverse, order)


def dropless_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, peers: Peers,
                      native_ragged: bool = False, gemm: GroupedDot = GroupedDot(),
                      receive_factor: float = 0.0, share_tokens: int | None = None,
                      wires: Wires = Wires()) -> tuple[jax.Array, jax.Array]:
  """Experts among `peers`, sorted rows through a ragged all-to-all: (output [T, D], dropped
  assignments: none unless `receive_factor` > 0 bounds the receive buffer, `receive_rows`).
  Expert ids index the peers' experts (peer j holds [j·E_l, (j+1)·E_l)); ids >= size·E_l
  mean "none here" and need gate 0. `native_ragged`: the backend's ragged_all_to_all (GPU),
  else its padded emulation. `gemm`: the grouped matmul of the received rows. `wires`: how
  the rows travel out, the outputs' gradients out in the backward and the outputs back
  (`jscale.fp8.wire.Wires`; by default in `dtype`)."""
  return phases.run(dropless_phases(x_TD, ids_TK, gates_TK, w, dtype, peers, native_ragged,
                                    gemm, receive_factor, share_tokens, wires))


def dropless_phases(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, peers: Peers,
                    native_ragged: bool = False, gemm: GroupedDot = GroupedDot(),
                    receive_factor: float = 0.0, share_tokens: int | None = None,
                    wires: Wires = Wires()) -> Phases[tuple[jax.Array, jax.Array]]:
  """`dropless_exchange` as phases (`jscale.model.phases`): boundaries where the rows have
  arrived (dispatch | grouped matmul) and where the experts' output leaves (matmul |
  combine)."""
  e_l = w.n_experts
  t, k = ids_TK.shape
  s = md.sort_by_expert(ids_TK, e_l * peers.size)
  cap = receive_rows(t, k, e_l, peers.size, receive_factor, share_tokens)

  def ffn(got, sizes_NE):
    x_RD = yield got[0]
    y_RD = yield _received_by_expert(x_RD, sizes_NE, cap, w, dtype, gemm)
    return y_RD, jnp.zeros((), jnp.int32)

  x_TD = x_TD.astype(dtype)  # (`Encoded` rows, hop 1's at the relay: sent on as they came)
  back_SD, slots, _ = yield from round_trip(lambda sl: (slots_lib.dispatch(x_TD, s, sl), ()), s,
                                            e_l, peers, cap, native_ragged, ffn, wires)
  return slots_lib.combine(back_SD, s, slots, gates_TK), jnp.sum(slots.unsent_A)


def in_chunks(exchange: Callable, chunks: int, x_TD, ids_TK, gates_TK
              ) -> tuple[jax.Array, jax.Array]:
  """`exchange(x, ids, gates)` -> (output, dropped) on `chunks` equal slices of the T tokens:
  the [T/chunks, D] outputs joined in order, the dropped counts summed; equal to one call
  (dropless: every row is computed alone).

  DeepSeek-V3's two-micro-batch overlap inside the MoE layer: a slice's dispatch and combine
  depend on its own rows only, so XLA:GPU's latency-hiding scheduler can run them (async
  ragged all-to-alls) while another slice's grouped matmuls compute. DeepSeek overlaps one
  micro-batch's exchange with the other's attention too; a single SPMD program gets that only
  where the scheduler moves the exchange across the layer's other ops, which the slices here do
  not need. T must divide by `chunks` (`validate.experts`)."""
  if chunks == 1:
    return exchange(x_TD, ids_TK, gates_TK)
  split = lambda a: jnp.split(a, chunks)
  outs, dropped = zip(*(exchange(*c) for c in zip(split(x_TD), split(ids_TK),
                                                   split(gates_TK))))
  return jnp.concatenate(outs), jnp.sum(jnp.stack(dropped))


def node_limited_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, axis: str,
                          n_ep: int, n_group: int, topk_group: int, native_ragged: bool = False,
                          gemm: GroupedDot = GroupedDot(), receive_factor: float = 0.0,
                          wires: Wires = Wires()) -> tuple[jax.Array, jax.Array]:
  """`node_limited_phases` to their end."""
  return phases.run(node_limited_phases(x_TD, ids_TK, gates_TK, w, dtype, axis, n_ep, n_group,
                                        topk_group, native_ragged, gemm, receive_factor,
                                        wires))


def node_limited_phases(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, axis: str,
                        n_ep: int, n_group: int, topk_group: int, native_ragged: bool = False,
                        gemm: GroupedDot = GroupedDot(), receive_factor: float = 0.0,
                        wires: Wires = Wires()) -> Phases[tuple[jax.Array, jax.Array]]:
  """Dropless experts over `axis` in DeepSeek-V3's two hops (module docstring): (output [T, D],
  equal to `dropless_exchange` over the whole axis; dropped assignments). The n_group groups of
  experts tile the n_ep devices (n_group divides n_ep). Unbounded, hop 1's blocks hold T rows
  per source and hop 2's every row of hop 1's padded buffer times min(K, E_l): at DeepSeek-V3
  671B's 64 expert devices, 16,384 tokens each, buffers of ~60 GB. `receive_factor` f > 0
  sizes both by their even shares: hop 1 ⌈f·T·topk_group / n_group⌉ rows per source
  (`node_rows`), hop 2 ⌈f·T·K / m⌉ (each device's T tokens bring about T·K assignments into
  the node, spread over its m devices); what does not fit is dropped and counted, per
  assignment, as the flat exchange's is. `wires`: how the rows, the outputs' gradients and the
  outputs travel, both hops."""
  per_node = n_ep // n_group
  e_g = w.n_experts * per_node  # experts per group: a node's
  t, k = ids_TK.shape
  g_G = jnp.arange(n_group, dtype=ids_TK.dtype)
  in_TGK = (ids_TK // e_g)[:, None, :] == g_G[None, :, None]
  chosen_TG = jnp.any(in_TGK, axis=-1)
  # Hop 1's rows: one per (token, chosen group), sorted by group; unchosen pairs go nowhere.
  pairs = md.sort_by_expert(jnp.where(chosen_TG, g_G, n_group), n_group)
  # Each copy carries its experts in that group (group-local ids; others "none", gate 0).
  local_AK = jnp.where(in_TGK, ids_TK[:, None] - g_G[None, :, None] * e_g, e_g).reshape(-1, k)
  gates_AK = jnp.where(in_TGK, gates_TK[:, None], 0).reshape(-1, k)
  local_AK = local_AK[pairs.order_A]
  gates_AK = md.permute(gates_AK, pairs.order_A, pairs.rank_A)
  x_TD = x_TD.astype(dtype)

  def rows(slots: slots_lib.Slots):
    real_S1 = slots.real_S[:, None]
    return (slots_lib.dispatch(x_TD, pairs, slots),
            (jnp.where(real_S1, local_AK[slots.row_S], e_g),
             jnp.where(real_S1, gates_AK[slots.row_S], 0)))

  cap = node_rows(t, topk_group, n_group, receive_factor)

  def in_node(got, sizes_N1):
    x_RD, (local_RK, gates_RK) = got
    real_R = (jnp.arange(cap) < sizes_N1).reshape(-1)  # padding rows: no experts
    return (yield from dropless_phases(
        x_RD, jnp.where(real_R[:, None], local_RK, e_g), gates_RK, w, dtype,
        Peers.within_nodes(axis, n_ep, per_node), native_ragged, gemm, receive_factor,
        share_tokens=t, wires=wires))

  back_SD, slots, dropped_in_node = yield from round_trip(
      rows, pairs, 1, Peers.across_nodes(axis, n_ep, per_node), cap, native_ragged, in_node,
      wires)
  dropped = jnp.sum(slots.unsent_A[:, None] & (local_AK < e_g)) + dropped_in_node
  return (slots_lib.combine(back_SD, pairs, slots, chosen_TG.astype(jnp.float32)),
          dropped)
