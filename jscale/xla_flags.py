"""XLA flags for overlapping communication with compute on GPU, and for a loop's stacked
outputs that need no zeros, set by the launcher.

`python -m jscale.train` prepends these to XLA_FLAGS before any JAX backend starts (flags the
user already gave win; `JSCALE_XLA_FLAGS=0` turns this off), and lets JAX's allocator take 0.9
of GPU memory (`MEM_FRACTION`, what `jscale.plan` budgets; XLA_PYTHON_CLIENT_MEM_FRACTION set
by the user wins). They are GPU settings: other backends parse and ignore them. What each flag
does:

* latency_hiding_scheduler: schedules async collectives (all-gather / reduce-scatter /
  all-reduce start..done) so that independent compute runs in between.
* pipelined_{all_gather,reduce_scatter,all_reduce}: XLA's collective pipeliner moves, inside the
  layer scan (a while loop), the next layer's all-gather (ZeRO-3's prefetch) and the previous
  layer's gradient reduce-scatter / all-reduce across the loop boundary, so they overlap with
  this layer's compute. manual mode's per-layer ZeRO-3 gathers rely on it for prefetch.
* while_loop_double_buffering: unrolls the scan by two so pipelined values need no copies.
* *_combine_threshold_bytes: merges independent small collectives into ones of up to 128 MiB
  (bandwidth). It may also merge manual mode's gradient buckets (`parallel.bucket_mb`).
* *_combine_by_dim=false: lets all-gathers / reduce-scatters along different dims combine.
* memory_limit_slop_factor (`parallel.scheduler_memory_percent`): the memory the scheduler and
  XLA's rematerialisation pass plan against (below).
* dus_accumulator_zero_init_elimination: a loop's stacked output that every iteration writes a
  row of before anything reads it (the layer scan's saved activations, its weights' stacked
  gradients: JAX's scan makes them as zeros) is allocated, not zero-filled by a kernel first. On
  the DeepSeek-V3 16B proxy that is ~4 GB of zero fills a step, which an H200 ran at 1.7 TB/s
  (2026-11-30). The pass proves the writes cover the buffer (XLA:GPU,
  `DusAccumulatorZeroInitElimination`; in jax 0.10.2's, 0.11.2's and 0.12.0's plugins; off by
  default in 0.10.2's, and the H200's jax 0.11.2 program still zero-filled).
"""

from __future__ import annotations

import os

import jax

GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_enable_dus_accumulator_zero_init_elimination=true",
)


# Not with gradient accumulation: to move an all-gather across the micro-batch loop, the
# pipeliner peels that loop's first iteration, a second copy of the layer scans whose saved
# activations get their own buffers: every micro-batch's activations twice (XLA:GPU, llama3_1b
# fsdp=8 ZeRO-3, 4 micro-batches: temporaries 7.3 -> 10.9 GiB; Llama-3 70B's planned layout, 64
# micro-batches: 66.6 -> 74.9 GiB per step, over an H100's 71.6). ZeRO-1/2 and TP + SP pay too
# (scripts/overlap_flags.py, predicted for 8 H100s: llama3_1b fsdp8 ZeRO-2 x4 67.3 -> 40.6 GiB;
# 8B fsdp4 ZeRO-1 tensor2+SP x4 100.0 -> 75.8 GiB and a 28% shorter step without it).
_PEELS_ACCUMULATION = "--xla_gpu_enable_pipelined_all_gather=true"


# xla mode's ZeRO-3: XLA's SPMD partitioner emits each layer's gradient reduce-scatters as the
# transposes of its gathers, and at 128 MiB the combiner merges them into one that waits for
# the layer's last gradient: it ends the loop iteration exposed (the pipeliner leaves it). With
# combines up to 8 MiB of output, each weight's reduce-scatter starts as its gradient is ready
# and hides behind the rest of the layer's backward (scripts/overlap_flags.py, predicted: 8B
# fsdp8 x 8 micro-batches 5.4% shorter, Llama 3 70B fsdp64 on 64 H100s 11%); manual ZeRO-3,
# whose reduce-scatters the pipeliner moves, and ZeRO-1/2 keep 128 MiB (a little faster).
# `parallel.scatter_each_trip` likewise: merged, a layer's reduce-scatter in each trip of its
# micro-batch loop waited for the trip's last gradient (DeepSeek-V3 671B on 1,024 H100s, 0.73 s
# a step exposed per loop clone at 128 MiB, predicted).
_SPLIT_REDUCE_SCATTERS = "--xla_gpu_reduce_scatter_combine_threshold_bytes=8388608"

# The layers unrolled (`model.scan_layers: false`): no loop iteration bounds what the combiner
# merges, and it merges the gradient reduce-scatters of different layers into ones that wait
# for the last of them, holding every layer's full gradient until then (Llama 3 70B, data2 x
# fsdp64 manual ZeRO-3 on 128 H100s, full remat: 343 GiB per device at 80 layers against the
# scan's 52; at 4 layers 20.2 -> 15.8 GiB of temporaries without, the scan's 16.3; 8 MiB
# still merges across layers: 20.9).
_UNCOMBINED_REDUCE_SCATTERS = "--xla_gpu_reduce_scatter_combine_threshold_bytes=0"


