"""Step time of a layout: compute, communication by mesh axis and link, pipeline bubble.

    step = compute x (1 + bubble) + exposed communication,   MFU = model FLOPs / (step x peak)

- compute: the step's hardware FLOPs per device (model FLOPs, `jscale.metrics.flops_per_token`,
  plus what remat recomputes) at the device's measured step efficiency (`hardware.Gpu`);
- bubble: idle over busy cells of the schedule jscale would run (`schedules.make_table`);
- communication: the playbook volumes (`jscale.analysis.volume`'s conventions) per mesh axis,
  each over the link its groups span (`Layout.nodes`), at the playbook's measured bus
  bandwidths (`hardware.busbw`). Gradient reduction and ZeRO's gathers overlap the backward
  (XLA's async collectives), so only what exceeds that window is exposed; TP, EP and pipeline
  transfers sit on the critical path; the context-parallel ring overlaps its block attention.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jscale import hardware
from jscale.config import ModelConfig
from jscale.metrics import flops_per_token, param_counts
from jscale.plan.layout import Layout, layout_of
from jscale.plan.memory import channels, local_param_split, schedule_table, tokens_per_microbatch

GRAD_BYTES = 4  # gradients are reduced in fp32
# What the compiled programs run beyond the FLOPs at the measured efficiency, fitted (relative
# least squares) on scripts/estimate_vs_compiled.py's sweep of XLA:GPU steps for H100s, as
# `jscale.predict` times them (results/estimate_vs_compiled.md; refit when that sweep changes):
NO_REMAT_EXTRA = 0.31  # remat=none: the layer scan's stacked residuals, as a share of compute
MICROBATCH_WEIGHT_PASSES = 7  # per extra micro-batch: passes over bf16 weights (casts, sums)
RING_HOP_S = 1.5e-3  # context parallelism: per micro-batch, layer and doubling of the ring
# Pipelines: jscale's executor runs the schedule's ticks in lockstep (each ends in a ppermute), a
# tick at the pace of the slowest op any stage runs in it, and the head's work rides on the
# ticks of every stage's last chunk; this many times the schedule's unit-op ticks.
PIPELINE_PACE = 1.88


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One communication term of a step, per device."""
  axis: str
  what: str
  kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | permute
  bytes: float  # playbook volume per step
  nodes: int  # nodes one group spans (1: NVLink)
  # What it can hide behind: "step" (the context-parallel ring's hops), "backward"
  # (per-micro-batch gradient reduce-scatters), "last backward" (the once-per-step gradient
  # reduction: inside the backward with one micro-batch, after the accumulation loop with
  # more, where the compiled programs show it whole), "" (exposed).
  overlap: str

  @property
  def overlapped(self) -> bool:
    return bool(self.overlap)

  def seconds(self) -> float:
    return self.bytes / hardware.busbw(self.kind, self.nodes)


@dataclasses.dataclass(frozen=True)
class Cost:
  """The estimate for one layout."""
  compute_s: float
  bubble: float
  transfers: tuple[Transfer, ...]
  exposed_s: float
  step_s: float
  model_flops: float  # per device per step
  mfu: float


def bubble(schedule: str, p: int, m: int, v: int) -> float:
  """Idle over busy time of the executed schedule (0 without a pipeline)."""
  return schedule_table(schedule, p, m, v).bubble() if p > 1 else 0.0


