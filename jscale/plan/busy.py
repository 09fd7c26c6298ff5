"""What one device computes in a step, in seconds, term by term: the time its compiled program
spends in kernels (everything but waiting on a collective).

    busy = gemm + attention + recompute + Σ passes × (bytes of one pass / HBM bandwidth)

- gemm: the matmul FLOPs (`metrics.param_counts`' matmul part, 6 per parameter per token) at
  the efficiency `jscale.predict.timing.gemm_efficiency` gives this layout's gemm shapes (the
  rows of one micro-batch by the tensor-split widths): the predictor's own rule, so thin TP
  shards and small micro-batches cost what their compiled gemms do;
- attention: the attention FLOPs at cuDNN's measured rates (`jscale.predict.rates`), backward
  2.5x the forward's work; context parallelism computes every block of its ring whole (twice
  the causal work) and pays a fitted cost per hop;
- recompute: full remat runs the forward again (a third of the gemms that feed the backward,
  attention's forward);
- optimizer: Adam's update over the device's shard, and each step's casts of its weights (fp32
  masters to the compute dtype, its gradients back), at the HBM bandwidth;
- passes (`Fit`): XLA's elementwise fusions and copies move bytes in proportion to the
  activations (the residual stream d_model wide — replicated over `tensor` unless SP splits it
  —, the MLP's hidden width split over `tensor`, what each layer saves for its backward under
  the remat policy) and, per extra micro-batch, the weights (casts, gradient sums: the whole
  copy under ZeRO-0/1/2, whose gradients are whole before they are scattered, the shard under
  ZeRO-3); near the memory limit XLA's scheduler copies and rematerialises more.

The fixed terms use measured rates; only the passes are fitted, on the compiled programs of
scripts/estimate_vs_compiled.py's sweep (`python scripts/estimate_vs_compiled.py fit`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jscale import hardware
from jscale.config import ModelConfig
from jscale.metrics import attention_params, flops_per_token, param_counts
from jscale.plan import memory
from jscale.plan.layout import Layout
from jscale.predict import rates, timing

# The memory estimate's share of the usable device memory above which XLA:GPU's programs
# spend more in copies (the `pressure` passes grow linearly beyond it).
PRESSURE_FROM = 0.5
# Adam's update reads the fp32 parameter and gradient and writes the parameter (12 bytes per
# parameter), and reads and writes both moments (twice `memory.moment_bytes`: 28 bytes in all
# with fp32 moments, 20 with bf16).
UPDATE_BYTES_PER_PARAM = 12
# Each step casts the fp32 masters it holds to bf16 (reads 4, writes 2) and its bf16 gradients
# to fp32 (reads 2, writes 4): 12 bytes per parameter, 3x the masters' 4 (`Memory.params`).
CAST_BYTES_PER_PARAM_BYTE = 3.0


@dataclasses.dataclass(frozen=True)
class Fit:
  """Passes over a step's bytes the compiled programs make beyond the FLOPs, fitted by relative
  non-negative least squares on the sweep's H100 programs (results/estimate_vs_compiled.jsonl:
  `estimate_vs_compiled.py fit`; tests/plan/test_busy.py fails until they are refit when the
  sweep changes). Each multiplies the seconds of one pass of its term."""
  residual: float = 58.3  # over the residual stream of every layer (d_model wide)
  hidden: float = 9.0  # over the MLP's hidden activations (split over tensor)
  sequence_parallel: float = 92.8  # SP: over the whole residual stream (gathers, slices)
  saved: float = 4.52  # over what each layer saves for its backward (written, read back)
  weights: float = 16.1  # per extra micro-batch, over the device's bf16 weights (ZeRO-0/1/2)
  weight_shards: float = 64.5  # the same over the ZeRO-2/3 shard
  pressure: float = 33.2  # over all activations, per unit of memory share past PRESSURE_FROM
  ring_hop_s: float = 0.874e-3  # context parallelism: per micro-batch, layer and ring doubling


FIT = Fit()


def layer_gemms(model: ModelConfig, lay: Layout, seq: int
                ) -> list[tuple[int, int, int, int, bool]]:
  """(m, n, k, count, rerun) of the forward gemms one device runs per step's micro-batch: per
  layer the attention projections as one, the MLP's in- and out-projections (MoE: one
  expert's, its tokens spread over the local experts; the shared expert), then the head.
  `rerun`: full remat runs it again in the backward — all but each MLP's out-projection, whose
  output (the layer's) no backward reads, and the head, outside the layers."""
  # rows: the tokens of one micro-batch on the device (all of them under TP)
  d, t, rows = model.d_model, lay.tensor, memory.tokens_per_microbatch(lay, seq)
  out = [(rows, attention_params(model)[1] // (d * t), d, model.n_layers, True)]
  mlps = [(rows, model.d_ff, model.n_layers)]
  if model.moe is not None:
    m = model.moe
    moe_layers = model.stack_layers // m.every
    per_expert = max(1, rows * m.top_k * lay.expert // m.n_experts)
    mlps = [(rows, model.d_ff, model.n_layers - moe_layers),
            (per_expert, m.d_ff or model.d_ff, moe_layers * m.n_experts // lay.expert)]
    if m.shared_d_ff:
      mlps.append((rows, m.shared_d_ff, moe_layers))
  for r, f, n in mlps:
    out += [(r, 2 * f // t, d, n, True), (r, d, f // t, n, False)]
  out.append((rows, model.vocab_size // t, d, 1, False))
  return [g for g in out if g[3] > 0]


def gemm_efficiency(model: ModelConfig, lay: Layout, seq: int, chip: rates.Chip
                    ) -> tuple[float, float]:
  """(efficiency, rerun share): the layout's gemms' efficiency, time-weighted (total FLOPs
  over Σ FLOPs / efficiency), and the share of their time full remat runs again."""
  work = [(m * n * k * c, timing.gemm_efficiency(1, m, n, k, chip), rerun)
          for m, n, k, c, rerun in layer_gemms(model, lay, seq)]
  seconds = sum(w / e for w, e, _ in work)
  return sum(w for w, *_ in work) / seconds, sum(w / e for w, e, r in work if r) / seconds


def attention_seconds(model: ModelConfig, lay: Layout, seq: int, tokens: float,
                      chip: rates.Chip) -> tuple[float, float]:
  """(forward, backward) seconds of attention for `tokens` on one device at cuDNN's measured
  rates (the large-gemm ceiling where none was measured)."""
  fwd = (flops_per_token(model, seq) - 6 * param_counts(model)["matmul"]) * tokens / 3
  ring = lay.sequence > 1 and not lay.ulysses
  if ring:
    fwd *= 2  # every block of the ring whole: twice the causal work
  rate, span = {}, seq // lay.sequence if ring else seq  # Ulysses: the whole sequence
  for backward in (False, True):
    r, _ = rates.attention_rate("cudnn", True, model.qk_head_dim, span, backward)
    rate[backward] = r or chip.peak["bf16"] * chip.fit.gemm_ceiling
  return fwd / rate[False], 2.5 * fwd / rate[True]


def terms(model: ModelConfig, lay: Layout, seq: int, gpu: hardware.Gpu,
          mem: memory.Memory | None = None) -> dict[str, float]:
  """Seconds of each term for one step of `lay` on `gpu`: the fixed ones (gemm, attention,
  recompute, optimizer) and one pass of each fitted one (named as `Fit`'s fields). `mem`:
  `memory.estimate` of the layout, where the caller has it."""
  chip = rates.chip(gpu.name)
  hbm = chip.hbm_bytes_s
  tokens = lay.mbs * lay.accum * lay.batch_ways * seq / lay.devices  # model FLOPs' tokens
  efficiency, rerun = gemm_efficiency(model, lay, seq, chip)
  gemm = 6 * param_counts(model)["matmul"] * tokens / (chip.peak["bf16"] * efficiency)
  att_fwd, att_bwd = attention_seconds(model, lay, seq, tokens, chip)
  c = jnp.dtype(model.dtype).itemsize
  local = lay.mbs * lay.accum * seq // lay.sequence  # tokens through this device's layers
  layers = model.n_layers / lay.stage
  stream = local * layers * model.d_model * c / hbm
  width = model.d_ff if model.moe is None else (
      model.moe.top_k * (model.moe.d_ff or model.d_ff) + model.moe.shared_d_ff)
  hidden = local * layers * width / lay.tensor * c / hbm
  sp = lay.sequence_parallel
  weights = (lay.accum - 1) * sum(memory.local_param_split(model, lay)) * c / hbm
  mem = mem or memory.estimate(model, lay, seq)
  share = mem.total / memory.usable_bytes(gpu)
  return {
      "gemm": gemm, "attention": att_fwd + att_bwd,
      "recompute": gemm / 3 * rerun + att_fwd if lay.rematerialised else 0.0,
      "optimizer": (mem.optimizer * (2 + UPDATE_BYTES_PER_PARAM / memory.moment_bytes(lay))
                    + mem.params * CAST_BYTES_PER_PARAM_BYTE) / hbm,
      "residual": stream / lay.tensor if sp else stream, "hidden": hidden,
      "sequence_parallel": stream if sp else 0.0,
      "saved": layers * lay.accum * memory.layer_activation_bytes(
          model, lay, memory.tokens_per_microbatch(lay, seq), lay.remat) / hbm,
      "weights": weights if lay.zero_stage < 3 else 0.0,
      "weight_shards": weights / lay.fsdp if lay.zero_stage == 3 else 0.0,
      "pressure": (stream + hidden) * max(0.0, share - PRESSURE_FROM),
      "ring_hop_s": 0.0 if lay.ulysses else lay.accum * layers * math.log2(lay.sequence),
  }


FIXED = ("gemm", "attention", "recompute", "optimizer")


def seconds(parts: dict[str, float], fit: Fit = FIT) -> float:
  """The busy time of `terms`' parts under `fit`."""
  return sum(parts[k] for k in FIXED) + sum(
      getattr(fit, f.name) * parts[f.name] for f in dataclasses.fields(fit))
