"""Expert parallelism (playbook: "Expert parallelism"), in both modes.

xla (`XlaExpert`): GShard. Tokens are routed per group (one per batch shard) into a [E, C, D]
slot buffer (dropless: C = T, so nothing overflows); constraining its expert dim onto `expert`
(and the groups off it) is an all-to-all XLA inserts, and the reverse one brings results back.

manual (`ManualExpert`, inside shard_map): tokens go to the devices holding their experts by
all-to-all and come back the same way (`jscale.parallel.expert_exchange`): a capacity slot
buffer, a flat dropless ragged exchange, or (`moe.exchange: node_limited`) DeepSeek-V3's two
hops, across nodes once per chosen group of experts and then inside the node.

Shape suffixes: T local tokens, K experts per token, A = T·K, E experts, D model, C slots.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jscale.fp8 import wire as wire_lib
from jscale.model import moe_dispatch as md
from jscale.model import phases
from jscale.model.moe_gemm import GroupedDot
from jscale.model.seam import Seam
from jscale.parallel import expert_exchange as ex
from jscale.parallel import tensor
from jscale.sharding import Layouts


class XlaExpert:
  """GShard dispatch under sharding constraints (mixed into `XlaComms`: uses `layouts`,
  `manual_axes`, `_over_manual_batch`)."""
  # Provided by the composition (`jscale.parallel.xla.XlaComms`):
  layouts: Layouts
  manual_axes: frozenset[str]
  kernel: Callable[..., Any]
  _sharding: Callable[[P], Any]
  _over_manual_batch: Callable[..., jax.Array]


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
      rows, whole = ("batch", None, "embed"), tuple((None,) * x.ndim for x in w)
      y_GTD = self.kernel(per_device, (x_GTD, ids_GTK, gates_GTK, *w),
                          (rows, ("batch", None, None), ("batch", None, None), *whole), rows)
      return y_GTD, jnp.zeros((), jnp.int32)
    # GShard: a per-group [E, C, D] slot buffer (dropless: C = T, so nothing overflows); the
    # constraint moving its expert dim onto `expert` (and groups off it) is an all-to-all.
    rules = self.layouts.rules
    e, (t, k) = w.n_experts, ids_GTK.shape[1:]
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
  # Provided by the composition (`jscale.parallel.manual.ManualComms`):
  mesh: Mesh
  tp: int
  batch_axes: tuple[str, ...]
  expert_chunks: int  # parallel.expert_chunks: the dropless exchange on this many token slices


  def token_sum(self, x: jax.Array) -> jax.Array:
    return tensor.reduce_from_tp(x, self.batch_axes) if self.batch_axes else x

  def router_input(self, h_GTD: jax.Array) -> jax.Array:
    return tensor.scale_grad(h_GTD, 1.0 / self.tp) if self.tp > 1 else h_GTD

  def expert_gates(self, gates_GTK: jax.Array) -> jax.Array:
    return tensor.copy_to_tp(gates_GTK, "tensor") if self.tp > 1 else gates_GTK

  def experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm=GroupedDot()):
    n_ep = self.mesh.shape["expert"]
    if n_ep == 1:
      return Seam.experts(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm)
    x_TD, ids_TK, gates_TK = x_GTD[0], ids_GTK[0], gates_GTK[0]
    if moe.dispatch == "dropless":
      exchange = self._dropless(w, moe, dtype, gemm)
      y_TD, dropped = ex.in_chunks(lambda *a: phases.run(exchange(*a)), self.expert_chunks,
                                   x_TD, ids_TK, gates_TK)
      return y_TD[None], dropped
    y_TD, dropped = ex.capacity_exchange(x_TD, ids_TK, gates_TK, w, dtype,
                                         moe.capacity_factor, "expert", n_ep)
    return y_TD[None], dropped

  def expert_phases(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype, gemm=GroupedDot()):
    """The dropless exchange in one slice as phases: boundaries before its dispatch, where
    the rows have arrived, where the experts' output leaves, and after its combine
    (`jscale.model.phases`); otherwise `experts` in one."""
    if self.mesh.shape["expert"] == 1 or moe.dispatch != "dropless" or self.expert_chunks > 1:
      return (yield from Seam.expert_phases(self, x_GTD, ids_GTK, gates_GTK, w, moe, dtype,
                                            gemm))
    x_TD, ids_TK, gates_TK = yield (x_GTD[0], ids_GTK[0], gates_GTK[0])
    y_TD, dropped = yield from self._dropless(w, moe, dtype, gemm)(x_TD, ids_TK, gates_TK)
    y_TD = yield y_TD
    return y_TD[None], dropped

  def _dropless(self, w, moe, dtype, gemm) -> Callable[..., phases.Phases]:
    """(x_TD, ids_TK, gates_TK) -> the dropless exchange's phases over `expert`: flat, or
    node-limited (`moe.exchange`)."""
    n_ep = self.mesh.shape["expert"]
    gpu = self.mesh.devices.flat[0].platform == "gpu"  # native ragged_all_to_all there
    e4m3 = lambda key: wire_lib.e4m3_rows(dtype) if key == "e4m3" else None
    wires = wire_lib.Wires(e4m3(moe.dispatch_dtype), e4m3(moe.dispatch_grad_dtype),
                           e4m3(moe.combine_dtype), e4m3(moe.combine_grad_dtype))
    if moe.exchange == "node_limited":
      return lambda x, i, g: ex.node_limited_phases(
          x, i, g, w, dtype, "expert", n_ep, moe.n_group, moe.topk_group, gpu, gemm,
          moe.receive_factor, wires)
    return lambda x, i, g: ex.dropless_phases(x, i, g, w, dtype, ex.Peers.whole("expert", n_ep),
                                              gpu, gemm, moe.receive_factor, wires=wires)
