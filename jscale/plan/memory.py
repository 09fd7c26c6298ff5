"""Per-device memory of a training step: the playbook's formulas, and jscale's own estimate.

Playbook (PLAYBOOK_DIGEST.md §2): mixed precision keeps 2Ψ bf16 weights + 2Ψ bf16 grads +
12Ψ (fp32 master weights and Adam's two moments) = 16Ψ, +4Ψ with fp32 gradient accumulation;
ZeRO divides optimizer / +grads / +weights by N_d; activations per layer (with a fused
attention, so no s² term) are 34·s·b·h bytes, s·b·h·(10 + 24/t) with TP and 34·s·b·h/t with
TP + SP (the 70B chart: 21.25 / 8.125 / 2.66 GiB at seq 1k).

jscale keeps fp32 master weights, fp32 gradients and fp32 Adam moments (4 + 4 + 8 bytes per
parameter: the same 16Ψ, distributed differently) and saves per layer and token what its remat
policy keeps (`jscale.model.llama.SELECTIVE_SAVE`), in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jscale.config import ModelConfig
from jscale.metrics import param_counts
from jscale.parallel.pipeline import schedules
from jscale.plan.layout import Layout

GiB = 2**30


def playbook_state_bytes(n_params: float, fp32_grad_accum: bool = False) -> float:
  """Weights + gradients + Adam state, mixed precision: 16Ψ (20Ψ with fp32 accumulation)."""
  return (20 if fp32_grad_accum else 16) * n_params


def playbook_zero_bytes(n_params: float, zero_stage: int, n_d: int, k: int = 12) -> float:
  """The ZeRO paper's per-device 2Ψ + 2Ψ + kΨ, with stage s dividing the first s terms by N_d."""
  w, g, o = 2 * n_params, 2 * n_params, k * n_params
  return (w / (n_d if zero_stage >= 3 else 1) + g / (n_d if zero_stage >= 2 else 1)
          + o / (n_d if zero_stage >= 1 else 1))


def playbook_activation_bytes(layers: int, seq: int, batch: int, hidden: int, tp: int = 1,
                              sp: bool = False) -> float:
  """34·s·b·h per layer (fused attention), s·b·h·(10 + 24/t) with TP, 34·s·b·h/t with SP."""
  per = 34 / tp if sp else (10 + 24 / tp if tp > 1 else 34)
  return layers * seq * batch * hidden * per


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes by term."""
  params: float
  grads: float
  optimizer: float
  activations: float
  workspace: float  # one layer's transient working set (recompute, weight gathers, logits chunk)

  @property
  def total(self) -> float:
    return self.params + self.grads + self.optimizer + self.activations + self.workspace

  def terms(self) -> dict[str, float]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def local_params(model: ModelConfig, lay: Layout) -> float:
  """Parameters one device stores before ZeRO: matrices split over tensor (experts also over
  expert), layers over stage; embedding and head vocab-parallel over tensor."""
  return sum(local_param_split(model, lay))


def local_param_split(model: ModelConfig, lay: Layout) -> tuple[float, float]:
  """`local_params` as (the layer stack's, the rest: embedding, head, final norm)."""
  d, f, t = model.d_model, model.d_ff, lay.tensor
  h, g, k = model.n_heads, model.n_kv_heads, model.resolved_head_dim
  attn = (2 * d * h * k + 2 * d * g * k) / t
  if model.moe is None:
    mlp = 3 * d * f / t
  else:
    m = model.moe
    mlp = (d * m.n_experts + m.n_experts * 3 * d * (m.d_ff or f) / (t * lay.expert)
           + 3 * d * m.shared_d_ff / t)
  layers = model.n_layers / lay.stage * (attn + mlp + 2 * d)
  vocab = model.vocab_size * d / t * (1 if model.tie_embeddings else 2)
  return layers, vocab + d


def tokens_per_microbatch(lay: Layout, seq: int) -> int:
  """Tokens of one micro-batch on one device (the sequence split over `sequence`)."""
  return lay.mbs * seq // lay.sequence


def layer_activation_bytes(model: ModelConfig, lay: Layout, tokens: int, remat: str) -> float:
  """Bytes one layer keeps for its backward, per device, for `tokens` local tokens.

  Per token, in the compute dtype: the layer input and the MLP's norm input (h each), the
  norm outputs fed to the matmuls (h each), q and the attention output (a·k each), k and v
  (g·k each), gate / up / their product (f each), the attention's fp32 log-sum-exp; TP splits
  all but the norms' inputs and outputs (replicated), SP those too. `selective` drops the
  norm outputs and the gate·up product (recomputed), `full` keeps only the layer input.
  """
  c = jnp.dtype(model.dtype).itemsize
  d, t = model.d_model, lay.tensor
  a, g, k = model.n_heads, model.n_kv_heads, model.resolved_head_dim
  if model.moe is None:
    f3 = 3 * model.d_ff
  else:
    f3 = model.moe.top_k * 3 * (model.moe.d_ff or model.d_ff) + 3 * model.moe.shared_d_ff + 2 * d
  norm_io = 2 * d if remat == "selective" else 4 * d  # inputs (+ outputs) of the two norms
  split = 2 * a * k + 2 * g * k + (f3 * 2 // 3 if remat == "selective" else f3)
  if remat == "full":
    return tokens * c * d / (t if lay.sequence_parallel else 1)
  norm_share = norm_io / t if lay.sequence_parallel else norm_io
  return tokens * (c * (norm_share + split / t) + 4 * a / t)


@functools.lru_cache(maxsize=4096)
def schedule_table(schedule: str, p: int, m: int, v: int) -> schedules.Table:
  """The pipeline schedule jscale would execute (cached: the enumeration asks again and again)."""
  return schedules.make_table(schedule, p, m, v)


def in_flight(schedule: str, p: int, m: int, v: int) -> int:
  """Most residual sets (one chunk of layers for one micro-batch) a stage holds at once."""
  return int(schedule_table(schedule, p, m, v).live().max())


def estimate(model: ModelConfig, lay: Layout, seq: int) -> Memory:
  """jscale's per-device memory for one train step of `lay`."""
  n = local_params(model, lay)
  f = lay.fsdp
  zero = lay.zero_stage
  params = 4 * n / (f if zero >= 3 else 1)
  grads = 4 * n / (f if zero >= 2 else 1)
  optimizer = 8 * n / (f if zero >= 1 else 1)
  tokens = tokens_per_microbatch(lay, seq)
  layers_per_chunk = model.n_layers / (lay.stage * lay.virtual_stages)
  per_layer = layer_activation_bytes(model, lay, tokens, lay.remat)
  sets = in_flight(lay.schedule, lay.stage, lay.accum, lay.virtual_stages) if lay.stage > 1 else 1
  activations = per_layer * layers_per_chunk * sets
  c = jnp.dtype(model.dtype).itemsize
  # Transients: a recomputed layer's full set under remat, one layer's gathered weights in the
  # compute dtype (ZeRO-3), one chunk of logits in fp32 (the chunked loss: 1024 tokens).
  layer_w = (n - model.vocab_size * model.d_model / lay.tensor) / (model.n_layers / lay.stage)
  workspace = (layer_activation_bytes(model, lay, tokens, "none") if lay.remat != "none" else 0)
  workspace += c * layer_w * (2 if zero >= 3 else 0) + 4 * 1024 * model.vocab_size / lay.tensor
  return Memory(params, grads, optimizer, activations, workspace)


def n_params(model: ModelConfig) -> int:
  """All parameters of `model` (`jscale.metrics.param_counts`)."""
  return param_counts(model)["total"]
