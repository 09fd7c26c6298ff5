"""A predicted step as a user reads it: time, tokens/s and MFU; time by the categories and
kernel names of `python -m jscale.profile` (so a prediction and a GPU trace compare line by
line); the top kernels and what bounds each; and what stands between the step and 55% MFU."""

from __future__ import annotations

import dataclasses

from jscale.predict.rates import Chip
from jscale.predict.timing import Schedule, Timed
from jscale.profile import CATEGORIES, categorize

TARGET_MFU = 0.55
# The report lists at most this many kinds of exposed collectives (each over 1% of the exposed
# time), then the rest's sum.
EXPOSED_KINDS = 8


def category(x: Timed) -> str:
  """The profile's category of a predicted launch (gemm / attention / collectives by what it
  is, the rest by its kernel name, as `jscale.profile.categorize` reads a trace)."""
  kind = x.launch.kind
  if kind in ("gemm", "attention"):
    return kind
  if kind in ("collective", "done"):
    return "collectives"
  if kind == "transfer":  # host offload copies: what a profile shows as memcpy
    return "copies"
  if "grouped_matmul" in x.launch.label:
    return "gemm"
  return categorize(x.launch.kernel_name, x.launch.label)


@dataclasses.dataclass
class Summary:
  """The figures of a prediction (what `--json` prints)."""
  step_s: float
  tokens_per_s: float
  mfu: float
  model_flops: float                  # per device per step
  peak_flops: float                   # the MFU denominator (dense bf16)
  by_category: dict[str, float]       # seconds per step, "idle" the launch gaps
  exposed_collectives_s: float
  top: list[dict]
  gap_to_target: list[tuple[str, float]]  # (what, seconds it costs)
  notes: list[str]
  # Per device: what the compiled step holds, and what XLA may plan for as the trainer
  # launches it (None: not known, e.g. for --hlo). Above the limit the step does not fit.
  memory_bytes: int | None = None
  memory_limit: int | None = None
  # Where XLA's remat pass warned it could not get the step under its limit: its estimate
  # (`jscale.analysis.compiler_log`). Not a verdict: the buffers as assigned are what a run
  # allocates (results/h200_measured/memory_check_h200.md: a step warned so ran).
  remat_limit_bytes: int | None = None
  remat_reached_bytes: int | None = None
  # (what, seconds per step): the collectives the compute stream waits for, most first,
  # grouped by kind, size and span (`exposed_by`)
  exposed_by: list[tuple[str, float]] = dataclasses.field(default_factory=list)
  # The compute stream's kernels and launch gaps, and the collectives' own time (XLA:GPU runs
  # them one after another on its collective stream): the step with every collective hidden
  # is the longer of the two (`overlap_ceiling_s`), whatever the schedule.
  busy_s: float = 0.0
  collectives_s: float = 0.0
  # The loops that wait for collectives, in program order (`loops.LoopTime` as dicts: per trip
  # compute_s and collectives_s, per step exposed_s, and collective_bound), and the step with
  # every collective hidden within its own loop (`loops.ceiling_s`; None: not known)
  loops: list[dict] = dataclasses.field(default_factory=list)
  loop_ceiling_s: float | None = None

  @property
  def overlap_ceiling_s(self) -> float:
    """The shortest step this program allows by overlap alone: its compute stream's time, or
    its one collective stream's, whichever is longer (host transfers have their own engines)."""
    return max(self.busy_s, self.collectives_s)

  @property
  def fits(self) -> bool | None:
    """Whether the compiled step's buffers fit the device (None: unknown)."""
    if self.memory_bytes is None or self.memory_limit is None:
      return None
    return self.memory_bytes <= self.memory_limit


def summarize(s: Schedule, chip: Chip, model_flops: float, tokens: int, top: int = 20
              ) -> Summary:
  """`s` with the step's model FLOPs (per device) and trained tokens (all devices)."""
  by = {c: 0.0 for c in CATEGORIES}
  gaps = busy = 0.0
  for x in s.timed:
    by[category(x)] += x.seconds * x.runs
    gaps += x.gap * x.runs
    # collectives and host transfers run beside the compute; waiting for them is "exposed"
    busy += (0.0 if x.launch.kind in ("collective", "done", "transfer") else
             (x.seconds + x.gap) * x.runs)
  by["idle"] = gaps
  exposed = max(0.0, s.seconds - busy)
  peak = chip.peak["bf16"]
  rows = sorted(s.timed, key=lambda x: -x.seconds * x.runs)[:top]
  top_rows = [{"kernel": x.launch.kernel_name, "runs": x.runs, "ms": x.seconds * x.runs * 1e3,
               "category": category(x), "bound": x.bound, "what": _what(x), "note": x.note}
              for x in rows if x.runs]
  notes = ([f"{len(s.branches)} conditional(s) timed by their longest branch: "
            + "; ".join(s.branches[:4]) + ("; ..." if len(s.branches) > 4 else "")]
           if s.branches else [])
  notes += [s.ticks] if s.ticks else []
  notes += ([f"loop {n}: trip count unknown to XLA, timed once" for n in s.unknown_trips]
           + sorted({x.note for x in s.timed if x.runs and x.bound == "roofline" and x.note}))
  return Summary(s.seconds, tokens / s.seconds, model_flops / (s.seconds * peak), model_flops,
                 peak, by, exposed, top_rows, _gap(s, chip, model_flops, exposed, gaps), notes,
                 exposed_by=exposed_by(s), busy_s=busy, collectives_s=by["collectives"],
                 loops=[{**dataclasses.asdict(x), "collective_bound": x.collective_bound}
                        for x in s.loops if x.exposed_s > 0],
                 loop_ceiling_s=s.loop_ceiling_s)


