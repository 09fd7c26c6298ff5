"""Typed run configuration: the dataclasses of one `Config`, and `ConfigError`.

A field's type is the list of values it allows (`Literal[...]` for choices; `choices` reads
it). Loading (YAML, overrides) is `jscale.config_load`, nested dicts -> `Config` is
`jscale.config_dict`; every check of a config is `jscale.validate`. This module imports no
other jscale module: everything else imports it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Literal


class ConfigError(ValueError):
  """A configuration problem, with the offending key and how to fix it."""


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
  """RoPE frequency scaling: Llama-3's (HF `rope_type: llama3`) or YaRN as DeepSeek-V3 ships it
  (`rope_type: yarn`, `jscale.model.rope`; MLA only, which applies its attention scales)."""
  # An optional section is off (null) until its switch key is written (jscale.config_load).
  SWITCH: ClassVar[str] = "rope_type"
  FEATURE: ClassVar[str] = "RoPE scaling"
  rope_type: Literal["llama3", "yarn"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0  # yarn: rotations where the ramp from extrapolation starts
  beta_slow: float = 1.0  # yarn: ... and where pure interpolation begins
  mscale: float = 1.0  # yarn: cos / sin scaled by mscale(factor, mscale) / mscale(factor, all)
  mscale_all_dim: float = 0.0  # yarn: softmax scale times mscale(factor, this)^2 (0: none)


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """Multi-head latent attention (DeepSeek-V2/V3, `jscale.model.mla`) in place of GQA: keys and
  values come from one compressed latent per token, plus a RoPE key shared by all heads."""
  SWITCH: ClassVar[str] = "kv_lora_rank"
  FEATURE: ClassVar[str] = "multi-head latent attention"
  q_lora_rank: int = 0  # low-rank query (with its norm); 0: queries projected directly
  kv_lora_rank: int = 512  # the key / value latent (what the generation cache holds)
  qk_nope_head_dim: int = 128  # per-head query / key dims without position
  qk_rope_head_dim: int = 64  # the decoupled RoPE dims (the key's shared across heads)
  v_head_dim: int = 128


@dataclasses.dataclass(frozen=True)
class MtpConfig:
  """Multi-token prediction (DeepSeek-V3, `jscale.model.mtp`): `depth` sequential modules after
  the trunk, module d predicting token t+1+d; training only."""
  SWITCH: ClassVar[str] = "depth"
  FEATURE: ClassVar[str] = "multi-token prediction"
  depth: int = 1  # HF num_nextn_predict_layers
  loss_weight: float = 0.3  # lambda: the objective adds lambda x the mean of the depths' losses


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Mixture-of-experts MLPs (jscale.model.moe): every layer's MLP is a routed set of experts."""
  SWITCH: ClassVar[str] = "n_experts"
  FEATURE: ClassVar[str] = "mixture-of-experts MLPs"
  n_experts: int = 8
  top_k: int = 2  # experts per token; gates are the renormalised top-k softmax (Mixtral)
  d_ff: int | None = None  # each expert's hidden size; None: model.d_ff
  shared_d_ff: int = 0  # hidden size of an always-on shared expert; 0: none
  # dropless (sort + grouped matmul) | capacity (drop overflow)
  dispatch: Literal["dropless", "capacity"] = "dropless"
  capacity_factor: float = 1.25  # capacity: slots per expert = factor * tokens * top_k / experts
  # dropless grouped matmul: auto (the Pallas kernel on Hopper where it tiles, else tiled) |
  # tiled (a batched matmul over row tiles, plain XLA) | ragged_dot (XLA's: E x the FLOPs on
  # GPU and CPU) | pallas (Mosaic GPU kernel, FP8 experts too when scaled per row;
  # model.kernel_interpret runs it on CPU)
  gemm: Literal["auto", "tiled", "ragged_dot", "pallas"] = "auto"
  aux_loss_weight: float = 0.01  # Switch load-balancing loss
  z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
  every: int = 1  # MoE in every k-th layer (layers k-1, 2k-1, ...), dense SwiGLU in the others
  # DeepSeek-V3 routing (`jscale.model.router`): sigmoid affinities, top-k on affinity + a
  # per-expert bias moved after each step by the sign of the expert's load error
  # (`bias_update_rate`, aux-loss-free balancing; the bias lives in the params, not trained)
  router: Literal["softmax", "sigmoid"] = "softmax"
  n_group: int = 1  # experts in n_group equal groups (a node's experts) ...
  topk_group: int = 1  # ... and each token's top-k come from at most topk_group of them
  norm_topk_prob: bool = True  # gates renormalised to sum to one (then scaled)
  routed_scaling_factor: float = 1.0  # gates times this
  bias_update_rate: float = 0.0  # sigmoid router: bias step per optimizer step; 0: frozen
  seq_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
  first_dense: int = 0  # the first k layers dense SwiGLU (HF first_k_dense_replace)
  # manual expert parallelism, dropless: flat (one all-to-all over mesh.expert) | node_limited
  # (the n_group groups tile mesh.expert, a group per node: a token crosses nodes once per
  # chosen group, then fans out to its experts inside the node; DeepSeek-V3's dispatch, for an
  # expert axis spanning nodes: inside one node the second hop only adds time)
  exchange: Literal["flat", "node_limited"] = "flat"
  # manual expert parallelism, dropless exchange: each device's receive buffer holds this
  # many times its even share of rows from each source (flat: top_k * tokens / mesh.expert;
  # node_limited: both hops by theirs), the overflow dropped and counted (dropped_fraction);
  # 0: room for the most a device can be sent (tokens * min(top_k, local experts) per source),
  # nothing dropped, at up to mesh.expert times the memory (jscale.parallel.expert_exchange)
  receive_factor: float = 0.0
  # manual expert parallelism, dropless exchange: the rows go out in the compute dtype or e4m3
  # with a power-of-two scale per row (D + 4 bytes a row: DeepSeek-V3's FP8 dispatch,
  # jscale.fp8.wire); results (combine_dtype) and gradients come back in the compute dtype. With
  # fp8.experts_scaling=row the experts' products round the rows the same way, so it adds none
  dispatch_dtype: Literal["compute", "e4m3"] = "compute"
  # the same for the backward's rows to the experts (the outputs' gradients, the combine's
  # transpose): e4m3 as DeepSeek-V3 sends them, D + 4 bytes a row, rounding the gradient the
  # experts' down projection and everything before it receive; compute: exact
  dispatch_grad_dtype: Literal["compute", "e4m3"] = "compute"
  # the same for the experts' outputs on their way back (the combine, both hops): e4m3 halves
  # its bytes but rounds the layer's output to 3 mantissa bits, which DeepSeek-V3 does not
  # (its combine is bf16); the gradient goes back straight through; compute: exact
  combine_dtype: Literal["compute", "e4m3"] = "compute"
  # the same for the backward's rows from the experts (the inputs' gradients, the dispatch's
  # transpose, both hops): e4m3 halves the backward's largest transfer but rounds the gradient
  # every earlier layer receives, which DeepSeek-V3 does not (bf16); compute: exact
  combine_grad_dtype: Literal["compute", "e4m3"] = "compute"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama shape and numerics. `preset` fills every field not given explicitly.

  Frozen (hashable) because the model keeps it as static structure.
  """
  preset: str | None = None  # tiny, llama3_1b, llama3_8b, ... (jscale.presets)
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 4  # grouped-query attention: n_heads / n_kv_heads query heads share one K/V
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int = 384  # the SwiGLU MLP's hidden size
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScalingConfig | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  # auto (cuDNN on GPU where it applies, the ring under mesh.sequence > 1, else xla) | xla |
  # cudnn | ring (context parallelism over mesh.sequence) | pallas (flash kernel)
  attention_impl: Literal["auto", "xla", "cudnn", "ring", "pallas"] = "auto"
  norm_impl: Literal["xla", "pallas"] = "xla"  # pallas: the fused Pallas RMSNorm kernel
  # Run the Pallas kernels (attention_impl / norm_impl = pallas) in the Pallas interpreter:
  # slow, for CPU tests and debugging; without it they need a GPU.
  kernel_interpret: bool = False
  # The layer stacks as a loop (lax.scan: one layer compiled) or, false, as straight-line code
  # (MaxText's scan_layers): no stacked-residual buffers for the loop to copy into, and XLA
  # schedules across layers; compiles take about n_layers times longer.
  # Weights are stacked either way, so checkpoints are the same.
  scan_layers: bool = True
  moe: MoeConfig | None = None  # None: dense SwiGLU MLPs
  mla: MlaConfig | None = None  # None: grouped-query attention
  mtp: MtpConfig | None = None  # None: next-token prediction only
  dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # compute dtype
  # master weights (and optimizer state)
  param_dtype: Literal["float32", "bfloat16"] = "float32"

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def qk_head_dim(self) -> int:
    """Query / key head size: MLA's nope + rope dims, else the head dim."""
    return (self.resolved_head_dim if self.mla is None
            else self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)

  @property
  def v_head_dim(self) -> int:
    """Value (and attention output) head size: MLA's own, else the head dim."""
    return self.resolved_head_dim if self.mla is None else self.mla.v_head_dim

  @property
  def attention_kv_heads(self) -> int:
    """The K/V heads attention sees: MLA expands its latent per query head, else n_kv_heads."""
    return self.n_kv_heads if self.mla is None else self.n_heads

  @property
  def rope_dim(self) -> int:
    """The dims RoPE rotates per head: MLA's decoupled rope part, else the whole head."""
    return self.resolved_head_dim if self.mla is None else self.mla.qk_rope_head_dim

  @property
  def first_dense(self) -> int:
    """Leading dense layers before the MoE stack (`moe.first_dense`; 0 without MoE)."""
    return 0 if self.moe is None else self.moe.first_dense

  @property
  def stack_layers(self) -> int:
    """The layers of the scanned (and pipelined) stack `blocks`: all but the dense prefix."""
    return self.n_layers - self.first_dense


