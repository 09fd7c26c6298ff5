"""Pipeline schedules as data: for every tick and stage, the action it runs.

A schedule is a `Table` (`table.py`): `kind[t, s]` (IDLE, F, B or W), `mb[t, s]` (micro-batch)
and `chunk[t, s]` (model chunk; the placement says on which stage it lives, `placement.py`: the
interleaved chunk c % p, or the V of ZB-V and DualPipeV). Time is in unit ticks costing
F = B = W = 1: B is the input gradient (what the previous stage waits for) and W the weight
gradient. Schedules without the split (AFAB, 1F1B, interleaved) run W right after B on the same
stage, and the stage before waits for both (a full backward, t_b = 2 t_f, sends its gradient at
its end); zero-bubble (ZB-H1) sends after B and defers W into the bubbles.

The four interleaved tables are built by one list scheduler (`_simulate`): each stage walks its
forward and backward orders, at each tick doing the first of {F, B} whose inputs have arrived (a
message sent at tick t can be used from tick t+1) and whose in-flight limit allows it, else a
deferred W, else idling. They differ only in orders and limits: AFAB lets all m forwards run
first, 1F1B keeps p - s in flight on stage s, interleaved p - s + (v-1)p, and ZB-H1 is 1F1B
whose W's wait for idle ticks (at most p of them pending). The V-shaped ones (ZB-V, DualPipeV)
are per-stage op orders placed in order (`vshape.py`); DualPipeV's ops include forward +
backward pairs.
"""

from __future__ import annotations

import numpy as np

from jscale.parallel.pipeline import placement, vshape
from jscale.parallel.pipeline.table import IDLE, NAMES, B, F, Table, W, fusable

__all__ = ["B", "F", "IDLE", "NAMES", "W", "Table", "SCHEDULES", "theory_bubble",
           "theory_in_flight", "why_not", "check_args", "make_table", "forward_table",
           "validate"]

