"""`python -m jscale.profile RUN_DIR`: where the device time of a traced run goes.

Reads the jax.profiler trace that `train.profile_steps` writes (the newest
`RUN_DIR/profile/**/*.xplane.pb`, or a trace file or directory given directly) with
`jax.profiler.ProfileData` — no TensorBoard — and prints the playbook's "table of the profiling
results, sorted by total CUDA time": time by category and the top kernels with their counts.

  * GPU: the kernels, copies and memsets on the first GPU plane's stream lines.
  * CPU (tests, development): device 0's XLA:CPU thunks (events carrying an `hlo_op`),
    without the `while` / `conditional` / `call` thunks that only contain others.

Categories, from kernel and HLO op names: gemm (cuBLAS / nvjet / CUTLASS / XLA's gemm fusions,
XLA:CPU dots), attention (cuDNN fused attention, flash kernels), collectives (NCCL), copies
(memcpy / memset / copy and transpose ops), elementwise/fusion (the rest: XLA's loop and
reduction fusions). Kernel time can overlap across streams (compute beside communication);
`idle` is the traced span minus the union of all kernels' intervals.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys

from jscale import exit_codes

CATEGORIES = ("gemm", "attention", "collectives", "elementwise/fusion", "copies")
_RULES = (  # first match wins: cuDNN's attention helpers have "dot" in their names
    ("collectives", ("nccl", "all-reduce", "allreduce", "all_reduce", "all-gather", "allgather",
                     "all_gather", "reduce-scatter", "reducescatter", "reduce_scatter",
                     "all-to-all", "alltoall", "all_to_all", "collective-permute",
                     "collective_permute", "sendrecv")),
    ("attention", ("sdpa", "fmha", "flash", "attention", "cudnn", "mha_")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "dot", "ynn_fusion",
              "ragged")),
    ("copies", ("memcpy", "memset", "copy", "transpose", "dynamic-update-slice",
                "dynamic_update_slice")),
)
_CONTAINERS = ("while", "conditional", "call")  # XLA:CPU thunks that run the ops nested in them


def categorize(name: str, hlo_op: str = "") -> str:
  """The category of a kernel (GPU kernel name) or op (XLA HLO op name)."""
  text = f"{name} {hlo_op}".lower()
  return next((cat for cat, keys in _RULES if any(k in text for k in keys)),
              "elementwise/fusion")


@dataclasses.dataclass
class Kernel:
  name: str
  category: str
  count: int
  total_ns: float


@dataclasses.dataclass
class Summary:
  """Device time of a trace: by category, by kernel, and the idle share of the span."""
  trace: str
  device: str
  span_ns: float  # first kernel start to last kernel end
  busy_ns: float  # union of kernel intervals
  by_category: dict[str, float]  # kernel time (overlapping streams count twice)
  kernels: list[Kernel]  # by total time, largest first
  steps: int | None = None  # traced steps, when the run's metadata says

  @property
  def kernel_ns(self) -> float:
    return sum(self.by_category.values())

  @property
  def idle_ns(self) -> float:
    return max(self.span_ns - self.busy_ns, 0.0)

  def shares(self) -> dict[str, float]:
    """Each category's share of the span, and "idle" (the union-based remainder)."""
    span = self.span_ns or 1.0
    return {**{c: self.by_category.get(c, 0.0) / span for c in CATEGORIES},
            "idle": self.idle_ns / span}


def find_trace(path: str) -> str:
  """The newest .xplane.pb under `path` (a run dir, its profile dir, or the file itself)."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no *.xplane.pb under {path}: run with train.profile_steps=[a,b] "
                            "(the trace goes to <train.output_dir>/profile)")
  return max(found, key=os.path.getmtime)


def _events(trace: str) -> tuple[str, list[tuple[str, str, float, float]]]:
  """(device label, [(name, hlo_op, start_ns, duration_ns)]) of the trace's device work."""
  from jax.profiler import ProfileData
  planes = list(ProfileData.from_file(trace).planes)
  gpus = sorted((p for p in planes if p.name.startswith("/device:GPU")), key=lambda p: p.name)
  out = []
  if gpus:
    for line in gpus[0].lines:
      if line.name.startswith("Stream"):
        for e in line.events:
          out.append((e.name, str(dict(e.stats).get("hlo_op", "")), e.start_ns, e.duration_ns))
    return gpus[0].name, out
  for plane in planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        op = stats.get("hlo_op")
        if (op is not None and not str(op).startswith(_CONTAINERS)
            and int(stats.get("device_ordinal", 0)) == 0):
          out.append((e.name, str(op), e.start_ns, e.duration_ns))
  return "/host:CPU device 0 (XLA:CPU thunks)", out


