"""Device and link figures the planner's roofline uses, each with where it comes from.

Links are given as bus bandwidth (nccl-tests' busbw): a collective of playbook volume V
(`jscale.analysis.volume`: an all-reduce of K bytes is 2K, an all-gather or reduce-scatter K)
takes about V / busbw. The playbook measured them on its cluster (8 x H100 per node, NVLink
inside a node, EFA between nodes; PLAYBOOK_DIGEST.md §3 "[ext] Chart data"):
all-reduce of 256 MB at 1/2/4/8/16/32/64 nodes: 436/362/160/100/85/65/33 GB/s; all-gather and
reduce-scatter about 250 GB/s in one node and 11 GB/s across 64.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from jscale.xla_flags import MEM_FRACTION

# nodes -> all-reduce busbw (GB/s), the playbook's 256 MB measurements.
_ALL_REDUCE_GBS = {1: 436, 2: 362, 4: 160, 8: 100, 16: 85, 32: 65, 64: 33}
# All-gather / reduce-scatter: 250 GB/s in a node, 11 across 64 nodes (two points; log-log in
# between, as the all-reduce curve is).
_GATHER_GBS = {1: 250, 64: 11}


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One accelerator: what a step's time and memory are bounded by."""
  name: str
  peak_flops: float  # dense bf16 FLOP/s (datasheet), the MFU denominator
  memory_bytes: float  # what a process can allocate
  hbm_bytes_s: float
  # Model FLOPs / s a tuned single-device step reaches, as a fraction of peak: the compute
  # term's efficiency (gemm efficiency x the share of time in gemms).
  step_efficiency: float
  gpus_per_node: int
  source: str


GPUS = {
    # 989.5 TFLOP/s: H100 SXM datasheet (also picotron's peak). 0.49: jscale's own measurement
    # on the lent H100 (issue 16: llama3_1b, seq 4096, bf16 matmuls, cuDNN attention, 49.0%
    # MFU at batch 8); the bare bf16 gemm there ran at ~790-800 TFLOP/s (0.80 of peak).
    # 3.0 TB/s HBM measured on the same card. 79.6 GiB of HBM3, of which a run may use
    # MEM_FRACTION (XLA_PYTHON_CLIENT_MEM_FRACTION: `python -m jscale.train` and train.sbatch
    # set 0.9 unless given; JAX's default is 0.75).
    "h100": Gpu("h100", 989.5e12, float(MEM_FRACTION) * 79.6 * 2**30, 3.0e12, 0.49, 8,
                "datasheet peak; efficiency and HBM measured by jscale on one H100 (issue 16)"),
    # An H100's chip (same peak) with 141 GB of HBM3e: 4.19 TB/s is the best copy measured on
    # the H200 lent on 2026-11-26 (results/h200_measured/bench_kernels.md), 0.527 its llama3_1b
    # MFU there (configs/llama3_1b.yaml).
    "h200": Gpu("h200", 989.5e12, float(MEM_FRACTION) * 140.4 * 2**30, 4.19e12, 0.527, 8,
                "datasheet peak; efficiency and HBM measured by jscale on one H200"),
}


def _loglog(table: dict[int, float], nodes: int) -> float:
  xs = sorted(table)
  nodes = min(max(nodes, xs[0]), xs[-1])
  i = bisect.bisect_left(xs, nodes)
  if xs[i] == nodes:
    return table[nodes]
  x0, x1 = xs[i - 1], xs[i]
  y0, y1 = math.log(table[x0]), math.log(table[x1])
  return math.exp(y0 + (y1 - y0) * (math.log(nodes) - math.log(x0)) / (math.log(x1) - math.log(x0)))


def busbw(kind: str, nodes: int) -> float:
  """Bytes/s of one collective `kind` (all-reduce, all-gather, reduce-scatter, all-to-all,
  permute) whose group spans `nodes` nodes (1: inside one node, over NVLink)."""
  table = _ALL_REDUCE_GBS if kind == "all-reduce" else _GATHER_GBS
  return _loglog(table, nodes) * 1e9