def exposed_by(s: Schedule) -> list[tuple[str, float]]:
  """Where the exposed collective time goes: the compute stream's waits for each collective
  (its -done, or a synchronous one's queue and run), summed over the collectives of one kind,
  size and span, every kind, most first. A loop's waits are weighted as its time is
  extrapolated (first trip once, steady state for the rest), so the rows add up to about the
  exposed total."""
  named = {x.launch.name: x for x in s.timed}
  by: dict[str, list] = {}
  for name, t in s.waits.items():
    x = named.get(name)
    what = "?" if x is None else _what(x) + (f" ({x.note})" if x.note else "")
    row = by.setdefault(what, [0.0, 0])
    row[0] += t
    row[1] += 1
  rows = sorted(by.items(), key=lambda kv: -kv[1][0])
  return [(f"{what}, {n} launch{'es' if n > 1 else ''}", t) for what, (t, n) in rows]


def _what(x: Timed) -> str:
  l = x.launch
  if l.kind == "gemm":
    b, m, n, k = l.mnk
    return f"{l.dtype}{' HIGHEST' if l.highest else ''} {'%dx' % b if b > 1 else ''}{m}x{n}x{k}"
  if l.kind == "attention":
    a = l.attention
    v = a.get("v_head_dim", a["head_dim"])
    return (f"{a['impl']} {a['pass']} seq {a['seq']} head {a['head_dim']}"
            + (f"/{v}" if v != a["head_dim"] else ""))
  if l.kind == "collective" and l.collective is not None:
    return f"{l.collective.kind} {l.collective.bytes / 2**20:.1f} MiB"
  return f"{l.label} {l.bytes / 2**20:.1f} MiB"


def _gap(s: Schedule, chip: Chip, model_flops: float, exposed: float, gaps: float
         ) -> list[tuple[str, float]]:
  """What the step spends beyond the 55%-MFU step, largest first: f32 gemms (over their bf16
  time), recomputed kernels, exposed communication, launch gaps, and the non-gemm categories."""
  f32 = recomputed = 0.0
  by: dict[str, float] = {}
  for x in s.timed:
    t = x.seconds * x.runs
    if x.launch.kind == "gemm" and x.launch.dtype == "f32":
      f32 += t * (1 - chip.peak["tf32"] / chip.peak["bf16"])
    if "rematted_computation" in x.launch.op_name:
      recomputed += t
    if category(x) in ("elementwise/fusion", "copies"):
      by[category(x)] = by.get(category(x), 0.0) + t
  items = [("f32 / TF32 gemms (their time over bf16's)", f32),
           ("recomputed kernels (remat)", recomputed), ("exposed collectives", exposed),
           ("launch gaps", gaps), *((f"{c} kernels", t) for c, t in by.items())]
  return sorted([(w, t) for w, t in items if t > 1e-6], key=lambda wt: -wt[1])