# pipeline.schedule's values (a test keeps them equal to the config's Literal).
SCHEDULES = ("afab", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev")


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
  """Idle over useful time with F = B = W = 1: (p-1)/m for AFAB and 1F1B, (p-1)/(v m) for
  interleaved, and for ZB-H1 (p-1)(F+B-W) / (m (F+B+W)) = (p-1)/(3m). V-shaped, 6m useful ticks
  a stage: ZB-V idles each stage only while the pipeline fills and drains, p − 1 ticks (the
  paper's zero bubble: every stage busy from its first action to its last), or 2(2p − 1 − m)
  when fewer than 2p − 1 micro-batches leave its warm-up short; DualPipeV the DualPipe report's
  (PP/2 − 1)(F&B + B − 3W) with PP = 2p chunks, a pair F&B = F + B + W = 3 ticks and the full
  backward B = 2: 2(p − 1) ticks."""
  if name == "interleaved":
    return (p - 1) / (v * m)
  if name == "zero_bubble":
    return (p - 1) / (3 * m)
  if name == "zbv":
    return max(p - 1, 2 * (2 * p - 1 - m)) / (6 * m)
  if name == "dualpipev":
    pp, f_and_b, b_full, w = 2 * p, 3, 2, 1  # PP: the report's stages, our chunks
    return (pp / 2 - 1) * (f_and_b + b_full - 3 * w) / (6 * m)
  return (p - 1) / m


def theory_in_flight(name: str, p: int, m: int, v: int = 1) -> int:
  """The most residual sets (one chunk for one micro-batch) a stage holds at once, by the
  papers: AFAB m, 1F1B p, interleaved v·p (Megatron), ZB-H1 2p − 1 here (its W keeps the whole
  set), ZB-V 2p (1F1B's p micro-batches of a whole stage, in half-stage chunks) and DualPipeV
  PP + 1 = 2p + 1 (the DualPipe report's table)."""
  return {"afab": m, "1f1b": p, "interleaved": v * p, "zero_bubble": min(m, 2 * p - 1),
          "zbv": 2 * p, "dualpipev": 2 * p + 1}[name]


def why_not(name: str, p: int, m: int, v: int) -> str | None:
  """Why schedule `name` cannot run p stages, m micro-batches, v chunks per stage, naming the
  config key (None: it can)."""
  if name not in SCHEDULES:
    return f"pipeline.schedule={name!r}: choose one of {', '.join(SCHEDULES)}"
  if p < 2:
    return f"mesh.stage={p}: a pipeline needs at least 2 stages"
  if m < 1 or v < 1:
    return f"pipeline.microbatches={m} and pipeline.virtual_stages={v} must be >= 1"
  if name == "interleaved":
    if v < 2:
      return ("pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2 "
              "(1 is plain 1f1b)")
    if m % p:
      return (f"pipeline.schedule=interleaved needs pipeline.microbatches ({m}) to be a "
              f"multiple of mesh.stage ({p}): micro-batches go round in groups of p")
  elif name in placement.V_SCHEDULES:
    if v != 2:
      return (f"pipeline.schedule={name} runs two chunks per stage in a V: set "
              f"pipeline.virtual_stages=2 (not {v})")
  elif v != 1:
    return (f"pipeline.virtual_stages={v} is only for pipeline.schedule=interleaved (or 2 for "
            "zbv and dualpipev); set it to 1")
  if name in ("1f1b", "zero_bubble", "zbv") and m < p:
    return (f"pipeline.schedule={name} needs pipeline.microbatches >= mesh.stage = {p} to fill "
            f"the pipeline (it is {m}); raise microbatches or use afab")
  if name == "dualpipev" and m < 2 * p:
    return (f"pipeline.schedule=dualpipev needs pipeline.microbatches >= 2 x mesh.stage = "
            f"{2 * p} (it is {m}): its steady state pairs a forward with an older micro-batch's "
            "backward; raise microbatches or use zbv")
  return None


def check_args(name: str, p: int, m: int, v: int) -> None:
  """ValueError naming the config key for shapes a schedule cannot run (`why_not`)."""
  if (why := why_not(name, p, m, v)) is not None:
    raise ValueError(why)


def make_table(name: str, p: int, m: int, v: int = 1) -> Table:
  """The action table of schedule `name` for p stages, m micro-batches, v chunks per stage."""
  check_args(name, p, m, v)
  bound = theory_in_flight(name, p, m, v)
  if name in placement.V_SCHEDULES:
    orders = (vshape.zbv_orders if name == "zbv" else vshape.dualpipev_orders)(p, m)
    kind, mb, chunk, fuse = vshape.place(p, orders)
    return Table(name, p, m, v, True, bound, kind, mb, chunk, placement="v", fuse=fuse)
  # Forward order on each stage: micro-batches in groups of p, going through the stage's
  # chunks group by group (Megatron's interleaved order; plain micro-batch order when v = 1).
  order = [((k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)]
  fwd = [[(mb, j * p + s) for mb, j in order] for s in range(p)]
  bwd = [[(mb, (v - 1 - j) * p + s) for mb, j in order] for s in range(p)]
  if name == "afab":
    limit, f_first = [m] * p, True
  else:  # in flight at once: p - s (1F1B), plus a round of p per extra chunk when interleaved
    limit, f_first = [(v - 1) * p + p - s for s in range(p)], True
  split = name == "zero_bubble"
  kind, mb, chunk = _simulate(p, v, fwd, bwd, limit, split, f_first)
  return Table(name, p, m, v, split, bound, kind, mb, chunk)


def forward_table(p: int, m: int, v: int = 1, placement: str = "interleaved") -> Table:
  """Forwards only (evaluation): every stage runs its forwards as soon as their inputs arrive
  (V placement: in ZB-V's order)."""
  if placement == "v":
    kind, mb, chunk, fuse = vshape.place(p, vshape.forward_orders(p, m))
    return Table("forward", p, m, v, False, m * v, kind, mb, chunk, backward=False,
                 placement="v", fuse=fuse)
  order = [((k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)]
  fwd = [[(mb, j * p + s) for mb, j in order] for s in range(p)]
  kind, mb, chunk = _simulate(p, v, fwd, [[] for _ in range(p)], [m * v] * p, False, True)
  return Table("forward", p, m, v, False, m * v, kind, mb, chunk, backward=False)


def _simulate(p, v, fwd, bwd, limit, split, f_first):
  """List-schedules the per-stage orders on unit ticks; returns kind, mb, chunk arrays."""
  C = p * v
  done: dict[tuple[int, int, int], int] = {}
  total = sum(len(f) for f in fwd) + 2 * sum(len(b) for b in bwd)
  fi, bi = [0] * p, [0] * p
  pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # B done, W not yet
  rows = []
  t = 0
  while len(done) < total:
    if t > 4 * total:
      raise RuntimeError("pipeline schedule deadlocked (orders and limits inconsistent)")

    def arrived(key):
      return done.get(key, t) < t

    row = []
    for s in range(p):
      act = None
      if pending[s] and (not split or len(pending[s]) >= p):
        # No split: W straight after its B. Zero bubble: W deferred, at most p of them, so a
        # stage holds at most 2p - 1 residual sets (1F1B's p in flight + p - 1 deferred).
        act = (W, *pending[s].pop(0))
      else:
        nf = fwd[s][fi[s]] if fi[s] < len(fwd[s]) else None
        nb = bwd[s][bi[s]] if bi[s] < len(bwd[s]) else None
        can_f = (nf is not None and fi[s] - bi[s] < limit[s]
                 and (nf[1] == 0 or arrived((F, nf[0], nf[1] - 1))))
        can_b = nb is not None and (arrived((F, *nb)) if nb[1] == C - 1 else
                                    arrived((B if split else W, nb[0], nb[1] + 1)))
        for k in ((F, B) if f_first else (B, F)):
          if k == F and can_f:
            act, fi[s] = (F, *nf), fi[s] + 1
            break
          if k == B and can_b:
            act, bi[s] = (B, *nb), bi[s] + 1
            pending[s].append(nb)
            break
        if act is None and split and pending[s]:
          act = (W, *pending[s].pop(0))
      row.append(act)
    for a in row:
      if a is not None:
        done[a] = t
    rows.append(row)
    t += 1
  kind = np.array([[a[0] if a else IDLE for a in r] for r in rows], np.int32)
  mb = np.array([[a[1] if a else -1 for a in r] for r in rows], np.int32)
  chunk = np.array([[a[2] if a else -1 for a in r] for r in rows], np.int32)
  return kind, mb, chunk


def validate(table: Table) -> None:
  """Raises ValueError unless `table` is runnable: chunks on their stage, each (micro-batch,
  chunk) with exactly one F, B and W, fused ops a full backward or a forward + backward pair,
  every input produced before the op that needs it starts (an op hands its outputs on when it
  ends), and at most `table.bound` residual sets held by any stage."""
  C = table.chunks
  at: dict[tuple[int, int, int], tuple[int, int]] = {}
  for t, s in zip(*np.nonzero(table.kind)):
    key = (int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s]))
    where = f"tick {t}, stage {s}: {NAMES[key[0]]} mb {key[1]} chunk {key[2]}"
    if not (0 <= key[1] < table.m and 0 <= key[2] < C):
      raise ValueError(f"{where}: micro-batch or chunk out of range")
    if table.stage_of(key[2]) != s:
      raise ValueError(f"{where}: chunk {key[2]} lives on stage {table.stage_of(key[2])}")
    if key in at:
      raise ValueError(f"{where}: already ran at tick {at[key][0]}")
    at[key] = (int(t), int(s))
  kinds = (F, B, W) if table.backward else (F,)
  for mb in range(table.m):
    for c in range(C):
      missing = [NAMES[k] for k in kinds if (k, mb, c) not in at]
      if missing:
        raise ValueError(f"mb {mb} chunk {c}: no {'/'.join(missing)}")
  _check_fused(table)
  start, end = table.starts(), table.ends()
  begins = lambda key: start[at[key]]  # the op of `key` starts / ends
  ends = lambda key: end[at[key]]
  for mb in range(table.m):
    for c in range(C):
      if not table.backward:
        if any((k, mb, c) in at for k in (B, W)):
          raise ValueError(f"forward table: mb {mb} chunk {c} has a B or W")
        if c and begins((F, mb, c)) <= ends((F, mb, c - 1)):
          raise ValueError(f"mb {mb} chunk {c}: F must come after F of the chunk before")
        continue
      ticks = {k: at[(k, mb, c)][0] for k in (F, B, W)}
      need = [(F, not c or begins((F, mb, c)) > ends((F, mb, c - 1)),
               "after F of the chunk before"),
              (B, begins((B, mb, c)) > ends((F, mb, c)), "after its F"),
              (W, ticks[W] > ticks[B], "after its B")]
      if c < C - 1:
        need.append((B, begins((B, mb, c)) > ends((B, mb, c + 1)),
                     "after the backward of the chunk after"))
      if not table.split:
        need.append((W, ticks[W] == ticks[B] + 1, "right after its B (no split)"))
      for k, ok, what in need:
        if not ok:
          raise ValueError(f"mb {mb} chunk {c}: {NAMES[k]} at tick {ticks[k]} must come {what}")
  peak = int(table.live().max())
  if peak > table.bound:
    raise ValueError(f"a stage holds {peak} residual sets, above the bound {table.bound}")


def _check_fused(table: Table) -> None:
  """Fused ops are ones the executor runs (`table.fusable`)."""
  fused = table.with_next()
  for t, s in zip(*np.nonzero(fused & (table.starts() == np.arange(table.ticks)[:, None]))):
    n = table.ends()[t, s] - t + 1
    cells = [(int(table.kind[u, s]), int(table.mb[u, s]), int(table.chunk[u, s]))
             for u in range(t, t + n)]
    if not (table.backward and fusable(cells, table.chunks)):
      raise ValueError(f"tick {t}, stage {s}: fused {''.join(NAMES[k] for k, _, _ in cells)} "
                       "is neither a full backward (B then its W) nor a pair (F, then B of "
                       "another micro-batch or chunk, optionally its W; not the last chunk's "
                       "F with a B that hands a gradient on)")
