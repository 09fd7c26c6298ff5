"""scripts/kernel_timing.py's trace reading (synthetic GPU / CPU traces, a real CPU trace)."""

import os
import sys

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
