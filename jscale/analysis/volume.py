"""Communication volume per device per step: the playbook's formulas, and the same measure
of the collectives a compiled program runs.

Volume counts what a ring implementation moves, without the (n-1)/n factor, as the playbook
does (PLAYBOOK_DIGEST.md §2): an all-reduce of X bytes costs 2X (reduce-scatter + all-gather),
an all-gather or a reduce-scatter of a full size X costs X, an all-to-all or a permute its size.
So DP costs 2Ψ, ZeRO-1/2 2Ψ (reduce-scatter Ψ + all-gather Ψ), ZeRO-3 3Ψ, TP 8·s·b·h per block,
and CP's ring per layer: K/V pass n-1 hops forward, again backward, with dK/dV n hops.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jscale.analysis.hlo import Collective
from jscale.sharding import spec_axes

GRAD_BYTES = 4  # gradients are reduced in fp32


def collective_volume(c: Collective) -> int:
  """Playbook volume of one collective per step (0 for a group of one device)."""
  if c.group_size == 1:
    return 0
  per_run = {"all-reduce": 2 * c.bytes,
             "reduce-scatter": c.bytes * (c.group_size or 1)}.get(c.kind, c.bytes)
  return per_run * c.executions


def hlo_volume(collectives: Iterable[Collective]) -> dict[str, int]:
  """{kind: volume bytes per step} and "total", from `jscale.analysis.hlo.collectives`."""
  out: dict[str, int] = {}
  for c in collectives:
    v = collective_volume(c)
    if v:
      out[c.kind] = out.get(c.kind, 0) + v
  out["total"] = sum(out.values())
  return out


def _local_params(rt) -> tuple[int, int]:
  """(layer-stack params, other params) per tensor-parallel rank."""
  tp = rt.mesh.shape["tensor"]
  layers = other = 0
  for names, shape, spec in zip(
      _leaves(rt.layouts.names), _leaves(rt.state_shapes["params"]), _leaves(rt.layouts.compute)):
    n = shape.size // (tp if "tensor" in spec_axes(spec) else 1)
    if names[0] == "layers":
      layers += n
    else:
      other += n
  return layers, other


def playbook_volume(rt) -> dict[str, float]:
  """Per-device bytes per step the playbook's formulas predict for `rt` (a `runtime.Runtime`),
  by term, and "total".

  Refinements of the bare formulas, each what the formula's own reasoning gives here:
  ZeRO-3 re-gathers layer weights in the backward, but the embedding (whose backward is a
  scatter-add) and the head (whose backward follows its forward at once) are gathered once;
  TP has one f/g pair per block (4 all-reduces of s·b·h) plus the embedding's g and the head's f,
  full rematerialisation repeats the block's forward collectives, and selective under SP the
  all-gathers of the (recomputed) norm outputs;
  the vocab-parallel loss all-reduces three [s·b] fp32 statistics.
  """
  cfg, sizes = rt.cfg, dict(rt.mesh.shape)
  m, t, zero = cfg.model, cfg.train, cfg.parallel.zero_stage
  c = jnp.dtype(m.dtype).itemsize
  p = jnp.dtype(m.param_dtype).itemsize
  layers, other = _local_params(rt)
  psi = layers + other
  f, tp, cp = sizes["fsdp"], sizes["tensor"], sizes["sequence"]
  d = sizes["data"] * sizes["expert"] * cp  # gradients are summed over every token-split axis
  mb = t.microbatches
  out: dict[str, float] = {}
  if f * d > 1:
    if zero == 0 or f == 1:
      out["dp all-reduce 2Ψ"] = 2 * psi * GRAD_BYTES
    else:
      if zero == 3:
        out["zero3 all-gather fwd+bwd 2Ψ"] = mb * (2 * layers + other) * c
        out["zero3 reduce-scatter Ψ"] = mb * psi * c
      else:
        rs = mb if zero == 2 else 1  # ZeRO-2 reduces each micro-batch to keep only a shard
        out["zero reduce-scatter Ψ"] = rs * psi * GRAD_BYTES
        out["zero all-gather Ψ"] = psi * p
      if d > 1:
        out["data all-reduce of the shard 2Ψ/fsdp"] = 2 * psi / f * GRAD_BYTES
  tokens = t.batch_size // (f * d // cp) * t.seq_len // cp  # per device per step
  if cp > 1:
    kv = tokens * m.n_kv_heads // tp * m.resolved_head_dim  # local K (or V) elements, per layer
    forwards = 2 if t.remat == "full" else 1
    out["cp ring K/V hops (n-1)·2·kv per pass"] = (
        m.n_layers * (forwards + 1) * (cp - 1) * 2 * kv * c)
    out["cp ring dK/dV hops n·2·kv"] = m.n_layers * cp * 2 * kv * GRAD_BYTES
  if tp > 1:
    sbh = tokens * m.d_model * c
    out["tp 8·sbh per block"] = 8 * m.n_layers * sbh
    out["tp embedding g + head f"] = 4 * sbh
    if t.remat == "full":
      out["tp remat: forward again"] = 4 * m.n_layers * sbh
    if t.remat == "selective" and cfg.parallel.sequence_parallel:
      out["tp selective + sp: norm outputs gathered again"] = 2 * m.n_layers * sbh
    out["tp loss statistics"] = 3 * 2 * tokens * 4
  out["total"] = sum(out.values())
  return out


def _leaves(tree: Any) -> list:
  is_leaf = lambda x: isinstance(x, PartitionSpec) or (
      isinstance(x, tuple) and all(isinstance(n, str) for n in x))
  return jax.tree.leaves(tree, is_leaf=is_leaf)
