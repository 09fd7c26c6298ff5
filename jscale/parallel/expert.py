"""Expert parallelism (playbook: "Expert parallelism"), in both modes.

xla (`XlaExpert`): GShard. Tokens are routed per group (one per batch shard) into a [E, C, D]
slot buffer (dropless: C = T, so nothing overflows); constraining its expert dim onto `expert`
(and the groups off it) is an all-to-all XLA inserts, and the reverse one brings results back.

manual (`ManualExpert`, inside shard_map): tokens go to the devices holding their experts with
`all_to_all` over the expert axis, are computed there, and come back the same way. Autodiff
transposes each all_to_all into the reverse one, so gradients flow back alike.

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

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jscale.model import moe_dispatch as md
from jscale.model.moe_gemm import GroupedDot
from jscale.model.seam import Seam
from jscale.parallel import tensor


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
  # Where each source's rows go; named so `remat: selective` keeps it, not exchanging it again.
  at_N = checkpoint_name(jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True), "moe_counts")
  dest_NR = jnp.where(i_R < recv_sizes[:, None], at_N[:, None] + i_R, output.shape[0])
  return output.at[dest_NR].set(got_NRD.astype(output.dtype), mode="drop")


def dropless_exchange(x_TD, ids_TK, gates_TK, w: md.ExpertWeights, dtype, axis: str,
                      n_ep: int, native_ragged: bool = False, gemm: GroupedDot = GroupedDot()):
  """Dropless experts over `axis`: output [T, D] (nothing is dropped). `native_ragged`: use
  the backend's ragged_all_to_all (GPU), else its padded emulation. `gemm`: the grouped
  matmul of the received rows."""
  e_l = w.gate_EDF.shape[0]
  t, k = ids_TK.shape
  d = x_TD.shape[1]
  s = md.sort_by_expert(ids_TK, e_l * n_ep)
  rows = t * min(k, e_l)  # the most rows one device can be sent by this one
  # Sorted rows are contiguous per destination device: block j starts at start_N[j].
  per_dev_N = s.sizes_E.reshape(n_ep, e_l).sum(axis=1)
  start_N = jnp.cumsum(per_dev_N) - per_dev_N
  sizes_NE = checkpoint_name(  # kept by `remat: selective`: the backward exchanges no counts
      jax.lax.all_to_all(s.sizes_E.reshape(n_ep, e_l), axis, 0, 0, tiled=True), "moe_counts")
  recv_N = sizes_NE.sum(axis=1)
  # Both directions land in a padded [n_ep * rows, D] layout: source (or expert device) j's
  # rows at j * rows, so the receiver never needs the senders' offsets.
  mine_N = jnp.full((n_ep,), jax.lax.axis_index(axis) * rows, jnp.int32)
  block_N = jnp.arange(n_ep, dtype=jnp.int32) * rows
  exchange = lambda x, in_off, send, recv: ragged_all_to_all(
      x, jnp.zeros((n_ep * rows, d), x.dtype), in_off, send, mine_N, recv, axis, rows,
      native_ragged)
  recv_RD = exchange(md.dispatch_sorted(x_TD.astype(dtype), s), start_N, per_dev_N, recv_N)
  # Each source's block is sorted by local expert; padding rows get expert e_l (last).
  i_R = jnp.arange(rows)
  local_NR = jax.vmap(lambda c: jnp.searchsorted(c, i_R, side="right"))(jnp.cumsum(sizes_NE, 1))
  order = jnp.argsort(local_NR.reshape(-1), stable=True).astype(jnp.int32)
  inverse = md.inverse_permutation(order)
  out = md.ragged_ffn(md.permute(recv_RD, order, inverse), sizes_NE.sum(0), w, dtype, gemm)
  out_RD = md.permute(out, inverse, order)
  back_NRD = exchange(out_RD, block_N, recv_N, per_dev_N).reshape(n_ep, rows, d)
  # Sorted assignment r went to device j = expert // e_l as row r - start_N[j].
  dev_A = s.expert_A // e_l
  out_AD = back_NRD[dev_A, jnp.arange(t * k) - start_N[dev_A]]
  return md.combine_sorted(out_AD, s, gates_TK)


class XlaExpert:
  """GShard dispatch under sharding constraints (mixed into `XlaComms`: uses `layouts`,
  `manual_axes`, `_over_manual_batch`)."""

  def token_sum(self, x: jax.Array) -> jax.Array:
    # Router statistics: global under GSPMD; in a region manual over batch axes (the gradient
    # loop, a pipeline stage) each shard adds the others' tokens explicitly. As in manual mode,
    # the backward passes the gradient through: a plain psum's (in these regions, which run
    # with check_vma=False) sums the shards' equal cotangents, multiplying every router
    # loss's gradient by the shard count (seen as DP x accumulation not matching one device).
    return self._over_manual_batch(tensor.reduce_from_tp, x)

  def expert_groups(self, batch: int) -> int:
    size = self.layouts.mesh.shape  # inside a region manual over batch axes: its shards' groups
    return math.prod(size[a] for a in self.layouts.rules["batch"] if a not in self.manual_axes)

  def experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm=GroupedDot()):
    size = self.layouts.mesh.shape
    if moe.dispatch == "dropless" and size["expert"] == 1 and size["tensor"] == 1:
      # Experts not split: each device runs its own token groups' sorted grouped matmul (a
      # shard_map over the batch, as the Pallas kernels run; weights whole), not the slot
      # buffer below, whose dropless C = T costs E / K times the products.
      per_device = lambda x, ids, gates, *ws: Seam.experts(
          self, x, ids, gates, md.ExpertWeights(*ws), moe, dtype, gemm)[0]
      rows, weight = ("batch", None, "embed"), (None, None, None)
      y_GTD = self.kernel(per_device, (x_GTD, ids_GTK, gates_GTK, *w),
                          (rows, ("batch", None, None), ("batch", None, None), *(weight,) * 3),
                          rows)
      return y_GTD, jnp.zeros((), jnp.int32)
    # GShard: a per-group [E, C, D] slot buffer (dropless: C = T, so nothing overflows); the
    # constraint moving its expert dim onto `expert` (and groups off it) is an all-to-all.
    rules = self.layouts.rules
    e, (t, k) = w.gate_EDF.shape[0], ids_GTK.shape[1:]
    cap = t if moe.dispatch == "dropless" else md.capacity(t, k, e, moe.capacity_factor)
    by_group = P(_axes(rules["batch"]), None, None, None)
    by_expert = P(_axes([a for a in rules["batch"] if a not in rules["experts"]]),
                  _axes(rules["experts"]), None, None)
    pin = lambda x, s: jax.lax.with_sharding_constraint(x, self._sharding(s))
    pos_GTK = jax.vmap(md.slots, in_axes=(0, None))(ids_GTK, e)
    buf = jax.vmap(md.dispatch, in_axes=(0, 0, 0, None, None))(x_GTD.astype(dtype), ids_GTK,
                                                               pos_GTK, e, cap)
    buf = pin(pin(buf, by_group), by_expert)
    y = pin(jax.vmap(md.dense_ffn, in_axes=(0, None, None))(buf, w, dtype), by_expert)
    y_GTD = jax.vmap(md.combine)(pin(y, by_group), ids_GTK, pos_GTK, gates_GTK)
    return y_GTD, jnp.sum(pos_GTK >= cap)


def _axes(axes) -> str | tuple[str, ...] | None:
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


class ManualExpert:
  """All-to-all dispatch by hand (mixed into `ManualComms`: uses `mesh`, `tp`,
  `batch_axes`)."""

  def token_sum(self, x: jax.Array) -> jax.Array:
    return tensor.reduce_from_tp(x, self.batch_axes) if self.batch_axes else x

  def router_input(self, h_GTD: jax.Array) -> jax.Array:
    return tensor.scale_grad(h_GTD, 1.0 / self.tp) if self.tp > 1 else h_GTD

  def expert_gates(self, gates_GTK: jax.Array) -> jax.Array:
    return tensor.copy_to_tp(gates_GTK, "tensor") if self.tp > 1 else gates_GTK

  def experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm=GroupedDot()):
    n_ep = self.mesh.shape["expert"]
    if n_ep == 1:
      return super().experts(x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm)
    if moe.dispatch == "dropless":
      gpu = self.mesh.devices.flat[0].platform == "gpu"  # native ragged_all_to_all there
      y_TD = dropless_exchange(x_GTD[0], ids_GTK[0], gates_GTK[0], w, dtype, "expert", n_ep,
                               native_ragged=gpu, gemm=gemm)
      return y_TD[None], jnp.zeros((), jnp.int32)
    y_TD, dropped = capacity_exchange(x_GTD[0], ids_GTK[0], gates_GTK[0], w, dtype,
                                      moe.capacity_factor, "expert", n_ep)
    return y_TD[None], dropped
