"""Ring attention over one mesh axis (context parallelism), zig-zag balanced, custom backward.

Runs inside `jax.shard_map`: each of the n devices along `axis_name` holds a slice of the
sequence (its queries, keys and values). K/V blocks travel around the ring with `ppermute` for n
steps; at step t device i holds the K/V of device (i - t) mod n and attends its queries to them
blockwise, merging partial outputs by their log-sum-exps (an online softmax over blocks).

The schedule is data (`schedule`): for every device and step, which blocks of local queries
meet which blocks of the visiting keys, and whether a block is the causal diagonal. Blocks
entirely above the diagonal are absent (skipped, not masked). Layouts of the sequence:
  * contiguous: device i holds chunk i of n. Device i computes i+1 blocks: unbalanced.
  * zigzag: the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i (the data
    pipeline permutes tokens, labels and positions once, `jscale.parallel.context.order`). Every
    device computes the same: its two diagonal blocks and one full block at step 0, then two
    full (chunk x chunk) blocks per step.

The backward is a `custom_vjp` running its own ring: K/V travel again and dK/dV travel with
them, arriving home after one last hop. The forward saves only local q, k, v, out and lse.
The per-block math is pluggable (`BlockFns`: plain jnp by default, a flash kernel later).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jscale.model import blockwise_attention
from jscale.model.blockwise_attention import BlockFns
from jscale.parallel.context.order import chunks_per_device as parts

_EMPTY_LSE = -1e30  # lse of rows that have seen no key yet (finite: merges never give nan)


class Block(NamedTuple):
  """Local query parts [q0, q1) against visiting key parts [k0, k1); `causal` = diagonal."""
  q: tuple[int, int]
  k: tuple[int, int]
  causal: bool


def blocks(layout: str, causal: bool, me: int, src: int) -> tuple[Block, ...]:
  """The blocks device `me` computes while holding the K/V of device `src`."""
  p = parts(layout)
  if not causal:
    return (Block((0, p), (0, p), False),)
  if layout == "contiguous":
    return ((Block((0, 1), (0, 1), True),) if src == me else
            (Block((0, 1), (0, 1), False),) if src < me else ())
  # zigzag: local chunks (me, 2n-1-me), visiting (src, 2n-1-src).
  if src == me:
    return (Block((0, 1), (0, 1), True), Block((1, 2), (0, 1), False),
            Block((1, 2), (1, 2), True))
  if src < me:  # both local chunks come after chunk src and before chunk 2n-1-src
    return (Block((0, 2), (0, 1), False),)
  return (Block((1, 2), (0, 2), False),)  # only the late local chunk sees both visiting ones


def schedule(n: int, layout: str, causal: bool = True) -> list[list[tuple[Block, ...]]]:
  """[device][step] -> blocks; at step t device i holds the K/V of device (i - t) mod n."""
  return [[blocks(layout, causal, i, (i - t) % n) for t in range(n)] for i in range(n)]


def work(n: int, layout: str, causal: bool = True) -> np.ndarray:
  """Chunk x chunk score blocks (each (L / (n·parts))² query x key pairs) each device
  computes."""
  return np.array([sum((b.q[1] - b.q[0]) * (b.k[1] - b.k[0]) for step in row for b in step)
                   for row in schedule(n, layout, causal)])


def ring_attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, axis_name: str, *,
                   layout: str = "zigzag", causal: bool = True,
                   block: BlockFns = blockwise_attention.JNP,
                   docs_BL: jax.Array | None = None) -> jax.Array:
  """Causal attention of this device's sequence slice against the whole sequence.

  Call inside `shard_map` with the sequence split over `axis_name` in `layout` order; GQA k
  [B, S, G, K] and v [B, S, G, Kv] (G dividing H; V's head size may differ from K's).
  `docs_BL`: this slice's tokens' documents (`jscale.model.positions`; they travel the ring with
  K/V), masking pairs across documents; None: one document per row. Returns [B, L, H, Kv] in
  q's dtype.
  """
  n = jax.lax.axis_size(axis_name)
  if q_BLHK.shape[1] % parts(layout):
    raise ValueError(f"local sequence {q_BLHK.shape[1]} is not divisible into "
                     f"{parts(layout)} {layout} chunks")
  return _ring(q_BLHK, k_BSGK, v_BSGK, docs_BL, axis_name, n, layout, causal, block)


def blocks_computed(q_BLHK, k_BSGK, v_BSGK, axis_name: str, *, layout: str = "zigzag",
                    causal: bool = True, block: BlockFns = blockwise_attention.JNP) -> jax.Array:
  """Chunk x chunk score blocks this device computed in the forward it executes (for balance
  checks; `work`'s unit)."""
  n = jax.lax.axis_size(axis_name)
  return _forward(q_BLHK, k_BSGK, v_BSGK, None, axis_name, n, layout, causal, block)[2]


# ------------------------------------------------------------------ executor


def _cases(n: int, layout: str, causal: bool):
  """Distinct block lists (the lax.switch branches) and the [device, step] -> case table."""
  table = schedule(n, layout, causal)
  cases = sorted({c for row in table for c in row})
  ids = np.array([[cases.index(c) for c in row] for row in table], np.int32)
  return cases, ids


def _rows(x: jax.Array, r: tuple[int, int], p: int) -> jax.Array:
  c = x.shape[1] // p
  return x[:, r[0] * c:r[1] * c]


def _set_rows(x: jax.Array, r: tuple[int, int], p: int, value: jax.Array) -> jax.Array:
  return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), r[0] * x.shape[1] // p, 1)


