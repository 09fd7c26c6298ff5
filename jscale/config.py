"""Typed run configuration: dataclasses, YAML files, dotted `key=value` overrides, validation.

Everything a run needs is in one `Config`. `load_config(path, overrides)` reads a YAML file,
applies overrides such as `train.steps=100 model.n_layers=4`, fills a model preset
(`model.preset: llama3_8b`), and validates, so that a bad value fails here, naming the key and
the fix, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
  """A configuration problem, with the offending key and how to fix it."""


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
  """Llama-3 RoPE frequency scaling (HF `rope_type: llama3`)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Mixture-of-experts MLPs (jscale.model.moe): every layer's MLP is a routed set of experts."""
  n_experts: int = 8
  top_k: int = 2  # experts per token; gates are the renormalised top-k softmax (Mixtral)
  d_ff: int | None = None  # each expert's hidden size; None: model.d_ff
  shared_d_ff: int = 0  # hidden size of an always-on shared expert; 0: none
  dispatch: str = "dropless"  # dropless (sort + grouped matmul) | capacity (drop overflow)
  capacity_factor: float = 1.25  # capacity: slots per expert = factor * tokens * top_k / experts
  aux_loss_weight: float = 0.01  # Switch load-balancing loss
  z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
  every: int = 1  # MoE in every k-th layer (layers k-1, 2k-1, ...), dense SwiGLU in the others


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama shape and numerics. `preset` fills every field not given explicitly.

  Frozen (hashable) because the model keeps it as static structure.
  """
  preset: str | None = None
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 4
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int = 384
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScalingConfig | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  # auto (cuDNN on GPU where it applies, the ring under mesh.sequence > 1, else xla) | xla |
  # cudnn | ring (context parallelism over mesh.sequence) | pallas (flash kernel)
  attention_impl: str = "auto"
  norm_impl: str = "xla"  # xla | pallas (fused Pallas RMSNorm kernel)
  # Run the Pallas kernels (attention_impl / norm_impl = pallas) in the Pallas interpreter:
  # slow, for CPU tests and debugging; without it they need a GPU.
  kernel_interpret: bool = False
  moe: MoeConfig | None = None  # None: dense SwiGLU MLPs
  dtype: str = "bfloat16"  # compute dtype
  param_dtype: str = "float32"  # master weights (and optimizer state)

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads


@dataclasses.dataclass
class MeshConfig:
  """Device-mesh axis sizes; one may be -1 (all remaining devices).

  Multi-node (hybrid) meshes: each axis's total size is `<axis> * dcn_<axis>`, where `<axis>`
  is the degree inside a node (fast links) and `dcn_<axis>` the degree across nodes.
  """
  data: int = -1
  fsdp: int = 1
  stage: int = 1
  sequence: int = 1
  tensor: int = 1
  expert: int = 1
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_stage: int = 1
  dcn_sequence: int = 1
  dcn_tensor: int = 1
  dcn_expert: int = 1


@dataclasses.dataclass
class ParallelConfig:
  collectives: str = "xla"  # xla | manual
  zero_stage: int = 0
  sequence_parallel: bool = False
  # Which sequence chunks each mesh.sequence rank holds: zigzag (chunks i and 2n-1-i: balanced
  # causal attention) or contiguous (chunk i).
  context_layout: str = "zigzag"
  bucket_mb: float = 25.0  # manual mode: gradients are reduced in buffers of at most this size
  # Overrides of the logical-axis -> mesh-axes table (jscale.sharding.RULES), e.g.
  # {mlp: tensor, embed: null}; a value is a mesh axis, a list of axes, or null (replicated).
  rules: dict | None = None


@dataclasses.dataclass
class PipelineConfig:
  """Pipeline parallelism over mesh.stage (jscale.parallel.pipeline)."""
  schedule: str = "1f1b"  # afab | 1f1b | interleaved | zero_bubble
  microbatches: int = 4  # micro-batches per step flowing through the stages
  virtual_stages: int = 1  # chunks of layers per stage (interleaved: >= 2)


@dataclasses.dataclass
class DistributedConfig:
  """Multi-process setup. All null: read SLURM's environment if present, else one process."""
  coordinator: str | None = None  # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None


