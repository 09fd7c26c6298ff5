"""Runs a compiled pipeline program on one stage's shards: a `lax.scan` over ticks, a
`lax.switch` per tick on what this stage does, `ppermute` both ways at the end of every tick.

Called inside `jax.shard_map` (manual over `stage`; in manual collectives mode over every axis).
The model comes cut in three: the first chunk embeds the micro-batch's tokens, every chunk runs
its layers, the last chunk applies the head and the loss, and straight away its backward, so
the last chunk's B starts from a gradient already filed like a received one.

Residuals: F takes `jax.vjp` of its chunk and keeps the pullback's residual arrays in a buffer
slot (the program assigns slots; the buffer has as many as the schedule holds at once). Leaves
that are the chunk's own weights, product state or positions are not stored: B rebuilds the
pullback from the stored arrays plus those. B of a schedule without the split is the full
backward (dx and the weight gradient); zero-bubble's B takes only dx (XLA drops the
weight-gradient matmuls) and keeps its output gradient for W, which takes only the weight
gradient.

Product state (`dots`: FP8's amax histories, stacked like the layers): each chunk's is an input
of its layers whose "gradient" is its new value (`jscale.fp8.dot`); the weight-gradient pass
keeps, per chunk, the max of the micro-batches' new values (each pushes its amaxes onto the
same old history: the max keeps the step's), as gradient accumulation does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jscale.parallel.pipeline import program as prog_lib

Tree = Any


class StageFns(NamedTuple):
  """The model cut for the pipeline (pure functions of param dicts and per-device arrays)."""
  embed: Callable  # (shared, tokens_bL, positions) -> x_bLD (positions: the dense prefix's)
  # (chunk, chunk dots, x_bLD, positions) -> (x_bLD, stats): stats a dict of this chunk's
  # share of the step's router statistics ({} if dense); its "moe_loss" is part of the
  # objective. `chunk dots`: the chunk's product state ({} without).
  layers: Callable
  # (shared, x_bLD, labels_bL, mask_bL, positions) -> (loss sum, extra objective, stats), all
  # sums over the micro-batch's tokens: the extra term (multi-token prediction's) is added to
  # the loss sum in the differentiated objective, and the stats join the layers' in
  # `Run.stats`, all scaled by `scale` as the loss is (0.0 and {} for a plain head)
  head_loss: Callable


class Run(NamedTuple):
  """What `run` returns for one stage."""
  dblocks: Tree  # fp32 gradients of this stage's chunks (None forward only)
  dshared: Tree  # fp32 gradients of the shared weights: nonzero on the first / last stage only
  loss: jax.Array  # loss sum * scale, nonzero on the last stage only
  codes: jax.Array  # [T] the executed program codes
  stats: dict  # the sum of this stage's chunks' `layers` statistics over its forwards
  ddots: Tree  # this stage's chunks' new product state (None forward only)


def _zeros(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _f32(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _placed(x: jax.Array, space: jax.memory.Space) -> jax.Array:
  """`x` moved to memory `space` (a no-op where it is already; XLA's host offloader makes a
  move between device and host an asynchronous copy)."""
  return x if space == jax.memory.Space.Device and not _on_host(x) else jax.device_put(x, space)


def _on_host(x: jax.Array) -> bool:
  return jax.typeof(x).memory_space == jax.memory.Space.Host


def _forward_with_residuals(fns: StageFns, chunk: Tree, dots: Tree, x, pos):
  """((y, stats), stored residuals, where-map, pullback treedef) of the chunk's layers."""
  y, pullback = jax.vjp(lambda c, d, x: fns.layers(c, d, x, pos), chunk, dots, x)
  leaves, treedef = jax.tree.flatten(pullback)
  params = {id(p): i for i, p in enumerate(jax.tree.leaves((chunk, dots)))}
  where = tuple(("param", params[id(l)]) if id(l) in params else ("pos", 0) if l is pos
                else ("res", 0) for l in leaves)
  return y, [l for l, (kind, _) in zip(leaves, where) if kind == "res"], where, treedef


def _pullback(fns: StageFns, chunk: Tree, dots: Tree, x_like, pos, stored):
  """The chunk's pullback from stored residuals. Re-traces the forward for the pytree
  structure only: none of its values is used, so XLA removes it."""
  _, _, where, treedef = _forward_with_residuals(fns, chunk, dots, jnp.zeros_like(x_like), pos)
  params, it = jax.tree.leaves((chunk, dots)), iter(stored)
  leaves = [params[i] if kind == "param" else pos if kind == "pos" else next(it)
            for kind, i in where]
  return jax.tree.unflatten(treedef, leaves)


class _Side(NamedTuple):
  """What one action of a tick works on: its chunk's weights and product state, its
  micro-batch, and which of the stage's chunks it is."""
  chunk: Tree
  dots: Tree
  mb: dict
  local: jax.Array


