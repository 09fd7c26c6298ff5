"""What each kind of kernel achieves on a Hopper GPU: the constants `jscale.predict.timing` times
a launch with, each with where it comes from.

Peaks, SMs and the HBM bandwidth (the best copy measured on the card) are `jscale.hardware`'s.
Kernels whose speed the compiled program cannot tell (cuDNN's fused attention, jscale's Pallas
kernels) run at rates measured on our GPUs, looked up by shape; where none was measured the
launch is timed as a roofline and flagged.
The efficiencies (`Fit`) were fitted on at most half of the measured training rows
(`scripts/predict_vs_measured.py`, results/predict_vs_measured.md lists which).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from jscale import hardware


@dataclasses.dataclass(frozen=True)
class Fit:
  """The constants fitted on 9 of the 22 measured rows (scripts/predict_vs_measured.py, from
  its START; each inside its grid)."""
  gemm_ceiling: float = 0.76   # of peak, a large well-shaped bf16 / fp8 gemm (cuBLAS)
  tf32_ceiling: float = 0.60   # the same for f32 gemms (TF32 on the tensor cores)
  gemm_k_half: float = 128.0   # k at which a gemm reaches half its ceiling (short dot products)
  memory: float = 1.0          # of the measured copy bandwidth, an XLA loop / input fusion
  launch_s: float = 3e-6       # per kernel: launch, ramp-up and tail, the gaps between kernels
  # Not fitted (no multi-GPU row measured yet): NCCL's latency per collective, nccl-tests' order.
  collective_s: float = 15e-6


FIT = Fit()


@dataclasses.dataclass(frozen=True)
class Chip:
  """One GPU as the predictor sees it."""
  name: str
  peak: dict[str, float]      # FLOP/s by gemm type: bf16, f8, tf32, f32
  hbm_bytes_s: float          # measured copy bandwidth
  host_bytes_s: float         # the host link, each way (`hardware.HOST_LINK_BYTES_S`)
  sms: int
  per_node: int
  fit: Fit = FIT


def chip(gpu: str, fit: Fit = FIT) -> Chip:
  """The predictor's view of `gpu` ("h100", "h200": `jscale.analysis.gpu_target.TARGETS`)."""
  g = hardware.GPUS[gpu]
  peaks = g.peak_flops
  return Chip(gpu, {"bf16": peaks["bf16"], "f8": peaks["fp8"], "tf32": peaks["tf32"],
                    "f32": peaks["f32"]}, g.hbm_bytes_s, hardware.HOST_LINK_BYTES_S, g.sms,
              g.gpus_per_node, fit)