@dataclasses.dataclass
class TrainConfig:
  steps: int = 300
  batch_size: int = 16  # global, in sequences
  seq_len: int = 256
  microbatches: int = 1  # gradient accumulation steps inside one optimizer step
  lr: float = 3e-3
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
  warmup_steps: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0
  remat: str = "none"  # none | selective | full
  # The loss holds at most this many MiB of fp32 logits per device: above it, the head and the
  # cross-entropy run in chunks of the sequence, gradients made chunk by chunk (jscale.loss);
  # 0: never chunk (one pass through autodiff, [tokens, vocab] fp32 logits in memory).
  logits_chunk_mb: float = 1024.0
  seed: int = 0
  output_dir: str = "runs/default"
  peak_flops: float | None = None  # per device; None: from the device table
  profile_steps: list[int] | None = None  # [first, last] traced steps
  eval_every: int = 100
  eval_batches: int = 4


@dataclasses.dataclass
class DataConfig:
  source: str = "stdlib"  # stdlib | bin | text
  path: str | None = None  # bin: .bin/.npy file; text: file, directory or glob
  tokenizer: str = "byte"  # byte | path to a HF tokenizers tokenizer.json
  bin_dtype: str = "uint16"  # uint16 | uint32, for source=bin
  val_fraction: float = 0.01
  seed: int = 0
  cache_dir: str | None = None  # tokenized corpora; None: ~/.cache/jscale


@dataclasses.dataclass
class CheckpointConfig:
  dir: str | None = None  # None: <train.output_dir>/checkpoints
  every: int = 100
  keep: int = 3
  async_save: bool = True
  resume: bool = True  # restore the latest checkpoint in dir if there is one
  init_from: str | None = None  # a jscale checkpoint dir (e.g. from jscale.convert) for params


@dataclasses.dataclass
class LoggingConfig:
  every: int = 10
  progress: bool = True
  tensorboard: bool = True


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


# ------------------------------------------------------------------ loading

def load_config(path: str | os.PathLike | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
  """Reads `path` (YAML), applies dotted `key=value` overrides, validates."""
  raw: dict[str, Any] = {}
  if path is not None:
    raw = _read_yaml(path)
  for item in overrides:
    _apply_override(raw, item)
  cfg = from_dict(raw)
  validate(cfg)
  return cfg


def from_dict(raw: dict[str, Any]) -> Config:
  """Builds a Config from nested dicts, rejecting unknown keys and wrong types."""
  raw = dict(raw)
  model = dict(raw.get("model") or {})
  if model.get("preset") is not None:
    from jscale.model.presets import PRESETS  # pylint: disable=import-outside-toplevel
    name = model["preset"]
    if name not in PRESETS:
      raise ConfigError(f"model.preset={name!r} is unknown: choose one of {sorted(PRESETS)}")
    # Nested sections (model.moe) merge key by key: an override keeps the preset's others.
    model = {k: ({**PRESETS[name][k], **v} if isinstance(v, dict) and
                 isinstance(PRESETS[name].get(k), dict) else v)
             for k, v in {**PRESETS[name], **model}.items()}
    raw["model"] = model
  return _build(Config, raw, "")


def to_dict(cfg) -> dict[str, Any]:
  """The config as plain nested dicts (for logging and checkpoint metadata)."""
  return dataclasses.asdict(cfg)


def _read_yaml(path) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file; pass a YAML file such as configs/tiny.yaml")
  with open(path, encoding="utf-8") as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"--config {path} is not valid YAML: {e}") from None
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ConfigError(f"--config {path}: top level must be a mapping of sections "
                      f"(model:, train:, ...), got {type(raw).__name__}")
  return raw