# `parallel.scheduler_memory_percent`: the memory XLA:GPU's latency-hiding scheduler and its
# rematerialisation pass budget against, in percent of the device memory XLA plans for less the
# parameters and outputs (`GetSchedulerMemoryLimit`; the config's default is XLA's, 95).
_SCHEDULER_MEMORY = "--xla_gpu_memory_limit_slop_factor"


def overlap_flags(cfg=None) -> tuple[str, ...]:
  """The overlap flags for a run of `cfg` (a Config; None: all of them, as for manual mode)."""
  flags = GPU_OVERLAP_FLAGS
  if cfg is not None:
    flags += (f"{_SCHEDULER_MEMORY}={cfg.parallel.scheduler_memory_percent}",)
  if cfg is not None and cfg.train.step_microbatches > 1:
    flags = tuple(f for f in flags if f != _PEELS_ACCUMULATION)
  if cfg is not None and not cfg.model.scan_layers:
    flags = _replaced(flags, _UNCOMBINED_REDUCE_SCATTERS)
  elif cfg is not None and (cfg.parallel.zero_stage == 3 and cfg.parallel.collectives == "xla"
                            or cfg.parallel.scatters_each_trip):
    flags = _replaced(flags, _SPLIT_REDUCE_SCATTERS)
  return flags


def _replaced(flags: tuple[str, ...], flag: str) -> tuple[str, ...]:
  name = flag.split("=")[0]
  return tuple(flag if f.startswith(name + "=") else f for f in flags)


def with_overlap_flags(xla_flags: str, cfg=None) -> str:
  """`xla_flags` with every overlap flag (for `cfg`) it does not set already put in front."""
  given = {f.split("=")[0] for f in xla_flags.split()}
  missing = [f for f in overlap_flags(cfg) if f.split("=")[0] not in given]
  return " ".join(missing + xla_flags.split())


# jax 0.11's XLA replaced the collective pipeliner's three booleans by modes (openxla/xla#45836):
# DebugOptions fields `xla_gpu_pipeline_{all_gather,all_reduce,reduce_scatter}` of enum
# CollectivePipeliningMode, and the XLA_FLAGS booleans still parse ("[Deprecated] True maps to
# --xla_gpu_pipeline_all_gather=on", read from jax 0.11.2's plugin). As compile options, which
# name DebugOptions fields, the booleans are refused ("No such compile option:
# 'xla_gpu_enable_pipelined_all_reduce'", 2026-11-29), and the field takes the enum's full name
# (scripts/pipeline_modes.py under jax 0.11.2 on an H200, 2026-11-30: 'COLLECTIVE_PIPELINING_
# MODE_ON' and 2 taken; 'on', 'ON' and True refused). A boolean the launcher asks for is that.
_MODES_FROM = (0, 11)
_PIPELINED = "xla_gpu_enable_pipelined_"
_MODE_ON = "COLLECTIVE_PIPELINING_MODE_ON"


def pipeliner_booleans_are_options(jax_version: tuple[int, ...] | None = None) -> bool:
  """Whether `jax_version`'s XLA (default: the running one) takes the collective pipeliner's
  booleans as compile options (else its `xla_gpu_pipeline_*` modes)."""
  return tuple(jax_version or jax.__version_info__)[:2] < _MODES_FROM


def compiler_options(cfg=None, jax_version: tuple[int, ...] | None = None
                     ) -> dict[str, bool | int | str]:
  """The overlap flags for `cfg` as `Lowered.compile(compiler_options=...)` takes them under
  `jax_version` (default: the running jax's): what a step compiled for GPUs elsewhere
  (`jscale.analysis`) needs to be the launcher's program."""
  as_booleans = pipeliner_booleans_are_options(jax_version)
  out: dict[str, bool | int | str] = {}
  for flag in overlap_flags(cfg):
    name, value = flag[2:].split("=")
    if name.startswith(_PIPELINED) and not as_booleans:
      assert value == "true", flag  # overlap_flags leaves a pipeliner out, never sets it false
      out["xla_gpu_pipeline_" + name[len(_PIPELINED):]] = _MODE_ON
      continue
    out[name] = value == "true" if value in ("true", "false") else int(value)
  return out


# Share of GPU memory JAX's allocator takes (JAX's default, 0.75, leaves 20 GB of an H100
# idle): the budget `jscale.plan` fits layouts to (`plan/hardware.py`); the rest stays for
# cuDNN / cuBLAS workspaces and NCCL, outside XLA's pool.
MEM_FRACTION = "0.9"


def apply(cfg=None) -> None:
  """Sets XLA_FLAGS (the overlap flags for `cfg`) and, unless the user set it,
  XLA_PYTHON_CLIENT_MEM_FRACTION for this process; call before anything starts a JAX backend."""
  if os.environ.get("JSCALE_XLA_FLAGS", "1") != "0":
    os.environ["XLA_FLAGS"] = with_overlap_flags(os.environ.get("XLA_FLAGS", ""), cfg)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
