"""scripts/bench_kernels.py on CPU (the --interpret --quick smoke run, the GPU-only refusal) and
scripts/kernel_timing.py's trace reading (synthetic GPU / CPU traces, a real CPU trace)."""

import csv
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import kernel_timing  # noqa: E402

_GPU_TRACE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 7 name: "Stream #7(Compute,MemcpyD2D)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
    events { metadata_id: 2 offset_ps: 1000000 duration_ps: 2000000 }
    events { metadata_id: 1 offset_ps: 6000000 duration_ps: 3000000 } }
  lines { id: 8 name: "Stream #8(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 1000000 } }
  lines { id: 9 name: "CUPTI overhead" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "loop_add_fusion" } }
  event_metadata { key: 2 value { id: 2 name: "nested" } } }
planes { id: 3 name: "/device:GPU:1" }
planes { id: 2 name: "/host:CPU"
  lines { id: 1 name: "Host Threads/1" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 7000000 } }
  event_metadata { key: 1 value { id: 1 name: "PjitFunction" } } }
"""


def test_stream_busy_ns_sums_stream_lines():
  # Stream #7: [0, 5) µs with a nested event counted once, then [6, 9): 8 µs; #8: 1 µs. The
  # overhead line and the host plane are not device work.
  assert kernel_timing.stream_busy_ns(ProfileData.from_text_proto(_GPU_TRACE)) == 9000.0


def test_stream_busy_ns_without_gpu_plane_is_none():
  host_only = _GPU_TRACE[_GPU_TRACE.index('planes { id: 2 name: "/host:CPU"'):]
  assert kernel_timing.stream_busy_ns(ProfileData.from_text_proto(host_only)) is None


def test_kernel_seconds_on_cpu_is_none_with_a_note():
  """A real profiler trace of a CPU run has no GPU plane: no figure, a note, no exception."""
  x = jnp.ones((64, 64))
  fn = jax.jit(lambda x: x @ x).lower(x).compile()
  sec, note = kernel_timing.kernel_seconds(fn, (x,), calls=2)
  assert sec is None and "no GPU plane" in note
  timing = kernel_timing.measure(fn, (x,), iters=3, repeats=2, warmup=1, profile_calls=0)
  assert timing.loop_s > 0 and timing.kernel_s is None
  assert timing.seconds == timing.loop_s and timing.source == "loop"
  assert kernel_timing.Timing(1.0, 0.5).seconds == 0.5
  assert kernel_timing.Timing(None, note="oom").source is None


def test_refuses_cpu_without_interpret_quick(capsys):
  import bench_kernels  # pylint: disable=import-outside-toplevel
  assert bench_kernels.main(["--quick"]) == 2
  assert "GPU benchmark" in capsys.readouterr().err


def test_quick_smoke_run(tmp_path):
  """--interpret --quick end to end: fwd and fwd+bwd rows of every CPU impl (the Hopper
  norm in the Mosaic GPU interpreter), the fused residual rows, the copy references, and both tables."""
  out = tmp_path / "x"
  # Compile speed, not code speed, decides this run's time (the timings mean nothing here).
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
  r = subprocess.run([sys.executable, "scripts/bench_kernels.py", "--interpret", "--quick",
                      "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=env)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  with open(f"{out}.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  done = {(r["bench"], r["impl"], r["kind"]) for r in rows if r["ms_loop"]}
  for impl in ("pallas", "xla"):
    for kind in ("fwd", "fwd+bwd"):
      assert ("attention", impl, kind) in done
  for impl in ("pallas", "hopper", "xla"):  # the Mosaic GPU norm runs in its interpreter
    for kind in ("fwd", "fwd+bwd", "fused fwd", "fused fwd+bwd"):
      assert ("rmsnorm", impl, kind) in done
  assert {("copy", c, "read+write") for c in ("x + 1", "jit copy", "device_put")} <= done
  measured = [r for r in rows if r["bench"] in ("attention", "rmsnorm", "copy")]
  assert all(r["gbs"] or r["tflops"] for r in measured)
  assert not any(r["ms_kernel"] for r in rows)  # no GPU: no profiler kernel time
  assert {r["impl"] for r in rows if r["bench"] == "skipped"} == {"cudnn", "hopper", "tokamax",
                                                                  "triton"}
  md = (tmp_path / "x.md").read_text()
  assert "## Attention" in md and "## RMSNorm" in md and "## Copy reference" in md
  assert "TFLOP/s from loop time" in md and "| 64 | 128 | fused fwd+bwd |" in md