def run(program: prog_lib.Program, fns: StageFns, blocks: Tree, shared: Tree,
        microbatches: dict[str, jax.Array], scale: jax.Array, stage_axis: str = "stage",
        shard_grads: Callable[[Tree], Tree] = lambda g: g, dots: Tree = None,
        offload: bool = False) -> Run:
  """Executes `program` on this stage. `blocks`: this stage's layers [v * k, ...] (its chunks
  in order); `shared`: the other weights; `microbatches`: tokens, labels, loss_mask, positions
  as [m, b, L]; `scale` multiplies the loss (1 / global token count). `shard_grads` puts each
  gradient a branch computes ({"blocks": chunk grads} or the shared grads) in the
  accumulators' layout (ZeRO-2: its fsdp shard), so only that layout is accumulated. `dots`:
  the layers' product state, stacked like `blocks` ({} or None without). `offload`: keep the
  stored residuals in host memory between their F and their B (`train.remat=offload`): each
  goes out when F stores it and comes back when B reads it.
  """
  stage = _Stage(program, fns, blocks, shared, microbatches, scale, stage_axis, shard_grads,
                 dots or {}, offload)
  s = jax.lax.axis_index(stage_axis)
  cols = {name: jnp.asarray(getattr(program, name))[:, s] for name in
          ("code", "mb", "local", "mb_b", "local_b", "res_write", "res_read", "stash_write",
           "read_f", "read_b", "send", "file_f", "file_b", "self_f", "self_b")}
  final, codes = jax.lax.scan(stage.tick, stage.carry0(), cols)
  train = program.table.backward
  stacked = lambda tree: jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), tree)
  return Run(stacked(final["dblocks"]) if train else None, final["dshared"], final["loss"],
             codes, final["stats"], stacked(final["ddots"]) if train else None)