def transfers(model: ModelConfig, lay: Layout, seq: int, gpus_per_node: int) -> list[Transfer]:
  """Every communication term of one step of `lay`, per device (playbook volumes)."""
  c = jnp.dtype(model.dtype).itemsize
  layer_psi, other_psi = local_param_split(model, lay)
  psi = layer_psi + other_psi
  nodes = lambda axis: lay.nodes(axis, gpus_per_node)
  out = []
  f = lay.fsdp
  dp_axes = [a for a in ("data", "expert", "sequence") if lay.size(a) > 1]
  if f > 1:
    if lay.zero_stage == 3:  # layers gathered in the forward and again in the backward, the
      # embedding and head once (their backward follows at once), per micro-batch
      # Exposed: XLA:GPU's compiled steps show each layer's gather waiting on its start
      # (`scripts/estimate_vs_compiled.py`: exposed time ~ the gathers' own time).
      out.append(Transfer("fsdp", "ZeRO-3 weight all-gathers, forward and backward", "all-gather",
                          (2 * layer_psi + other_psi) * c * lay.accum, nodes("fsdp"), ""))
      out.append(Transfer("fsdp", "ZeRO-3 gradient reduce-scatter (the gather's transpose)",
                          "reduce-scatter", psi * c * lay.accum, nodes("fsdp"), "backward"))
    else:
      two = lay.zero_stage == 2  # ZeRO-2 reduces each micro-batch's gradient in its backward
      out.append(Transfer("fsdp", f"ZeRO-{lay.zero_stage} gradient reduce-scatter",
                          "reduce-scatter", psi * GRAD_BYTES * (lay.accum if two else 1),
                          nodes("fsdp"), "backward" if two else "last backward"))
      out.append(Transfer("fsdp", "updated weights all-gather", "all-gather", psi * 4,
                          nodes("fsdp"), ""))
  if dp_axes:  # gradients are summed over every other axis that splits the tokens
    out.append(Transfer("+".join(dp_axes), "gradient all-reduce" + (" of the shard" if f > 1
                                                                      else ""), "all-reduce",
                        2 * psi / f * GRAD_BYTES, max(nodes(a) for a in dp_axes),
                        "last backward"))
  tokens = tokens_per_microbatch(lay, seq) * lay.accum
  layers = model.n_layers / lay.stage
  if lay.tensor > 1:
    sbh = tokens * model.d_model * c
    passes = 3 if lay.remat == "full" else 2  # forward (+ again), backward
    # Two all-reduces of s·b·h per block per pass (with SP a reduce-scatter + all-gather pair:
    # the same volume), the embedding's and the head's, three fp32 loss statistics; selective
    # remat under SP gathers the recomputed norm outputs again for the weight gradients.
    again = 2 * layers * sbh if lay.remat == "selective" and lay.sequence_parallel else 0
    out.append(Transfer("tensor", "TP/SP activations, 2 per block per pass", "all-reduce",
                        2 * 2 * passes * layers * sbh + again + 4 * sbh + 3 * 2 * tokens * 4,
                        nodes("tensor"), ""))
  if lay.sequence > 1:
    kv = tokens * model.n_kv_heads * (model.qk_head_dim + model.v_head_dim) / 2 / lay.tensor
    fwd = 2 if lay.remat == "full" else 1
    ring = layers * ((fwd + 1) * (lay.sequence - 1) * 2 * kv * c + lay.sequence * 2 * kv * 4)
    out.append(Transfer("sequence", "ring attention K/V (+dK/dV) hops", "permute", ring,
                        nodes("sequence"), "step"))
  if lay.expert > 1 and model.moe is not None:
    moe_layers = model.stack_layers / lay.stage // model.moe.every + (
        model.mtp.depth if model.mtp is not None else 0)
    routed = tokens * model.moe.top_k * model.d_model * c
    # The buffer's own slice stays put, but volumes omit the (n-1)/n factor throughout.
    out.append(Transfer("expert", "token dispatch + combine all-to-all, fwd and bwd",
                        "all-to-all", 4 * moe_layers * routed, nodes("expert"), ""))
  if lay.stage > 1:
    # Every tick of the executed schedule sends on each of its channels, one activation-sized
    # message each (jscale's shard_map program: idle ticks send too): an activation forward
    # and a gradient back, or twice that when DualPipeV's pairs send two the same way.
    act = lay.mbs * seq * model.d_model * c
    shape = (lay.schedule, lay.stage, lay.accum, lay.virtual_stages)
    sends = channels(*shape) * schedule_table(*shape).ticks
    out.append(Transfer("stage", "activation + gradient sends, one each per schedule tick",
                        "permute", sends * act, nodes("stage"), ""))
    out.append(Transfer("stage", "embedding + head gradients all-reduce (on every stage)",
                        "all-reduce", 2 * other_psi * GRAD_BYTES, nodes("stage"),
                        "last backward"))
  return out


