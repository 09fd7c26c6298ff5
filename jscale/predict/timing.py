"""Time every launch of a compiled step, then run the schedule: compute on one stream,
collectives on another, loops by their trip counts.

Cost rules, per launch (`rates.Chip` holds the constants and their sources):
- gemm: FLOPs at the peak of its operand type (bf16 989, fp8 1979, TF32 495 — an f32 gemm at
  default precision —, f32 67 TFLOP/s on an H100 SXM) times an efficiency from its shape: a
  ceiling for a large gemm (`Fit.gemm_ceiling`, `Fit.tf32_ceiling` for f32 operands), times
  the wave quantisation of the best of cuBLAS's usual Hopper tiles (128x256, 256x128, 128x128)
  over the 132 SMs, times k / (k + k_half) for short dot products; never faster than its
  operands and result move through HBM.
- attention (cuDNN's fused kernels, jscale's Pallas flash kernels): FLOPs over the rate
  measured for that kernel, sequence length and head dim (`rates.ATTENTION`).
- other Pallas kernels: RMSNorm at its measured share of copy bandwidth; the grouped matmul
  and its transposed (dW) kernel at their measured bf16 rates (`rates.GROUPED`; the
  row-grouped kernel on 64-column tiles at `rates.GROUPED_NARROW`; on e4m3
  operands scaled by the FP8:bf16 peak, as XLA's FP8 gemms are: no FP8 rate measured); any
  other as a roofline, flagged.
- everything else (XLA's loop / input / Triton fusions, copies, dynamic-update-slices): bytes
  read + written over the copy bandwidth times `Fit.memory`.
- every kernel adds `Fit.launch_s` (what a profile shows as idle between kernels).
- host offload (`remat: offload`): the async fusions that write activations into host memory
  or read them back, their slice's bytes over the host link (`hardware.HOST_LINK_BYTES_S`), on
  a stream of their own, waited for at their -done like a collective.
- collectives: playbook volume (`jscale.analysis.volume`) over the bus bandwidth of the link
  their groups span (`jscale.hardware.busbw`), plus `Fit.collective_s`.
The schedule: a collective's -start queues it on the communication stream, its -done makes the
compute stream wait for it, so only the part that outlasts the compute between them is exposed
(the playbook's overlap arithmetic, A3). A loop runs its body twice (the second pass is the
steady state, with collectives started in the previous iteration) and the rest as the second.
A conditional's longest branch is taken and named, except the pipeline executor's per-tick
switch (`pipeline.program.TICK_SCOPE`): given the executed table's codes, each tick is timed at
the longest branch its stages run then (the stages' ticks run in lockstep, each ending in their
ppermutes), and the tick loop's trips one by one.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp
import numpy as np

from jscale import hardware
from jscale.analysis import volume
from jscale.parallel.pipeline.program import TICK_SCOPE
from jscale.predict import rates
from jscale.predict.launches import Branches, Item, Launch, Loop
from pallas_kernels.grouped_matmul import hopper_config as gmm_config

_TILES = ((128, 256), (256, 128), (128, 128))


@dataclasses.dataclass
class Timed:
  """A launch with its predicted time (per run) and how often a step runs it."""
  launch: Launch
  seconds: float        # device time of one run, kernel only
  gap: float            # launch overhead that follows it
  bound: str            # compute | memory | launch | measured | roofline | link
  runs: int = 0
  note: str = ""


def gemm_efficiency(batch: int, m: int, n: int, k: int, chip: rates.Chip,
                    ceiling: float | None = None) -> float:
  """Fraction of peak a tuned gemm reaches: the ceiling (default: bf16's), wave quantisation,
  short k."""
  best = 0.0
  for tm, tn in _TILES:
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / chip.sms)
    used = batch * m * n / (waves * chip.sms * tm * tn)
    best = max(best, used)
  short_k = k / (k + chip.fit.gemm_k_half) if chip.fit.gemm_k_half else 1.0
  return (ceiling or chip.fit.gemm_ceiling) * best * short_k


def time_launch(x: Launch, chip: rates.Chip) -> Timed:
  """The predicted device time of one run of `x`."""
  fit, mem = chip.fit, lambda b: b / chip.hbm_bytes_s
  if x.kind == "gemm":
    f32 = x.dtype == "f32"
    peak = chip.peak["f32" if x.highest else "tf32"] if f32 else chip.peak[x.dtype]
    ceiling = chip.fit.tf32_ceiling if f32 else None
    compute = x.flops / (peak * gemm_efficiency(*x.mnk, chip, ceiling)) if x.flops else 0.0
    memory = mem(x.bytes)
    return Timed(x, max(compute, memory), fit.launch_s,
                 "compute" if compute >= memory else "memory")
  if x.kind == "attention":
    a = x.attention
    rate, note = rates.attention_rate(a["impl"], a["causal"], a["head_dim"], a["seq"],
                                      a["pass"] == "bwd", a.get("v_head_dim"))
    if rate is None:
      return Timed(x, x.flops / chip.peak["bf16"], fit.launch_s, "roofline", note=note)
    return Timed(x, x.flops / rate, fit.launch_s, "measured", note=note)
  if x.kind == "kernel":
    return _pallas_kernel(x, chip)
  if x.kind == "collective":
    return _collective(x, chip)
  if x.kind == "done":
    return Timed(x, 0.0, 0.0, "link")
  if x.kind == "transfer":
    return Timed(x, x.bytes / chip.host_bytes_s, 0.0, "host link")
  t = mem(x.bytes) / fit.memory
  if x.online and x.online / rates.ONLINE_SOFTMAX > t:
    return Timed(x, x.online / rates.ONLINE_SOFTMAX, fit.launch_s, "measured",
                 note="online softmax reduction")
  return Timed(x, t, fit.launch_s, "memory" if t > fit.launch_s else "launch")


def _pallas_kernel(x: Launch, chip: rates.Chip) -> Timed:
  name = x.label
  impl = "hopper" if "hopper" in name else "pallas"
  if "rms_norm" in name:
    share = rates.NORM[(impl, "bwd" if "bwd" in name else "fwd")]
    return Timed(x, x.bytes / (chip.hbm_bytes_s * share), chip.fit.launch_s, "measured")
  if "grouped_matmul" in name:
    x.flops = _grouped_flops(x)
    rate, note = _grouped_rate(x)
    if x.dtype == "f8":  # as XLA's FP8 gemms: the bf16 efficiency at the FP8 peak
      rate *= chip.peak["f8"] / chip.peak["bf16"]
      note += ", bf16's, scaled to the FP8 peak (no FP8 rate measured)"
    t = max(x.flops / rate, x.bytes / chip.hbm_bytes_s)
    return Timed(x, t, chip.fit.launch_s, "measured", note=note)
  t = x.bytes / chip.hbm_bytes_s
  return Timed(x, t, chip.fit.launch_s, "roofline", note=f"{name}: no measured rate")


def _grouped_rate(x: Launch) -> tuple[float, str]:
  """(FLOP/s, note) of a grouped matmul kernel: its measured rate, the row-grouped kernel's
  lower one where its output columns tile narrower than the default (`rates.GROUPED_NARROW`)."""
  if "transposed" in x.label:
    return rates.GROUPED["transposed_grouped_matmul"], "transposed_grouped_matmul: 8 x 4096 rows"
  f8 = x.dtype == "f8"
  default = gmm_config.DEFAULT_FP8 if f8 else gmm_config.DEFAULT
  n, k = x.mnk[2], x.mnk[3]
  tiles = gmm_config.fit(default, k, n, jnp.float8_e4m3fn if f8 else jnp.bfloat16)
  if n and tiles.tile_n < default.tile_n:
    return rates.GROUPED_NARROW, (f"grouped_matmul: {tiles.tile_n}-column tiles for {n} "
                                  f"columns, the rate of DeepSeek-V3's 1408")
  return rates.GROUPED["grouped_matmul"], "grouped_matmul: 8 x 4096 rows"


def _grouped_flops(x: Launch) -> float:
  """2·M·K·N of a grouped matmul (each row times its own expert's [K, N]); set by
  `program` from the operands as (batch=1, M, N, K)."""
  return 2.0 * x.mnk[1] * x.mnk[2] * x.mnk[3] if x.mnk[1] else 0.0


def _collective(x: Launch, chip: rates.Chip) -> Timed:
  c = x.collective
  if c is None or c.group_size == 1 or (c.groups is not None and len(c.groups[0]) <= 1
                                         and c.kind != "collective-permute"):
    return Timed(x, 0.0, 0.0, "link", note="group of one device")
  bytes_ = volume.collective_volume(dataclasses.replace(c, executions=1))
  # Nodes one group spans (devices are numbered node by node, `gpu_target.topology_name`).
  nodes = len({d // chip.per_node for d in c.groups[0]}) if c.groups else 1
  kind = {"collective-permute": "permute"}.get(c.kind, c.kind)
  t = bytes_ / hardware.busbw(kind, nodes) + chip.fit.collective_s
  return Timed(x, t, 0.0, "link", note=f"{nodes} node(s)" if nodes > 1 else "")


# ------------------------------------------------------------------------------- the schedule
@dataclasses.dataclass
class _Clock:
  t: float = 0.0             # compute stream
  comm_free: float = 0.0     # communication stream
  host_free: float = 0.0     # the host link's copies (host-offloaded activations)
  pending: dict = dataclasses.field(default_factory=dict)  # start name -> finish time
  # collective name -> seconds a step's compute stream waits for it (its -done, or a
  # synchronous collective's queue and run), each wait counted `wait_runs` times (0 in a
  # conditional's trials; the dict is shared by the copies they make)
  waits: dict = dataclasses.field(default_factory=dict)
  wait_runs: int = 1

  def shift(self, dt: float, keep: frozenset = frozenset()) -> None:
    """Moves the streams `dt` later; so do the transfers in flight, except those named in
    `keep` (started before a loop whose trips are extrapolated: they finish when they do)."""
    self.t += dt
    self.comm_free += dt
    self.host_free += dt
    self.pending = {k: v if k in keep else v + dt for k, v in self.pending.items()}


@dataclasses.dataclass
class Schedule:
  """A step as predicted: wall time and every timed launch with its runs per step."""
  seconds: float
  timed: list[Timed]
  branches: list[str]       # which branch each conditional was timed by
  unknown_trips: list[str]  # loops XLA gave no trip count (timed once)
  ticks: str = ""           # how the pipeline executor's ticks were timed ("" without)
  # collective name -> seconds per step the compute stream waits for it (a loop's first trip
  # once and its steady state for the others, as the step's time is extrapolated)
  waits: dict[str, float] = dataclasses.field(default_factory=dict)
  # Each loop's two streams per trip and its waits (`loops.LoopTime`), and the step with each
  # loop's collectives hidden within it (`loops.ceiling_s`); set by `jscale.predict.predict`.
  loops: list = dataclasses.field(default_factory=list)
  loop_ceiling_s: float | None = None


_TICK = re.compile(rf"/{TICK_SCOPE}/[^/]+$")


@dataclasses.dataclass
class _Notes:
  """What the walk records, and the pipeline executor's ticks as it runs them."""
  ticks: np.ndarray | None  # [T, p]: the switch branch each stage runs per executed tick
  branches: list[str] = dataclasses.field(default_factory=list)
  unknown: list[str] = dataclasses.field(default_factory=list)
  tick: int = 0             # ticks timed so far

  def is_tick(self, it: Branches) -> bool:
    """The switch itself, directly under the scope (not a conditional inside its branches)."""
    return self.ticks is not None and _TICK.search(it.op_name) is not None

  def holds_ticks(self, items: list[Item]) -> bool:
    return any(self.is_tick(x) if isinstance(x, Branches) else
               isinstance(x, Loop) and self.holds_ticks(x.body) for x in items)


def schedule(items: list[Item], chip: rates.Chip, ticks: np.ndarray | None = None) -> Schedule:
  """Runs `items` (a `program.Program`'s entry) on the two streams. `ticks`: the pipeline
  executor's branch per executed tick and stage (`pipeline.program.Program.code`), so that
  each tick is timed at the longest op a stage runs in it (the ticks run in lockstep), not
  every tick at the switch's longest branch."""
  timed: dict[str, Timed] = {}
  notes = _Notes(None if ticks is None else np.asarray(ticks))
  clock = _Clock()
  _run(items, clock, 1, timed, notes, chip)
  said = ""
  if notes.ticks is not None:
    said = (f"pipeline: {notes.tick} ticks timed from the executed table, each at the longest "
            f"op a stage runs in it" + ("" if notes.tick == len(notes.ticks) else
                                        f" (the table has {len(notes.ticks)}: check the loop)"))
  return Schedule(clock.t, list(timed.values()), notes.branches, notes.unknown, said,
                  clock.waits)


def _run(items, clock: _Clock, runs: int, timed, notes: _Notes, chip, count: bool = True
         ) -> None:
  for it in items:
    if isinstance(it, Loop):
      _loop(it, clock, runs, timed, notes, chip, count)
    elif isinstance(it, Branches):
      _branches(it, clock, runs, timed, notes, chip, count)
    else:
      _launch(it, clock, runs, timed, chip, count)


def _loop(it: Loop, clock: _Clock, runs: int, timed, notes: _Notes, chip, count: bool) -> None:
  trips = it.trips if it.trips is not None else 1
  if it.trips is None and count:
    notes.unknown.append(it.name)
  if notes.holds_ticks(it.body):  # every trip runs ticks of its own: no steady state
    for _ in range(trips):
      _run(it.body, clock, runs, timed, notes, chip, count)
    return
  before = frozenset(clock.pending)  # in flight across the loop: host copies, or collectives
  # XLA keeps in flight past it (xla_gpu_experimental_parallel_collective_overlap_limit > 1)
  _run(it.body, clock, runs * trips, timed, notes, chip, count)
  if trips > 1:
    t1, weight = clock.t, clock.wait_runs
    clock.wait_runs = weight * (trips - 1)  # the steady state's waits stand for trips 2..n
    _run(it.body, clock, 0, timed, notes, chip, False)  # steady state
    clock.wait_runs = weight
    clock.shift((trips - 2) * (clock.t - t1), keep=before)


def _branches(it: Branches, clock: _Clock, runs: int, timed, notes: _Notes, chip,
              count: bool) -> None:
  """The longest branch; for an executor tick, the longest of those its stages run."""
  trials = []
  for branch in it.branches:
    trials.append(dataclasses.replace(clock, pending=dict(clock.pending), wait_runs=0))
    _run(branch, trials[-1], 0, timed, notes, chip, False)
  if not trials:
    return
  candidates, tick = range(len(trials)), notes.is_tick(it)
  if tick and notes.ticks is not None:
    candidates = sorted({int(c) for c in notes.ticks[notes.tick % len(notes.ticks)]})
    notes.tick += 1
  pick = max(candidates, key=lambda i: trials[i].t)
  _run(it.branches[pick], dataclasses.replace(clock, pending=dict(clock.pending)), runs, timed,
       notes, chip, count)
  best = trials[pick]
  clock.t, clock.comm_free, clock.pending = best.t, best.comm_free, best.pending
  if count and not tick:
    notes.branches.append(f"{it.name}: branch {pick} of {len(it.branches)}")


def _launch(it: Launch, clock: _Clock, runs: int, timed, chip, count: bool) -> None:
  x = timed.get(it.name) or time_launch(it, chip)
  if count:
    x.runs += runs
    timed[it.name] = x
  if it.kind == "collective" and it.op.endswith("-start") or it.op == "async-start":
    begin = max(clock.t, clock.comm_free)
    clock.comm_free = begin + x.seconds
    clock.pending[it.name] = clock.comm_free
  elif it.kind == "collective":  # synchronous: the compute stream waits
    _waited(clock, it.name, max(clock.t, clock.comm_free) + x.seconds)
    clock.comm_free = clock.t
  elif it.kind == "transfer":  # async over the host link, waited for at its -done
    clock.host_free = max(clock.t, clock.host_free) + x.seconds
    clock.pending[it.name] = clock.host_free
  elif it.kind == "done":
    _waited(clock, it.done_of, clock.pending.pop(it.done_of, clock.t))
  else:
    clock.t += x.seconds + x.gap


def _waited(clock: _Clock, name: str, ready: float) -> None:
  """The compute stream waits until `ready` for collective `name`: recorded per step."""
  if clock.wait_runs and ready > clock.t:
    clock.waits[name] = clock.waits.get(name, 0.0) + (ready - clock.t) * clock.wait_runs
  clock.t = max(clock.t, ready)
