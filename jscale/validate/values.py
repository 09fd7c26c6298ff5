"""`check_config`: the values of a config alone, no devices (`load_config` runs it at load)."""

from __future__ import annotations

import dataclasses

from jscale import distributed
from jscale.config import Config, ConfigError, DataConfig, ModelConfig
from jscale.fp8 import linears as fp8_linears
from jscale.validate import deepseek, experts
from jscale.validate.choices import check_choices


def _get(cfg: Config, key: str):
  section, name = key.split(".")
  return getattr(getattr(cfg, section), name)


def check_config(cfg: Config) -> None:
  """Checks values that do not depend on the devices; raises ConfigError naming key and fix."""
  check_choices(cfg)
  _check_signs(cfg)
  _check_model(cfg.model)
  if cfg.model.mtp is not None:
    deepseek.check_mtp(cfg.model.mtp, cfg.train.seq_len)
  if cfg.fp8.enabled:
    _check_fp8(cfg)
  _check_train(cfg)
  _check_layer_microbatches(cfg)
  distributed.validate(cfg.distributed)
  _check_checkpoint_and_data(cfg)
  _check_layout(cfg)


def _check_signs(cfg: Config) -> None:
  """Sizes, counts and rates that must be positive (or >= 0 where 0 turns a thing off)."""
  positive = ["model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
              "model.n_kv_heads", "model.d_ff", "model.max_seq_len", "train.steps",
              "train.batch_size", "train.seq_len", "train.microbatches", "train.eval_batches",
              "checkpoint.keep", "logging.every", "pipeline.microbatches",
              "pipeline.virtual_stages", "model.rope_theta", "model.norm_eps", "model.init_std",
              "train.lr", "parallel.expert_chunks", "parallel.overlap_microbatches",
              "parallel.scheduler_memory_percent"]
  for key in positive:
    if _get(cfg, key) <= 0:
      raise ConfigError(f"{key}={_get(cfg, key)} must be positive")
  for key in ["train.warmup_steps", "train.eval_every", "checkpoint.every", "train.clip_norm",
              "train.weight_decay", "train.logits_chunk_mb"]:
    if _get(cfg, key) < 0:
      raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0 (0 disables it)")


def _check_model(m: ModelConfig) -> None:
  """Head sizes, GQA groups, RoPE scaling, the MoE and DeepSeek-V3's sections."""
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
  rs = m.rope_scaling
  if rs is not None and (rs.factor < 1 or rs.low_freq_factor <= 0
                         or rs.high_freq_factor <= rs.low_freq_factor):
    raise ConfigError("model.rope_scaling needs factor >= 1 and 0 < low_freq_factor < "
                      f"high_freq_factor, got {rs}")
  if m.moe is not None:
    experts.check_values(m.moe, m.n_layers)
  if m.mla is not None or (rs is not None and rs.rope_type == "yarn"):
    deepseek.check_mla(m)


def _check_fp8(cfg: Config) -> None:
  m, f = cfg.model, cfg.fp8
  try:
    names = fp8_linears.target_names(f.targets)
  except ValueError as e:
    raise ConfigError(f"fp8.targets={list(f.targets)}: {e}") from None
  linears = names - {fp8_linears.EXPERTS}
  if linears and cfg.parallel.collective_matmul:
    raise ConfigError("fp8.enabled with parallel.collective_matmul: the ring would run each "
                      "FP8 product once per chunk, each with its own scale; set one of them "
                      "false")
  if linears and f.recipe == "delayed" and (m.mla is not None or m.mtp is not None
                                             or m.first_dense):
    raise ConfigError(f"fp8.targets={list(f.targets)} with fp8.recipe=delayed and model.mla, "
                      "model.mtp or model.moe.first_dense: delayed scaling keeps amax "
                      "histories for the Llama / Mixtral blocks' linears only; set "
                      "fp8.recipe=current (no state), or fp8.targets=[experts]")
  if fp8_linears.EXPERTS in names:
    _check_fp8_experts(cfg)
  if f.amax_history < 1:
    raise ConfigError(f"fp8.amax_history={f.amax_history} must be >= 1 (steps of amaxes kept)")
  if f.margin < 0:
    raise ConfigError(f"fp8.margin={f.margin} must be >= 0 (powers of two of headroom)")


