"""Micro-batches inside each layer (`train.accumulate: layer`): every layer runs all of a step's
micro-batches in turn before the next layer starts, instead of every micro-batch running the
whole model in turn (`jscale.step.accumulate`).

Why: with the weights stored as ZeRO-3 shards, micro-batch accumulation gathers each layer
once per micro-batch and pass (forward, and the backward's recomputation) and reduce-scatters
its gradient once per micro-batch. Here a layer is gathered once per pass and its gradient,
summed over the micro-batches in fp32, is reduced once per step: for m micro-batches m times
fewer weight collectives, the same activations in flight (a layer's backward still runs one
micro-batch at a time, rematerialised by `train.remat`'s policy). What it costs: the layer
inputs of all micro-batches are kept, as one large micro-batch keeps them.

For a layer `f` with weights `w` (gathered: `W = gather(w)`) and micro-batches x_1..x_m:

    forward:   W = gather(w);  y_j = f(W, x_j)  for j = 1..m
    backward:  W = gather(w);  dW = sum_j vjp_W f(W, x_j)(dy_j)  (fp32);  dw = scatter(dW)

The layer function is checkpointed twice. The outer checkpoint (around the gather and the
loop) saves only the layer's input: its backward gathers again and runs the micro-batch loop's
forward for what each call keeps. Each micro-batch's call is checkpointed by `train.remat`'s
policy: under `full` it keeps its input alone, so JAX drops the outer recomputation's loop
(nothing of it is needed) and each micro-batch's backward reruns its forward once, as plain
rematerialisation does; under `selective` the outer recomputation keeps the matmul outputs of
one layer's micro-batches for their backward. (An outer policy that saves more does not nest:
it keeps every micro-batch's intermediates, whatever the inner policy says.)

Micro-batch j takes rows j, j+m, ... of the batch (`split`): with the batch split over devices
in blocks, every device keeps its own rows, as `accumulate.split_microbatches` does.

Reduced each trip (`parallel.scatter_each_trip`): the loop's r trips (r = m / side by side)

    backward:  W = gather(w);  dw = sum_i scatter(dW_i),  dW_i = sum_(j in trip i) vjp_W f(W, x_j)

the gathered W carries no gradient; each trip's use of it sends its cotangent through the
gather's transpose (a reduce-scatter: r times the bytes) inside the trip, where XLA:GPU can run
it beside the rest of the trip's backward, and the shards sum over the trips in their own fp32.
After the loop, XLA:GPU's scheduler waits for the one large reduce-scatter whole: it keeps no
collective in flight across a loop that holds collectives (its one collective stream; letting
more be in flight, `xla_gpu_experimental_parallel_collective_overlap_limit`, only queues them
on that stream: DeepSeek-V3 671B on 1,024 H100s 30.81 -> 32.91 s, predicted).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jscale.config import Config, ModelConfig
from jscale.model import phases
from jscale.model import remat as remat_lib
from jscale.model.seam import GATHERED


class Turns(NamedTuple):
  """How a layer takes the batch: in `n` micro-batches (1: whole), `side_by_side` of them in
  each step of its loop (`parallel.overlap_microbatches`): independent work XLA can overlap,
  one micro-batch's collectives (the expert exchange) under another's compute, as DeepSeek-V3's
  dual micro-batch overlap does, for their activations in flight at once. `skewed`: each one
  phase behind the one before, barriers between phases (`jscale.model.phases`,
  `parallel.overlap_skew`), not left to XLA's scheduler."""
  n: int = 1
  side_by_side: int = 1
  skewed: bool = False
  scatter_each_trip: bool = False  # `parallel.scatter_each_trip` (`each_trip`)
  prefetch: bool = False  # `parallel.prefetch_layers` (`jscale.model.layer_prefetch`)

  @classmethod
  def of(cls, cfg: Config) -> "Turns":
    return cls(cfg.train.layer_microbatches, cfg.parallel.overlap_microbatches,
               cfg.parallel.overlap_skew, cfg.parallel.scatters_each_trip,
               cfg.parallel.prefetches_layers)

  @property
  def trips(self) -> int:
    """The loop's trips: the micro-batches, k at a time where skewed (else XLA unrolls it)."""
    return self.n // (self.side_by_side if self.skewed else 1)

  @property
  def unroll(self) -> int:
    return 1 if self.skewed else self.side_by_side


WHOLE = Turns()


def split(tree: Any, m: int) -> Any:
  """Every [B, ...] leaf as [m, B/m, ...]: micro-batch j holds rows j, j+m, ..."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1),
                      tree)


def merge(tree: Any) -> Any:
  """`split`'s inverse: [m, B/m, ...] -> [B, ...]."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def _accumulating(weights: Any) -> tuple[Any, Callable[[Any], Any]]:
  """(weights in fp32, back to their dtype): the micro-batch loop closes over the fp32 ones, so
  their gradient sums over the micro-batches in fp32 (JAX sums a loop constant's cotangent in
  its dtype). Named `GATHERED`: no policy keeps this copy of a layer for the backward."""
  def up(w):
    if not jnp.issubdtype(w.dtype, jnp.floating) or w.dtype == jnp.float32:
      return w
    return checkpoint_name(w.astype(jnp.float32), GATHERED)

  dtypes = jax.tree.map(lambda w: w.dtype, weights)
  return (jax.tree.map(up, weights),
          lambda w32: jax.tree.map(lambda w, dt: w.astype(dt), w32, dtypes))


