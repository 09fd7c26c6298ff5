"""Per-device memory of a training step: the playbook's formulas, and jscale's own estimate.

Playbook (PLAYBOOK_DIGEST.md §2): mixed precision keeps 2Ψ bf16 weights + 2Ψ bf16 grads +
12Ψ (fp32 master weights and Adam's two moments) = 16Ψ, +4Ψ with fp32 gradient accumulation;
ZeRO divides optimizer / +grads / +weights by N_d; activations per layer (with a fused
attention, so no s² term) are 34·s·b·h bytes, s·b·h·(10 + 24/t) with TP and 34·s·b·h/t with
TP + SP (the 70B chart: 21.25 / 8.125 / 2.66 GiB at seq 1k).

jscale keeps fp32 master weights, fp32 gradients and fp32 Adam moments (4 + 4 + 8 bytes per
parameter: the same 16Ψ, distributed differently; 4 + 4 + 4 with bf16 moments,
`train.moments_dtype`) and saves per layer and token what its remat
policy keeps (`jscale.model.remat.SELECTIVE_SAVE`), in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jscale import hardware
from jscale.config import ModelConfig, TrainConfig
from jscale.metrics import attention_params, param_counts
from jscale.parallel import expert_exchange
from jscale.parallel.pipeline import lockstep, program, schedules
from jscale.parallel.pipeline.table import W
from jscale.plan.layout import Layout
from jscale.step import compute_copies as copies_lib
from jscale.step.loss import num_chunks
from jscale.xla_flags import MEM_FRACTION

GiB = hardware.GiB


def usable_bytes(gpu: hardware.Gpu) -> float:
  """What a run may allocate on `gpu`: its HBM x MEM_FRACTION (XLA_PYTHON_CLIENT_MEM_FRACTION:
  `python -m jscale.train` and train.sbatch set 0.9 unless given; JAX's default is 0.75)."""
  return float(MEM_FRACTION) * gpu.hbm_bytes


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
  # transients at the peak: the loss's logits, or in the backward a recomputed layer, gathered
  # weights and a vocabulary-sized gradient in the making
  workspace: float
  exchange: float = 0.0  # a paired layout's expert exchange buffers (`exchange_buffers`)

  @property
  def total(self) -> float:
    return sum(self.terms().values())

  def terms(self) -> dict[str, float]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def local_params(model: ModelConfig, lay: Layout) -> float:
  """Parameters one device stores before ZeRO: matrices split over tensor (experts also over
  expert), layers over stage; embedding and head vocab-parallel over tensor."""
  return sum(local_param_split(model, lay))


def local_param_split(model: ModelConfig, lay: Layout) -> tuple[float, float]:
  """`local_params` as (the layer stack's, the rest: embedding, head, final norm)."""
  d, t = model.d_model, lay.tensor
  vocab = model.vocab_size * d / t * (1 if model.tie_embeddings else 2)
  return sum(layer_param_split(model, lay)), vocab + d


def layer_param_split(model: ModelConfig, lay: Layout) -> tuple[float, float]:
  """The layers' parameters on one device as (their matrices but the routers': what the step
  keeps compute copies of, with the untied head, `copied_params`; the rest: norms' scales,
  MLA's latent norms, routers)."""
  d, f, t = model.d_model, model.d_ff, lay.tensor
  attn, attn_matrices = attention_params(model)  # (MLA's down projections and norms: split
  matrices = attn_matrices / t + 3 * d * f / t     # over tensor too, ~5%)
  small = (attn - attn_matrices) / t + 2 * d
  dense = (matrices, small)
  if model.moe is not None:
    m = model.moe
    matrices = attn_matrices / t + (m.n_experts * 3 * d * (m.d_ff or f) / (t * lay.expert)
                                    + 3 * d * m.shared_d_ff / t)
    small += d * m.n_experts
  # The scanned stack is split over stages; the dense prefix (`moe.first_dense`, run with the
  # embedding) and the MTP modules (with the head) are on every stage, as those are.
  per_stage = model.stack_layers / lay.stage
  out = [per_stage * x + model.first_dense * y for x, y in zip((matrices, small), dense)]
  if model.mtp is not None:
    out[0] += model.mtp.depth * (matrices + 2 * d * d)
    out[1] += model.mtp.depth * (small + 3 * d)
  return out[0], out[1]


def tokens_per_microbatch(lay: Layout, seq: int) -> int:
  """Tokens of one micro-batch on one device (the sequence split over `sequence`)."""
  return lay.mbs * seq // lay.sequence


def layer_activation_bytes(model: ModelConfig, lay: Layout, tokens: int, remat: str) -> float:
  """Bytes one layer keeps for its backward, per device, for `tokens` local tokens: what JAX
  saves under jscale's remat policy (`jax.ad_checkpoint.saved_residuals` of the layer lists the
  same; `tests/plan/test_plan.py` checks it, dense and MoE), with cuDNN's fused attention (GPU's
  default).

  Per token, h = d_model, c = the compute dtype's bytes, f = the MLP's hidden width (MoE: k
  routed copies of the expert width plus the shared expert's):
  - full: the layer input (h).
  - selective (`remat.SELECTIVE_SAVE`): the q, k, v projections (a·k, g·k, g·k), the attention
    kernel's output (a·k) with its fp32 log-sum-exp (a), the layer input and the attention
    output (h each), gate and up (f each); MoE also the experts' sorted input rows and their
    outputs (k·h each).
  - none: every intermediate: the two RMSNorms' fp32 input and normalised input and two fp32
    scalars each (4h + 4 fp32), their outputs, the attention's input and the MLP's as their
    matmuls read them (4h; an MoE without a shared expert 3h), q and k after RoPE, v and the
    attention output (2 a·k + 2 g·k), the log-sum-exp, six [f] MLP tensors (gate, up, the
    SiLU's parts, their product); MoE also the router's fp32 input and probabilities (4h, 4E),
    the top-k's and the sort's indices and gates, the sorted rows (k·h) and the fp32 gated
    outputs (4·k·h); and the layer's weights in the compute dtype (`cast_weights`, unless
    ZeRO-3 gathers them again).
  Ulysses context parallelism keeps the attention output twice (before and after its
  all-to-all). Tensor parallelism splits heads and f (not the MoE's routing or rows); sequence
  parallelism also the [h] terms. The experts' rows and their [f] terms are those of the buffer
  they run on (`receive_ratio`: manual EP's receive buffer). Dropless MoE in xla mode over
  `expert` / `tensor` (GShard's slot buffer, one slot per token and expert) keeps E / k times
  the rows: not modelled.
  """
  c = jnp.dtype(model.dtype).itemsize
  d, t = model.d_model, lay.tensor
  # q, k, v and the attention output: a·qk, g·qk, g·v, a·v (GQA: qk = v = the head dim; MLA:
  # its expanded heads, g = a, and its latents, a few % more under `none`, left out)
  a, g, qk, vk = model.n_heads, model.attention_kv_heads, model.qk_head_dim, model.v_head_dim
  if remat == "full_offload":  # the layer's input lives in host memory (`estimate`: in flight)
    return 0.0
  if remat in ("full", "offload"):  # offload: selective's residuals live in host memory
    return tokens * c * d / (t if lay.sequence_parallel else 1)
  moe, none = model.moe, remat == "none"
  rho = receive_ratio(model, lay, tokens)
  f = (model.d_ff if moe is None else
       rho * moe.top_k * (moe.d_ff or model.d_ff) + moe.shared_d_ff)
  mlp_input = moe is None or moe.shared_d_ff > 0  # a dense matmul reading the normed input
  h_terms = 16 * d + (3 + mlp_input) * c * d + 16 if none else 2 * d * c
  # Ulysses keeps the attention output twice: the kernel's (its backward reads it) and the
  # all-to-all's (the output projection's dW reads it).
  outputs = 2 if lay.ulysses else 1
  split = c * (a * qk + g * qk + g * vk + outputs * a * vk + (6 if none else 2) * f) + 4 * a
  if moe is not None:  # routing and rows: whole on every tensor-parallel device
    top = moe.top_k
    rows = (rho * (c * top * d + 4 * top * d) + 4 * d + 4 * moe.n_experts + 16 + 20 * top
            if none else 2 * rho * c * top * d)
    split += rows * t
  return tokens * (h_terms / (t if lay.sequence_parallel else 1) + split / t)


def receive_ratio(model: ModelConfig, lay: Layout, tokens: int) -> float:
  """Rows the routed experts run on per routed assignment of a device's `tokens`: with experts
  over `expert` (dropless), manual EP's receive buffer, `lay.expert` blocks of
  `expert_exchange.receive_rows` (up to `lay.expert` times the T·k assignments; about
  `model.moe.receive_factor` times them when it bounds the blocks); the node-limited
  exchange's second hop, the node's devices' blocks over the first hop's padded rows
  (`expert_exchange.node_limited_phases`); 1 otherwise."""
  moe, n = model.moe, lay.expert
  if moe is None or n == 1 or moe.dispatch != "dropless":
    return 1.0
  k, e_l, f = moe.top_k, moe.n_experts // n, moe.receive_factor
  if moe.exchange == "flat":
    rows = n * expert_exchange.receive_rows(tokens, k, e_l, n, f)
  else:  # node-limited: hop 2 inside a node of m devices, from hop 1's n_group blocks
    m = n // moe.n_group
    relayed = moe.n_group * expert_exchange.node_rows(tokens, moe.topk_group, moe.n_group, f)
    rows = m * expert_exchange.receive_rows(relayed, k, e_l, m, f, share_tokens=tokens)
  return rows / (tokens * k)


def cast_weights(model: ModelConfig, lay: Layout) -> float:
  """Bytes of one layer's weights in the compute dtype on one device (before ZeRO-3)."""
  layer_psi, _ = local_param_split(model, lay)
  extra = model.first_dense + (model.mtp.depth if model.mtp is not None else 0)
  return jnp.dtype(model.dtype).itemsize * layer_psi / (model.stack_layers / lay.stage + extra)


def copied_params(model: ModelConfig, lay: Layout) -> float:
  """Parameters on one device that the step keeps compute copies of where it keeps them
  (`jscale.step.compute_copies.copied`): the layers' matrices but the routers', and the untied
  head (split over `tensor` by vocab)."""
  head = 0.0 if model.tie_embeddings else model.vocab_size * model.d_model / lay.tensor
  return layer_param_split(model, lay)[0] + head


def kept_copies(model: ModelConfig, lay: Layout) -> float:
  """Bytes of the compute-dtype copies the train state keeps (`jscale.step.compute_copies.kept`:
  `copied_params`, split as their masters; none under ZeRO-2/3 over fsdp, in pipelines, or in
  fp32)."""
  if not copies_lib.kept(False, lay.zero_stage, lay.fsdp, lay.stage, model.dtype):
    return 0.0
  return jnp.dtype(model.dtype).itemsize * copied_params(model, lay)


def narrow_gradients(model: ModelConfig, lay: Layout) -> float:
  """Bytes the layers' matrices' gradients save at the compute dtype (`jscale.step.
  compute_copies`: the step differentiates the kept copies) against fp32. `estimate` counts
  the saving where no step sums them in fp32: over micro-batches (whose sum is fp32) or devices
  (gradients are converted before any data-parallel sum). Fitted to XLA:GPU's buffer
  assignment: 13 llama3_1b / 3b / 8b layouts on 1 and 8 H100s (`scripts/planner_vs_gpu.py`),
  rest within 15%."""
  if not kept_copies(model, lay):
    return 0.0
  return (4 - jnp.dtype(model.dtype).itemsize) * copied_params(model, lay)


def vocab_gradient_bytes(model: ModelConfig, lay: Layout) -> float:
  """One fp32 vocabulary-sized gradient (head or embedding) on one device: the unit of the
  loss's and the backward's vocabulary-sized buffers in the making (the head's running sum and
  one chunk's product; a tied embedding's scatter and transposed head halves)."""
  return 4 * model.vocab_size * model.d_model / lay.tensor


def loss_chunks(model: ModelConfig, lay: Layout, tokens: int,
                chunk_mb: float = TrainConfig.logits_chunk_mb) -> int:
  """The chunks the loss runs `tokens` local tokens in (`jscale.step.loss.num_chunks`; 1:
  unchunked)."""
  return num_chunks((lay.mbs, tokens // lay.mbs, int(model.vocab_size / lay.tensor)), chunk_mb)


def loss_workspace(model: ModelConfig, lay: Layout, tokens: int,
                   chunk_mb: float = TrainConfig.logits_chunk_mb) -> float:
  """The loss's transient bytes for `tokens` local tokens (`jscale.step.loss`): unchunked, the fp32
  logits and their gradient in the compute dtype; chunked (`train.logits_chunk_mb`), one
  chunk's logits in the compute dtype and the head's gradient in the making."""
  v = model.vocab_size / lay.tensor
  c = jnp.dtype(model.dtype).itemsize
  n = loss_chunks(model, lay, tokens, chunk_mb)
  if n == 1:
    return (4 + c) * tokens * v
  return c * tokens / n * v + 2 * vocab_gradient_bytes(model, lay)


@functools.lru_cache(maxsize=4096)
def schedule_table(schedule: str, p: int, m: int, v: int) -> schedules.Table:
  """The papers' table of the pipeline schedule (cached: the enumeration asks again and again);
  its order and residual sets are the executed table's."""
  return schedules.make_table(schedule, p, m, v)


class Executed(NamedTuple):
  """The table the executor runs (`lockstep.executed_table`), as a pipelined step's time reads
  it: its unit ticks (lockstep steps, each as long as the longest op a stage runs in it), and
  the share of its W actions run as ops of their own (a split backward: ZB-H1 and ZB-V all,
  DualPipeV some), each of which the executor pays for apart from its B."""
  ticks: int
  w_alone: float


@functools.lru_cache(maxsize=4096)
def executed(schedule: str, p: int, m: int, v: int) -> Executed:
  """`Executed` of schedule `schedule` on p stages, m micro-batches, v chunks a stage."""
  table = lockstep.executed_table(schedule, p, m, v)
  w = table.kind == W
  alone = w & (table.starts() == np.arange(table.ticks)[:, None])
  return Executed(table.ticks, float(alone.sum() / max(int(w.sum()), 1)))


@functools.lru_cache(maxsize=4096)
def channels(schedule: str, p: int, m: int, v: int) -> int:
  """Activation-sized sends a stage makes every tick (`pipeline.program`'s channels: 2, one
  each way; DualPipeV 4, since a pair sends its forward's and its backward's the same way)."""
  # A property of the schedule's shape, not of m: read it off 2p micro-batches (valid for every
  # schedule), since compiling the program of a large m takes seconds per candidate.
  return len(program.compile_program(schedule_table(schedule, p, min(m, 2 * p), v)).channels)


def in_flight(schedule: str, p: int, m: int, v: int) -> int:
  """Most residual sets (one chunk of layers for one micro-batch) a stage holds at once."""
  return int(schedule_table(schedule, p, m, v).live().max())


def held_head_grads(model: ModelConfig, lay: Layout, tokens: int,
                    chunk_mb: float = TrainConfig.logits_chunk_mb) -> float:
  """The fp32 head gradients the chunked loss holds from its forward to the backward beyond
  the one `loss_workspace` counts: one per MTP depth (each depth's loss makes the shared head's
  dW in its own forward). Seen on XLA:GPU's program for DeepSeek-V3 671B on 1,024 H100s: the
  main and MTP heads' accumulators, 6.9 GiB, live at its peak (scripts/peak_memory.py)."""
  depth = model.mtp.depth if model.mtp is not None else 0
  chunked = loss_chunks(model, lay, tokens, chunk_mb) > 1
  return depth * vocab_gradient_bytes(model, lay) if chunked else 0.0


def moment_bytes(lay: Layout) -> int:
  """Bytes of Adam's two moments per parameter (`train.moments_dtype`)."""
  return 2 * jnp.dtype(lay.moments).itemsize


def estimate(model: ModelConfig, lay: Layout, seq: int) -> Memory:
  """jscale's per-device memory for one train step of `lay`."""
  n = local_params(model, lay)
  f = lay.fsdp
  zero = lay.zero_stage
  params = 4 * n / (f if zero >= 3 else 1) + kept_copies(model, lay)
  grads = 4 * n / (f if zero >= 2 else 1)
  narrow = narrow_gradients(model, lay)
  if lay.accum == 1 and lay.data * lay.fsdp * lay.sequence * lay.expert == 1:
    grads -= narrow  # one device's step: the copies' gradients reach Adam in bf16
  optimizer = moment_bytes(lay) * n / (f if zero >= 1 else 1)
  tokens = tokens_per_microbatch(lay, seq)
  # (the dense prefix and MTP blocks counted as one more chunk's layers each, on every stage)
  extra = model.first_dense + (model.mtp.depth if model.mtp is not None else 0)
  layers_per_chunk = model.stack_layers / (lay.stage * lay.virtual_stages) + extra
  per_layer = layer_activation_bytes(model, lay, tokens, lay.remat)
  pipe = lay.stage > 1
  # Under a pipeline the executor's residual buffer has a slot per set in flight plus a scratch
  # slot (`pipeline.program`), and a B tick copies its set out of it.
  sets = in_flight(lay.schedule, lay.stage, lay.accum, lay.virtual_stages) + 2 if pipe else 1
  # The layers taking the micro-batches in turn keep every micro-batch's inputs.
  activations = per_layer * layers_per_chunk * sets * (lay.accum // lay.step_accum)
  if lay.remat == "none" and zero < 3:  # compute-dtype weights saved for the backward (ZeRO-3
    # gathers them again instead)
    activations += cast_weights(model, lay) * layers_per_chunk * sets
  # Transients at the step's peak, whichever is larger: the loss's or the backward's beside the
  # gradients. Both hold the vocabulary weight in the compute dtype (the head's operand). The
  # backward adds half a recomputed layer under remat (the rest is saved or freed as it goes),
  # ZeRO-3's gathered weights of this layer and the next (prefetched), ZeRO-2/3's full fp32
  # vocabulary gradient before its reduce-scatter, and under
  # accumulation the micro-batch's gradients beside their running sum; an untied embedding's
  # gradient is made last, after the layers' transients are gone. Fitted to XLA:GPU's buffer
  # assignment with the launcher's overlap flags (`python -m jscale.plan --verify N --target
  # h100xN`): 19 llama3_1b / 3b / 8b / 70b layouts on 1 to 64 H100s within 12%
  # (tests/plan/test_gpu_compile.py).
  vocab = vocab_gradient_bytes(model, lay)
  vocab_weight = vocab * jnp.dtype(model.dtype).itemsize / 4
  backward = vocab_weight
  # Paired, two micro-batches are recomputed side by side, and the trips gather the next
  # layer's weights beside this one's.
  sides = lay.side_by_side
  if lay.remat != "none":
    backward += 0.5 * sides * layer_activation_bytes(model, lay, tokens, "none")
  if zero >= 3:
    backward += (1 + sides) * cast_weights(model, lay)
  if zero >= 2:
    backward += vocab
  if lay.step_accum < lay.accum:  # a gathered layer's fp32 gradient summed over the micro-
    backward += 2 * cast_weights(model, lay)  # batches; under full_offload two inputs in flight
    backward += 2 * layer_activation_bytes(model, lay, tokens * lay.accum, "full") * (
        lay.remat == "full_offload")
  if lay.step_accum > 1 and not pipe:
    backward += grads - narrow  # a micro-batch's, in bf16 for the copies, beside the fp32 sum
    if zero == 2:  # the micro-batch's vocabulary gradients in full (a tied embedding's halves
      backward += 2 * vocab  # and their sum) before their reduce-scatter into the sum's shard
  if not model.tie_embeddings:
    backward -= vocab
  if pipe:  # a tick's chunk gradient before it is added into the running sum (the stage's
    # layer gradients once more); every stage runs the embedding and head (SPMD) and
    # all-reduces their gradients over `stage`: four more vocabulary-sized buffers (measured on
    # XLA:GPU, 1F1B p=4 m=8)
    backward += 4 * local_param_split(model, lay)[0] + 4 * vocab
  # The loss's peak holds no gradient yet, except under accumulation the running sum.
  whole = tokens * (lay.accum // lay.step_accum)  # the head's tokens: one call's
  loss = loss_workspace(model, lay, whole) + vocab_weight - (0 if lay.step_accum > 1 else grads)
  held = held_head_grads(model, lay, whole)  # MTP's: its loss comes last, the backward next
  workspace = max(loss, backward) + held
  if zero >= 3 and lay.step_accum == 1:  # the launcher's pipelined all-gather (`xla_flags`: not
    workspace += vocab_weight  # with accumulation) holds a prefetched vocabulary weight (fitted)
  return Memory(params, grads, optimizer, activations, workspace,
                exchange_buffers(model, lay, tokens))


# [rows, D] buffers of the expert exchange that a paired program (`Layout.overlap`) keeps live
# at its peak per micro-batch, beyond the layer's own activations: the received rows, their
# encodings and decodings, the experts' outputs and the gradients of each, for two
# micro-batches in flight, as XLA:GPU's buffer assignment keeps them. Fitted on one compiled
# program (DeepSeek-V3 671B on 1,024 H100s, fsdp 16 x expert 64, paired, 2175fb4: 64.2 GiB,
# ~25 buffers of [81920, 7168] in its memory-usage report; results/planner_paired.md). Unpaired,
# the activations' rows account for the buffer (within 5% of XLA:GPU's for 8 H100s:
# tests/parallel/test_receive_factor.py).
EXCHANGE_BUFFERS = 11.4


def exchange_buffers(model: ModelConfig, lay: Layout, tokens: int) -> float:
  """Bytes of a paired layout's exchange buffers at the peak, for micro-batches of `tokens`
  tokens per device: `EXCHANGE_BUFFERS` receive buffers (`receive_ratio`'s rows, D wide, in the
  compute dtype) for each of the two micro-batches in flight; 0 unpaired."""
  if not lay.overlap or model.moe is None:
    return 0.0
  rows = receive_ratio(model, lay, tokens) * tokens * model.moe.top_k
  c = jnp.dtype(model.dtype).itemsize
  return EXCHANGE_BUFFERS * lay.side_by_side * rows * model.d_model * c


def n_params(model: ModelConfig) -> int:
  """All parameters of `model` (`jscale.metrics.param_counts`)."""
  return param_counts(model)["total"]