def _check_fp8_experts(cfg: Config) -> None:
  """FP8 experts run in the dropless sort's grouped matmul: tiled (`jscale.fp8.grouped`), or
  the Hopper kernel when scaled per row (`jscale.fp8.grouped_kernel`)."""
  moe = cfg.model.moe
  key = "fp8.targets=[experts]"
  if moe is None:
    raise ConfigError(f"{key} needs routed experts: set model.moe, or drop experts from "
                      f"fp8.targets")
  if moe.dispatch != "dropless":
    raise ConfigError(f"{key} with model.moe.dispatch={moe.dispatch}: FP8 experts run in the "
                      f"dropless grouped matmul; set model.moe.dispatch=dropless")
  if moe.gemm == "ragged_dot":
    raise ConfigError(f"{key} with model.moe.gemm=ragged_dot: ragged_dot takes no FP8 scales "
                      f"(and costs E times the FLOPs); set model.moe.gemm=tiled, pallas or auto")
  if moe.gemm == "pallas" and cfg.fp8.experts_scaling != "row":
    raise ConfigError(f"{key} with model.moe.gemm=pallas and fp8.experts_scaling="
                      f"{cfg.fp8.experts_scaling}: the kernel's FP8 path scales per row (its "
                      f"epilogue-exact scales); set fp8.experts_scaling=row, or "
                      f"model.moe.gemm=tiled")
  # (xla mode's split experts, which run slot buffers: `experts.check_experts`, on the mesh)


# The largest relative rounding error of bf16 (8 significant bits): a change smaller than this
# share of a stored value may round away.
BF16_HALF_ULP = 2.0**-8


def _check_train(cfg: Config) -> None:
  m, t = cfg.model, cfg.train
  if t.batch_size % t.microbatches:
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches="
                      f"{t.microbatches}: pick a batch size that is a multiple of microbatches")
  if t.seq_len > m.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                      "lower train.seq_len or raise model.max_seq_len")
  for key in ["train.b1", "train.b2"]:
    if not 0.0 <= _get(cfg, key) < 1.0:
      raise ConfigError(f"{key}={_get(cfg, key)} must lie in [0, 1) (Adam's moment decay)")
  if t.moments_dtype == "bfloat16" and 1.0 - t.b2 < BF16_HALF_ULP:
    raise ConfigError(f"train.moments_dtype=bfloat16 with train.b2={t.b2}: bf16 keeps 8 "
                      f"significant bits, so the second moment's decay per step (1 - b2 = "
                      f"{1 - t.b2:.2g} of it) rounds away and it never falls; use "
                      f"train.b2 <= {1 - BF16_HALF_ULP:.4f} (DeepSeek-V3: 0.95) or "
                      "train.moments_dtype=float32")
  if t.eps <= 0:
    raise ConfigError(f"train.eps={t.eps} must be positive (Adam's denominator floor)")
  if t.peak_flops is not None and t.peak_flops <= 0:
    raise ConfigError(f"train.peak_flops={t.peak_flops} must be positive (FLOP/s per device)")
  if not 0.0 <= t.min_lr_ratio <= 1.0:
    raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
  if t.profile_steps is not None and (len(t.profile_steps) != 2 or
                                      not 0 <= t.profile_steps[0] <= t.profile_steps[1]):
    raise ConfigError(f"train.profile_steps={t.profile_steps}: give [first, last] with "
                      "0 <= first <= last")