# Flash attention, bf16, TFLOP/s at B·L = 16384 tokens, H·K = 2048 (scripts/bench_kernels.py;
# the FLOPs of `program._attention_flops`): impl, causal, head_dim -> [(seq, fwd, fwd + bwd)].
# The chip's SMs and clocks bound these kernels, so H100 and H200 figures stand for each other.
ATTENTION: dict[tuple[str, bool, int], list[tuple[int, float, float]]] = {
    # cuDNN, H100 (results/h100_measured/h100_2026-11-23.md, "cuDNN timed properly": 30 calls
    # per sync; 4096/64 also 415/371 beside tokamax, 421/369 on the H200). At K 64 only 4096
    # was timed properly: 2048 and 8192 follow the host-timed table's trend from 4096.
    ("cudnn", True, 64): [(2048, 318, 290), (4096, 415, 369), (8192, 460, 434)],
    ("cudnn", True, 128): [(4096, 552, 457), (8192, 608, 507)],
    ("cudnn", False, 128): [(4096, 653, 537)],
    # MLA's head 192 (V's 128 padded to Q's 192), from the DeepSeek-V3 16B proxy's traced step
    # on the H200 (results/h200_measured/dsv3_proxy_h200_2026-11-29.xplane.pb.gz, b 2, 16
    # heads): 4 forward launches 0.406 ms each, 4 backward 1.734 ms + cuDNN's dO·O pass 0.053
    # ms; 206 GFLOP forward, so 508 TFLOP/s forward, 329 forward + backward.
    ("cudnn", True, 192): [(4096, 508, 329)],
    # jscale's Hopper (Mosaic GPU) kernel and the portable Pallas (Triton) one, on the H200
    # (results/h200_measured/bench_kernels.md, profiler kernel time).
    ("hopper", True, 64): [(4096, 419, 354)],
    ("pallas", True, 64): [(4096, 232, 135)],
}
# jscale's Hopper grouped matmul (pallas_kernels/grouped_matmul), bf16, FLOP/s on the H200
# (results/h200_measured/bench_moe_gpu_kernels.md, profiler kernel time: 32768 rows x 2048 ->
# 2048 in 8 groups). The forward kernel ran at 732 TFLOP/s; the backward at 595 is dX (the same
# kernel) and dW (the transposed one) over twice the FLOPs, so dW's rate is
# 1 / (2/595 - 1/732) = 501. The SMs and clocks bound it, so the H200's figures stand for the
# H100's (as attention's). Measured at one shape: groups of 4096 rows, where a real router's
# groups are smaller and uneven.
GROUPED = {"grouped_matmul": 732e12, "transposed_grouped_matmul": 501e12}
# The row-grouped kernel on 64-column warpgroup tiles (`hopper_config.fit` halves them where
# asked to tile a width of 128-column ones it does not divide; the kernel runs such a width's
# whole tiles first and only the rest on them, `hopper_config.column_parts`): timed alone on
# the H200 at DeepSeek-V3's 1408 (results/h200_measured/bench_moe_gpu_deepseek_kernels.md,
# 2026-11-29: 49152 rows in 64 uneven groups, 2048 -> 1408), 477 TFLOP/s forward. The 286
# derived before from the 2026-11-28 step's kernel total was the kernel's old per-visit search
# over the 64 groups (it now reads a table), not the narrow tiles.
GROUPED_NARROW = 477e12
# XLA:GPU's variadic reduction with exps in its combiner, the chunked loss's one-pass (max,
# sum-exp) (`launches._online_elements`): elements a second, from the DeepSeek-V3 16B proxy's
# traced steps on the H200 (results/h200_measured/dsv3_proxy_h200_2026-11-{29,30}.xplane.pb.gz,
# the 30th's program beside it): 4 launches a step of 4096 x 102400 bf16 logits, 0.692 and
# 0.709 ms each, 1.2 TB/s where plain reductions in the same steps ran 3.5-4.5. Two exps
# and selects an element in the combiner, not the bytes, bound it, so the H200's figure
# stands for the H100's. The combiner takes one exp an element since 2026-12-01
# (`loss._online_combine`); priced at this rate until `scripts/softmax_passes.py` times it.
ONLINE_SOFTMAX = 4096 * 102400 / 0.70e-3
# RMSNorm kernels, fraction of the copy bandwidth (results/h200_measured/bench_kernels.md, N
# 16384, D 2048 / 4096 averaged; the backward's share derived from fwd+bwd minus fwd).
NORM = {("hopper", "fwd"): 0.87, ("hopper", "bwd"): 0.75,
        ("pallas", "fwd"): 0.89, ("pallas", "bwd"): 0.46}


def attention_rate(impl: str, causal: bool, head_dim: int, seq: int, backward: bool,
                   v_head_dim: int | None = None) -> tuple[float | None, str]:
  """(FLOP/s, note) of one attention pass; None where nothing was measured. Backward rates
  follow from fwd and fwd + bwd: the backward does 2.5x the forward's FLOPs. A V head size
  apart from Q's (`v_head_dim`, MLA's in cuDNN since 9.10) takes Q's head size's rate, over
  the FLOPs it does (no such kernel timed yet: the note says so)."""
  keys = [k for k in ATTENTION if k[0] == impl and k[1] == causal]
  if not keys:
    return None, f"no measured {impl} rate"
  key = min(keys, key=lambda k: abs(math.log2(k[2] / head_dim)))
  points = ATTENTION[key]
  note = "" if key[2] == head_dim else f"head dim {key[2]}'s rate"
  if v_head_dim not in (None, head_dim):
    note = ", ".join(x for x in (note, f"V {v_head_dim} at V {key[2]}'s rate (not timed)") if x)
  seqs = [p[0] for p in points]
  if seq < seqs[0] or seq > seqs[-1]:
    note = ", ".join(x for x in (note, f"seq {seq} outside the measured {seqs[0]}-{seqs[-1]}")
                     if x)
  fwd, both = _interp(points, seq)
  rate = 2.5 / (3.5 / both - 1.0 / fwd) if backward else fwd
  return rate * 1e12, note


def _interp(points, seq) -> tuple[float, float]:
  """Linear in log(seq) between measured lengths, clamped outside them."""
  seqs = [p[0] for p in points]
  if seq <= seqs[0] or len(points) == 1:
    return points[0][1:] if seq <= seqs[0] else points[-1][1:]
  if seq >= seqs[-1]:
    return points[-1][1:]
  i = bisect.bisect_left(seqs, seq)
  (s0, f0, b0), (s1, f1, b1) = points[i - 1], points[i]
  w = (math.log(seq) - math.log(s0)) / (math.log(s1) - math.log(s0))
  return f0 + w * (f1 - f0), b0 + w * (b1 - b0)