class _Stage:
  """One stage's share of a pipeline program: the shapes and zeros its branches need (set up
  once, at trace time), its branches, and one tick of the scan."""

  def __init__(self, program: prog_lib.Program, fns: StageFns, blocks: Tree, shared: Tree,
               microbatches: dict[str, jax.Array], scale: jax.Array, stage_axis: str,
               shard_grads: Callable[[Tree], Tree], dots: Tree, offload: bool):
    self.program, self.fns, self.shared, self.microbatches = program, fns, shared, microbatches
    # Where stored residuals wait for their B: host memory under `train.remat=offload`.
    self.res_space = jax.memory.Space.Host if offload else jax.memory.Space.Device
    self.scale, self.stage_axis, self.shard_grads = scale, stage_axis, shard_grads
    self.v, self.train = program.table.v, program.table.backward
    self.own_f = bool((program.self_f != program.n_in_f).any())  # the V's turn: F files its own
    by_chunk = lambda tree: jax.tree.map(
        lambda x: x.reshape(self.v, x.shape[0] // self.v, *x.shape[1:]), tree)
    self.chunks, self.chunk_dots = by_chunk(blocks), by_chunk(dots)
    one_chunk, one_dots = (jax.tree.map(lambda x: x[0], t) for t in (self.chunks,
                                                                     self.chunk_dots))
    mb0 = jax.tree.map(lambda x: x[0], microbatches)
    self.act = act = jax.eval_shape(fns.embed, shared, mb0["tokens"], mb0["positions"])
    stats_shape = jax.eval_shape(fns.layers, one_chunk, one_dots, act, mb0["positions"])[1]
    layer_stats = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)
    head_shape = jax.eval_shape(lambda sh, y: fns.head_loss(
        sh, y, mb0["labels"], mb0["loss_mask"], mb0["positions"])[2], shared, act)
    self.zero_stats = {**layer_stats,
                       **jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), head_shape)}
    # The objective's cotangent for a chunk's statistics: only its "moe_loss" is minimised.
    self.d_stats = {k: jnp.ones_like(v) if k == "moe_loss" else v
                    for k, v in layer_stats.items()}
    self.res_shapes = (jax.eval_shape(
        lambda c, d, x, pos: _forward_with_residuals(fns, c, d, x, pos)[1],
        one_chunk, one_dots, act, mb0["positions"]) if self.train else [])
    self.acc_chunk = jax.eval_shape(self.dchunk_of, one_chunk) if self.train else None
    self.acc_shared = jax.eval_shape(self.dshared_of, shared) if self.train else None
    self.zero_act = jnp.zeros(act.shape, act.dtype)

  def dchunk_of(self, g: Tree) -> Tree:
    return self.shard_grads({"blocks": _f32(g)})["blocks"]

  def dshared_of(self, g: Tree) -> Tree:
    return self.shard_grads(_f32(g))

  def carry0(self) -> dict:
    """The scan's carry: inboxes, residual and stash buffers (each with a scratch slot), the
    gradient accumulators, the loss and statistics, and the messages in flight."""
    program, act = self.program, self.act
    buffer = lambda n, a: jnp.zeros((n + 1, *a.shape), a.dtype)  # + the scratch slot
    return dict(
        inbox_f=buffer(program.n_in_f, act), inbox_b=buffer(program.n_in_b, act),
        res=[_placed(buffer(program.n_res, r), self.res_space) for r in self.res_shapes],
        stash=buffer(program.n_res if program.table.split else 0, act),
        dblocks=jax.tree.map(lambda a: jnp.zeros((self.v, *a.shape), a.dtype), self.acc_chunk),
        dshared=_zeros(self.acc_shared), ddots=jax.tree.map(jnp.zeros_like, self.chunk_dots),
        loss=jnp.zeros((), jnp.float32), stats=self.zero_stats,
        msgs=[self.zero_act for _ in program.channels])

  def nothing(self, dblocks: Tree, dshared: Tree, ddots: Tree) -> dict:
    """An idle branch's output. The gradient accumulators go through the switch: a branch adds
    its gradient in place (the others hand them back untouched), so no branch output holds a
    second, gradient-sized buffer beside them."""
    return dict(out_f=self.zero_act, out_b=self.zero_act,
                res=[jnp.zeros(r.shape, r.dtype) for r in self.res_shapes], stash=self.zero_act,
                dblocks=dblocks, dshared=dshared, ddots=ddots, loss=jnp.zeros((), jnp.float32),
                stats=self.zero_stats)

  def add_shared(self, acc: Tree, g: Tree) -> Tree:
    return jax.tree.map(jnp.add, acc, self.dshared_of(g))

  def forward(self, fside: _Side, x_in, first: bool, last: bool, out: dict) -> dict:
    """F of `fside`'s micro-batch: embed (first chunk) or the received activation, the chunk's
    layers (keeping their residuals when training), and on the last chunk the head, the loss
    and straight away the head's backward."""
    fns, shared, mb = self.fns, self.shared, fside.mb
    x = fns.embed(shared, mb["tokens"], mb["positions"]) if first else x_in
    out = dict(out)
    if self.train:
      (y, stats), out["res"], _, _ = _forward_with_residuals(fns, fside.chunk, fside.dots, x,
                                                             mb["positions"])
    else:
      y, stats = fns.layers(fside.chunk, fside.dots, x, mb["positions"])
    out["stats"] = {**self.zero_stats, **stats}
    if not last:
      return {**out, "out_f": y}
    if not self.train:
      loss, _, stats = fns.head_loss(shared, y, mb["labels"], mb["loss_mask"],
                                     mb["positions"])
      return {**out, "loss": loss, "stats": {**out["stats"], **stats}}

    def head(sh, y):
      loss, extra, stats = fns.head_loss(sh, y, mb["labels"], mb["loss_mask"],
                                         mb["positions"])
      return (loss + extra) * self.scale, (loss * self.scale,
                                           jax.tree.map(lambda v: v * self.scale, stats))

    (_, (loss, stats)), (dsh, dy) = jax.value_and_grad(head, argnums=(0, 1),
                                                       has_aux=True)(shared, y)
    return {**out, "loss": loss, "stats": {**out["stats"], **stats},
            "dshared": self.add_shared(out["dshared"], dsh), "out_b": dy.astype(self.act.dtype)}

  def backward(self, bside: _Side, x_in, stored, first: bool, need_dx: bool, need_dw: bool,
               dy, out: dict) -> dict:
    """B (dx, and the weight gradient unless the schedule splits it off), or W (the weight
    gradient alone, from the stashed output gradient), from the stored residuals."""
    if not self.train:  # forward-only programs never take these branches
      return dict(out)
    chunk, dots, mb, local = bside
    pullback = _pullback(self.fns, chunk, dots, x_in, mb["positions"], stored)
    dchunk, new_dots, dx = pullback((dy, self.d_stats))
    out = dict(out)
    if need_dw:
      out["dblocks"] = jax.tree.map(lambda a, g: a.at[local].add(g), out["dblocks"],
                                    self.dchunk_of(dchunk))
      out["ddots"] = jax.tree.map(lambda a, d: a.at[local].max(d), out["ddots"], new_dots)
    if need_dx and first:  # the embedding's gradient (a scatter-add of dx)
      _, embed_vjp = jax.vjp(lambda sh: self.fns.embed(sh, mb["tokens"], mb["positions"]),
                             self.shared)
      out["dshared"] = self.add_shared(out["dshared"], embed_vjp(dx.astype(self.act.dtype))[0])
    elif need_dx:
      out["out_b"] = dx.astype(self.act.dtype)
    if need_dx and not need_dw:
      out["stash"] = dy
    return out

  def branches(self, fside: _Side, bside: _Side, x_in, dy_in, stored, stash, dblocks, dshared,
               ddots) -> list[Callable[[], dict]]:
    """One callable per program code, in `program.codes` order (the tick's `lax.switch`)."""
    nothing = self.nothing(dblocks, dshared, ddots)
    f = lambda first, last: self.forward(fside, x_in, first, last, nothing)
    b = lambda first, dw: self.backward(bside, x_in, stored, first, True, dw, dy_in, nothing)

    def pair(code):
      # A forward of one micro-batch and the backward of another, as one branch: their
      # dataflows are apart, so XLA's scheduler may run one's collectives (the expert
      # all-to-alls) under the other's matmuls.
      fcode, bcode = code.split("+")
      with jax.named_scope("pair_forward"):
        out = self.forward(fside, x_in, fcode == "f_first", fcode == "f_last", nothing)
      with jax.named_scope("pair_backward"):
        return self.backward(bside, x_in, stored, bcode.endswith("_first"), True,
                             bcode.startswith("bw"), dy_in, out)

    by_code = {
        "idle": lambda: dict(nothing),
        "f": lambda: f(False, False), "f_first": lambda: f(True, False),
        "f_last": lambda: f(False, True),
        "b": lambda: b(False, False), "b_first": lambda: b(True, False),
        "bw": lambda: b(False, True), "bw_first": lambda: b(True, True),
        "w": lambda: self.backward(bside, x_in, stored, False, False, True, stash, nothing),
    }
    return [by_code[code] if code in by_code else functools.partial(pair, code)
            for code in self.program.codes]

  def side(self, col_mb, col_local) -> _Side:
    chunk, dots = (jax.tree.map(lambda x: x[col_local], t) for t in (self.chunks,
                                                                     self.chunk_dots))
    return _Side(chunk, dots, jax.tree.map(lambda x: x[col_mb], self.microbatches), col_local)

  def payload(self, k: int, out: dict, send) -> jax.Array:
    """What channel k sends: unasked-for values land in the receiver's scratch slot."""
    if self.program.carries[k] == "f":
      return out["out_f"]
    if self.program.carries[k] == "b":
      return jnp.where(send == prog_lib.SEND_B, out["out_b"], jnp.zeros_like(out["out_b"]))
    return jnp.where(send == prog_lib.SEND_F, out["out_f"], out["out_b"])

  def tick(self, carry: dict, col: dict) -> tuple[dict, jax.Array]:
    """File what arrived, run this tick's branch, keep what it made, send both ways."""
    program = self.program
    inbox_f, inbox_b = carry["inbox_f"], carry["inbox_b"]
    for k, msg in enumerate(carry["msgs"]):  # what arrived, filed by what it is
      if "f" in program.carries[k]:
        inbox_f = inbox_f.at[col["file_f"][k]].set(msg)
      if "b" in program.carries[k]:
        inbox_b = inbox_b.at[col["file_b"][k]].set(msg)
    fside = self.side(col["mb"], col["local"])
    bside = self.side(col["mb_b"], col["local_b"]) if program.has_pairs else fside
    stored = [_placed(jax.lax.dynamic_index_in_dim(r, col["res_read"], keepdims=False),
                      jax.memory.Space.Device) for r in carry["res"]]
    with jax.named_scope(prog_lib.TICK_SCOPE):
      out = jax.lax.switch(col["code"], self.branches(
          fside, bside, inbox_f[col["read_f"]], inbox_b[col["read_b"]], stored,
          carry["stash"][col["res_read"]], carry["dblocks"], carry["dshared"], carry["ddots"]))
    if self.own_f:
      inbox_f = inbox_f.at[col["self_f"]].set(out["out_f"])
    new = dict(carry, inbox_f=inbox_f, loss=carry["loss"] + out["loss"],
               stats=jax.tree.map(jnp.add, carry["stats"], out["stats"]))
    new["res"] = [jax.lax.dynamic_update_index_in_dim(r, _placed(o, self.res_space),
                                                      col["res_write"], 0)
                  for r, o in zip(carry["res"], out["res"])]
    if self.train:
      # The last chunk's own head gradient is filed like a received one (the F's out_b), as
      # is the V's turn's gradient.
      new["inbox_b"] = inbox_b.at[col["self_b"]].set(out["out_b"])
      new["stash"] = carry["stash"].at[col["stash_write"]].set(out["stash"])
      new["dblocks"], new["dshared"], new["ddots"] = out["dblocks"], out["dshared"], out["ddots"]
    else:
      new["inbox_b"] = inbox_b
    new["msgs"] = [jax.lax.ppermute(self.payload(k, out, col["send"][k]), self.stage_axis,
                                    list(perm)) for k, perm in enumerate(program.channels)]
    return new, col["code"]