@dataclasses.dataclass
class MeshConfig:
  """Device-mesh axis sizes; one may be -1 (all remaining devices).

  Multi-node (hybrid) meshes: each axis's total size is `<axis> * dcn_<axis>`, where `<axis>`
  is the degree inside a node (fast links) and `dcn_<axis>` the degree across nodes.

  The mesh's axes are written here once, outermost first (`jscale.mesh.AXES` reads them).
  """
  data: int = -1
  stage: int = 1
  fsdp: int = 1
  expert: int = 1
  sequence: int = 1
  tensor: int = 1
  dcn_data: int = 1
  dcn_stage: int = 1
  dcn_fsdp: int = 1
  dcn_expert: int = 1
  dcn_sequence: int = 1
  dcn_tensor: int = 1


@dataclasses.dataclass
class ParallelConfig:
  """How the mesh's axes are used (docs/parallelism.md)."""
  # xla: sharding annotations XLA partitions | manual: hand-written collectives in shard_map
  collectives: Literal["xla", "manual"] = "xla"
  # ZeRO over mesh.fsdp: 1 shards the optimizer state, 2 also gradients, 3 also parameters
  zero_stage: int = 0
  # with mesh.tensor: activations outside attention and the MLP split over the sequence
  sequence_parallel: bool = False
  # Which sequence chunks each mesh.sequence rank holds: zigzag (chunks i and 2n-1-i: balanced
  # causal attention) or contiguous (chunk i).
  context_layout: Literal["zigzag", "contiguous"] = "zigzag"
  # How attention meets the split sequence: ring (K/V blocks travel; xla mode with
  # model.attention_impl=xla: K/V all-gathered) or ulysses (all-to-alls trade the sequence
  # split for a head split; attention runs whole per head group: jscale.parallel.context.ulysses)
  context_impl: Literal["ring", "ulysses"] = "ring"
  bucket_mb: float = 25.0  # manual mode: gradients are reduced in buffers of at most this size
  # manual mode with SP: SP's all-gather / reduce-scatter decomposed into ring steps overlapped
  # with the attention and MLP projections (jscale.parallel.tensor)
  collective_matmul: bool = False
  # manual mode with mesh.expert > 1, dropless: each device's tokens go through the expert
  # exchange in this many slices, one slice's all-to-alls under another's expert matmuls
  # (DeepSeek-V3's two-micro-batch overlap inside the MoE layer; jscale.parallel.expert_exchange)
  expert_chunks: int = 1
  # with train.accumulate=layer: micro-batches each layer runs side by side, in one step of its
  # loop, so that XLA can run one's collectives (the expert exchange) under another's compute
  # (2: DeepSeek-V3's dual micro-batch overlap); divides train.microbatches; their activations
  # are in flight together (jscale.model.layer_microbatches)
  overlap_microbatches: int = 1
  # with parallel.overlap_microbatches > 1: each side-by-side micro-batch one phase of the
  # layer (attention | dispatch | experts | combine | rest) behind the one before, optimization
  # barriers between phases, so that one's all-to-alls run beside another's compute (DeepSeek-
  # V3's pairing); false: XLA's scheduler orders them, and runs them in lockstep
  # (jscale.model.phases)
  overlap_skew: bool = False
  # with train.accumulate=layer, manual ZeRO-3: each step of a layer's micro-batch loop
  # reduce-scatters its own part of the layer's gradient as its backward makes it, instead of
  # one reduce-scatter of the sum after the loop, which XLA:GPU cannot overlap with the loop:
  # the loop's trips times the bytes, summed on the shards in fp32; the launcher's reduce-scatter
  # combine threshold 8 MiB (jscale.model.layer_microbatches)
  scatter_each_trip: bool = False
  # with parallel.scatter_each_trip: the backward gathers the layer before each layer inside
  # that layer's micro-batch loop, a chunk a trip, where XLA:GPU runs it beside the trip's
  # compute (a gather before the loop waits whole), and with parallel.overlap_skew the
  # forward the layer after, beside each trip's first phase; one more gathered layer in
  # memory (jscale.model.layer_prefetch)
  prefetch_layers: bool = False
  # What XLA:GPU's latency-hiding scheduler takes each kernel to cost: default (its own
  # approximate model) | predicted (jscale.predict's times for this step on this GPU; the step
  # compiles twice: jscale.predict.schedule_costs)
  schedule_costs: Literal["default", "predicted"] = "default"
  # The memory XLA:GPU's scheduler and rematerialisation pass plan the step against, in percent
  # of what XLA may use less the parameters (XLA's own default, 95). Their estimate can run far
  # over the buffers XLA then assigns (DeepSeek-V3 671B on 1,024 H100s: 88.7 GiB estimated, 60.5
  # assigned), and under it they recompute weight gathers and start transfers late; more lets
  # them overlap. What must fit is the compiled step (`python -m jscale.predict` says)
  scheduler_memory_percent: int = 95
  # Overrides of the logical-axis -> mesh-axes table (jscale.sharding.RULES), e.g.
  # {mlp: tensor, embed: null}; a value is a mesh axis, a list of axes, or null (replicated).
  rules: dict | None = None

  @property
  def manual_zero3(self) -> bool:
    """ZeRO-3 by hand: its gathers are plain collectives, whose transpose a trip of a layer's
    micro-batch loop can take (`scatter_each_trip`; xla mode's and ZeRO-2's are custom VJPs)."""
    return self.collectives == "manual" and self.zero_stage == 3

  @property
  def scatters_each_trip(self) -> bool:
    """`scatter_each_trip` where it takes effect (`manual_zero3`)."""
    return self.scatter_each_trip and self.manual_zero3

  @property
  def prefetches_layers(self) -> bool:
    """`prefetch_layers` where it takes effect (`scatters_each_trip`)."""
    return self.prefetch_layers and self.scatters_each_trip


