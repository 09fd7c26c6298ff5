"""`check_mesh`: the parallel layout against the model on a mesh's devices: what the sharding
rules divide, context parallelism, the pipeline, the experts and the kernels each device runs."""

from __future__ import annotations

from jax.sharding import Mesh

from jscale.config import Config, ConfigError, ModelConfig
from jscale.model import attention as attn_lib
from jscale.parallel.context.order import token_order
from jscale.parallel.pipeline import schedules
from jscale.validate import experts, kernels, no_ops


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
    if cfg.parallel.context_impl == "ulysses":
      _check_ulysses(cfg, sizes)
    elif m.attention_impl == "cudnn":
      raise ConfigError(f"model.attention_impl=cudnn with mesh.sequence={cp}: cuDNN's mask is "
                        "by index, not by token position; use model.attention_impl=ring, "
                        "pallas (the ring with flash-kernel blocks) or xla, or "
                        "parallel.context_impl=ulysses")
    if (why := context_why_not(m, cp)) is not None:
      raise ConfigError(why)
  capability = getattr(mesh.devices.flat[0], "compute_capability", None)
  if m.attention_impl == "cudnn" and m.v_head_dim != m.qk_head_dim and (why := (
      attn_lib.cudnn_applies(m.dtype, m.qk_head_dim, capability, m.v_head_dim))) is not None:
    raise ConfigError(f"model.attention_impl=cudnn: {why}; use model.attention_impl=xla, "
                      "pallas or ring")
  kernels.check_backend(cfg, mesh.devices.flat[0].platform)
  if m.attention_impl == "pallas":
    kernels.check_flash_attention(cfg, sizes)
  if sizes["stage"] > 1:
    _check_pipeline(cfg, sizes)
  if cfg.parallel.collectives == "xla":
    why = xla_layout_why_not(sizes, cfg.parallel.zero_stage, cfg.parallel.sequence_parallel,
                             cfg.model.moe is not None, cfg.model.tie_embeddings,
                             cfg.train.microbatches)
    if why is not None:
      raise ConfigError(why)
  if cfg.model.moe is not None or sizes["expert"] > 1:
    experts.check_experts(cfg, sizes)
  if cfg.model.moe is not None and cfg.model.moe.gemm == "pallas":
    kernels.check_moe_gemm(cfg, sizes, mesh.devices.flat[0])
  no_ops.check(cfg, sizes)  # refuses a key that asks for what would not happen


def no_op_warnings(cfg: Config, mesh: Mesh) -> list[str]:
  """A warning line per key that has no effect on `mesh` (`no_ops`; the refused ones raised in
  `check_mesh`)."""
  return no_ops.check(cfg, dict(mesh.shape))


def _check_ulysses(cfg: Config, sizes: dict[str, int]) -> None:
  """Ulysses splits each device's heads (after mesh.tensor's split) over mesh.sequence, and
  runs whole-sequence attention, which the ring's impl is not."""
  m, cp, tp = cfg.model, sizes["sequence"], sizes["tensor"]
  for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.attention_kv_heads)):
    if heads % (cp * tp):
      raise ConfigError(
          f"parallel.context_impl=ulysses: {key}={heads} is not divisible by mesh.sequence="
          f"{cp}{f' x mesh.tensor={tp}' if tp > 1 else ''}: the all-to-all gives each device "
          f"whole heads; use parallel.context_impl=ring, or a mesh.sequence dividing "
          f"{heads // tp}")
  if m.attention_impl == "ring":
    raise ConfigError("model.attention_impl=ring with parallel.context_impl=ulysses: each device "
                      "attends over the whole sequence, not the ring's blocks; use "
                      "model.attention_impl=auto, xla, cudnn or pallas")


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
  if t.remat == "full_offload":
    raise ConfigError(f"train.remat=full_offload with mesh.stage={p}: the pipeline executor keeps "
                      "its chunks' inputs itself, on the device; use train.remat=full, or "
                      "offload (its stored residuals in host memory)")
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
  if cfg.parallel.zero_stage > 2:
    raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} with mesh.stage={p}: ZeRO-3 "
                      "would all-gather every chunk's weights again at each of its forward and "
                      "backward ticks; use parallel.zero_stage=2 (gradients and optimizer state "
                      "sharded over fsdp)")


