"""The summary a training run prints before its first step: what it trains, on what, how.

One line per topic (model, devices, numerics, data, batch, output, start), so a user sees at
a glance what the config resolved to before any compile time is spent.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jscale import distributed, metrics, runtime
from jscale.ckpt import init_from
from jscale.config import Config, ModelConfig
from jscale.metrics import count_text


def model_line(cfg: ModelConfig) -> str:
  """The startup `model` line: parameters (active per token for an MoE) and the shape."""
  counts = metrics.param_counts(cfg)
  total = counts["total"]
  shape = (f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads / "
           f"{cfg.n_kv_heads} kv, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}")
  if cfg.moe is None:
    return f"model     {count_text(total)} parameters ({shape})"
  m = cfg.moe
  active = count_text(counts["active"])
  return (f"model     {count_text(total)} parameters, {active} active per token "
          f"({shape}; {m.n_experts} experts top-{m.top_k}, {m.dispatch})")


def kernel_lines(k: runtime.Kernels, moe: bool) -> list[str]:
  """What the runtime chose (`Runtime.kernels`): attention (and why, for "auto"), the flash
  and RMSNorm kernels and, for an MoE (`moe`), the experts' grouped matmul."""
  auto = k.attention_requested == "auto"
  why = f" (model.attention_impl=auto: {k.attention_why})" if auto else ""
  lines = [f"attention: {k.attention}{why}"]
  if k.flash[0]:
    lines.append(f"flash kernels: {k.flash[0]} ({k.flash[1]})")
  if k.norm[0]:
    lines.append(f"norm kernels: {k.norm[0]} ({k.norm[1]})")
  if moe:
    lines.append(f"moe experts: {k.moe_gemm[0] or 'slot buffers'} ({k.moe_gemm[1]})")
  return lines


def write_run_info(rt: runtime.Runtime, meta: dict[str, Any]) -> None:
  """`<output_dir>/run.json` (process 0): what this run resolved and runs on — the kernels
  chosen (and why: `Runtime.kernels`), devices, mesh, jax version — and `meta`
  (`run.directory.metadata`: the config after presets and overrides, the jscale version, the
  command line), written whole via a temporary file, so a reader never sees half of it."""
  if not distributed.is_main():
    return
  cfg, k = rt.cfg, rt.kernels
  device = rt.mesh.devices.flat[0]
  info = {"attention_impl": k.attention, "attention_impl_requested": k.attention_requested,
          "attention_why": k.attention_why,
          "backend": device.platform, "device_kind": getattr(device, "device_kind", ""),
          "devices": int(rt.mesh.size), "processes": jax.process_count(),
          "mesh": {a: int(n) for a, n in rt.mesh.shape.items()}, "jax": jax.__version__,
          **meta}
  if k.flash[0]:
    info["flash_kernels"], info["flash_kernels_why"] = k.flash
  if k.norm[0]:
    info["norm_kernels"], info["norm_kernels_why"] = k.norm
  if cfg.model.moe is not None:
    info["moe_gemm"], info["moe_gemm_why"] = k.moe_gemm
  os.makedirs(cfg.train.output_dir, exist_ok=True)
  path = os.path.join(cfg.train.output_dir, "run.json")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  os.replace(path + ".tmp", path)


def _source(d) -> str:
  """The data line's source: `data.source` and its path, or a mixture's sources and shares."""
  if d.mixture is None:
    return d.source + (f" {d.path}" if d.path else "")
  total = sum(m.weight for m in d.mixture)
  return "mixture of " + ", ".join(
      f"{m.label} {m.weight / total:.0%} ({m.source}{f' {m.path}' if m.path else ''})"
      for m in d.mixture)


def _documents(long_docs: tuple[int, int] | None, seq_len: int, masked: bool) -> str:
  """The data line's words on documents: how many a window splits, whether they are masked."""
  mask = "; documents masked apart" if masked else ""
  if long_docs is None:
    return mask
  long, total = long_docs
  split = (f"; {long:,} of {total:,} documents longer than a window ({seq_len} tokens) are "
           "split across windows" if long else f"; {total:,} documents, each fits a window")
  return split + mask


def summary(cfg: Config, mesh: jax.sharding.Mesh, start_step: int, checkpoint_dir: str,
            data_tokens: tuple[int, int], tokenizer_vocab: int, impls: list[str],
            long_docs: tuple[int, int] | None = None) -> str:
  """The startup summary. `data_tokens`: (train, val) token counts; `impls`: lines of the
  kernels the runtime chose (attention, flash, MoE experts), each "<what>: <choice (why)>";
  `long_docs`: (train documents longer than a window, all of them), if known."""
  t, m, p = cfg.train, cfg.model, cfg.parallel
  device = mesh.devices.flat[0]
  kind = getattr(device, "device_kind", "") or device.platform
  kind = kind if device.platform in kind.lower() else f"{device.platform} {kind}"
  axes = " x ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
  par = f"collectives {p.collectives}, ZeRO-{p.zero_stage}"
  if p.sequence_parallel:
    par += ", sequence parallel"
  if mesh.shape["stage"] > 1:
    par += f", pipeline {cfg.pipeline.schedule} x {cfg.pipeline.microbatches} microbatches"
  fp8 = f", fp8 {cfg.fp8.recipe} on {'/'.join(cfg.fp8.targets)}" if cfg.fp8.enabled else ""
  train_tokens, val_tokens = data_tokens
  step_tokens = t.batch_size * t.seq_len
  epochs = t.steps * step_tokens / max(train_tokens, 1)
  source = _source(cfg.data)
  if start_step:
    start = f"resuming from step {start_step} ({checkpoint_dir})"
  elif cfg.checkpoint.init_from:  # the model is the checkpoint's, but for the keys listed
    changed = init_from.overrides(cfg)
    start = (f"new run from checkpoint.init_from={cfg.checkpoint.init_from}: model config "
             f"from the checkpoint{', overridden:' if changed else ''}")
    start += "".join(f"\n            {line}" for line in changed)
  else:
    start = f"new run, random init (seed {t.seed})"
  saves = (f"every {cfg.checkpoint.every} steps and at the end, keep {cfg.checkpoint.keep}"
           if cfg.checkpoint.every > 0 else "off (checkpoint.every=0)")
  lines = [
      model_line(m),
      f"devices   {mesh.size} x {kind} in {jax.process_count()} process(es); mesh {axes}; {par}",
      f"numerics  compute {m.dtype}, params {m.param_dtype}, Adam moments {t.moments_dtype}, "
      f"norm {m.norm_impl}, remat {t.remat}{fp8}",
      *[("kernels   " if i == 0 else "          ") + line for i, line in enumerate(impls)],
      f"data      {source}, tokenizer {cfg.data.tokenizer} (vocab {tokenizer_vocab}): "
      f"{count_text(train_tokens)} train / {count_text(val_tokens)} val tokens"
      f"{_documents(long_docs, t.seq_len, cfg.data.document_mask)}",
      f"batch     {t.batch_size} x {t.seq_len} = {step_tokens:,} tokens per step x {t.steps} "
      f"steps = {count_text(step_tokens * t.steps)} tokens ({epochs:.2g} epochs)",
      f"output    {os.path.abspath(t.output_dir)} (metrics.jsonl, "
      f"{'metrics.png, ' if cfg.logging.plot else ''}run.json"
      f"{'; libraries: logs/process<i>.log' if jax.process_count() > 1 else ''}); "
      f"checkpoints {checkpoint_dir} {saves}",
      f"start     {start}",
  ]
  return "\n".join(lines)
