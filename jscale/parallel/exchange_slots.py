"""Where an expert exchange's rows sit in its send and return buffers (`Slots`): the sorted
assignment rows themselves ([A] rows, A = T·K, peer j's rows from its first sorted row on), or
per-peer blocks ([N·cap] rows, peer j's at j·cap), whichever is the smaller.

Why blocks: a ragged all-to-all sends at most `cap` rows to each of its N peers, and where the
sorted assignments outnumber N·cap most of them are never sent. The node-limited exchange's
second hop sorts every row of the first hop's padded buffer K times, mostly "none": on
DeepSeek-V3 671B at 1,024 H100s it materialised a bf16[327680, 7168] (4.7 GB) buffer per call
to send at most [81920, 7168], in the forward, the recompute and the backward. Where the
blocks are larger (the flat exchange's buffer bounded at f > 1 times its even share), the
sorted rows stay.

A token's rows are gathered straight into their slots (`dispatch`); the rows returned (always
into blocks) are gathered straight back onto their tokens and gated (`combine`). Both are written
with their transposes as gathers too (`jax.custom_vjp`), as `md.permute` is: XLA would
transpose a gather into a scatter-add.

    slot of sorted row r, to peer j = expert_r // E_l:   r                     (sorted rows)
                                                         j·cap + (r − start_j) (blocks)
    sent if r − start_j < cap;  dispatch: send[s] = x[token(s)];
    combine: y[t] = Σ_k gate[t, k] · back[slot(t, k)] over its sent k

Shape suffixes: T tokens, K experts per token, A assignments (T·K), S slots, N peers, D model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jscale.fp8.wire import Encoded, rows_of
from jscale.model import moe_dispatch as md
from jscale.model.zeros import zero_from


class Slots(NamedTuple):
  """Where the sorted assignments of `md.Sorted` sit in the send (and return) buffer."""
  row_S: jax.Array      # the sorted row slot s carries (clipped; meaningful where `real_S`)
  real_S: jax.Array     # slot s carries a row that is sent
  slot_A: jax.Array     # the slot of assignment a (a = t·K + choice); S where not sent
  offsets_N: jax.Array  # where each peer's rows start in the buffer
  sent_N: jax.Array     # rows sent to each peer: its rows, cut to cap
  unsent_A: jax.Array   # by sorted row: meant for a peer, past its cap


def blocks(a: int, n: int, cap: int) -> bool:
  """Whether per-peer blocks ([n·cap] rows) are smaller than the `a` sorted rows."""
  return n * cap < a


def layout(s: md.Sorted, per_device: int, n: int, cap: int, in_blocks: bool) -> Slots:
  """The slots of `s`'s rows for `n` peers of `per_device` experts each, `cap` rows sent to
  a peer at most: per-peer blocks (`in_blocks`; the returned rows always land so), else the
  sorted rows."""
  a = s.order_A.shape[0]
  per_dev_N = s.sizes_E.reshape(n, per_device).sum(axis=1)
  start_N = jnp.cumsum(per_dev_N) - per_dev_N  # sorted rows are contiguous per peer
  sent_N = jnp.minimum(per_dev_N, cap)
  dev_A = s.expert_A // per_device  # by sorted row; >= n: "none"
  j_A = jnp.minimum(dev_A, n - 1)
  at_A = jnp.arange(a, dtype=jnp.int32) - start_N[j_A]
  sent_A = (dev_A < n) & (at_A < cap)
  unsent_A = (dev_A < n) & ~sent_A
  if in_blocks:
    i_R = jnp.arange(cap, dtype=jnp.int32)
    slot_sorted = jnp.where(sent_A, j_A * cap + at_A, n * cap)
    return Slots(jnp.minimum(start_N[:, None] + i_R, a - 1).reshape(-1),
                 (i_R < sent_N[:, None]).reshape(-1), slot_sorted[s.rank_A],
                 jnp.arange(n, dtype=jnp.int32) * cap, sent_N, unsent_A)
  slot_sorted = jnp.where(sent_A, jnp.arange(a, dtype=jnp.int32), a)
  return Slots(jnp.arange(a, dtype=jnp.int32), sent_A, slot_sorted[s.rank_A], start_N, sent_N,
               unsent_A)


def tokens(s: md.Sorted, slots: Slots) -> jax.Array:
  """[S]: the token whose row each slot carries."""
  return s.order_A[slots.row_S] // s.k


@jax.custom_vjp
def _gather_rows(x_TD, token_S, real_S, slot_TK):
  return jnp.where(real_S[:, None], x_TD[token_S], zero_from(token_S, x_TD.dtype))


def _gather_rows_fwd(x_TD, token_S, real_S, slot_TK):
  return _gather_rows(x_TD, token_S, real_S, slot_TK), (token_S, real_S, slot_TK)


def _gather_rows_bwd(res, g_SD):
  token_S, real_S, slot_TK = res
  # Each token's rows went to its sent slots: their cotangents summed over K, in fp32.
  sent_TK = slot_TK < g_SD.shape[0]
  g_TKD = jnp.where(sent_TK[..., None], g_SD[jnp.minimum(slot_TK, g_SD.shape[0] - 1)],
                    zero_from(slot_TK, g_SD.dtype))
  dx_TD = jnp.sum(g_TKD.astype(jnp.float32), axis=1).astype(g_SD.dtype)
  return dx_TD, *(np.zeros(r.shape, jax.dtypes.float0) for r in res)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def dispatch(x_TD: jax.Array | Encoded, s: md.Sorted, slots: Slots) -> jax.Array | Encoded:
  """[S, D]: each real slot's token row; its transpose gathers each token's slots back. Rows
  `Encoded` (they came over a wire) come out so, their bytes gathered alike (a relay)."""
  t, token_S = rows_of(x_TD).shape[0], tokens(s, slots)
  rows = lambda x: _gather_rows(x, token_S, slots.real_S, slots.slot_A.reshape(t, s.k))
  if isinstance(x_TD, Encoded):
    return x_TD.take(rows, token_S, slots.real_S)
  return rows(x_TD)


@jax.custom_vjp
def _gated_sum(back_SD, gate_TK, slot_TK, assignment_S, real_S):
  sent_TK = slot_TK < back_SD.shape[0]
  rows_TKD = jnp.where(sent_TK[..., None], back_SD[jnp.minimum(slot_TK, back_SD.shape[0] - 1)],
                       zero_from(slot_TK, back_SD.dtype))
  y_TD = jnp.sum(rows_TKD.astype(jnp.float32) * gate_TK[..., None], axis=1)
  return y_TD.astype(back_SD.dtype)


def _gated_sum_fwd(back_SD, gate_TK, slot_TK, assignment_S, real_S):
  out = _gated_sum(back_SD, gate_TK, slot_TK, assignment_S, real_S)
  return out, (back_SD, gate_TK, slot_TK, assignment_S, real_S)


def _gated_sum_bwd(res, dy_TD):
  back_SD, gate_TK, slot_TK, assignment_S, real_S = res
  t, k = gate_TK.shape
  dy32_TD = dy_TD.astype(jnp.float32)
  # d back[s] = gate(a) · dy[t(a)] for the assignment a in slot s: a gather, not a scatter.
  gate_S = gate_TK.reshape(-1)[assignment_S]
  dback_SD = jnp.where(real_S[:, None], gate_S[:, None] * dy32_TD[assignment_S // k],
                       zero_from(assignment_S, jnp.float32))
  sent_TK = slot_TK < back_SD.shape[0]
  rows_TKD = back_SD[jnp.minimum(slot_TK, back_SD.shape[0] - 1)].astype(jnp.float32)
  # (a product and a sum, as autodiff makes of the forward's: no fp32 dot_general)
  dgate_TK = jnp.where(sent_TK, jnp.sum(rows_TKD * dy32_TD[:, None], axis=-1), 0)
  zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dback_SD.astype(back_SD.dtype), dgate_TK.astype(gate_TK.dtype), zero(slot_TK),
          zero(assignment_S), zero(real_S))


_gated_sum.defvjp(_gated_sum_fwd, _gated_sum_bwd)


def combine(back_SD: jax.Array, s: md.Sorted, slots: Slots, gate_TK: jax.Array) -> jax.Array:
  """[T, D]: Σ_k gate · the row returned to each sent assignment's slot, summed in fp32, in
  `back_SD`'s dtype (rows not sent add nothing)."""
  back_SD = checkpoint_name(back_SD, "moe_out")  # the gates' gradient reads it
  return _gated_sum(back_SD, gate_TK, slots.slot_A.reshape(gate_TK.shape),
                    s.order_A[slots.row_S], slots.real_S)
