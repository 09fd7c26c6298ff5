"""The layer scan's backward by hand, each layer's weights gathered inside the micro-batch loop
of the layer after it (`parallel.prefetch_layers`, with `parallel.scatter_each_trip`), and
where the micro-batches run skewed, the forward's inside the loop of the layer before it.

Why: under manual ZeRO-3 with the micro-batches inside each layer (`layer_microbatches`), the
backward gathers layer i's weights before its micro-batch loop and XLA:GPU waits for that
gather whole: it keeps no collective in flight across a loop that holds collectives, and the
loop before it is layer i+1's (DeepSeek-V3 671B on 1,024 H100s: 780 MiB a layer, ~26 ms,
~1.4 s a step, predicted). JAX's transposed scan gives no place to start it earlier. So the
layer is one custom VJP, and both passes are written here:

    forward, layer i:       W_i = what layer i-1's forward gathered
                            for each trip t:  y_i,t = f(W_i, x_i,t),
                                chunk t of gather(w_(i+1)) beside its first phase
                            hand the gathered W_(i+1) on
    backward, layer i:      W_i = what layer i+1's backward gathered
                            for each trip t (reversed):  recompute and vjp of trip t at W_i,
                                dw_i += scatter(dW_i,t)   (`layer_microbatches.scatter`)
                                chunk t of gather(w_(i-1))  (`seam.LayerChunks`)
                            hand the gathered W_(i-1) on

The gathered layer travels as a carry `c` of the layer scan (its chunks): forward from
iteration i to i+1, and back from i to i-1 as the carry's cotangent (the scan's transpose
carries any carry's cotangent so). The forward's chunk goes beside the first micro-batch's
first phase (`phases.alongside`: its attention, with no exchange in flight); where the
micro-batches do not run skewed nothing places it (left to XLA:GPU's scheduler, a chunk
queued before the exchange's all-to-alls on its one collective stream made the 671B slower,
27.97 s against 27.49, predicted), and the forward gathers each layer before its loop, `c`
passing through as zeros. The forward's pieces are `chunks.forward`'s (the routed experts'
weights as e4m3 columns where their FP8 products quantise them so: fewer bytes, the same
values for those products). Layer 0's chunks are gathered before the scan and the top
layer's after it for the backward (`_seeded`), each once a step and exposed; the top layer
and layer 0 fetch themselves once more, unused. What it costs: one more gathered layer in
memory (the one in flight; the layer's checkpoint does not keep `c`, which neither pass's
recompute reads), and a trip's recompute keeps what JAX's vjp keeps (the remat policy's
per-trip checkpoint is the trip itself here).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jscale.config import ModelConfig
from jscale.model import layer_microbatches as lm
from jscale.model import remat as remat_lib
from jscale.model.seam import LayerChunks


def _no_grad(tree: Any) -> Any:
  """Zero cotangents for `tree` (float0 for its integer leaves)."""
  return jax.tree.map(lambda a: jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.inexact)
                      else np.zeros(a.shape, jax.dtypes.float0), tree)


def _backward(trip_fn: Callable, w: Any, batch: Any, turns: lm.Turns, gather: Callable,
              stored: Any, prev: Any, chunks: LayerChunks, cts: tuple) -> tuple[Any, Any, Any]:
  """Layer i's backward on its gathered weights `w` (module docstring), `batch` its input in
  trips ([r, k, ...] leaves, `lm.trips`): (dw on `stored`, in its dtype; dx; the [r, N, c]
  chunks of `prev`'s gather)."""
  ct_y, ct_stats = cts

  def trip(carry, inputs):
    dw, got = carry
    t, (x_k, pos_k), ct_k = inputs
    (_, stats), vjp = jax.vjp(lambda w, x: trip_fn(w, (x, pos_k)), w, x_k)
    # The stats are the mean over the n micro-batches: each one's share of the cotangent.
    ct_s = jax.tree.map(lambda s, c: jnp.broadcast_to(c / turns.n, s.shape).astype(s.dtype),
                        stats, ct_stats)
    dw_t, dx_k = vjp((ct_k, ct_s))
    dw = jax.tree.map(jnp.add, dw, lm.scatter(gather, stored, dw_t))
    return (dw, chunks.fetch(got, prev, t)), dx_k

  init = (jax.tree.map(jnp.zeros_like, stored), chunks.empty(prev))
  (dw, got), dx = jax.lax.scan(trip, init, (jnp.arange(turns.trips), batch,
                                            lm.trips(ct_y, turns)),
                               reverse=True, unroll=turns.unroll)
  return dw, lm.merge(dx.reshape(turns.n, *dx.shape[2:])), got


def _forward(trip_fn: Callable, w: Any, batch: Any, turns: lm.Turns) -> tuple[Any, Any]:
  """The layer's forward on its gathered weights, as `lm.over_microbatches` runs it: (y, the
  stats averaged over the micro-batches)."""
  _, (ys, stats) = jax.lax.scan(lambda _, part: (None, trip_fn(w, part)), None, batch,
                                unroll=turns.unroll)
  return _merged(ys, stats, turns)


def _forward_fetching(fetch_fn: Callable, w: Any, batch: Any, turns: lm.Turns, nxt: Any,
                      chunks: LayerChunks) -> tuple[jax.Array, Any, Any]:
  """`_forward`, with chunk t of the next layer's gather (`nxt`: its stored shards) fetched
  beside trip t's first phase (`fetch_fn(w, part, nxt, got, t) -> (out, got)`): (the
  chunks, y, stats)."""
  def trip(got, inputs):
    t, part = inputs
    out, got = fetch_fn(w, part, nxt, got, t)
    return got, out

  got, (ys, stats) = jax.lax.scan(trip, chunks.empty(nxt), (jnp.arange(turns.trips), batch),
                                  unroll=turns.unroll)
  return (got, *_merged(ys, stats, turns))


def _merged(ys: Any, stats: Any, turns: lm.Turns) -> tuple[Any, Any]:
  ys, stats = jax.tree.map(lambda a: a.reshape(turns.n, *a.shape[2:]), (ys, stats))
  return lm.merge(ys), jax.tree.map(lambda s: jnp.mean(s, axis=0), stats)


def _at(stack: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stack)


def _layer_op(trip_fn: Callable, fetch_fn: Callable | None, turns: lm.Turns, gather: Callable,
              chunks: LayerChunks) -> Callable:
  """(c, x, positions, stored_i, stack, i, consts) -> (c, y, stats): layer i on its stored
  shards. `c` holds gathered chunks (`LayerChunks`): in the forward, with `fetch_fn`, layer
  i's own, fetched by layer i-1 (it leaves with layer i+1's), else zeros passed through; in
  the backward, as its cotangent, layer i's from layer i+1's backward, leaving with layer
  i-1's. `stack`: every layer's stored shards (no gradient: the neighbours are read from it);
  `trip_fn(w, part, *consts[0])` one trip's k micro-batches, `fetch_fn(w, part, nxt, got, t,
  *consts[1])` that with chunk t of `nxt` fetched beside it (closure-converted: a custom VJP
  closes over no tracer). The consts get no gradient: `run_layers`' block closes over none
  that needs one (the rotary frequencies, the FP8 dot state)."""
  depth = lambda stack: jax.tree.leaves(stack)[0].shape[0]

  @jax.custom_vjp
  def op(c, x, positions, stored, stack, i, consts):
    batch, fetch = lm.trips((x, positions), turns), fetch_fn
    if fetch is None:
      return (c, *_forward(lambda w, part: trip_fn(w, part, *consts[0]), gather(stored),
                           batch, turns))
    nxt = _at(stack, jnp.minimum(i + 1, depth(stack) - 1))  # the top fetches itself, unused
    return _forward_fetching(
        lambda w, part, nxt, got, t: fetch(w, part, nxt, got, t, *consts[1]),
        chunks.forward.assemble(c, stored), batch, turns, nxt, chunks)

  def fwd(c, x, positions, stored, stack, i, consts):
    out = op(c, x, positions, stored, stack, i, consts)
    return out, (x, positions, stored, stack, i, consts)

  def bwd(res, cts):
    x, positions, stored, stack, i, consts = res
    got, ct_y, ct_stats = cts
    prev = _at(stack, jnp.maximum(i - 1, 0))  # layer 0 fetches itself, unused
    dw, dx, got = _backward(lambda w, part: trip_fn(w, part, *consts[0]),
                            chunks.assemble(got, stored), lm.trips((x, positions), turns),
                            turns, gather, stored, prev, chunks, (ct_y, ct_stats))
    return (got, dx, _no_grad(positions), dw, _no_grad(stack), _no_grad(i), _no_grad(consts))

  op.defvjp(fwd, bwd)
  return op


def _seeded(chunks: LayerChunks, top: Any) -> Callable:
  """x -> x whose backward hands the top layer's gathered chunks (`chunks.whole(top)`) to the
  layer scan's carry as its cotangent (the top layer has no layer after it to prefetch them)."""
  @jax.custom_vjp
  def seed(x, c, top):
    del c, top
    return x

  seed.defvjp(lambda x, c, top: (x, top),
              lambda top, g: (g, chunks.whole(top), _no_grad(top)))
  return seed


def scan(fn: Callable, stacked: Any, dots: Any, x_BLD, positions, turns: lm.Turns, remat: str,
         cfg: ModelConfig, gather: Callable, chunks: LayerChunks) -> tuple[jax.Array, Any]:
  """`run_layers`' layer scan with the backward's gathers prefetched (module docstring), and
  the forward's where the micro-batches run skewed (their first phase places the chunk):
  `fn(weights, dots, part)` -> a layer's phases, `stacked` the stored shards [L, ...] (`dots`
  scanned beside them), `gather` one layer's ZeRO-3 gather, `chunks` it in the loop's trips.
  Returns (x after the layers, each layer's stats [L, ...])."""
  depth = jax.tree.leaves(stacked)[0].shape[0]
  stack = jax.lax.stop_gradient(stacked)
  first = jax.tree.map(lambda a: a[0], stack)
  w0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                    jax.eval_shape(lambda s: chunks.assemble(chunks.empty(s), s), first))
  batch0 = jax.tree.map(lambda a: a[0], lm.trips((x_BLD, positions), turns))
  dots0 = jax.tree.map(lambda a: a[0], dots)
  one = lambda w, d, part, extra=None: lm.side_by_side(lambda w_, p: fn(w_, d, p), w, part,
                                                      extra)
  trip_fn, consts = jax.closure_convert(one, w0, dots0, batch0)
  fetching, fetch_consts = None, []
  if turns.skewed:
    fetch_fn, fetch_consts = jax.closure_convert(
        lambda w, d, part, nxt, got, t: one(w, d, part,
                                            lambda: chunks.forward.fetch(got, nxt, t)),
        w0, dots0, batch0, first, chunks.empty(first), jnp.int32(0))
    fetching = lambda w, part, nxt, got, t, d, *cs: fetch_fn(w, d, part, nxt, got, t, *cs)
  op = _layer_op(lambda w, part, d, *cs: trip_fn(w, d, part, *cs), fetching, turns, gather,
                 chunks)
  # The layer's own checkpoint keeps its input alone (on the host under full_offload); the
  # custom VJP's other residuals are its inputs.
  layer = remat_lib.checkpointed(
      lambda c, x, s, i, d: op(c, remat_lib.layer_input(x, remat), positions, s, stack, i,
                               ((d, *consts), (d, *fetch_consts))),
      "full_offload" if remat == "full_offload" else "full", cfg)

  def body(carry, inputs):
    c, x = carry
    i, stored, dot = inputs
    c, x, stats = layer(c, x, stored, i, dot)
    return (c, x), stats

  # The forward's carry: layer 0's chunks, gathered here once (exposed), or zeros.
  c0 = chunks.forward.whole(first) if turns.skewed else chunks.empty(first)
  (c, x_BLD), stats = jax.lax.scan(body, (c0, x_BLD), (jnp.arange(depth), stacked, dots))
  top = jax.tree.map(lambda a: a[depth - 1], stack)
  return _seeded(chunks, top)(x_BLD, c, top), stats
