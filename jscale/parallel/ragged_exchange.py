"""One ragged all-to-all of an expert exchange among a group of peers, differentiable, its rows
through an FP8 wire where asked (`jscale.fp8.wire`).

`ragged_all_to_all` is GPU's `jax.lax.ragged_all_to_all` (only the real rows move) or the
same semantics as padded blocks through `all_to_all` elsewhere (XLA:CPU has none), with one
transpose written here for both (JAX's, 0.10, exchanges the offsets over the whole axis,
ignoring `axis_index_groups`), so CPU tests check the program GPU runs. Through a wire the
rows arrive `Encoded` (decoded, beside their bytes), and `Encoded` rows to send go as the bytes
they came as: the node-limited exchange's relay (`jscale.parallel.expert_exchange`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jscale.fp8.wire import Encoded, Wire, rows_of
from jscale.model.zeros import zero_from


class Peers(NamedTuple):
  """The devices of `axis` (n in all) one exchange runs among: groups of `size` devices,
  `stride` apart on the axis (size n: the whole axis)."""
  axis: str
  n: int
  size: int
  stride: int = 1

  @classmethod
  def whole(cls, axis: str, n: int) -> "Peers":
    return cls(axis, n, n)

  @classmethod
  def within_nodes(cls, axis: str, n: int, per_node: int) -> "Peers":
    """Each node's `per_node` consecutive devices."""
    return cls(axis, n, per_node)

  @classmethod
  def across_nodes(cls, axis: str, n: int, per_node: int) -> "Peers":
    """The devices at the same place p of every node: {p, p + per_node, ...}."""
    return cls(axis, n, n // per_node, per_node)

  def groups(self) -> list[list[int]] | None:
    """`axis_index_groups` of the collectives (None: the whole axis)."""
    if self.size == self.n:
      return None
    firsts = [i for i in range(self.n) if (i // self.stride) % self.size == 0]
    return [[i + j * self.stride for j in range(self.size)] for i in firsts]

  def index(self) -> jax.Array:
    """This device's place in its group."""
    return (jax.lax.axis_index(self.axis) // self.stride) % self.size

  def all_to_all(self, x: jax.Array) -> jax.Array:
    """Tiled all_to_all over dim 0 among the group."""
    return jax.lax.all_to_all(x, self.axis, 0, 0, tiled=True, axis_index_groups=self.groups())


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      peers: Peers, rows: int, native: bool, wire: Wire | None = None,
                      grad_wire: Wire | None = None):
  """`jax.lax.ragged_all_to_all` among `peers` (native: GPU, which moves only the real rows) or
  the same semantics on any backend (`padded_all_to_all`, `rows` per peer); differentiable
  by one transpose for both (`_transposed`), so CPU tests check the one GPU runs. `wire`: the
  rows (and `output`) travel encoded (`jscale.fp8.wire`, the FP8 dispatch) and arrive as
  `Encoded` rows; an `Encoded` operand goes as the bytes it came as (a relay); `grad_wire`:
  the transpose's rows do (None: the gradient goes back in `operand`'s dtype, passing straight
  through the forward's rounding)."""
  if native:
    groups = peers.groups()
    bind = lambda *args: jax.lax.ragged_all_to_all(*args, axis_name=peers.axis,
                                                   axis_index_groups=groups)
  else:
    bind = lambda *args: padded_all_to_all(*args, peers=peers, rows=rows)
  x = rows_of(operand)
  exchange = _transposed(bind, peers, x.shape, x.dtype, wire, grad_wire)
  offsets = (input_offsets, send_sizes, output_offsets, recv_sizes)
  if wire is None:
    return exchange(x, output, *offsets)
  sent = operand.bytes if isinstance(operand, Encoded) else wire.encode(x)
  return exchange(x, output, *offsets, sent)


def padded_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, peers: Peers, rows: int):
  """ragged_all_to_all's semantics as `rows`-padded blocks through a tiled all_to_all,
  written at the senders' output offsets (XLA:CPU has no ragged-all-to-all)."""
  i_R = jnp.arange(rows)
  src_NR = jnp.minimum(input_offsets[:, None] + i_R, operand.shape[0] - 1)
  valid_NR = (i_R < send_sizes[:, None]).reshape(send_sizes.shape + (rows,) + (1,) * (
      operand.ndim - 1))
  got_NR = peers.all_to_all(jnp.where(valid_NR, operand[src_NR],
                                      zero_from(src_NR, operand.dtype)))
  # Where each source's rows go; named so `remat: selective` keeps it, not exchanging it again.
  at_N = checkpoint_name(peers.all_to_all(output_offsets), "moe_counts")
  dest_NR = jnp.where(i_R < recv_sizes[:, None], at_N[:, None] + i_R, output.shape[0])
  return output.at[dest_NR].set(got_NR.astype(output.dtype), mode="drop")


def landing_zeros(shape, dtype, sizes_N: jax.Array) -> jax.Array:
  """A zero output buffer for a ragged all-to-all, made from the exchange's own send or receive
  sizes (never negative, so min(sizes[0], 0) is 0) rather than as a constant. XLA:GPU fuses
  the constant zero broadcasts of every exchange in the step into one multi-output kernel at
  its start (horizontal fusion), so every layer's receive buffers were allocated from there
  to their use: on DeepSeek-V3 at 1,024 H100s, 10 buffers of 2.2 GiB. Made from the sizes, a
  buffer is made when its exchange's sizes are known."""
  return jnp.broadcast_to(zero_from(sizes_N, dtype), shape)


def _encoded(bind: Callable, wire: Wire | None) -> Callable:
  """`bind` sending its rows and landing buffer through `wire` (None: as they are)."""
  if wire is None:
    return bind
  return lambda x, out, *offsets: wire.decode(bind(wire.encode(x), wire.encode(out), *offsets))


def _transposed(bind: Callable, peers: Peers, shape, dtype, wire: Wire | None,
                grad_wire: Wire | None = None) -> Callable:
  """`bind` (a ragged all-to-all among `peers`) with its transpose written here: JAX's (0.10)
  exchanges the offsets over the whole axis, ignoring `axis_index_groups`. The forward sends
  its rows through `wire` — given as the bytes to send after the offsets, arriving as
  `Encoded` rows —, the transpose through `grad_wire` (None: as they are)."""
  backward = _encoded(bind, grad_wire)

  def forward(operand, output, *offsets_and_sent):
    if wire is None:
      return bind(operand, output, *offsets_and_sent)
    *offsets, sent = offsets_and_sent  # the operand's bytes: its values are not read here
    got = bind(sent, wire.encode(output), *offsets)
    return Encoded(wire.decode(got), got)

  @jax.custom_vjp
  def exchange(operand, output, *offsets_and_sent):
    return forward(operand, output, *offsets_and_sent)

  def fwd(operand, output, *offsets_and_sent):
    return forward(operand, output, *offsets_and_sent), offsets_and_sent

  def bwd(res, g):
    input_offsets, send_sizes, output_offsets, recv_sizes = res[:4]
    g = rows_of(g)
    # Each peer sends back the rows it was sent: from where they landed in its output (the
    # senders' output offsets) to where they came from (the senders' input offsets).
    landed_N = peers.all_to_all(output_offsets)
    operand_g = backward(g, landing_zeros(shape, g.dtype, send_sizes), landed_N, recv_sizes,
                         peers.all_to_all(input_offsets), send_sizes).astype(dtype)
    edges = jnp.zeros(g.shape[0] + 1, jnp.int32).at[landed_N].add(1).at[
        landed_N + recv_sizes].add(-1)
    received = (jnp.cumsum(edges)[:-1] > 0).reshape((-1,) + (1,) * (g.ndim - 1))
    no_grad = lambda x: np.zeros(x.shape, jax.dtypes.float0)
    return (operand_g, jnp.where(received, zero_from(recv_sizes, g.dtype), g),
            *map(no_grad, res))

  exchange.defvjp(fwd, bwd)
  return exchange