@dataclasses.dataclass
class PipelineConfig:
  """Pipeline parallelism over mesh.stage (jscale.parallel.pipeline)."""
  schedule: Literal["afab", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"] = "1f1b"
  microbatches: int = 4  # micro-batches per step flowing through the stages
  virtual_stages: int = 1  # chunks of layers per stage (interleaved: >= 2; zbv, dualpipev: 2)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """FP8 matmuls on chosen linear layers (jscale.fp8): e4m3 operands forward, e5m2 output
  gradients backward, per-tensor power-of-two scales, fp32 accumulation."""
  enabled: bool = False
  # delayed: scales from the max of the last `amax_history` steps' amaxes (Transformer Engine,
  # Flax); current: from each tensor's amax in this step (one more pass over it before the gemm)
  recipe: Literal["delayed", "current"] = "delayed"
  amax_history: int = 16  # steps of amaxes delayed scaling keeps per tensor
  margin: int = 0  # scales leave 2**margin headroom below the format's max
  # Linear layers in FP8: groups (attention: wq wk wv wo; mlp: w_gate w_up w_down and the MoE
  # shared expert's) or single weight names; experts: the routed experts' grouped matmuls
  # (current scaling: jscale.fp8.grouped, tiled; jscale.fp8.grouped_kernel, the Hopper kernel).
  # Never the embedding, the head or the router.
  targets: tuple[str, ...] = ("attention", "mlp")
  # the routed experts' scales (targets: [experts]): expert (a scale per expert and operand, e5m2
  # output gradients) | row (a scale per row of every operand along its free dim, all e4m3, as
  # DeepSeek-V3 runs every tensor once its scales are fine-grained; the one the Pallas kernel
  # takes, forward and dx in e4m3, dW in bf16: jscale.fp8.grouped_kernel)
  experts_scaling: Literal["expert", "row"] = "expert"


@dataclasses.dataclass
class DistributedConfig:
  """Multi-process setup. All null: read SLURM's environment if present, else one process."""
  coordinator: str | None = None  # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  # a process silent this long (killed, hung, its node gone) is declared lost: JAX's coordination
  # service then stops every other process with a message naming it (no hang on a dead peer)
  heartbeat_timeout_s: int = 60
  # every process must have reached the coordinator this long after starting to connect, else
  # each exits (a peer that never started, or died while starting: no wait on JAX's 300 s)
  init_timeout_s: int = 120


@dataclasses.dataclass
class TrainConfig:
  """The optimisation: steps, batch, AdamW and its cosine schedule, eval, profiling."""
  steps: int = 300  # optimizer steps in all (a resumed run trains on up to this step)
  batch_size: int = 16  # global, in sequences
  seq_len: int = 256
  microbatches: int = 1  # gradient accumulation steps inside one optimizer step
  # where the micro-batches take turns: step (each runs the whole model; jscale.step.accumulate)
  # | layer (each layer runs them all before the next: ZeRO-3 gathers a layer once per pass and
  # reduces its gradient once a step instead of once per micro-batch; every micro-batch's layer
  # inputs are kept; jscale.model.layer_microbatches)
  accumulate: Literal["step", "layer"] = "step"
  lr: float = 3e-3
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
  warmup_steps: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0  # global gradient-norm clipping; 0: off
  # Adam's two moments as stored (updated in fp32 either way): float32 | bfloat16 (half their
  # memory and update traffic, as DeepSeek-V3 trained; needs 1 - b2 >= 2^-8, see jscale.optim)
  moments_dtype: Literal["float32", "bfloat16"] = "float32"
  # what a layer keeps for its backward (jscale.model.remat): none (everything) | selective
  # (matmul outputs; softmax and pointwise ops recomputed) | offload (selective's, in host
  # memory) | full (only the layer's input) | full_offload (full's, in host memory)
  remat: Literal["none", "selective", "offload", "full", "full_offload"] = "none"
  # The loss holds at most this many MiB of logits per device: above it, the head and the
  # cross-entropy run in chunks of the sequence, gradients made chunk by chunk (jscale.step.loss);
  # 0: never chunk (one pass through autodiff, [tokens, vocab] logits in memory).
  logits_chunk_mb: float = 1024.0
  # What the head's product writes its logits in: float32 (its fp32 accumulator) | bfloat16
  # (rounded, as Megatron, torchtitan and Hugging Face make them: half the bytes the loss
  # writes and reads). The softmax, the loss and its gradient are fp32 math either way.
  logits_dtype: Literal["float32", "bfloat16"] = "float32"
  seed: int = 0
  output_dir: str = "runs/default"
  peak_flops: float | None = None  # per device, for MFU; None: from the device table
  profile_steps: list[int] | None = None  # [first, last] traced steps (<output_dir>/profile)
  eval_every: int = 100  # steps between evals of the val loss (and at the end); 0: never
  eval_batches: int = 4  # batches of the val split each eval covers (jscale.eval's default)
  # a non-finite loss or gradient norm: stop (report the step, exit without saving) | skip (the
  # update is dropped, counted as nonfinite_steps in the metrics). Either way no update with a
  # NaN or inf is ever applied.
  on_nan: Literal["stop", "skip"] = "stop"

  @property
  def step_microbatches(self) -> int:
    """The micro-batches of the step's gradient loop (`accumulate: step`; else 1)."""
    return self.microbatches if self.accumulate == "step" else 1

  @property
  def layer_microbatches(self) -> int:
    """The micro-batches each layer runs in turn (`accumulate: layer`; else 1)."""
    return self.microbatches if self.accumulate == "layer" else 1


@dataclasses.dataclass
class MixSource:
  """One source of data.mixture: its keys as data.*'s; drawn with weight / (sum of weights)."""
  source: Literal["stdlib", "bin", "text", "jsonl", "parquet", "arrow"] = "text"
  path: str | None = None
  text_field: str = "text"
  bin_dtype: Literal["uint16", "uint32"] = "uint16"
  weight: float = 1.0
  name: str | None = None  # its eval loss is val_loss/<name> (default: the source's kind)

  @property
  def label(self) -> str:
    """The source's name in the metrics: `name`, or its kind."""
    return self.name or self.source


@dataclasses.dataclass
class DataConfig:
  """What the model reads: the corpus, its tokenizer, the validation split."""
  # stdlib: the Python standard library's sources (no download) | bin: pre-tokenized ids |
  # text: plain-text files | jsonl, parquet, arrow: records, one document per data.text_field
  # (arrow: a datasets.save_to_disk directory too)
  source: Literal["stdlib", "bin", "text", "jsonl", "parquet", "arrow"] = "stdlib"
  path: str | None = None  # bin: .bin/.npy file; text and records: file, directory or glob
  text_field: str = "text"  # jsonl / parquet / arrow: the field holding each document's text
  tokenizer: str = "byte"  # byte | path to a HF tokenizers tokenizer.json
  bin_dtype: Literal["uint16", "uint32"] = "uint16"  # for source=bin
  val_fraction: float = 0.01  # the corpus's share held out as the val split; 0: no eval
  seed: int = 0  # the shuffle of the training windows
  cache_dir: str | None = None  # tokenized corpora; None: ~/.cache/jscale
  # Packed documents attend only to themselves and RoPE restarts at each (windows carry
  # doc_starts; jscale.model.positions). Off by default: at the playbook's 4k windows Llama 3
  # found it changes little, and cuDNN takes documents only as a dense L x L mask (on a GPU,
  # attention_impl=auto then runs the flash kernel); turn it on for long context.
  document_mask: bool = False
  # Several sources mixed by weight, e.g. [{source: jsonl, path: code.jsonl, weight: 0.7},
  # {source: text, path: prose/, weight: 0.3}] (each: source, path, text_field, bin_dtype,
  # weight, name): the run's tokenizer, seed and val_fraction; each source keeps its own
  # validation split, and eval reports val_loss/<name> for each. Replaces data.source / path /
  # text_field / bin_dtype.
  mixture: list[MixSource] | None = None


@dataclasses.dataclass
class CheckpointConfig:
  """Orbax checkpoints: when to save, how many to keep, resume and overwrite."""
  dir: str | None = None  # None: <train.output_dir>/checkpoints
  every: int = 100  # steps between saves (and at the end, and on SIGTERM / Ctrl-C); 0: never
  keep: int = 3  # the newest this many are kept
  async_save: bool = True  # write in the background while training goes on
  every_minutes: float = 0.0  # also save when this long has passed since the last save; 0: off
  # restore the latest checkpoint in dir if there is one; a config that changes the model or
  # the optimizer state's shapes is refused (jscale.run.directory)
  resume: bool = True
  # with resume=false over an earlier run: move it aside to <output_dir>/replaced-<time>/ and
  # start anew (nothing is deleted)
  overwrite: bool = False
  init_from: str | None = None  # a jscale checkpoint dir (e.g. from jscale.convert) for params
  # read every stored array back: of the checkpoint a resume starts from, and of a run's last
  # save before it says done (jscale.ckpt.integrity); false: the metadata and data position only
  verify: bool = True


@dataclasses.dataclass
class LoggingConfig:
  """What the run reports and where (jscale.run.console, metrics.jsonl, TensorBoard)."""
  every: int = 10  # steps between metrics rows and console lines
  progress: bool = True  # a progress bar below the lines, when stderr is a terminal
  tensorboard: bool = True  # <output_dir>/tensorboard event files
  plot: bool = True  # <output_dir>/metrics.png when the run ends (jscale.analysis.plots)


@dataclasses.dataclass
class Config:
  """One run's configuration: a YAML file's sections, one dataclass each."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


def choices(cls, name: str) -> tuple[Any, ...]:
  """The values field `name` of config dataclass `cls` allows: the arguments of its Literal."""
  return typing.get_args(typing.get_type_hints(cls)[name])


def to_dict(cfg) -> dict[str, Any]:
  """The config as plain nested dicts (for logging and checkpoint metadata)."""
  return dataclasses.asdict(cfg)
