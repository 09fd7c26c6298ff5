"""Pipeline schedules as data: for every tick and stage, the action it runs.

A schedule is a `Table`: `kind[t, s]` (IDLE, F, B or W), `mb[t, s]` (micro-batch) and
`chunk[t, s]` (model chunk; chunk c lives on stage c % p, so with v virtual stages each stage
holds chunks s, s+p, ..., the interleaved layout). Time is in unit ticks costing F = B = W = 1:
B is the input gradient (what the previous stage waits for) and W the weight gradient. Schedules
without the split (AFAB, 1F1B, interleaved) run W right after B on the same stage, and the stage
before waits for both (a full backward, t_b = 2 t_f, sends its gradient at its end); zero-bubble
(ZB-H1) sends after B and defers W into the bubbles.

Every table is built by one list scheduler (`_simulate`): each stage walks its forward and
backward orders, at each tick doing the first of {F, B} whose inputs have arrived (a message
sent at tick t can be used from tick t+1) and whose in-flight limit allows it, else a deferred
W, else idling. The schedules differ only in orders and limits: AFAB lets all m forwards run
first, 1F1B keeps p - s in flight on stage s, interleaved p - s + (v-1)p, and ZB-H1 is 1F1B
whose W's wait for idle ticks (at most p of them pending).
"""

from __future__ import annotations

import dataclasses

import numpy as np

IDLE, F, B, W = 0, 1, 2, 3
# pipeline.schedule's values (a test keeps them equal to the config's Literal).
SCHEDULES = ("afab", "1f1b", "interleaved", "zero_bubble")
NAMES = {IDLE: ".", F: "F", B: "B", W: "W"}


@dataclasses.dataclass(frozen=True)
class Table:
  """An action table. `bound`: residual sets (F done, W not yet) a stage may hold at once."""
  name: str
  p: int  # stages
  m: int  # micro-batches
  v: int  # chunks per stage
  split: bool  # B and W may be apart (zero bubble); else W always follows B at once
  bound: int
  kind: np.ndarray  # [T, p] int
  mb: np.ndarray  # [T, p] int (-1 when idle)
  chunk: np.ndarray  # [T, p] int, model chunk (-1 when idle)
  backward: bool = True  # False: forwards only (evaluation)

  @property
  def ticks(self) -> int:
    return self.kind.shape[0]

  @property
  def chunks(self) -> int:
    return self.p * self.v

  def bubble(self) -> float:
    """Idle cells over busy cells (the playbook's bubble relative to useful work)."""
    busy = int(np.count_nonzero(self.kind))
    return (self.kind.size - busy) / busy

  def live(self) -> np.ndarray:
    """[T, p]: residual sets held at the end of each tick (F done and W not yet)."""
    delta = (self.kind == F).astype(int) - (self.kind == W).astype(int)
    return np.cumsum(delta, axis=0)


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
  """Idle over useful time with F = B = W = 1: (p-1)/m for AFAB and 1F1B, (p-1)/(v m) for
  interleaved, and for ZB-H1 (p-1)(F+B-W) / (m (F+B+W)) = (p-1)/(3m)."""
  if name == "interleaved":
    return (p - 1) / (v * m)
  if name == "zero_bubble":
    return (p - 1) / (3 * m)
  return (p - 1) / m


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
  elif v != 1:
    return (f"pipeline.virtual_stages={v} is only for pipeline.schedule=interleaved; "
            "set it to 1")
  if name in ("1f1b", "zero_bubble") and m < p:
    return (f"pipeline.schedule={name} needs pipeline.microbatches ({m}) >= mesh.stage "
            f"({p}) to fill the pipeline; raise microbatches or use afab")
  return None


def check_args(name: str, p: int, m: int, v: int) -> None:
  """ValueError naming the config key for shapes a schedule cannot run (`why_not`)."""
  if (why := why_not(name, p, m, v)) is not None:
    raise ValueError(why)


def make_table(name: str, p: int, m: int, v: int = 1) -> Table:
  """The action table of schedule `name` for p stages, m micro-batches, v chunks per stage."""
  check_args(name, p, m, v)
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
  bound = {"afab": m, "1f1b": p, "interleaved": v * p, "zero_bubble": min(m, 2 * p - 1)}[name]
  kind, mb, chunk = _simulate(p, v, fwd, bwd, limit, split, f_first)
  return Table(name, p, m, v, split, bound, kind, mb, chunk)


def forward_table(p: int, m: int, v: int = 1) -> Table:
  """Forwards only (evaluation): every stage runs its forwards as soon as their inputs arrive."""
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
  chunk) with exactly one F, B and W, dependencies one tick or more apart, and at most
  `table.bound` residual sets held by any stage."""
  p, C = table.p, table.chunks
  at: dict[tuple[int, int, int], tuple[int, int]] = {}
  for t, s in zip(*np.nonzero(table.kind)):
    key = (int(table.kind[t, s]), int(table.mb[t, s]), int(table.chunk[t, s]))
    where = f"tick {t}, stage {s}: {NAMES[key[0]]} mb {key[1]} chunk {key[2]}"
    if not (0 <= key[1] < table.m and 0 <= key[2] < C):
      raise ValueError(f"{where}: micro-batch or chunk out of range")
    if key[2] % p != s:
      raise ValueError(f"{where}: chunk {key[2]} lives on stage {key[2] % p}")
    if key in at:
      raise ValueError(f"{where}: already ran at tick {at[key][0]}")
    at[key] = (int(t), int(s))
  kinds = (F, B, W) if table.backward else (F,)
  for mb in range(table.m):
    for c in range(C):
      missing = [NAMES[k] for k in kinds if (k, mb, c) not in at]
      if missing:
        raise ValueError(f"mb {mb} chunk {c}: no {'/'.join(missing)}")
  for mb in range(table.m):
    for c in range(C):
      if not table.backward:
        if any((k, mb, c) in at for k in (B, W)):
          raise ValueError(f"forward table: mb {mb} chunk {c} has a B or W")
        if c and at[(F, mb, c)][0] <= at[(F, mb, c - 1)][0]:
          raise ValueError(f"mb {mb} chunk {c}: F must come after F of the chunk before")
        continue
      ticks = {k: at[(k, mb, c)][0] for k in (F, B, W)}
      need = [(F, ticks[F] > (at[(F, mb, c - 1)][0] if c else -1), "after F of the chunk before"),
              (B, ticks[B] > ticks[F], "after its F"),
              (W, ticks[W] > ticks[B], "after its B")]
      if c < C - 1:
        before = at[(B if table.split else W, mb, c + 1)][0]
        need.append((B, ticks[B] > before, "after the backward of the chunk after"))
      if not table.split:
        need.append((W, ticks[W] == ticks[B] + 1, "right after its B (no split)"))
      for k, ok, what in need:
        if not ok:
          raise ValueError(f"mb {mb} chunk {c}: {NAMES[k]} at tick {ticks[k]} must come {what}")
  peak = int(table.live().max())
  if peak > table.bound:
    raise ValueError(f"a stage holds {peak} residual sets, above the bound {table.bound}")
