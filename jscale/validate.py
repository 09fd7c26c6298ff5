"""Every check of a config: a ConfigError naming the key and the fix, before anything compiles.

- `check_config(cfg)`: the values alone, no devices (`load_config` runs it at load).
- `check_mesh(cfg, mesh)`: the parallel layout and kernels against the model on a mesh's devices
  (`runtime.build` runs both).
- `check_runtime(cfg)`: this machine's backend and files (tokenizer, init_from checkpoint); the
  trainer runs it before building anything.

The allowed values of a field are its `Literal` type in `jscale.config`. Lower layers check their
own arguments with plain ValueErrors (the context token order, FP8 targets) or say why not
(the kernels' and the pipeline schedules' `why_not`); here those become ConfigErrors naming
the key.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
from jax.sharding import Mesh

from jscale import distributed, validate_deepseek
from jscale.ckpt import init_from
from jscale.config import (Config, ConfigError, ModelConfig, MoeConfig, RopeScalingConfig,
                           choices)
from jscale.data import tokenizer_vocab_size
from jscale.fp8 import linears as fp8_linears
from jscale.model import attention as attn_lib
from jscale.model import moe_gemm
from jscale.parallel.context.order import chunks_per_device as parts, token_order
from jscale.parallel.pipeline import schedules
from pallas_kernels.flash_attention import why_not as flash_why_not


def _get(cfg: Config, key: str):
  section, name = key.split(".")
  return getattr(getattr(cfg, section), name)


def _check_choices(cfg: Config) -> None:
  """Every `Literal` field of the sections holds one of its values."""
  for section in dataclasses.fields(cfg):
    sub = getattr(cfg, section.name)
    for name, tp in typing.get_type_hints(type(sub)).items():
      if typing.get_origin(tp) is typing.Literal and getattr(sub, name) not in typing.get_args(tp):
        raise ConfigError(f"{section.name}.{name}={getattr(sub, name)!r}: choose one of "
                          f"{', '.join(typing.get_args(tp))}")


def check_config(cfg: Config) -> None:
  """Checks values that do not depend on the devices; raises ConfigError naming key and fix."""
  _check_choices(cfg)
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
    if rs.rope_type not in choices(RopeScalingConfig, "rope_type"):
      raise ConfigError(f"model.rope_scaling.rope_type={rs.rope_type!r}: choose "
                        f"{' or '.join(choices(RopeScalingConfig, 'rope_type'))}")
    if rs.factor < 1 or rs.low_freq_factor <= 0 or rs.high_freq_factor <= rs.low_freq_factor:
      raise ConfigError("model.rope_scaling needs factor >= 1 and 0 < low_freq_factor < "
                        f"high_freq_factor, got {rs}")
  if m.moe is not None:
    _check_moe(m)
  if m.mla is not None or (m.rope_scaling is not None and m.rope_scaling.rope_type == "yarn"):
    validate_deepseek.check_mla(m)
  if m.mtp is not None:
    validate_deepseek.check_mtp(cfg)
  if cfg.fp8.enabled and (m.mla is not None or m.mtp is not None or m.first_dense):
    raise ConfigError("fp8.enabled with model.mla, model.mtp or model.moe.first_dense: FP8 "
                      "linears cover the Llama / Mixtral blocks only; set fp8.enabled=false")
  if cfg.fp8.enabled:
    _check_fp8(cfg)
  if t.batch_size % t.microbatches:
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches="
                      f"{t.microbatches}: pick a batch size that is a multiple of microbatches")
  if t.seq_len > m.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                      "lower train.seq_len or raise model.max_seq_len")
  for key in ["train.b1", "train.b2"]:
    if not 0.0 <= _get(cfg, key) < 1.0:
      raise ConfigError(f"{key}={_get(cfg, key)} must lie in [0, 1) (Adam's moment decay)")
  if t.eps <= 0:
    raise ConfigError(f"train.eps={t.eps} must be positive (Adam's denominator floor)")
  if t.peak_flops is not None and t.peak_flops <= 0:
    raise ConfigError(f"train.peak_flops={t.peak_flops} must be positive (FLOP/s per device)")
  distributed.validate(cfg.distributed)
  if cfg.checkpoint.every_minutes < 0:
    raise ConfigError(f"checkpoint.every_minutes={cfg.checkpoint.every_minutes} must be >= 0 "
                      "(0: no timed saves)")
  if cfg.checkpoint.every_minutes > 0 and cfg.checkpoint.every == 0:
    raise ConfigError(f"checkpoint.every_minutes={cfg.checkpoint.every_minutes} needs "
                      "checkpoints on: checkpoint.every=0 turns every save off (use a large "
                      "checkpoint.every for timed saves only)")
  if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
    raise ConfigError("checkpoint.overwrite=true replaces an earlier run: it needs "
                      "checkpoint.resume=false as well")
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


def _check_moe(m: ModelConfig) -> None:
  e = m.moe
  if e.dispatch not in choices(MoeConfig, "dispatch"):
    raise ConfigError(f"model.moe.dispatch={e.dispatch!r}: choose "
                      f"{' or '.join(choices(MoeConfig, 'dispatch'))}")
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
  if e.aux_loss_weight < 0 or e.z_loss_weight < 0 or e.seq_aux_loss_weight < 0:
    raise ConfigError("model.moe.aux_loss_weight, z_loss_weight and seq_aux_loss_weight must be "
                      ">= 0 (0 disables)")
  validate_deepseek.check_routing(m)


def _check_fp8(cfg: Config) -> None:
  f = cfg.fp8
  try:
    fp8_linears.target_names(f.targets)
  except ValueError as e:
    raise ConfigError(f"fp8.targets={list(f.targets)}: {e}") from None
  if f.amax_history < 1:
    raise ConfigError(f"fp8.amax_history={f.amax_history} must be >= 1 (steps of amaxes kept)")
  if f.margin < 0:
    raise ConfigError(f"fp8.margin={f.margin} must be >= 0 (powers of two of headroom)")


def check_mesh(cfg: Config, mesh: Mesh) -> None:
  """Divisibility the sharding rules need, and what the kernels, the pipeline and the experts
  need on `mesh`'s devices; ConfigError naming the key, before any compile."""
  m, t, sizes = cfg.model, cfg.train, dict(mesh.shape)
  tp = sizes["tensor"]
  for key, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                     ("model.d_ff", m.d_ff), ("model.vocab_size", m.vocab_size)):
    if value % tp:
      raise ConfigError(f"{key}={value} is not divisible by mesh.tensor={tp}: tensor "
                        f"parallelism splits it evenly; pick mesh.tensor dividing {value}")
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if t.batch_size % (dp * t.microbatches):
    raise ConfigError(
        f"train.batch_size={t.batch_size} is not divisible by data x fsdp x expert ({dp}) x "
        f"train.microbatches ({t.microbatches}): use a multiple of {dp * t.microbatches}")
  seq_split = sizes["sequence"] * (tp if cfg.parallel.sequence_parallel else 1)
  if t.seq_len % seq_split:
    raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by mesh.sequence"
                      f"{' x mesh.tensor (sequence_parallel)' if tp > 1 else ''} ({seq_split})")
  cp = sizes["sequence"]
  if cp > 1:
    try:
      token_order(t.seq_len, cp, cfg.parallel.context_layout)  # the chunks must divide
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if m.attention_impl == "cudnn":
      raise ConfigError(f"model.attention_impl=cudnn with mesh.sequence={cp}: cuDNN's mask is "
                        "by index, not by token position; use model.attention_impl=ring, "
                        "pallas (the ring with flash-kernel blocks) or xla")
    if m.mtp is not None:
      raise ConfigError(f"model.mtp with mesh.sequence={cp}: multi-token prediction shifts the "
                        "labels along the sequence, which context parallelism splits; set "
                        "mesh.sequence=1 or model.mtp=null")
  if m.attention_impl == "cudnn" and m.v_head_dim != m.qk_head_dim:
    raise ConfigError(f"model.attention_impl=cudnn with model.mla: V's head size "
                      f"{m.v_head_dim} differs from Q's {m.qk_head_dim}, which cuDNN "
                      "(jax.nn.dot_product_attention) cannot take; use xla, pallas or ring")
  check_backend(cfg, mesh.devices.flat[0].platform)
  if m.attention_impl == "pallas":
    check_flash_attention(cfg, sizes)
  if sizes["stage"] > 1:
    _check_pipeline(cfg, sizes)
  if cfg.model.moe is not None or sizes["expert"] > 1:
    _check_experts(cfg, sizes)
  if cfg.model.moe is not None and cfg.model.moe.gemm == "pallas":
    check_moe_gemm(cfg, sizes, mesh.devices.flat[0])