def _merge(o, lse, bo, blse):
  """Combines two partial softmax outputs of the same queries by their log-sum-exps."""
  new = jnp.logaddexp(lse, blse)
  return (o * jnp.exp(lse - new)[..., None] + bo * jnp.exp(blse - new)[..., None]), new


def _step_case(axis_name: str, ids: np.ndarray, t) -> jax.Array:
  return jnp.asarray(ids)[jax.lax.axis_index(axis_name), t]


def _next(x, axis_name: str, n: int):
  if n == 1:
    return x
  return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def _docs(docs, r: tuple[int, int], p: int):
  return None if docs is None else _rows(docs, r, p)


def _forward(q, k, v, docs, axis_name, n, layout, causal, block):
  p, (cases, ids) = parts(layout), _cases(n, layout, causal)
  b, l, h, _ = q.shape

  def branch(case):
    def run(o, lse, k, v, kdocs):
      done = 0
      for blk in case:
        bo, blse = block.forward(_rows(q, blk.q, p), _rows(k, blk.k, p), _rows(v, blk.k, p),
                                 blk.causal, _docs(docs, blk.q, p), _docs(kdocs, blk.k, p))
        mo, mlse = _merge(_rows(o, blk.q, p), _rows(lse, blk.q, p), bo, blse)
        o, lse = _set_rows(o, blk.q, p, mo), _set_rows(lse, blk.q, p, mlse)
        # In chunk x chunk blocks: score elements overflow int32 at long context.
        done += (blk.q[1] - blk.q[0]) * (blk.k[1] - blk.k[0])
      return o, lse, jnp.int32(done)
    return run

  branches = [branch(c) for c in cases]

  def compute(t, o, lse, kv):
    return jax.lax.switch(_step_case(axis_name, ids, t), branches, o, lse, *kv)

  def body(carry, t):
    o, lse, kv, done = carry
    kv_next = _next(kv, axis_name, n)  # independent of this step's compute: overlaps
    o, lse, d = compute(t, o, lse, kv)
    return (o, lse, kv_next, done + d), None

  o = jnp.zeros((b, l, h, v.shape[-1]), jnp.float32)  # V's head size
  lse = jnp.full((b, l, h), _EMPTY_LSE, jnp.float32)
  kv = (k, v, docs)  # the documents of the K/V, travelling with them
  (o, lse, kv, done), _ = jax.lax.scan(body, (o, lse, kv, jnp.int32(0)), jnp.arange(n - 1))
  o, lse, d = compute(n - 1, o, lse, kv)
  return o, lse, done + d


def _backward(q, k, v, docs, o, lse, dout, axis_name, n, layout, causal, block):
  p, (cases, ids) = parts(layout), _cases(n, layout, causal)
  delta = jnp.sum(dout.astype(jnp.float32) * o, axis=-1)  # [B, L, H]

  def branch(case):
    def run(dq, dk, dv, k, v, kdocs):
      for blk in case:
        qr = lambda x: _rows(x, blk.q, p)
        kr = lambda x: _rows(x, blk.k, p)
        bdq, bdk, bdv = block.backward(qr(q), kr(k), kr(v), qr(dout), qr(lse), qr(delta),
                                       blk.causal, _docs(docs, blk.q, p),
                                       _docs(kdocs, blk.k, p))
        dq = _set_rows(dq, blk.q, p, qr(dq) + bdq)
        dk, dv = _set_rows(dk, blk.k, p, kr(dk) + bdk), _set_rows(dv, blk.k, p, kr(dv) + bdv)
      return dq, dk, dv
    return run

  branches = [branch(c) for c in cases]

  def compute(t, dq, dk, dv, kv):
    return jax.lax.switch(_step_case(axis_name, ids, t), branches, dq, dk, dv, *kv)

  def body(carry, t):
    dq, dk, dv, kv = carry
    kv_next = _next(kv, axis_name, n)
    dq, dk, dv = compute(t, dq, dk, dv, kv)
    dk, dv = _next((dk, dv), axis_name, n)  # dK/dV travel with the K/V they belong to
    return (dq, dk, dv, kv_next), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  carry = (zeros(q), zeros(k), zeros(v), (k, v, docs))
  (dq, dk, dv, kv), _ = jax.lax.scan(body, carry, jnp.arange(n - 1))
  dq, dk, dv = compute(n - 1, dq, dk, dv, kv)
  dk, dv = _next((dk, dv), axis_name, n)  # the last hop home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q, k, v, docs, axis_name, n, layout, causal, block):
  return _forward(q, k, v, docs, axis_name, n, layout, causal, block)[0].astype(q.dtype)


def _ring_fwd(q, k, v, docs, axis_name, n, layout, causal, block):
  o, lse, _ = _forward(q, k, v, docs, axis_name, n, layout, causal, block)
  o = checkpoint_name(o.astype(q.dtype), "attn_ctx")
  # Named so that `remat: selective` keeps it with the output and skips re-running the ring.
  return o, (q, k, v, docs, o, checkpoint_name(lse, "attn_lse"))


def _ring_bwd(axis_name, n, layout, causal, block, res, dout):
  q, k, v, docs, o, lse = res
  dq, dk, dv = _backward(q, k, v, docs, o.astype(jnp.float32), lse, dout, axis_name, n, layout,
                         causal, block)
  return dq, dk, dv, None  # the documents are integers: no cotangent


_ring.defvjp(_ring_fwd, _ring_bwd)
