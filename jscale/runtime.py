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
from jscale import validate
from jscale.config import Config
from jscale.fp8 import linears as fp8_linears
from jscale.model import attention as attn_lib
from jscale.model import moe_gemm as moe_gemm_lib
from jscale.model.layers import norm_backend
from jscale.optim import make_optimizer
from jscale.parallel.comms import Comms
from jscale.parallel.context.order import Reorder
from jscale.parallel.context.ulysses import whole_sequence
from jscale.parallel.manual import ManualComms
from jscale.parallel.xla import XlaComms
from jscale.sharding import Layouts
from jscale.step import compute_copies as copies_lib
from jscale.step import state as state_lib
from jscale.step import train_step as ts
from jscale.validate import experts as validate_experts


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What a runtime runs for its config on its devices, each with why: chosen once, by
  `build`; the startup summary and run.json read them here."""
  attention: str  # model.attention_impl, resolved
  attention_requested: str  # model.attention_impl as configured ("auto" or an impl)
  attention_why: str = ""  # why auto chose `attention` ("" when it was given)
  flash: tuple[str, str] = ("", "")  # attention_impl=pallas: hopper | portable (`pallas_kernels`)
  norm: tuple[str, str] = ("", "")  # norm_impl=pallas: hopper | portable (`norm_kernels`)
  moe_gemm: tuple[str, str] = ("", "")  # an MoE's experts: pallas | tiled | ragged_dot | ""
  # (slot buffers) (`moe_gemm`)


@dataclasses.dataclass
class Runtime:
  cfg: Config
  mesh: Mesh
  layouts: Layouts
  comms: Comms
  graphdef: nnx.GraphDef
  state_shapes: Any  # ShapeDtypeStructs of the train state (no shardings)
  state_shardings: Any
  kernels: Kernels

  def init_state(self) -> state_lib.State:
    return state_lib.init_state(self.cfg, self.state_shardings, self.mesh.shape["stage"])

  def params_to_storage(self, tree: dict) -> dict:
    """`tree` (params or dot_state in model layer order: init_from's, a loaded model's) in
    the layer order this runtime's pipeline stores (`state.params_to_storage`)."""
    return state_lib.params_to_storage(tree, self.cfg.model.stack_layers, self.mesh.shape["stage"],
                                       self.cfg.pipeline)

  def abstract_state(self) -> state_lib.State:
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
                             self.state_shardings["params"], self.layouts.batch(),
                             self.state_shardings.get("dot_state"))


def resolve_attention(cfg: Config, mesh: Mesh) -> tuple[Config, str]:
  """`cfg` with model.attention_impl=auto replaced by the impl it runs on `mesh`'s devices,
  and why (`attention.auto_impl`); other values are returned as they are ("" as the why)."""
  m = cfg.model
  if m.attention_impl != "auto":
    return cfg, ""
  device = mesh.devices.flat[0]
  ring = not whole_sequence(cfg.parallel.context_impl, mesh.shape["sequence"])
  flash_tiles = device.platform != "gpu" or validate.flash_attention_why_not(
      _with_attention(cfg, "pallas"), dict(mesh.shape)) is None
  impl, why = attn_lib.auto_impl(device.platform, m.dtype, m.qk_head_dim, ring,
                                 flash_tiles, getattr(device, "compute_capability", None),
                                 m.v_head_dim, cfg.data.document_mask)
  return _with_attention(cfg, impl), why


def pallas_kernels(cfg: Config, mesh: Mesh) -> tuple[str, str]:
  """Which flash kernels `attention_impl: pallas` runs on `mesh`'s devices, and why
  (`attention.pallas_backend`): "hopper", "portable", or "" for other impls."""
  m = cfg.model
  if m.attention_impl != "pallas":
    return "", ""
  ring = not whole_sequence(cfg.parallel.context_impl, mesh.shape["sequence"])
  if m.kernel_interpret or ring:
    return "portable", ("the Pallas interpreter" if m.kernel_interpret
                        else "ring-attention blocks (mesh.sequence > 1)")
  seq, hd = cfg.train.seq_len, m.qk_head_dim
  cc = attn_lib.compute_capability(mesh.devices.flat[0])
  return attn_lib.pallas_backend((1, seq, m.n_heads, hd), (1, seq, m.n_kv_heads, hd),
                                 (1, seq, m.n_kv_heads, m.v_head_dim), m.dtype, True, cc)