def union_ns(intervals) -> float:
  """Total length of the union of (start, end) intervals (overlaps counted once)."""
  total, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def summarize(path: str) -> Summary:
  """The summary of the newest trace under `path`."""
  trace = find_trace(path)
  device, events = _events(trace)
  if not events:
    raise ValueError(f"{trace}: no device kernels or XLA ops in the trace")
  kernels: dict[str, Kernel] = {}
  by_category = {c: 0.0 for c in CATEGORIES}
  for name, op, _, dur in events:
    k = kernels.setdefault(name, Kernel(name, categorize(name, op), 0, 0.0))
    k.count += 1
    k.total_ns += dur
    by_category[k.category] += dur
  spans = [(s, s + d) for _, _, s, d in events]
  return Summary(trace, device, max(e for _, e in spans) - min(s for s, _ in spans),
                 union_ns(spans), by_category,
                 sorted(kernels.values(), key=lambda k: -k.total_ns), _traced_steps(trace))


def _traced_steps(trace: str) -> int | None:
  # <output_dir>/profile/plugins/profile/<time>/<host>.xplane.pb; run.json in <output_dir>.
  run_dir = os.path.dirname(trace)
  for _ in range(5):
    run_dir = os.path.dirname(run_dir)
    info = os.path.join(run_dir, "run.json")
    if os.path.isfile(info):
      with open(info, encoding="utf-8") as f:
        steps = json.load(f)["config"]["train"].get("profile_steps")
      return steps[1] - steps[0] + 1 if steps else None
  return None


def format_summary(s: Summary, top: int = 20) -> str:
  """The summary as text: categories, then the top kernels by total time."""
  ms = lambda ns: ns / 1e6
  per_step = f", {ms(s.span_ns) / s.steps:.1f} ms per step ({s.steps} steps)" if s.steps else ""
  lines = [f"trace: {s.trace}", f"device: {s.device}",
           f"span {ms(s.span_ns):.1f} ms{per_step}; kernels busy {ms(s.busy_ns):.1f} ms "
           f"({s.busy_ns / s.span_ns:.1%}), idle {ms(s.idle_ns):.1f} ms "
           f"({s.idle_ns / s.span_ns:.1%})", "",
           f"{'category':<22}{'ms':>10}{'% of span':>11}{'% of kernels':>14}"]
  for c in CATEGORIES:
    t = s.by_category[c]
    lines.append(f"{c:<22}{ms(t):>10.2f}{t / s.span_ns:>11.1%}{t / (s.kernel_ns or 1):>14.1%}")
  lines.append(f"{'idle':<22}{ms(s.idle_ns):>10.2f}{s.idle_ns / s.span_ns:>11.1%}")
  lines += ["", f"top {top} kernels by total time:",
            f"{'ms':>10}{'%':>7}{'count':>7}  {'category':<20}name"]
  for k in s.kernels[:top]:
    lines.append(f"{ms(k.total_ns):>10.2f}{k.total_ns / (s.kernel_ns or 1):>7.1%}{k.count:>7}  "
                 f"{k.category:<20}{k.name[:110]}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jscale.profile",
                              description="Device time of a traced run by category and kernel.")
  p.add_argument("run_dir", help="a run's output_dir (trace in <dir>/profile), or a trace file")
  p.add_argument("--top", type=int, default=20, help="kernels to list (default 20)")
  args = p.parse_args(argv)
  try:
    print(format_summary(summarize(args.run_dir), args.top))
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  return 0


if __name__ == "__main__":
  sys.exit(main())
