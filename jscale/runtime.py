"""Everything a config needs to run on a set of devices: mesh, layouts, comms, jitted steps.

`build(cfg)` validates the parallel layout against the model before anything is compiled, then
returns the pieces the train loop, the scripts and the tests share.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from jscale import mesh as mesh_lib
from jscale import train_step as ts
from jscale.config import Config, ConfigError
from jscale.parallel.context.order import Reorder, chunks_per_device as parts, token_order
from jscale.model import attention as attn_lib
from jscale.model import llama
from jscale.optim import make_optimizer
from jscale.parallel.comms import Comms
from jscale.parallel.manual import ManualComms
from jscale.parallel.pipeline import schedules
from jscale.parallel.xla import XlaComms
from jscale.sharding import Layouts


@dataclasses.dataclass
class Runtime:
  cfg: Config
  mesh: Mesh
  layouts: Layouts
  comms: Comms
  graphdef: nnx.GraphDef
  state_shapes: Any  # ShapeDtypeStructs of the train state (no shardings)
  state_shardings: Any
  attention_why: str = ""  # why model.attention_impl=auto chose cfg.model.attention_impl

  def init_state(self) -> ts.State:
    return ts.init_state(self.cfg, self.state_shardings, self.mesh.shape["stage"])

  def abstract_state(self) -> ts.State:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        self.state_shapes, self.state_shardings)

  def train_step(self) -> Callable:
    return ts.make_train_step(self.cfg, self.graphdef, self.comms, self.state_shardings,
                              self.layouts.batch())

  def reorder(self) -> Reorder | None:
    """The token order the data pipeline applies under context parallelism (None without):
    tokens, labels and mask permuted to `parallel.context_layout`, plus RoPE positions."""
    n = self.mesh.shape["sequence"]
    return Reorder(self.cfg.train.seq_len, n, self.cfg.parallel.context_layout) if n > 1 else None

  def eval_step(self) -> Callable:
    return ts.make_eval_step(self.cfg, self.graphdef, self.comms,
                             self.state_shardings["params"], self.layouts.batch())


def check_layout(cfg: Config, mesh: Mesh) -> None:
  """Divisibility the sharding rules need; ConfigError naming the key, before any compile."""
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
    token_order(t.seq_len, cp, cfg.parallel.context_layout)  # raises if the chunks do not divide
    if m.attention_impl == "cudnn":
      raise ConfigError(f"model.attention_impl=cudnn with mesh.sequence={cp}: cuDNN's mask is "
                        "by index, not by token position; use model.attention_impl=ring, "
                        "pallas (the ring with flash-kernel blocks) or xla")
  check_backend(cfg, mesh.devices.flat[0].platform)
  if m.attention_impl == "pallas":
    check_flash_attention(cfg, sizes)
  if sizes["stage"] > 1:
    check_pipeline(cfg, sizes)
  if cfg.model.moe is not None or sizes["expert"] > 1:
    check_experts(cfg, sizes)


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


def check_flash_attention(cfg: Config, sizes: dict[str, int]) -> None:
  """The flash kernel can tile the attention each device runs (its own shape check)."""
  from pallas_kernels.flash_attention import check_shapes  # pylint: disable=import-outside-toplevel
  m, t = cfg.model, cfg.train
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  b = max(t.batch_size // (dp * t.microbatches), 1)
  h, g = m.n_heads // sizes["tensor"], m.n_kv_heads // sizes["tensor"]
  k = m.resolved_head_dim
  # Under context parallelism the kernel runs on the ring's blocks: one sequence chunk each.
  cp = sizes["sequence"]
  chunk = t.seq_len // (cp * parts(cfg.parallel.context_layout)) if cp > 1 else t.seq_len
  try:
    check_shapes((b, chunk, h, k), (b, chunk, g, k), causal=True)
  except ValueError as e:
    key = (f"model.head_dim={k}" if "head_dim" in str(e) else f"train.seq_len={t.seq_len}")
    raise ConfigError(f"model.attention_impl=pallas cannot run with {key}: {e}; use "
                      "model.attention_impl=xla, or a shape the kernel tiles") from None


def check_experts(cfg: Config, sizes: dict[str, int]) -> None:
  """What expert parallelism over mesh.expert needs; ConfigError naming the key."""
  moe, ep = cfg.model.moe, sizes["expert"]
  if moe is None:
    raise ConfigError(f"mesh.expert={ep} needs an MoE model: set model.moe.n_experts (or "
                      "model.preset=tiny_moe), or use mesh.data for data parallelism")
  if moe.n_experts % ep:
    raise ConfigError(f"model.moe.n_experts={moe.n_experts} is not divisible by mesh.expert={ep}: "
                      "each device must hold the same number of experts")


def check_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
  """What a pipeline over mesh.stage needs; ConfigError naming the key, before any compile."""
  p, pc, t = sizes["stage"], cfg.pipeline, cfg.train
  try:
    schedules.check_args(pc.schedule, p, pc.microbatches, pc.virtual_stages)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  chunks = p * pc.virtual_stages
  if cfg.model.n_layers % chunks:
    raise ConfigError(f"model.n_layers={cfg.model.n_layers} is not divisible by mesh.stage x "
                      f"pipeline.virtual_stages ({chunks}): each chunk needs as many layers")
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
  if cfg.parallel.zero_stage > 2:
    raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} with mesh.stage={p}: ZeRO-3 "
                      "would all-gather every chunk's weights again at each of its forward and "
                      "backward ticks; use parallel.zero_stage=2 (gradients and optimizer state "
                      "sharded over fsdp)")


def resolve_attention(cfg: Config, mesh: Mesh) -> tuple[Config, str]:
  """`cfg` with model.attention_impl=auto replaced by the impl it runs on `mesh`'s devices,
  and why (`attention.auto_impl`); other values are returned as they are ("" as the why)."""
  m = cfg.model
  if m.attention_impl != "auto":
    return cfg, ""
  device, cp = mesh.devices.flat[0], mesh.shape["sequence"]
  flash_tiles = True
  if cp > 1 and device.platform == "gpu":
    try:
      check_flash_attention(_with_attention(cfg, "pallas"), dict(mesh.shape))
    except ConfigError:
      flash_tiles = False
  impl, why = attn_lib.auto_impl(device.platform, m.dtype, m.resolved_head_dim, cp > 1,
                                 flash_tiles, getattr(device, "compute_capability", None))
  return _with_attention(cfg, impl), why


def _with_attention(cfg: Config, impl: str) -> Config:
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl))


def build(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Runtime:
  """Mesh, layouts and comms for `cfg` on `devices` (default: all); `Runtime.cfg` is `cfg` with
  model.attention_impl=auto resolved for those devices."""
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  cfg, attention_why = resolve_attention(cfg, mesh)
  check_layout(cfg, mesh)
  abstract_model = nnx.eval_shape(lambda: llama.create(cfg.model, cfg.train.seed))
  graphdef = nnx.split(abstract_model)[0]
  layouts = Layouts(abstract_model, mesh, cfg.parallel)
  abstract = jax.eval_shape(lambda: ts.init_state(cfg))
  state_shardings = layouts.state(make_optimizer(cfg.train), abstract)
  comms = (ManualComms(layouts, cfg.parallel.bucket_mb) if cfg.parallel.collectives == "manual"
           else XlaComms(layouts))
  return Runtime(cfg, mesh, layouts, comms, graphdef, abstract, state_shardings, attention_why)
