"""Throughput and MFU accounting, device peaks, and the run's metric sinks.

MFU = model FLOPs per step / (step time x number of devices x per-device peak). Model FLOPs per
token are 6·N (N = parameters that take part in matmuls: every block weight plus the LM head,
not the embedding lookup) plus the causal attention term 6·n_layers·seq·(n_heads·head_dim):
QKᵀ and PV are 2·2·seq·H·K FLOPs per token forward without a mask, halved by causality, times
3 for forward + backward (MLA: 3·n_layers·seq·H·(K_qk + K_v)).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from jscale import hardware
from jscale.config import Config, ModelConfig


def attention_params(cfg: ModelConfig) -> tuple[int, int]:
  """(one attention module's parameters, those of them in matmuls): GQA's four projections, or
  MLA's (`model.mla`): the (low-rank) query, the latent and RoPE key, its key / value
  up-projections and the output, plus the latent norms' scales."""
  d, h = cfg.d_model, cfg.n_heads
  if cfg.mla is None:
    g, k = cfg.n_kv_heads, cfg.resolved_head_dim
    return 2 * d * h * k + 2 * d * g * k, 2 * d * h * k + 2 * d * g * k
  m = cfg.mla
  qk, q, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.q_lora_rank, m.kv_lora_rank
  query = d * q + q * h * qk if q else d * h * qk
  matmul = query + d * (r + m.qk_rope_head_dim) + r * h * (m.qk_nope_head_dim + m.v_head_dim) \
      + h * m.v_head_dim * d
  return matmul + q + r, matmul


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts, the one owner of each: `total`; `active`, the parameters one token's
  forward touches (the total less the routed experts it is not sent to, in the MoE stack and
  in MTP's blocks; the total for a dense model); and `matmul`, the matmul-participating part
  used for MFU (for MoE, the router, top_k experts and the shared expert, as each token sees
  them; with `model.mtp`, its modules too, which train on every token)."""
  d, f = cfg.d_model, cfg.d_ff
  attn, attn_mm = attention_params(cfg)
  mlp = active = expert = 0
  if cfg.moe is not None:
    m = cfg.moe
    expert, shared = 3 * d * (m.d_ff or f), 3 * d * m.shared_d_ff
    mlp = d * m.n_experts + m.n_experts * expert + shared
    mlp += m.n_experts if m.router == "sigmoid" else 0  # the balancing bias
    active = d * m.n_experts + m.top_k * expert + shared
  n_moe = cfg.stack_layers // cfg.moe.every if cfg.moe is not None else 0
  n_dense = cfg.n_layers - n_moe
  embed = cfg.vocab_size * d
  head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
  moe_block = (attn + mlp + 2 * d, attn_mm + active) if n_moe else (attn + 3 * d * f + 2 * d,
                                                                    attn_mm + 3 * d * f)
  total = embed + n_dense * (attn + 3 * d * f + 2 * d) + n_moe * moe_block[0] + d + head
  matmul = n_dense * (attn_mm + 3 * d * f) + n_moe * moe_block[1] + d * cfg.vocab_size
  moe_blocks = n_moe
  if cfg.mtp is not None:  # per depth: 3 norms, eh_proj [2D, D], a block; the head again
    total += cfg.mtp.depth * (3 * d + 2 * d * d + moe_block[0])
    matmul += cfg.mtp.depth * (2 * d * d + moe_block[1] + d * cfg.vocab_size)
    moe_blocks += cfg.mtp.depth if n_moe else 0
  idle = (cfg.moe.n_experts - cfg.moe.top_k) * expert if cfg.moe is not None else 0
  return {"total": total, "active": total - moe_blocks * idle, "matmul": matmul}


def count_text(n: float) -> str:
  """A count as people read it: 3.3M, 38.2B, 16.4k, 512."""
  for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return f"{int(n)}"


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Model FLOPs (forward + backward) per trained token, causal attention counted honestly
  (MLA: scores over the q / k head size, the context over the value head size; MTP's blocks
  attend too)."""
  blocks = cfg.n_layers + (cfg.mtp.depth if cfg.mtp is not None else 0)
  attention = 3 * blocks * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
  return 6 * param_counts(cfg)["matmul"] + attention

def routed_tokens(cfg: Config, sizes: dict[str, int]) -> int:
  """Tokens one device routes through its MoE layers per micro-batch: its rows times its share
  of the sequence (`parallel.expert_chunks` slices them further). With balanced routing a
  device computes top_k expert rows per such token, whatever room its exchange's receive buffer
  keeps for uneven routing."""
  t = cfg.train
  accum = cfg.pipeline.microbatches if sizes["stage"] > 1 else t.microbatches
  rows = t.batch_size // (sizes["data"] * sizes["fsdp"] * sizes["expert"]) // accum
  return rows * t.seq_len // sizes["sequence"]



def mfu(flops_per_step: float, step_time_s: float, n_devices: int,
        peak_flops: float | None) -> float | None:
  """Model FLOPs utilisation of a step (None where the device's peak is unknown)."""
  return flops_per_step / (step_time_s * n_devices * peak_flops) if peak_flops else None


def device_peak_flops(device: Any = None, precision: str = "bf16") -> float | None:
  """Peak FLOP/s of one device (`jscale.hardware`); None where unknown (e.g. CPU)."""
  device = device or jax.devices()[0]
  gpu = hardware.of_device_kind(getattr(device, "device_kind", ""))
  return gpu.peak_flops[precision] if gpu else None


def peak_memory_bytes() -> int | None:
  """Peak bytes in use on the first local device, where the backend reports it (GPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


class MetricsWriter:
  """metrics.jsonl + TensorBoard; on non-zero processes it does nothing (the console's lines
  and bar: `jscale.run.console`).

  Resuming at `start_step` keeps one clean series: rows past it (written after the checkpoint
  the run resumes from) are dropped from metrics.jsonl, TensorBoard events past it purged.
  `nonfinite_steps` carries the run's count of skipped non-finite steps across resumes."""

  def __init__(self, output_dir: str, start_step: int = 0, *, tensorboard: bool = True):
    self.active = jax.process_index() == 0
    self._tb = self._jsonl = None
    self.nonfinite_steps = 0
    if not self.active:
      return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "metrics.jsonl")
    self.nonfinite_steps = trim_metrics(path, start_step)
    self._jsonl = open(path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter
      # A unique file per writer: tensorboardX names files by the second, so a resume within
      # the same second would overwrite the earlier events.
      self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                               purge_step=start_step + 1 if start_step else None,
                               filename_suffix=f".{time.time_ns()}")

  def write(self, step: int, values: dict[str, Any]) -> None:
    if not self.active:
      return
    row = {"step": step, **{k: _plain(v) for k, v in values.items()}, "time": time.time()}
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in row.items():
        if isinstance(v, (int, float)) and k not in ("step", "time"):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    for sink in (self._tb, self._jsonl):
      if sink is not None:
        sink.close()


def trim_metrics(path: str, last_step: int) -> int:
  """Drops the rows of metrics.jsonl past `last_step` (and any torn last line), rewriting it via
  a temporary file; returns the last kept row's `nonfinite_steps` (0 if none)."""
  if not os.path.exists(path):
    return 0
  kept, nonfinite = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue  # a line cut short by a kill
      if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
        kept.append(line if line.endswith("\n") else line + "\n")
        nonfinite = row.get("nonfinite_steps", nonfinite)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)
  return nonfinite


def _plain(v):
  if hasattr(v, "item"):
    v = v.item()
  return v