def _check_layer_microbatches(cfg: Config) -> None:
  """`train.accumulate=layer`'s micro-batch loop inside each layer, and what it can carry."""
  t, side = cfg.train, cfg.parallel.overlap_microbatches
  if side > 1 and (t.layer_microbatches == 1 or t.microbatches % side):
    raise ConfigError(f"parallel.overlap_microbatches={side}: the layers run that many of "
                      f"train.microbatches side by side, so it needs train.accumulate=layer "
                      f"(now {t.accumulate}) and must divide train.microbatches "
                      f"({t.microbatches}); set them so, or parallel.overlap_microbatches=1")
  if side > 1 and t.microbatches > side and t.remat == "offload":
    # XLA:GPU (jax 0.10.2) fails the step in layout assignment, "Expected instruction to have
    # shape equal to ...": the loop over the side-by-side groups carries the residuals in host
    # memory (S(5)) where its tuple expects device memory. One group (no loop), groups of one
    # (overlap 1) and full_offload's layer inputs compile (tests/step/test_layer_microbatches.py;
    # found compiling the 671B's layout with offload, 2026-11-30).
    raise ConfigError(f"train.remat=offload with parallel.overlap_microbatches={side} and "
                      f"train.microbatches={t.microbatches}: XLA:GPU cannot compile a loop over "
                      "side-by-side micro-batches whose residuals wait in host memory; use "
                      "train.remat=full_offload (the layers' inputs in host memory) or "
                      "selective, or parallel.overlap_microbatches=1")
  if t.layer_microbatches > 1 and cfg.fp8.enabled and cfg.fp8.recipe == "delayed":
    # The amax histories ride on the backward as "gradients" that micro-batches combine by a
    # max (`accumulate`); a layer's micro-batch loop would sum them.
    raise ConfigError(f"train.accumulate=layer with train.microbatches={t.microbatches} and "
                      "fp8.recipe=delayed: the layers' micro-batches would sum the amax "
                      "histories instead of taking their max; use fp8.recipe=current or "
                      "train.accumulate=step")


def _check_checkpoint_and_data(cfg: Config) -> None:
  c, d = cfg.checkpoint, cfg.data
  if c.every_minutes < 0:
    raise ConfigError(f"checkpoint.every_minutes={c.every_minutes} must be >= 0 "
                      "(0: no timed saves)")
  if c.every_minutes > 0 and c.every == 0:
    raise ConfigError(f"checkpoint.every_minutes={c.every_minutes} needs "
                      "checkpoints on: checkpoint.every=0 turns every save off (use a large "
                      "checkpoint.every for timed saves only)")
  if c.overwrite and c.resume:
    raise ConfigError("checkpoint.overwrite=true replaces an earlier run: it needs "
                      "checkpoint.resume=false as well")
  if not 0.0 <= d.val_fraction < 1.0:
    raise ConfigError(f"data.val_fraction={d.val_fraction} must lie in [0, 1)")
  if d.mixture is not None:
    _check_mixture(d)
  elif d.source != "stdlib" and not d.path:
    raise ConfigError(f"data.source={d.source} needs data.path (a file, directory or glob)")


def _check_mixture(d: DataConfig) -> None:
  if not d.mixture:
    raise ConfigError("data.mixture is empty: list its sources, or set data.mixture=null")
  if d.path is not None:
    raise ConfigError(f"data.path={d.path!r} with data.mixture: each of the mixture's sources "
                      "names its own path; drop data.path")
  names = [m.label for m in d.mixture]
  for i, m in enumerate(d.mixture):
    if not m.weight > 0:
      raise ConfigError(f"data.mixture[{i}].weight={m.weight} must be > 0")
    if m.source != "stdlib" and not m.path:
      raise ConfigError(f"data.mixture[{i}].source={m.source} needs data.mixture[{i}].path")
    if names.count(names[i]) > 1:
      raise ConfigError(f"data.mixture[{i}]: two sources are named {names[i]!r} (their eval "
                        f"losses would share val_loss/{names[i]}): give each a name")


def _check_layout(cfg: Config) -> None:
  """The parallel section's values and the mesh's axis sizes (their product is checked
  against the devices in `check_mesh`)."""
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
