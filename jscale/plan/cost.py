"""Step time of a layout: what a device computes, the communication its program leaves exposed,
and a pipeline's pace.

    step = busy x pace + exposed communication,   MFU = model FLOPs / (step x peak)

- busy: the kernels' time, term by term (`jscale.plan.busy`: gemms at their shapes'
  efficiency, attention at measured rates, remat, memory-bound passes);
- communication: the playbook volumes (`jscale.analysis.volume`'s conventions) per mesh axis,
  each over the link its groups span (`Layout.nodes`), at the playbook's measured bus
  bandwidths (`hardware.busbw`). Gradient reductions overlap the backward (XLA's async
  collectives), so only what exceeds that window is exposed; ZeRO-3's weight gathers are
  prefetched behind a fitted share of the busy time, their reduce-scatters and TP's
  activation collectives sit on the critical path (`Exposure`: the shares the compiled
  programs leave exposed); EP and pipeline transfers whole; the context-parallel ring
  overlaps its block attention. Paired (`Layout.overlap`), the layer loops' gathers,
  reduce-scatters and expert exchange hide behind the other micro-batch's compute but for a
  share (`Exposure.paired`).
- pace: a pipelined step's executed ticks over its work (`pipeline_pace`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jscale import hardware
from jscale.config import ModelConfig, MoeConfig
from jscale.metrics import flops_per_token
from jscale.plan import busy, memory
from jscale.plan.layout import Layout, layout_of
from jscale.plan.memory import (
  Memory,
  channels,
  executed,
  local_param_split,
  schedule_table,
  tokens_per_microbatch,
)

GRAD_BYTES = 4  # gradients are reduced in fp32
PAIRED = ("paired", "paired")  # a Transfer's overlap and share under `Layout.overlap`


@dataclasses.dataclass(frozen=True)
class Exposure:
  """What the compiled programs leave exposed, fitted with `busy.Fit` on the same sweep
  (`scripts/estimate_vs_compiled.py fit`: the shares by least squares, the window and the
  memory threshold on a grid): the share of each critical-path transfer's own time (XLA:GPU's
  scheduler hides the rest behind independent kernels), and the pipelines' pace
  (jscale's executor runs the schedule's ticks in lockstep, each ending in a ppermute, a tick
  at the pace of the slowest op any stage runs in it: this many times the unit-op ticks)."""
  # ZeRO-3's weight gathers are prefetched a layer ahead: they hide behind `zero3_window` of
  # the busy time — wholly under remat, but for a share of what fits without it (each small
  # micro-batch's layer gather shows) — and what exceeds it is exposed whole, as for Llama 3
  # 70B's ZeRO-3 over 64 GPUs, link-bound across 8 nodes. Past `regather_from` of the device's
  # memory, XLA's remat pass gathers weights again where they are used (the programs'
  # `all-gather-start.N.remat`): `zero3_regather` of them per unit of memory share past it.
  zero3_gathers: float = 0.0
  zero3_gathers_full: float = 0.0
  zero3_gathers_none: float = 0.554
  zero3_window: float = 0.37
  zero3_regather: float = 2.92
  regather_from: float = 0.8
  tensor_all_reduce: float = 0.528  # TP without SP: the backward's dW gemms hide some
  sequence_parallel: float = 1.52  # SP's gather / scatter pairs: wholly, and then some
  # remat=offload's copies to the host and back: XLA:GPU starts each just before it is needed,
  # so little hides (0.86-0.89 of the link time exposed in four compiled H100 programs: llama3
  # 1b b4, 3b b2, the 8b shape at b1 and b2; not fitted on the sweep, whose two pipeline-free
  # offload rows also run ZeRO-3 and TP)
  host_offload: float = 0.87
  pipeline_pace: float = 0.993
  # DeepSeek-V3's pairing (`Layout.overlap`): the share of the layer loops' transfers (ZeRO-3's
  # gathers and reduce-scatters, the expert exchange) that the other micro-batch's compute
  # leaves exposed, what exceeds the step's busy time exposed whole. Not fitted on the sweep:
  # one compiled program's exposed collectives over those transfers' time (DeepSeek-V3 671B on
  # 1,024 H100s, fsdp 16 x expert 64, 2175fb4: 2.54 s of 13.04; results/planner_paired.md)
  paired: float = 0.195
  # each W run as an op of its own (a split backward) costs this much more of a tick: the
  # executor's B and W branches each take the chunk's backward apart (ZB-H1, ZB-V)
  split_backward: float = 0.629


EXPOSURE = Exposure()


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
  # more, where the compiled programs show it whole), "paired" (the other micro-batch's
  # compute: `Layout.overlap`), "" (on the critical path).
  overlap: str
  share: str = ""  # on the critical path: the `Exposure` field of its exposed share ("": all)

  @property
  def overlapped(self) -> bool:
    return bool(self.overlap)

  def seconds(self) -> float:
    return self.bytes / hardware.busbw(self.kind, self.nodes)

  def exposed_seconds(self, exposure: Exposure = EXPOSURE) -> float:
    """Its time on the critical path: its `share` of it, else all or, overlapped, none (what
    exceeds its window: see `exposed`)."""
    if self.share:
      return self.seconds() * getattr(exposure, self.share)
    return 0.0 if self.overlap else self.seconds()


@dataclasses.dataclass(frozen=True)
class Cost:
  """The estimate for one layout."""
  compute_s: float  # busy: the kernels' time (`busy.terms`, summed)
  bubble: float
  transfers: tuple[Transfer, ...]
  exposed_s: float
  step_s: float
  model_flops: float  # per device per step
  mfu: float
  busy: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds by `busy` term


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
      # Prefetched (`Exposure.zero3_window`); each layer's gradient reduce-scatter is waited
      # for in its own loop iteration: on the critical path, whole.
      # Paired (`Layout.overlap`), both run inside the layers' micro-batch loops, beside the
      # trips' compute, and each trip (two micro-batches) reduce-scatters its own gradient.
      trips = lay.accum // lay.side_by_side if lay.overlap else 1
      gathers = (PAIRED if lay.overlap else
                 ("prefetch", "zero3_gathers_full" if lay.rematerialised else
                  {"none": "zero3_gathers_none"}.get(lay.remat, "zero3_gathers")))
      out.append(Transfer("fsdp", "ZeRO-3 weight all-gathers, forward and backward", "all-gather",
                          (2 * layer_psi + other_psi) * c * lay.step_accum, nodes("fsdp"),
                          *gathers))
      out.append(Transfer("fsdp", "ZeRO-3 gradient reduce-scatter (the gather's transpose)",
                          "reduce-scatter", psi * c * lay.step_accum * trips, nodes("fsdp"),
                          *(PAIRED if lay.overlap else ("",))))
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
    passes = 3 if lay.rematerialised else 2  # forward (+ again), backward
    # Two all-reduces of s·b·h per block per pass (with SP a reduce-scatter + all-gather pair:
    # the same volume), the embedding's and the head's, three fp32 loss statistics; selective
    # remat under SP gathers the recomputed norm outputs again for the weight gradients.
    again = 2 * layers * sbh if lay.remat == "selective" and lay.sequence_parallel else 0
    out.append(Transfer("tensor", "TP/SP activations, 2 per block per pass", "all-reduce",
                        2 * 2 * passes * layers * sbh + again + 4 * sbh + 3 * 2 * tokens * 4,
                        nodes("tensor"), "", "sequence_parallel" if lay.sequence_parallel
                        else "tensor_all_reduce"))
  if lay.remat == "offload":  # what selective saves, out in the forward and back in the backward
    rows = tokens_per_microbatch(lay, seq)
    host = (memory.layer_activation_bytes(model, lay, rows, "selective")
            - memory.layer_activation_bytes(model, lay, rows, "offload"))
    out.append(Transfer("host", "offloaded residuals to host memory and back", "host",
                        2 * layers * lay.accum * host, 1, "", "host_offload"))
  if lay.remat == "full_offload":  # each layer's input, out in the forward and back
    out.append(Transfer("host", "offloaded layer inputs to host memory and back", "host",
                        2 * layers * tokens * model.d_model * c, 1, "", "host_offload"))
  if lay.sequence > 1:
    out.append(_context_transfer(model, lay, tokens, layers, nodes("sequence")))
  if lay.expert > 1 and model.moe is not None:
    out += _expert_transfer(model, model.moe, lay, tokens, nodes("expert"))
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


def _expert_transfer(model: ModelConfig, moe: MoeConfig, lay: Layout, tokens: int, nodes: int
                     ) -> list[Transfer]:
  """The expert exchange per device (`moe`: `model`'s): each MoE layer's dispatch and combine,
  forward and backward, a row per routed assignment; the node-limited exchange's rows cross
  nodes once per token and chosen group (its first hop, relayed by the node's device at that
  place: `expert_exchange.node_limited_exchange`), then reach their experts inside the node."""
  c = jnp.dtype(model.dtype).itemsize
  moe_layers = model.stack_layers / lay.stage // moe.every + (
      model.mtp.depth if model.mtp is not None else 0)
  # A row in e4m3 carries its D bytes and its fp32 scale (jscale.fp8.wire): the forward's
  # dispatch, the backward's output gradients (the combine's transpose), the forward's combine,
  # the inputs' gradients (the dispatch's transpose).
  row = lambda dtype: model.d_model + 4 if dtype == "e4m3" else model.d_model * c
  passes = (row(moe.dispatch_dtype) + row(moe.dispatch_grad_dtype) + row(moe.combine_dtype)
            + row(moe.combine_grad_dtype))
  over = PAIRED if lay.overlap else ("", "")
  # The buffer's own slice stays put, but volumes omit the (n-1)/n factor throughout.
  if moe.exchange == "node_limited" and lay.collectives == "manual" and nodes > 1:
    return [Transfer("expert", "node-limited exchange across nodes, fwd and bwd", "all-to-all",
                     moe_layers * tokens * moe.topk_group * passes, nodes, *over),
            Transfer("expert", "node-limited exchange inside the node, fwd and bwd",
                     "all-to-all", moe_layers * tokens * moe.top_k * passes,
                     max(1, nodes // moe.n_group), *over)]  # a group past a node spans more
  return [Transfer("expert", "token dispatch + combine all-to-all, fwd and bwd", "all-to-all",
                   moe_layers * tokens * moe.top_k * passes, nodes, *over)]


def _context_transfer(model: ModelConfig, lay: Layout, tokens: int, layers: float,
                      nodes: int) -> Transfer:
  """Context parallelism's exchange per device: the ring's K/V hops (overlapped with its
  blocks), or Ulysses' all-to-alls of q, k, v and the output and of their cotangents
  (`parallel.context.ulysses`; on the critical path: the attention waits for them)."""
  c, n = jnp.dtype(model.dtype).itemsize, lay.sequence
  g, qk, vk = model.attention_kv_heads, model.qk_head_dim, model.v_head_dim
  passes = 3 if lay.rematerialised else 2  # full remat exchanges the forward's again
  if lay.ulysses:
    per_pass = tokens * (model.n_heads + g) * (qk + vk) * c / lay.tensor
    return Transfer("sequence", "Ulysses q, k, v + output all-to-alls, fwd and bwd",
                    "all-to-all", layers * passes * per_pass, nodes, "")
  kv = tokens * g * (qk + vk) / 2 / lay.tensor
  ring = layers * (passes * (n - 1) * 2 * kv * c + n * 2 * kv * 4)
  return Transfer("sequence", "ring attention K/V (+dK/dV) hops", "permute", ring, nodes, "step")


def pipeline_pace(model: ModelConfig, lay: Layout, seq: int,
                  exposure: Exposure = EXPOSURE) -> float:
  """Executed time of a pipelined step over its busy time without a pipeline: the executed
  table's ticks (unit F / B / W cells, in lockstep steps) over the m·v·3 cells of work, each at
  `Exposure.pipeline_pace` (more by `Exposure.split_backward` times the share of W actions
  run alone); the head's share of the FLOPs (h) all on the last stage, whose load sets the
  lockstep pace: (1 - h) / p + h of the work against 1 / p, i.e. (1 - h) + h·p. 1 without a
  pipeline."""
  p, m, v = lay.stage, lay.accum, lay.virtual_stages
  if p == 1:
    return 1.0
  head = 6 * model.d_model * model.vocab_size / flops_per_token(model, seq)
  ex = executed(lay.schedule, p, m, v)
  per_tick = exposure.pipeline_pace * (1 + exposure.split_backward * ex.w_alone)
  return per_tick * ex.ticks / (3 * m * v) * ((1 - head) + head * p)


def prefetch_inside(ts: list[Transfer], window_s: float) -> float:
  """The share of the prefetched transfers' time that fits in their window of `window_s`."""
  pre = sum(t.seconds() for t in ts if t.overlap == "prefetch")
  return min(1.0, window_s / pre) if pre else 1.0


def regathered(ts: list[Transfer], memory_share: float, start: float) -> float:
  """The prefetched transfers' seconds per unit of `memory_share` past `start`."""
  return max(0.0, memory_share - start) * sum(t.seconds() for t in ts if t.overlap == "prefetch")


def exposed(ts: list[Transfer], busy_s: float, accum: int,
            exposure: Exposure = EXPOSURE, memory_share: float = 0.0) -> float:
  """Seconds of `ts` on the critical path: the exposed share of each critical-path transfer,
  and what the overlapped ones need beyond their window (the step, the backward — a third of
  the busy time is the forward —, the last backward: the backward with one micro-batch, none
  after an accumulation loop, ZeRO-3's prefetch: `Exposure`), with `memory_share` of the
  device's usable memory taken (XLA's remat pass near the limit)."""
  backward = busy_s * 2 / 3
  windows = {"step": busy_s, "backward": backward, "prefetch": busy_s * exposure.zero3_window,
             "last backward": backward if accum == 1 else 0.0, "paired": busy_s}
  inside = prefetch_inside(ts, windows["prefetch"])
  out = sum(t.exposed_seconds(exposure) * (inside if t.overlap == "prefetch" else 1.0)
            for t in ts)
  out += exposure.zero3_regather * regathered(ts, memory_share, exposure.regather_from)
  for name, window in windows.items():
    out += max(0.0, sum(t.seconds() for t in ts if t.overlap == name) - window)
  return out


def estimate(model: ModelConfig, lay: Layout, seq: int, gpu: hardware.Gpu,
             fit: busy.Fit = busy.FIT, exposure: Exposure = EXPOSURE,
             mem: Memory | None = None) -> Cost:
  """Step time and MFU of `lay` on `gpu`s (ValueError for a GPU whose HBM bandwidth jscale has
  not measured: the passes are priced by it). `mem`: the layout's `memory.estimate`, where the
  caller has it."""
  peak = gpu.peak_flops["bf16"]
  if not gpu.hbm_bytes_s or not peak:
    raise ValueError(f"{gpu.name}: no measured HBM bandwidth (jscale/hardware.py)")
  tokens = lay.mbs * lay.accum * lay.batch_ways * seq  # global tokens per step
  model_flops = flops_per_token(model, seq) * tokens / lay.devices
  mem = mem or memory.estimate(model, lay, seq)
  parts = busy.terms(model, lay, seq, gpu, mem)
  busy_s = busy.seconds(parts, fit)
  ts = transfers(model, lay, seq, gpu.gpus_per_node)
  exposed_s = exposed(ts, busy_s, lay.step_accum, exposure,
                      mem.total / memory.usable_bytes(gpu))
  step = busy_s * pipeline_pace(model, lay, seq, exposure) + exposed_s
  weights = {f.name: getattr(fit, f.name) for f in dataclasses.fields(fit)}
  mfu = model_flops / (step * peak)
  return Cost(busy_s, bubble(lay.schedule, lay.stage, lay.accum, lay.virtual_stages),
              tuple(ts), exposed_s, step, model_flops, mfu,
              {k: v * weights.get(k, 1.0) for k, v in parts.items() if v})


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