def norm_kernels(cfg: Config, mesh: Mesh) -> tuple[str, str]:
  """Which RMSNorm kernels `norm_impl: pallas` runs on `mesh`'s devices, and why
  (`layers.norm_backend`): "hopper", "portable", or "" for the XLA norm."""
  m = cfg.model
  if m.norm_impl != "pallas":
    return "", ""
  if m.kernel_interpret:
    return "portable", "the Pallas interpreter"
  return norm_backend((cfg.train.seq_len, m.d_model), m.dtype,
                      attn_lib.compute_capability(mesh.devices.flat[0]))


def moe_gemm(cfg: Config, mesh: Mesh) -> tuple[str, str]:
  """Which grouped matmul an MoE's dropless experts run on `mesh`'s devices, and why
  (`moe_gemm.auto_gemm` for model.moe.gemm=auto): "pallas", "tiled", "ragged_dot", or ""
  (slot buffers, or no MoE)."""
  m = cfg.model
  if m.moe is None:
    return "", ""
  if m.moe.dispatch != "dropless":
    return "", "capacity dispatch: batched dense matmuls over slot buffers"
  if validate_experts.slot_buffers(cfg, dict(mesh.shape)):
    return "", "xla collectives, experts split: GShard slot buffers (dense batched matmuls)"
  if m.moe.gemm != "auto":
    return m.moe.gemm, f"model.moe.gemm={m.moe.gemm}"
  if m.kernel_interpret:
    return "tiled", "model.kernel_interpret: auto runs the tiled XLA matmuls"
  fp8 = fp8_linears.experts_in(cfg.fp8)
  if fp8 and cfg.fp8.experts_scaling != "row":
    return "tiled", ("fp8.targets has experts, scaled per expert: FP8 products in the tiled "
                     "XLA matmuls (the kernel's FP8 path scales per row)")
  f = (m.moe.d_ff or m.d_ff) // mesh.shape["tensor"]
  return moe_gemm_lib.auto_gemm(m.dtype, m.d_model, f, m.moe.n_experts // mesh.shape["expert"],
                                moe_gemm_lib.compute_capability(mesh.devices.flat[0]), fp8)


def resolve_moe_gemm(cfg: Config, mesh: Mesh) -> tuple[Config, tuple[str, str]]:
  """`cfg` with model.moe.gemm=auto replaced by the grouped matmul it runs on `mesh`'s devices,
  and (impl, why) as `moe_gemm` gives them (other values, and slot buffers, left as they are)."""
  gemm = moe_gemm(cfg, mesh)
  if cfg.model.moe is None or cfg.model.moe.gemm != "auto" or not gemm[0]:
    return cfg, gemm
  moe = dataclasses.replace(cfg.model.moe, gemm=gemm[0])
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe)), gemm


def _with_attention(cfg: Config, impl: str) -> Config:
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl))


def build(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Runtime:
  """Mesh, layouts and comms for `cfg` on `devices` (default: all); `Runtime.cfg` is `cfg` with
  model.attention_impl=auto and model.moe.gemm=auto resolved for those devices (not for the
  process's default device: a step compiled here for other GPUs runs what they would)."""
  validate.check_config(cfg)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  requested = cfg.model.attention_impl
  cfg, attention_why = resolve_attention(cfg, mesh)
  cfg, gemm = resolve_moe_gemm(cfg, mesh)
  validate.check_mesh(cfg, mesh)
  kernels = Kernels(cfg.model.attention_impl, requested, attention_why,
                    pallas_kernels(cfg, mesh), norm_kernels(cfg, mesh), gemm)
  abstract_model = nnx.eval_shape(lambda: state_lib.create_model(cfg))
  graphdef = nnx.split(abstract_model)[0]
  layouts = Layouts(abstract_model, mesh, cfg.parallel)
  abstract = jax.eval_shape(lambda: state_lib.init_state(cfg, stages=mesh.shape["stage"]))
  state_shardings = layouts.state(make_optimizer(cfg.train), abstract,
                                  [k for k in (copies_lib.KEY,) if k in abstract])
  comms = (ManualComms(layouts, cfg.parallel.bucket_mb, cfg.parallel.collective_matmul,
                       cfg.parallel.expert_chunks)
           if cfg.parallel.collectives == "manual" else XlaComms(layouts))
  return Runtime(cfg, mesh, layouts, comms, graphdef, abstract, state_shardings, kernels)