def _apply_override(raw: dict[str, Any], item: str) -> None:
  key, sep, text = item.partition("=")
  if not sep or not key or "." not in key:
    raise ConfigError(f"override {item!r}: write it as section.key=value, e.g. train.steps=100")
  try:
    value = yaml.safe_load(text) if text else None
  except yaml.YAMLError:
    value = text
  node = raw
  parts = key.split(".")
  for p in parts[:-1]:
    if node.get(p) is None:
      node[p] = {}
    if not isinstance(node[p], dict):
      raise ConfigError(f"override {item!r}: {p} is not a section")
    node = node[p]
  node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str):
  if not isinstance(raw, dict):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in raw:
    if key not in names:
      close = difflib.get_close_matches(str(key), names, n=1)
      hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(names)}"
      raise ConfigError(f"unknown config key {prefix}{key}: {hint}")
  kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in raw.items()}
  return cls(**kwargs)


def _coerce(tp, value, key):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      return None
    return _coerce(args[0], value, key)
  if dataclasses.is_dataclass(tp):
    return _build(tp, value or {}, key + ".")
  if tp is dict or origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {{mlp: tensor}}")
    return dict(value)
  if origin is list:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[10,20]")
    (elem,) = typing.get_args(tp)
    return [_coerce(elem, v, key) for v in value]
  if value is None:
    raise ConfigError(f"{key} may not be empty: give a {tp.__name__}")
  if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if tp is float and isinstance(value, str):
    try:
      return float(value)  # YAML reads 3e-4 (no dot) as a string
    except ValueError:
      pass
  if tp is bool and not isinstance(value, bool):
    raise ConfigError(f"{key}={value!r}: expected true or false")
  if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise ConfigError(f"{key}={value!r}: expected an integer")
  if tp is str and not isinstance(value, str):
    raise ConfigError(f"{key}={value!r}: expected a string")
  return value


# --------------------------------------------------------------- validation

