"""Timing a compiled JAX function on one accelerator: loop time and profiler kernel time.

Timing one call at a time from the host (call, block_until_ready, repeat) adds the dispatch and
the synchronisation to every call: a 0.1 ms kernel reads as several times slower. Two figures
instead, both per call:

  * loop time (`loop_seconds`): a few warm-up calls, then `iters` calls dispatched back to
    back and one block on the last result (a device runs a stream's work in order, so the last
    result ready means all are); total / iters, the median over `repeats` such loops. The host
    enqueues while the device runs, so this is the device's time per call once a call is longer
    than its dispatch (~10-50 µs); shorter calls measure the dispatch rate (an upper bound).
  * kernel time (`kernel_seconds`, GPU): what the device itself recorded. A few calls run
    under `jax.profiler.trace`; in the trace each GPU plane ("/device:GPU:0") has one line per
    CUDA stream ("Stream #14(Compute,MemcpyD2D)") whose events are the kernels, memcpys and
    memsets with GPU timestamps (CUPTI). Per stream line the union of its events' intervals
    (so an event nested in another, e.g. a CUDA-graph record around its kernels, counts once),
    summed over the lines, / calls. It leaves out the gaps between one call's kernels: device
    busy time, a lower bound of what the call costs inside a training step.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import statistics
import tempfile
import time

import jax

from jscale.profile import union_ns

GPU_PLANE_PREFIX = "/device:GPU"
STREAM_LINE_PREFIX = "Stream"  # CUPTI names device lines "Stream #<id>(<activity kinds>)"


@dataclasses.dataclass
class Timing:
  """Seconds per call: `loop_s` (None when the call failed), `kernel_s` (None without a GPU
  trace), and a short note on whatever is missing."""
  loop_s: float | None
  kernel_s: float | None = None
  note: str = ""

  @property
  def seconds(self) -> float | None:
    """The figure rates are computed from: kernel time when measured, else loop time."""
    return self.kernel_s if self.kernel_s is not None else self.loop_s

  @property
  def source(self) -> str | None:
    """"kernel" or "loop" (which figure `seconds` is), None when neither exists."""
    if self.kernel_s is not None:
      return "kernel"
    return None if self.loop_s is None else "loop"


def loop_seconds(fn, args, *, iters: int = 30, repeats: int = 3, warmup: int = 3) -> float:
  """Median over `repeats` of (wall time of `iters` back-to-back `fn(*args)`) / iters.

  Blocks only on the last call's result of each loop. `fn` should be compiled already (a
  `jax.jit(f).lower(*args).compile()`), or the first loop pays for tracing.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(max(repeats, 1)):
    out = None
    start = time.perf_counter()
    for _ in range(max(iters, 1)):
      out = fn(*args)  # the previous result is freed as the device finishes with it
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / max(iters, 1))
  return statistics.median(per_call)


def stream_busy_ns(profile) -> float | None:
  """Busy nanoseconds on the GPU planes' stream lines of a trace, or None with no GPU plane.

  Args:
    profile: a `jax.profiler.ProfileData`, or the path of an `.xplane.pb` file.

  Returns:
    The sum over stream lines of the union of each line's event intervals (0.0 when the GPU
    planes hold no stream events), or None when the trace has no "/device:GPU" plane (e.g. a
    CPU run).
  """
  if isinstance(profile, (str, os.PathLike)):
    from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
    profile = ProfileData.from_file(os.fspath(profile))
  gpus = [p for p in profile.planes if p.name.startswith(GPU_PLANE_PREFIX)]
  if not gpus:
    return None
  # Only this process's work is traced, so the idle GPUs' planes add nothing: sum them all
  # rather than guess which plane ordinal the benchmarked device has.
  return sum(union_ns((e.start_ns, e.start_ns + e.duration_ns) for e in line.events)
             for plane in gpus for line in plane.lines
             if line.name.startswith(STREAM_LINE_PREFIX))


def find_xplane(log_dir: str) -> str | None:
  """The newest `*.xplane.pb` under `log_dir` (jax.profiler.trace writes
  <log_dir>/plugins/profile/<time>/<host>.xplane.pb), or None."""
  found = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
  return max(found, key=os.path.getmtime) if found else None


def kernel_seconds(fn, args, *, calls: int = 10) -> tuple[float | None, str]:
  """Device seconds per call of `fn(*args)` from a profiler trace of `calls` calls.

  Never raises: returns (seconds, "") or (None, a short reason) when the profiler API is
  missing, the trace cannot be written or read, or it has no GPU plane / no stream events.
  `fn` should be compiled and warmed up (compilation inside the trace is harmless but slow).
  """
  calls = max(calls, 1)
  log_dir = tempfile.mkdtemp(prefix="kernel_timing_")
  try:
    jax.block_until_ready(fn(*args))  # nothing of an earlier call left running in the trace
    from jax import profiler  # pylint: disable=import-outside-toplevel  (missing -> a note)
    with profiler.trace(log_dir):
      out = None
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    trace = find_xplane(log_dir)
    if trace is None:
      return None, "profiler wrote no .xplane.pb"
    busy = stream_busy_ns(trace)
    if busy is None:
      return None, "no GPU plane in the profiler trace"
    if busy <= 0:
      return None, "no kernels on the GPU stream lines of the trace"
    return busy / calls / 1e9, ""
  except Exception as e:  # pylint: disable=broad-except  (a missing figure, not a failed run)
    first = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
    return None, f"profiler: {type(e).__name__} {first}".strip()
  finally:
    shutil.rmtree(log_dir, ignore_errors=True)


def measure(fn, args, *, iters: int = 30, repeats: int = 3, warmup: int = 3,
            profile_calls: int = 10) -> Timing:
  """Loop time and (profile_calls > 0) kernel time of a compiled `fn(*args)`.

  Errors of the calls themselves (out of memory, a kernel that fails) propagate from the
  loop; the profiler's never do (kernel_s None and a note).
  """
  loop = loop_seconds(fn, args, iters=iters, repeats=repeats, warmup=warmup)
  if profile_calls <= 0:
    return Timing(loop)
  kern, note = kernel_seconds(fn, args, calls=profile_calls)
  return Timing(loop, kern, note)