def check_backend(cfg: Config, backend: str) -> None:
  """The model's kernels can run on `backend` ("cpu", "gpu", "tpu"): ConfigError naming the key
  and the fix otherwise, never a silent fallback to another impl."""
  m = cfg.model
  for key, impl in (("model.attention_impl", m.attention_impl), ("model.norm_impl", m.norm_impl)):
    backends = attn_lib.BACKENDS.get(impl, ("cpu", "gpu", "tpu"))
    if backend in backends or (impl == "pallas" and m.kernel_interpret):
      continue
    fix = f"use {key}=xla (or run on {'/'.join(backends)})"
    if impl == "pallas":
      fix = (f"Pallas kernels here compile for GPUs (Triton); use {key}=xla, or set "
             "model.kernel_interpret=true to run it in the (slow) Pallas interpreter")
    raise ConfigError(f"{key}={impl} cannot run on backend {backend!r}: {fix}")
  if m.moe is not None and m.moe.gemm == "pallas" and backend != "gpu" and not m.kernel_interpret:
    raise ConfigError(f"model.moe.gemm=pallas cannot run on backend {backend!r}: the grouped "
                      "matmul kernel compiles for Hopper GPUs; use model.moe.gemm=tiled "
                      "(or auto), or set model.kernel_interpret=true to run it in the (slow) "
                      "Mosaic GPU interpreter")