_CHOICES = {
    "model.attention_impl": ("auto", "xla", "cudnn", "ring", "pallas"),
    "model.norm_impl": ("xla", "pallas"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "parallel.collectives": ("xla", "manual"),
    "parallel.context_layout": ("zigzag", "contiguous"),
    "pipeline.schedule": ("afab", "1f1b", "interleaved", "zero_bubble"),
    "train.remat": ("none", "selective", "full"),
    "data.source": ("stdlib", "bin", "text"),
    "data.bin_dtype": ("uint16", "uint32"),
}


def _get(cfg: Config, key: str):
  section, name = key.split(".")
  return getattr(getattr(cfg, section), name)


def validate(cfg: Config) -> None:
  """Checks values that do not depend on the devices; raises ConfigError naming key and fix."""
  for key, choices in _CHOICES.items():
    if _get(cfg, key) not in choices:
      raise ConfigError(f"{key}={_get(cfg, key)!r}: choose one of {', '.join(choices)}")
  m, t = cfg.model, cfg.train
  positive = ["model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
              "model.n_kv_heads", "model.d_ff", "model.max_seq_len", "train.steps",
              "train.batch_size", "train.seq_len", "train.microbatches", "train.eval_batches",
              "checkpoint.keep", "logging.every", "pipeline.microbatches",
              "pipeline.virtual_stages"]
  for key in positive:
    if _get(cfg, key) <= 0:
      raise ConfigError(f"{key}={_get(cfg, key)} must be positive")
  for key in ["model.rope_theta", "model.norm_eps", "model.init_std", "train.lr"]:
    if _get(cfg, key) <= 0:
      raise ConfigError(f"{key}={_get(cfg, key)} must be positive")
  for key in ["train.warmup_steps", "train.eval_every", "checkpoint.every", "train.clip_norm",
              "train.weight_decay", "train.logits_chunk_mb"]:
    if _get(cfg, key) < 0:
      raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0 (0 disables it)")
  if m.head_dim is not None and m.head_dim <= 0:
    raise ConfigError(f"model.head_dim={m.head_dim} must be positive (or null: d_model // n_heads)")
  if m.head_dim is None and m.d_model % m.n_heads:
    raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}: "
                      "change one, or set model.head_dim explicitly")
  if m.resolved_head_dim % 2:
    raise ConfigError(f"head dim {m.resolved_head_dim} must be even for RoPE: set model.head_dim")
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads="
                      f"{m.n_kv_heads}: set n_kv_heads to a divisor of n_heads (GQA groups)")
  if m.rope_scaling is not None:
    rs = m.rope_scaling
    if rs.factor < 1 or rs.low_freq_factor <= 0 or rs.high_freq_factor <= rs.low_freq_factor:
      raise ConfigError("model.rope_scaling needs factor >= 1 and 0 < low_freq_factor < "
                        f"high_freq_factor, got {rs}")
  if m.moe is not None:
    _validate_moe(m)
  if t.batch_size % t.microbatches:
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches="
                      f"{t.microbatches}: pick a batch size that is a multiple of microbatches")
  if t.seq_len > m.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                      "lower train.seq_len or raise model.max_seq_len")
  if not 0.0 <= t.min_lr_ratio <= 1.0:
    raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
  if t.profile_steps is not None and (len(t.profile_steps) != 2 or
                                      not 0 <= t.profile_steps[0] <= t.profile_steps[1]):
    raise ConfigError(f"train.profile_steps={t.profile_steps}: give [first, last] with "
                      "0 <= first <= last")
  if not 0.0 <= cfg.data.val_fraction < 1.0:
    raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must lie in [0, 1)")
  if cfg.data.source in ("bin", "text") and not cfg.data.path:
    raise ConfigError(f"data.source={cfg.data.source} needs data.path (a file, directory or glob)")
  if cfg.parallel.bucket_mb <= 0:
    raise ConfigError(f"parallel.bucket_mb={cfg.parallel.bucket_mb} must be positive (MiB per "
                      "gradient bucket; 25 is PyTorch DDP's default)")
  if not 0 <= cfg.parallel.zero_stage <= 3:
    raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage}: choose 0, 1, 2 or 3")
  sizes = dataclasses.asdict(cfg.mesh)
  for name, size in sizes.items():
    if size == 0 or size < -1 or (name.startswith("dcn_") and size < 1):
      raise ConfigError(f"mesh.{name}={size}: give a positive size" +
                        ("" if name.startswith("dcn_") else ", or -1 for the rest"))
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError("mesh: at most one axis may be -1; give explicit sizes to the others")


def _validate_moe(m: ModelConfig) -> None:
  e = m.moe
  if e.dispatch not in ("dropless", "capacity"):
    raise ConfigError(f"model.moe.dispatch={e.dispatch!r}: choose dropless or capacity")
  if e.n_experts < 1 or not 1 <= e.top_k <= e.n_experts:
    raise ConfigError(f"model.moe.top_k={e.top_k} with model.moe.n_experts={e.n_experts}: need "
                      "1 <= top_k <= n_experts")
  if (e.d_ff is not None and e.d_ff <= 0) or e.shared_d_ff < 0:
    raise ConfigError(f"model.moe.d_ff={e.d_ff} / shared_d_ff={e.shared_d_ff}: give positive "
                      "sizes (d_ff null: model.d_ff; shared_d_ff 0: no shared expert)")
  if e.every < 1 or m.n_layers % e.every:
    raise ConfigError(f"model.moe.every={e.every} must be >= 1 and divide model.n_layers="
                      f"{m.n_layers} (layers are stacked in groups of every-1 dense + 1 MoE)")
  if e.capacity_factor <= 0:
    raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} must be positive")
  if e.aux_loss_weight < 0 or e.z_loss_weight < 0:
    raise ConfigError("model.moe.aux_loss_weight and z_loss_weight must be >= 0 (0 disables)")
