"""Every GPU fact jscale uses, each with where it comes from: dense peaks by dtype, HBM size and
the copy bandwidth measured on the card, SM count, GPUs per node, the links' bus bandwidths.
MFU (`jscale.metrics`), the planner, the predictor and the scripts read them here. A leaf: it
imports no jscale module.

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

GiB = 2**30
# nodes -> all-reduce busbw (GB/s), the playbook's 256 MB measurements.
_ALL_REDUCE_GBS = {1: 436, 2: 362, 4: 160, 8: 100, 16: 85, 32: 65, 64: 33}
# All-gather / reduce-scatter: 250 GB/s in a node, 11 across 64 nodes (two points; log-log in
# between, as the all-reduce curve is).
_GATHER_GBS = {1: 250, 64: 11}


# The host link, bytes/s each way (what host-offloaded activations cross): PCIe Gen5 x16 on the
# Hopper SXM boards, 128 GB/s both ways together by NVIDIA's H100 / H200 datasheets. Datasheet,
# not measured by jscale.
HOST_LINK_BYTES_S = 64e9


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One accelerator: what a step's time and memory are bounded by."""
  name: str  # jscale's name: the planner's --gpu, the predictor's --target prefix
  kind: str  # a substring of JAX's `device.device_kind` that identifies it
  # Dense FLOP/s (no sparsity; datasheets) by operand type: bf16 and fp8 tensor cores, TF32
  # (what an f32 gemm runs in at default precision) and plain f32. None: no such units.
  peak_flops: dict[str, float | None]
  hbm_bytes: float  # device memory as nvidia-smi reports it
  sms: int
  gpus_per_node: int  # the NVLink domain of one node
  # Measured by jscale on the card (None where no such card was lent): the best copy's bytes/s
  # (the predictor's and the planner's price of memory-bound work).
  hbm_bytes_s: float | None = None
  source: str = ""


_HOPPER_PEAKS = {"bf16": 989.5e12, "fp8": 1979e12, "tf32": 494.7e12, "f32": 66.9e12}  # SXM
# Ordered: specific device kinds before general ones ("H100 PCIe" before "H100").
GPUS: dict[str, Gpu] = {
    # An H100's chip (same SMs and peaks) with 141 GB of HBM3e: 4.19 TB/s is the best copy
    # measured on the H200 lent on 2026-11-26 (results/h200_measured/bench_kernels.md).
    "h200": Gpu("h200", "H200", _HOPPER_PEAKS, 140.4 * GiB, 132, 8, 4.19e12,
                "datasheet peaks; HBM bandwidth measured by jscale on one H200"),
    "h100_pcie": Gpu("h100_pcie", "H100 PCIe", {"bf16": 756e12, "fp8": 1513e12,
                                               "tf32": 378e12, "f32": 51.2e12},
                     80 * GiB, 114, 8, source="datasheet"),
    # 989.5 TFLOP/s: H100 SXM datasheet (also picotron's peak); the bare bf16 gemm on the lent
    # H100 ran at ~790-800 TFLOP/s (0.80 of peak; issue 16). 3.0 TB/s HBM measured on the same
    # card; 79.6 GiB of HBM3.
    "h100": Gpu("h100", "H100", _HOPPER_PEAKS, 79.6 * GiB, 132, 8, 3.0e12,
                "datasheet peak; HBM bandwidth measured by jscale on one H100 (issue 16)"),
    "a100": Gpu("a100", "A100", {"bf16": 312e12, "fp8": None, "tf32": 156e12, "f32": 19.5e12},
                80 * GiB, 108, 8, source="datasheet (SXM4 80GB)"),
}


def of_device_kind(device_kind: str) -> Gpu | None:
  """The GPU whose `kind` names `device_kind` ("NVIDIA H200" -> GPUS["h200"]); None if none."""
  return next((g for g in GPUS.values() if g.kind.upper() in device_kind.upper()), None)


def predictable(device_kind: str) -> str | None:
  """The predictor's name for a device kind ("NVIDIA H200" -> "h200"); None for a device whose
  copy bandwidth jscale has not measured."""
  gpu = of_device_kind(device_kind)
  return gpu.name if gpu is not None and gpu.hbm_bytes_s else None


def predictable_device(device) -> str | None:
  """`predictable` for a JAX device: its GPU's name if it is a GPU the predictor has rates for,
  else None (a CPU, an unmeasured GPU)."""
  if device.platform != "gpu":
    return None
  return predictable(getattr(device, "device_kind", ""))


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
  permute) whose group spans `nodes` nodes (1: inside one node, over NVLink); "host": the
  copies between a device and its host's memory."""
  if kind == "host":
    return HOST_LINK_BYTES_S
  table = _ALL_REDUCE_GBS if kind == "all-reduce" else _GATHER_GBS
  return _loglog(table, nodes) * 1e9
