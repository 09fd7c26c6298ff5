"""A candidate layout (mesh sizes, ZeRO, pipeline, remat, micro-batch) and their enumeration.

The mesh axes are jscale's (`jscale.mesh.AXES`, outermost first: data, stage, fsdp, expert,
sequence, tensor), so an axis' devices are consecutive when the axes after it have size 1 and
`Layout.nodes(axis)` says how many nodes one of its groups spans (consecutive devices fill a
node first, as `mesh.make_mesh` and SLURM's block placement do).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from jscale.config import Config, ModelConfig
from jscale.mesh import AXES
from jscale.parallel.pipeline import schedules
from jscale.validate.deepseek import node_limited_why_not
from jscale.validate.on_mesh import context_why_not, xla_layout_why_not

REMATS = ("none", "selective", "offload", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)
# DeepSeek-V3's pairing (`Layout.overlap`): each layer runs two micro-batches side by side, one
# a phase behind the other, so that one's expert exchange runs beside the other's compute; each
# trip reduce-scatters its gradient and gathers the next layer's weights in chunks (the keys'
# entries in docs/config.md; docs/deepseek.md's 671B table adds them one by one).
PAIR = 2  # micro-batches a paired layer runs side by side
OVERLAP = (f"parallel.overlap_microbatches={PAIR}", "parallel.overlap_skew=true",
           "parallel.scatter_each_trip=true", "parallel.prefetch_layers=true")


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to run a step of `batch` sequences of `seq` tokens on prod(mesh sizes) devices."""
  data: int = 1
  stage: int = 1
  fsdp: int = 1
  expert: int = 1
  sequence: int = 1
  tensor: int = 1
  zero_stage: int = 0
  sequence_parallel: bool = False
  schedule: str = "1f1b"  # with stage > 1
  virtual_stages: int = 1
  remat: str = "none"
  mbs: int = 1  # sequences per device per micro-batch
  accum: int = 1  # micro-batches per optimizer step (pipeline.microbatches under a pipeline)
  moments: str = "float32"  # train.moments_dtype (a choice the planner is given, not a lever)
  context: str = "ring"  # parallel.context_impl with sequence > 1: ring | ulysses
  accumulate: str = "step"  # train.accumulate: step | layer (`layer_microbatches`)
  # parallel.collectives: manual where the layout needs jscale's hand-written collectives (the
  # node-limited expert exchange, `overlap`), else xla
  collectives: str = "xla"
  overlap: bool = False  # DeepSeek-V3's pairing (`OVERLAP`)

  @property
  def step_accum(self) -> int:
    """Micro-batches of the step's gradient loop: ZeRO-3 gathers each layer once per one
    (1 when the layers take the micro-batches in turn: `train.accumulate: layer`)."""
    return self.accum if self.accumulate == "step" else 1

  @property
  def side_by_side(self) -> int:
    """Micro-batches each layer runs at once: `PAIR` paired (`overlap`), else 1."""
    return PAIR if self.overlap else 1

  @property
  def rematerialised(self) -> bool:
    """The backward reruns each layer's forward (`train.remat`: full, full_offload)."""
    return self.remat in ("full", "full_offload")

  def size(self, axis: str) -> int:
    return getattr(self, axis)

  @property
  def devices(self) -> int:
    n = 1
    for a in AXES:
      n *= self.size(a)
    return n

  @property
  def batch_ways(self) -> int:
    """Devices the batch is split over (`sharding.RULES`: batch -> data, fsdp, expert)."""
    return self.data * self.fsdp * self.expert

  @property
  def ulysses(self) -> bool:
    """Context parallelism by Ulysses' all-to-alls (not the ring)."""
    return self.sequence > 1 and self.context == "ulysses"

  def nodes(self, axis: str, gpus_per_node: int) -> int:
    """Nodes one group of `axis` spans (1: all its devices share a node)."""
    stride = 1
    for a in AXES[AXES.index(axis) + 1:]:
      stride *= self.size(a)
    return len({stride * i // gpus_per_node for i in range(self.size(axis))})

  def overrides(self, seq: int, gpus_per_node: int) -> list[str]:
    """The `python -m jscale.train` overrides that run this layout."""
    out = []
    for a in AXES:
      n, k = self.size(a), self.nodes(a, gpus_per_node)
      out.append(f"mesh.{a}={n // k}")
      if k > 1:
        out.append(f"mesh.dcn_{a}={k}")
    out += [f"parallel.zero_stage={self.zero_stage}", f"train.remat={self.remat}",
            f"train.seq_len={seq}", f"train.batch_size={self.mbs * self.accum * self.batch_ways}"]
    if self.sequence_parallel:
      out.append("parallel.sequence_parallel=true")
    if self.moments != "float32":
      out.append(f"train.moments_dtype={self.moments}")
    if self.ulysses:
      out.append("parallel.context_impl=ulysses")
    if self.stage > 1:
      out += [f"pipeline.schedule={self.schedule}", f"pipeline.microbatches={self.accum}",
              f"pipeline.virtual_stages={self.virtual_stages}", "train.microbatches=1"]
    else:
      out.append(f"train.microbatches={self.accum}")
    if self.accumulate != "step":
      out.append(f"train.accumulate={self.accumulate}")
    if self.collectives != "xla":
      out.append(f"parallel.collectives={self.collectives}")
    if self.overlap:
      out += OVERLAP
    return out

  def describe(self) -> str:
    """Short form: 'dp2 fsdp4(z3) tp2+sp pp2(1f1b x8) cp1 ep1 mbs1 remat=none'."""
    parts = [f"{a}{self.size(a)}" for a in ("data", "fsdp", "tensor", "stage", "sequence",
                                             "expert") if self.size(a) > 1]
    if self.fsdp > 1:
      parts[[p.startswith("fsdp") for p in parts].index(True)] += f"(z{self.zero_stage})"
    if self.sequence_parallel:
      parts[[p.startswith("tensor") for p in parts].index(True)] += "+sp"
    if self.ulysses:
      parts[[p.startswith("sequence") for p in parts].index(True)] += "(ulysses)"
    if self.stage > 1:
      v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
      parts[[p.startswith("stage") for p in parts].index(True)] += f"({self.schedule}{v})"
    moments = "" if self.moments == "float32" else f" {self.moments} moments"
    turns = "" if self.accumulate == "step" else f" ({self.accumulate}{', paired' * self.overlap})"
    manual = " manual" if self.collectives == "manual" else ""
    return (" ".join(parts or ["1 device"]) + f" mbs{self.mbs}x{self.accum}{turns} {self.remat}"
            + moments + manual)


def layout_of(cfg: Config, sizes: dict[str, int]) -> Layout:
  """The Layout `cfg` runs on a mesh of `sizes` (axis -> size)."""
  t, stages = cfg.train, sizes["stage"] > 1
  accum = cfg.pipeline.microbatches if stages else t.microbatches
  ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  return Layout(**{a: sizes[a] for a in AXES},
                zero_stage=cfg.parallel.zero_stage if sizes["fsdp"] > 1 else 0,
                sequence_parallel=cfg.parallel.sequence_parallel, schedule=cfg.pipeline.schedule,
                virtual_stages=cfg.pipeline.virtual_stages, remat=t.remat,
                mbs=t.batch_size // ways // accum, accum=accum, moments=t.moments_dtype,
                context=cfg.parallel.context_impl if sizes["sequence"] > 1 else "ring",
                accumulate=t.accumulate, collectives=cfg.parallel.collectives,
                overlap=paired(cfg))


def paired(cfg: Config) -> bool:
  """Whether `cfg` runs every lever of `OVERLAP` (where it takes effect)."""
  p = cfg.parallel
  return (p.overlap_microbatches == PAIR and p.overlap_skew and p.prefetches_layers
          and cfg.train.layer_microbatches > 1)


def _factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
  """Ordered k-tuples of positive integers whose product is n."""
  if k == 1:
    yield (n,)
    return
  for d in range(1, n + 1):
    if n % d == 0:
      for rest in _factorizations(n // d, k - 1):
        yield (d, *rest)


def candidates(model: ModelConfig, devices: int, seq: int, batch: int,
               gpus_per_node: int = 8, max_tensor: int | None = None,
               moments: str = "float32") -> Iterator[Layout]:
  """Every layout of `devices` that jscale can run for `model` at `batch` sequences of `seq`
  tokens per step (the divisibility rules of `validate.check_mesh` / `_check_pipeline`, in the
  collectives mode it needs: `_collectives`), with Adam's moments stored in `moments`
  (`train.moments_dtype`); where DeepSeek-V3's pairing applies, each also paired (`_pairs`)."""
  moe = model.moe is not None
  max_tensor = max_tensor or gpus_per_node
  heads = (model.n_heads, model.n_kv_heads, model.d_ff, model.vocab_size)
  for data, stage, fsdp, expert, sequence, tensor in _factorizations(devices, 6):
    if tensor > max_tensor or any(x % tensor for x in heads):
      continue
    if expert > 1 and (not moe or model.moe.n_experts % expert):
      continue
    if sequence > 1 and (stage > 1 or seq % (2 * sequence) or
                         context_why_not(model, sequence) is not None):
      continue
    ways = data * fsdp * expert
    if batch % ways:
      continue
    per_device = batch // ways
    for sp in ((False, True) if tensor > 1 else (False,)):
      if sp and seq % (sequence * tensor):
        continue
      for zero in ((1, 2, 3) if fsdp > 1 else (0,)):
        if stage > 1 and zero > 2:
          continue
        sizes = dict(data=data, stage=stage, fsdp=fsdp, expert=expert, tensor=tensor)
        mode = _collectives(model, expert)
        # what validate refuses in the mode the layout runs in is not offered
        if mode is None or (mode == "xla" and xla_layout_why_not(sizes, zero, sp, moe)):
          continue
        for pipe in _pipelines(model, stage):
          for mbs in MICRO_BATCHES:
            if per_device % mbs:
              continue
            accum = per_device // mbs
            if stage > 1 and not _schedule_ok(pipe, stage, accum):
              continue
            if mode == "xla" and stage == 1 and xla_layout_why_not(
                sizes, zero, sp, moe, model.tie_embeddings, accum) is not None:
              continue
            for remat, turns in _rematerialisations(stage, zero, accum):
              for context in _contexts(model, sequence, tensor):
                lay = Layout(data, stage, fsdp, expert, sequence, tensor, zero, sp, pipe[0],
                             pipe[1], remat, mbs, accum, moments, context, turns, mode)
                yield lay
                if _pairs(model, lay):
                  yield dataclasses.replace(lay, collectives="manual", overlap=True)


def _collectives(model: ModelConfig, expert: int) -> str | None:
  """The parallel.collectives a layout with `expert` devices on mesh.expert runs in: manual
  for the node-limited exchange (None where its groups cannot tile the axis), else xla."""
  moe = model.moe
  if moe is None or moe.exchange != "node_limited" or expert == 1:
    return "xla"
  return None if node_limited_why_not(moe, "manual", expert) else "manual"


def _pairs(model: ModelConfig, lay: Layout) -> bool:
  """Whether `lay` can also run DeepSeek-V3's pairing (`OVERLAP`'s conditions: two of the
  layers' micro-batches side by side, the hand-written dropless exchange to skew by, manual
  ZeRO-3 to reduce-scatter each trip and prefetch in the trips)."""
  return (model.moe is not None and model.moe.dispatch == "dropless" and lay.expert > 1
          and lay.stage == 1 and lay.zero_stage == 3 and lay.fsdp > 1
          and lay.accumulate == "layer" and lay.accum % PAIR == 0)


def _rematerialisations(stage: int, zero: int, accum: int) -> list[tuple[str, str]]:
  """(train.remat, train.accumulate) pairs: every remat with accumulation over the step; where
  ZeRO-3 gathers per micro-batch, also full remat with the layers taking the micro-batches in
  turn, their inputs on the device or in host memory."""
  pairs = [(remat, "step") for remat in REMATS]
  if stage == 1 and zero == 3 and accum > 1:
    pairs += [("full", "layer"), ("full_offload", "layer")]
  return pairs


def _contexts(model: ModelConfig, sequence: int, tensor: int) -> tuple[str, ...]:
  """parallel.context_impl's choices: Ulysses where each device gets whole heads
  (`validate.on_mesh`'s rule)."""
  if sequence == 1:
    return ("ring",)
  whole = not (model.n_heads % (sequence * tensor) or
               model.attention_kv_heads % (sequence * tensor))
  return ("ring", "ulysses") if whole else ("ring",)


def _pipelines(model: ModelConfig, stage: int) -> list[tuple[str, int]]:
  """(schedule, chunks a stage) whose stage x chunks divide the pipelined stack (the dense
  prefix runs in the first stage: `validate.on_mesh`'s rule)."""
  if stage == 1:
    return [("1f1b", 1)]
  n = model.stack_layers
  out = [(name, 1) for name in ("afab", "1f1b", "zero_bubble") if n % stage == 0]
  out += [("interleaved", v) for v in (2, 4) if n % (stage * v) == 0]
  out += [(name, 2) for name in ("zbv", "dualpipev") if n % (stage * 2) == 0]
  return out


def _schedule_ok(pipe: tuple[str, int], stage: int, m: int) -> bool:
  return schedules.why_not(pipe[0], stage, m, pipe[1]) is None