def context_why_not(model: ModelConfig, sequence: int) -> str | None:
  """Why `model` cannot split its sequences over `sequence` devices (None: it can); the
  planner offers no such layout."""
  if sequence > 1 and model.mtp is not None:
    return (f"model.mtp with mesh.sequence={sequence}: multi-token prediction shifts the labels "
            "along the sequence, which context parallelism splits; set mesh.sequence=1 or "
            "model.mtp=null")
  return None


def xla_layout_why_not(sizes: dict[str, int], zero_stage: int, sequence_parallel: bool,
                       moe: bool, tied: bool = False, microbatches: int = 1) -> str | None:
  """Why xla mode cannot run this layout of mesh axis `sizes` (None: it can); manual mode
  can. `tied`: the model ties its embedding and head; `microbatches`: train.microbatches. The
  planner offers no such layout (`jscale.plan.layout.candidates`)."""
  p, tp, fsdp = sizes["stage"], sizes["tensor"], sizes["fsdp"]
  if (zero_stage == 3 and tied and microbatches > 1 and fsdp > 1 and tp > 1
      and sizes["data"] > 1):
    # The same check failure as ZeRO-2's below, on the tied table's accumulated gradient (XLA:GPU
    # for 8 and 64 H100s, llama3_1b: scripts/estimate_vs_compiled.py's sweep; untied, or one
    # micro-batch, or mesh.data=1 compiles).
    return (f"parallel.zero_stage=3 with model.tie_embeddings, train.microbatches={microbatches},"
            f" mesh.fsdp={fsdp}, mesh.tensor={tp} and mesh.data={sizes['data']} in xla mode: "
            "XLA's SPMD partitioner aborts the compile (a check failure in "
            "spmd_partitioner_util.cc) on the tied embedding's gradient; use "
            "parallel.collectives=manual, train.microbatches=1, or put the data-parallel devices "
            "on mesh.fsdp (mesh.data=1)")
  if zero_stage == 2 and fsdp > 1 and tp > 1 and (sizes["data"] > 1 or p > 1):
    # XLA 0.10's SPMD partitioner: spmd_partitioner_util.cc "Check failed:
    # partition_group_list.num_replica_groups() * ... == device_groups.num_devices_per_group()"
    # (SIGABRT), on CPU and GPU alike (scripts/sweep_layout_compiles.py).
    other = f"mesh.stage={p}" if p > 1 else f"mesh.data={sizes['data']}"
    return (f"parallel.zero_stage=2 with mesh.fsdp={fsdp}, mesh.tensor={tp} and {other} in "
            "xla mode: XLA's SPMD partitioner aborts the compile (a check failure in "
            "spmd_partitioner_util.cc) on the ZeRO-2 gradient shards; use "
            "parallel.collectives=manual, or parallel.zero_stage=1 or 3")
  return _xla_pipeline_why_not(sizes, sequence_parallel, moe) if p > 1 else None


def _xla_pipeline_why_not(sizes: dict[str, int], sequence_parallel: bool, moe: bool
                          ) -> str | None:
  """Why xla mode cannot run a pipeline over mesh.stage = sizes["stage"] > 1 (None: it can)."""
  p, tp = sizes["stage"], sizes["tensor"]
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if sequence_parallel and dp > 1 and tp > 1:
    return (f"parallel.sequence_parallel=true with mesh.stage={p}, mesh.tensor={tp} and "
            "data-parallel axes in xla mode: GSPMD reshuffles the sequence-parallel activations "
            "between data and tensor ranks with collective-permutes inside the pipeline's "
            "per-stage branches, which only one stage's devices run (a deadlock); use "
            "parallel.collectives=manual, or sequence_parallel=false")
  if moe and sizes["data"] * sizes["fsdp"] > 1:
    # Measured: the router's gradient 27% off (ZeRO-1), a deadlock (ZeRO-2), for every schedule.
    return (f"an MoE model with mesh.stage={p} and mesh.data x mesh.fsdp = "
            f"{sizes['data'] * sizes['fsdp']} in xla mode: the stage region keeps those batch "
            "shards apart, so each routes with its own load-balance statistics (not the "
            "step's), and under ZeRO-2 GSPMD reorders rows with a collective-permute inside the "
            "first stage's branch (a deadlock); use parallel.collectives=manual, or split the "
            "batch over mesh.expert only")
  return None