def format_summary(r: Summary, header: str) -> str:
  """The report as text."""
  ms = lambda sec: sec * 1e3
  target_s = r.model_flops / (TARGET_MFU * r.peak_flops)
  lines = [header,
           f"predicted step {ms(r.step_s):.1f} ms, {r.tokens_per_s:,.0f} tokens/s, MFU "
           f"{r.mfu:.1%} (exposed collectives {ms(r.exposed_collectives_s):.1f} ms)",
           *memory_lines(r), "",
           f"{'category':<22}{'ms':>10}{'% of step':>11}"]
  for c, t in r.by_category.items():
    lines.append(f"{c:<22}{ms(t):>10.2f}{t / r.step_s:>11.1%}")
  lines += ["", f"top {len(r.top)} kernels by predicted time:",
            f"{'ms':>9}{'runs':>6}  {'category':<19}{'bound':<9}{'kernel':<44}what"]
  for k in r.top:
    lines.append(f"{k['ms']:>9.2f}{k['runs']:>6}  {k['category']:<19}{k['bound']:<9}"
                 f"{k['kernel'][:43]:<44}{k['what']}{'  (' + k['note'] + ')' if k['note'] else ''}")
  lines += ["", f"to {TARGET_MFU:.0%} MFU the step must take {ms(target_s):.1f} ms "
            f"({_to_target(r.step_s - target_s)}); where the time goes beyond the "
            "gemms and attention:"]
  lines += [f"  {ms(t):>8.1f} ms  {w}" for w, t in r.gap_to_target]
  shown = [(w, t) for w, t in r.exposed_by[:EXPOSED_KINDS]
           if t >= 0.01 * r.exposed_collectives_s > 0]
  if shown:
    lines += ["", "the collectives the compute waits for (the exposed time, by kind):"]
    lines += [f"  {ms(t):>8.1f} ms  {w}" for w, t in shown]
    rest = r.exposed_by[len(shown):]
    if rest:  # what the list leaves out, so its rows add up to the exposed total
      lines.append(f"  {ms(sum(t for _, t in rest)):>8.1f} ms  {len(rest)} more kind"
                   f"{'s' if len(rest) > 1 else ''}, the largest {ms(rest[0][1]):.1f} ms")
  if r.exposed_collectives_s > 0:
    ceiling = r.overlap_ceiling_s
    lines += ["", f"with every collective hidden the step would take {ms(ceiling):.1f} ms, MFU "
              f"{r.model_flops / (ceiling * r.peak_flops):.1%}: the "
              + ("compute stream's" if r.busy_s >= r.collectives_s else
                 "collective stream's (XLA:GPU runs one collective at a time)")
              + f" time (compute {ms(r.busy_s):.1f} ms, collectives {ms(r.collectives_s):.1f} ms)"]
    lines += loop_lines(r)
  lines += [f"note: {n}" for n in r.notes]
  return "\n".join(lines)


def loop_lines(r: Summary) -> list[str]:
  """The loops holding the exposed time, each trip's two streams, and the step with every
  collective hidden within its own loop (`jscale.predict.loops`)."""
  ms = lambda sec: sec * 1e3
  shown = [x for x in r.loops if x["exposed_s"] >= 0.01 * r.exposed_collectives_s]
  out = []
  if shown:
    out += ["", "the loops that wait, nested ones indented (exposed per step, inner loops' "
            "waits included; per trip: compute / collectives):"]
    out += [f"  {ms(x['exposed_s']):>8.1f} ms  {'  ' * x['depth']}{x['name']} x{x['runs']}: "
            f"{ms(x['compute_s']):.1f} / {ms(x['collectives_s']):.1f} ms"
            + (" collective-bound" if x["collective_bound"] else "")
            + f"  {_short(x['source'])}" for x in shown]
  if r.loop_ceiling_s is not None and r.loop_ceiling_s > r.overlap_ceiling_s * 1.001:
    out += [f"with every collective hidden within its own loop: {ms(r.loop_ceiling_s):.1f} ms, "
            f"MFU {r.model_flops / (r.loop_ceiling_s * r.peak_flops):.1%} (a collective-bound "
            "loop's transfers outlast its compute, and no other loop's compute runs beside "
            "them)"]
  return out


def _short(source: str) -> str:
  """A loop's JAX source without the step's own prefix."""
  return source.split("shard_map/")[-1].split("jit(step)/")[-1][-90:]


def memory_lines(r: Summary) -> list[str]:
  """What the compiled step holds per device against what XLA may use, and the remat pass's
  warning if it drew one; a step that does not fit says so above all else."""
  gib = lambda b: f"{b / 2**30:.1f} GiB"
  out = []
  if r.memory_bytes is not None and r.fits is None:
    out.append(f"memory {gib(r.memory_bytes)} per device (no device limit known)")
  elif r.fits is False:
    out.append(f"DOES NOT FIT: the compiled step needs {gib(r.memory_bytes)} per device, over "
               f"the {gib(r.memory_limit)} XLA may use: expect out-of-memory, not the speed "
               "above")
  elif r.fits:
    out.append(f"memory {gib(r.memory_bytes)} per device of the {gib(r.memory_limit)} XLA may "
               "use: fits")
  if r.remat_reached_bytes is not None:
    said = (f"XLA's remat pass estimated the step at {gib(r.remat_reached_bytes)}, over its "
            f"{gib(r.remat_limit_bytes)}")
    out.append(f"note: {said}; its buffers as assigned fit, and they are what a run allocates "
               "(such a step ran on an H200: results/h200_measured/memory_check_h200.md)"
               if r.fits else f"{said} too")
  return out


def _to_target(seconds: float) -> str:
  """How far the predicted step is from the target step time, in words."""
  ms = 1e3 * abs(seconds)
  return f"{ms:.1f} ms less than predicted" if seconds > 0 else f"already {ms:.1f} ms under it"