def pipeline_pace(model: ModelConfig, lay: Layout, seq: int) -> float:
  """Executed time of a pipelined step over its compute without a pipeline: the schedule's
  ticks (unit F / B / W cells) over the m·v·3 cells of work, each tick at `PIPELINE_PACE`, the
  head's share of the FLOPs (h) on the ticks of every chunk: (1 - h) + h·p·v."""
  p, m, v = lay.stage, lay.accum, lay.virtual_stages
  head = 6 * model.d_model * model.vocab_size / flops_per_token(model, seq)
  ticks = schedule_table(lay.schedule, p, m, v).ticks
  return PIPELINE_PACE * ticks / (3 * m * v) * ((1 - head) + head * p * v)


def overheads(model: ModelConfig, lay: Layout, seq: int, flops_s: float,
              hbm_bytes_s: float | None, compute: float) -> float:
  """Seconds the compiled step spends beyond its FLOPs, outside a pipeline's pace: saved
  residuals without remat, per-micro-batch passes over the weights, context parallelism's
  doubled attention (every block of the ring in full) and its per-hop kernels. `flops_s`: the
  device's rate at its measured step efficiency; `compute`: the step's FLOPs at that rate."""
  extra = NO_REMAT_EXTRA * compute if lay.remat == "none" else 0.0
  psi = sum(local_param_split(model, lay))
  if hbm_bytes_s:
    # the step efficiency was measured at one micro-batch: it includes the first one's passes
    extra += (lay.accum - 1) * MICROBATCH_WEIGHT_PASSES * 2 * psi / hbm_bytes_s
  if lay.sequence > 1:
    attention = flops_per_token(model, seq) - 6 * param_counts(model)["matmul"]
    tokens = lay.mbs * lay.accum * lay.batch_ways * seq / lay.devices
    extra += attention * tokens / flops_s
    extra += lay.accum * model.n_layers / lay.stage * math.log2(lay.sequence) * RING_HOP_S
  return extra


def estimate(model: ModelConfig, lay: Layout, seq: int, gpu: hardware.Gpu) -> Cost:
  """Step time and MFU of `lay` on `gpu`s."""
  tokens = lay.mbs * lay.accum * lay.batch_ways * seq  # global tokens per step
  model_flops = flops_per_token(model, seq) * tokens / lay.devices
  forward = model_flops / 3
  extra = {"none": 0.0, "full": forward,
           # selective recomputes the norms, pointwise ops and attention core (not matmuls):
           "selective": 0.1 * forward}[lay.remat]
  peak, efficiency = gpu.peak_flops["bf16"], gpu.step_efficiency
  if peak is None or efficiency is None:
    raise ValueError(f"{gpu.name}: no measured step efficiency (jscale/hardware.py)")
  compute = (model_flops + extra) / (peak * efficiency)
  bub = bubble(lay.schedule, lay.stage, lay.accum, lay.virtual_stages)
  ts = transfers(model, lay, seq, gpu.gpus_per_node)
  backward = compute * 2 / 3
  windows = {"step": compute, "backward": backward,
             "last backward": backward if lay.accum == 1 else 0.0}
  exposed = sum(t.seconds() for t in ts if not t.overlap)
  for name, window in windows.items():
    exposed += max(0.0, sum(t.seconds() for t in ts if t.overlap == name) - window)
  busy = compute + overheads(model, lay, seq, peak * efficiency, gpu.hbm_bytes_s, compute)
  step = (busy * pipeline_pace(model, lay, seq) if lay.stage > 1 else busy) + exposed
  return Cost(compute, bub, tuple(ts), exposed, step, model_flops,
              model_flops / (step * peak))


def playbook_volume(rt) -> dict[str, float]:
  """Per-device bytes per step the playbook's formulas predict for `rt` (a `runtime.Runtime`:
  its config on its mesh), by term, and "total": the communication terms of `transfers`, to
  set beside what a compiled program runs (`jscale.analysis.volume.hlo_volume`)."""
  out: dict[str, float] = {}
  lay = layout_of(rt.cfg, dict(rt.mesh.shape))
  for x in transfers(rt.cfg.model, lay, rt.cfg.train.seq_len, gpus_per_node=1):
    out[f"{x.axis}: {x.what}"] = out.get(f"{x.axis}: {x.what}", 0.0) + x.bytes
  out["total"] = sum(out.values())
  return out