def check_moe_gemm(cfg: Config, sizes: dict[str, int], device=None) -> None:
  """model.moe.gemm=pallas: a Hopper GPU (or the interpreter), and the kernel tiles each
  device's expert matmuls (bf16 / fp16, widths that divide into its tiles; the expert hidden
  dim is split over mesh.tensor)."""
  m = cfg.model
  if m.kernel_interpret and cfg.train.remat != "none":
    raise ConfigError(f"model.moe.gemm=pallas with model.kernel_interpret and "
                      f"train.remat={cfg.train.remat}: JAX's Mosaic GPU interpreter runs the "
                      f"kernel through ordered host callbacks, which remat cannot replay; set "
                      f"train.remat=none (interpreted runs are for tests)")
  cc = moe_gemm.compute_capability(device) if device is not None else None
  if device is not None and device.platform == "gpu" and not str(cc).startswith("9"):
    raise ConfigError(f"model.moe.gemm=pallas needs a Hopper GPU (compute capability 9.x), "
                      f"this is {cc}: use model.moe.gemm=auto or tiled")
  f = (m.moe.d_ff or m.d_ff) // sizes["tensor"]
  why_not = moe_gemm.kernel_fits(m.dtype, m.d_model, f, m.moe.n_experts // sizes["expert"])
  if why_not is not None:
    raise ConfigError(f"model.moe.gemm=pallas cannot run this MoE (model.d_model={m.d_model}, "
                      f"expert width {f} per device, model.dtype={m.dtype}): {why_not}")


def check_flash_attention(cfg: Config, sizes: dict[str, int]) -> None:
  """The flash kernel can tile the attention each device runs (`flash_attention_why_not`)."""
  why = flash_attention_why_not(cfg, sizes)
  if why is not None:
    raise ConfigError(why)


def flash_attention_why_not(cfg: Config, sizes: dict[str, int]) -> str | None:
  """Why `model.attention_impl=pallas` cannot run on a mesh of `sizes` (the flash kernel's
  own shape check on the attention each device runs), naming the key and the fix; None when
  it can."""
  m, t = cfg.model, cfg.train
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  b = max(t.batch_size // (dp * t.microbatches), 1)
  h, g = m.n_heads // sizes["tensor"], m.n_kv_heads // sizes["tensor"]
  k, kv = m.qk_head_dim, m.v_head_dim
  # Under context parallelism the kernel runs on the ring's blocks: one sequence chunk each.
  cp = sizes["sequence"]
  chunk = t.seq_len // (cp * parts(cfg.parallel.context_layout)) if cp > 1 else t.seq_len
  why = flash_why_not((b, chunk, h, k), (b, chunk, g, k), causal=True,
                      v_shape=(b, chunk, g, kv))
  if why is None:
    return None
  key = ((f"model.head_dim={k}" if m.mla is None else
          f"model.mla (q/k head {k}, v head {kv})") if "head_dim" in why
         else f"train.seq_len={t.seq_len}")
  return (f"model.attention_impl=pallas cannot run with {key}: {why}; use "
          "model.attention_impl=xla, or a shape the kernel tiles")


def _check_experts(cfg: Config, sizes: dict[str, int]) -> None:
  """What expert parallelism over mesh.expert needs."""
  moe, ep = cfg.model.moe, sizes["expert"]
  if moe is None:
    raise ConfigError(f"mesh.expert={ep} needs an MoE model: set model.moe.n_experts (or "
                      "model.preset=tiny_moe), or use mesh.data for data parallelism")
  if moe.n_experts % ep:
    raise ConfigError(f"model.moe.n_experts={moe.n_experts} is not divisible by mesh.expert={ep}: "
                      "each device must hold the same number of experts")
  if moe.exchange == "node_limited" and ep > 1:
    validate_deepseek.check_node_limited(cfg, ep)


def _check_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
  """What a pipeline over mesh.stage needs."""
  p, pc, t = sizes["stage"], cfg.pipeline, cfg.train
  why = schedules.why_not(pc.schedule, p, pc.microbatches, pc.virtual_stages)
  if why is not None:
    raise ConfigError(why)
  chunks = p * pc.virtual_stages
  stack = cfg.model.stack_layers
  if stack % chunks:
    dense = (f" - model.moe.first_dense={cfg.model.first_dense} (those run in the first stage)"
             if cfg.model.first_dense else "")
    raise ConfigError(f"model.n_layers={cfg.model.n_layers}{dense} is not divisible by "
                      f"mesh.stage x pipeline.virtual_stages ({chunks}): each chunk needs as "
                      "many layers")
  if t.microbatches != 1:
    raise ConfigError(f"train.microbatches={t.microbatches} with mesh.stage={p}: the pipeline "
                      "splits the batch itself; set pipeline.microbatches instead (and "
                      "train.microbatches=1)")
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if t.batch_size % (dp * pc.microbatches):
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by data x fsdp x expert "
                      f"({dp}) x pipeline.microbatches ({pc.microbatches}): use a multiple of "
                      f"{dp * pc.microbatches}")
  if sizes["sequence"] > 1:
    raise ConfigError(f"mesh.sequence={sizes['sequence']} with mesh.stage={p}: context "
                      "parallelism inside pipeline stages is not supported; set one of them to 1")
  if (cfg.parallel.collectives == "xla" and cfg.parallel.sequence_parallel and dp > 1
      and sizes["tensor"] > 1):
    raise ConfigError(
        f"parallel.sequence_parallel=true with mesh.stage={p}, mesh.tensor={sizes['tensor']} and "
        "data-parallel axes in xla mode: GSPMD reshuffles the sequence-parallel activations "
        "between data and tensor ranks with collective-permutes inside the pipeline's per-stage "
        "branches, which only one stage's devices run (a deadlock); use "
        "parallel.collectives=manual, or sequence_parallel=false")
  if (cfg.parallel.collectives == "xla" and cfg.model.moe is not None
      and sizes["data"] * sizes["fsdp"] > 1):
    # Measured: the router's gradient 27% off (ZeRO-1), a deadlock (ZeRO-2), for every schedule.
    raise ConfigError(
        f"an MoE model with mesh.stage={p} and mesh.data x mesh.fsdp = "
        f"{sizes['data'] * sizes['fsdp']} in xla mode: the stage region keeps those batch "
        "shards apart, so each routes with its own load-balance statistics (not the step's), "
        "and under ZeRO-2 GSPMD reorders rows with a collective-permute inside the first "
        "stage's branch (a deadlock); use parallel.collectives=manual, or split the batch over "
        "mesh.expert only")
  if cfg.parallel.zero_stage > 2:
    raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} with mesh.stage={p}: ZeRO-3 "
                      "would all-gather every chunk's weights again at each of its forward and "
                      "backward ticks; use parallel.zero_stage=2 (gradients and optimizer state "
                      "sharded over fsdp)")


def check_runtime(cfg: Config) -> None:
  """Checks that need this machine (backend, files); raises ConfigError before any compile."""
  check_backend(cfg, jax.default_backend())
  if cfg.checkpoint.init_from:  # first: its tokenizer rule names the right fix there
    init_from.check(cfg)  # shape keys, stored parameter shapes, the tokenizer rule
  vocab = tokenizer_vocab_size(cfg.data)
  if vocab > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                      f"vocabulary ({vocab}, data.tokenizer={cfg.data.tokenizer}): raise it")