def each_trip(gather: Callable[[Any], Any], stored: Any) -> tuple[Any, Callable[[Any], Any]]:
  """(W, use): W = `gather(stored)` carrying no gradient, and `use(W)` inside a loop trip: W,
  whose cotangent there goes through `gather`'s transpose onto `stored` (the trip's
  reduce-scatter; `gather` must be linear: manual mode's collectives and casts)."""
  whole = jax.lax.stop_gradient(gather(stored))

  @jax.custom_vjp
  def use(stored, w):
    return w

  use.defvjp(lambda stored, w: (w, stored), lambda stored, g: (scatter(gather, stored, g), None))
  return whole, lambda w: use(stored, w)


def scatter(gather: Callable[[Any], Any], stored: Any, g: Any) -> Any:
  """`g` (a cotangent of `gather(stored)`) through `gather`'s transpose onto `stored`: the
  reduce-scatter (`gather` linear: manual mode's collectives and casts)."""
  # Transposed as linearised: `gather`'s names (`checkpoint_name`) have no transpose rule, its
  # tangent carries none; the primal gather traced here is unused (XLA removes it).
  _, linear = jax.linearize(gather, stored)
  return jax.linear_transpose(linear, stored)(g)[0]


def trips(tree: Any, turns: Turns) -> Any:
  """Every [B, ...] leaf as the loop's [trips, k, B/n, ...] (`split`, k at a time)."""
  return jax.tree.map(lambda a: a.reshape(turns.trips, -1, *a.shape[1:]), split(tree, turns.n))


def over_microbatches(fn: Callable, weights: Any, batch: Any, turns: Turns, remat: str,
                      cfg: ModelConfig, gather: Callable[[Any], Any] = lambda w: w
                      ) -> tuple[jax.Array, dict]:
  """`fn(gather(weights), batch_part) -> phases of (y_bLD, stats)` (`jscale.model.phases`)
  over the `turns.n` micro-batches of `batch` (a pytree of [B, ...] arrays),
  `turns.side_by_side` at a time: (y [B, ...], the stats averaged over micro-batches, which
  hold equally many rows). `gather`: ZeRO-3's (`Seam.gather_layer`), its gradient reduced after
  the loop or in each trip (`turns.scatter_each_trip`). Each step of the loop is checkpointed by
  `remat`'s policy. With one micro-batch: `fn` on the whole batch (`outer` checkpoints it)."""
  if turns.n == 1:
    return phases.run(fn(gather(weights), batch))
  if turns.scatter_each_trip:
    whole, use = each_trip(gather, weights)
  else:  # the loop closes over fp32 weights: their cotangent sums over the trips in fp32
    whole, use = _accumulating(gather(weights))
  # (Under full_offload the layer's input is what went to the host: each call keeps its part.)
  each = "full" if remat == "full_offload" else remat
  # `use` inside the checkpoint: what it keeps is the loop's constant, not a copy per trip.
  one = remat_lib.checkpointed(lambda w, parts: side_by_side(fn, use(w), parts), each, cfg)
  _, (ys, stats) = jax.lax.scan(lambda _, parts: (None, one(whole, parts)), None,
                                trips(batch, turns), unroll=turns.unroll)
  ys, stats = jax.tree.map(lambda a: a.reshape(turns.n, *a.shape[2:]), (ys, stats))
  return merge(ys), jax.tree.map(lambda s: jnp.mean(s, axis=0), stats)


def side_by_side(fn: Callable, weights: Any, parts: Any,
                 extra: Callable[[], Any] | None = None) -> Any:
  """`fn`'s results on the k micro-batches of `parts` ([k, ...] leaves), stacked: one alone
  runs its phases through; more run skewed (`phases.skewed`). With `extra`: (those, `extra()`
  run beside the first micro-batch's first phase, `phases.alongside`)."""
  k = jax.tree.leaves(parts)[0].shape[0]
  each = [fn(weights, jax.tree.map(lambda a: a[i], parts)) for i in range(k)]
  if extra is not None:
    each[0] = phases.alongside(each[0], extra)
  outs = [phases.run(each[0])] if k == 1 else phases.skewed(each)
  if extra is not None:
    outs[0], got = outs[0]
  stacked = jax.tree.map(lambda *o: jnp.stack(o), *outs)
  return stacked if extra is None else (stacked, got)


def outer(layer: Callable, remat: str, m: int, cfg: ModelConfig) -> Callable:
  """The layer function's own checkpoint: `remat`'s policy with one micro-batch; with `m` > 1
  only the layer's input is kept, in host memory under full_offload (the micro-batches' calls
  are checkpointed inside, `over_microbatches`)."""
  return remat_lib.checkpointed(layer, remat if m == 1 or remat == "full_offload" else "full",
                                cfg)
