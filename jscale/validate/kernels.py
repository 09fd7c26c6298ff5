"""The kernels a config asks for, on a backend and at the shapes each device runs: attention
and RMSNorm impls (`model.attention_impl`, `model.norm_impl`), the flash kernel's tiling, the
experts' grouped matmul (`model.moe.gemm=pallas`)."""

from __future__ import annotations

from jscale.config import Config, ConfigError
from jscale.fp8 import linears as fp8_linears
from jscale.model import attention as attn_lib
from jscale.model import moe_gemm
from jscale.parallel.context.order import chunks_per_device as parts
from jscale.parallel.context.ulysses import whole_sequence
from pallas_kernels.flash_attention import why_not as flash_why_not


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
  device's expert matmuls (bf16 / fp16, widths that divide into its tiles, and 128 for FP8
  experts' e4m3 operands; the expert hidden dim is split over mesh.tensor)."""
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
  moe = m.moe
  if moe is None:
    raise ConfigError("model.moe.gemm=pallas needs an MoE: set model.moe.n_experts")
  f = (moe.d_ff or m.d_ff) // sizes["tensor"]
  fp8 = fp8_linears.experts_in(cfg.fp8)
  why_not = moe_gemm.kernel_fits(m.dtype, m.d_model, f, moe.n_experts // sizes["expert"], fp8)
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
  # Under the ring the kernel runs on its blocks, one sequence chunk each; under Ulysses on the
  # whole sequence and the heads' share of the sequence axis.
  cp, ctx = sizes["sequence"], cfg.parallel.context_impl
  chunk = (t.seq_len if whole_sequence(ctx, cp) else
           t.seq_len // (cp * parts(cfg.parallel.context_layout)))
  if ctx == "ulysses":
    h, g = h // cp, g // cp
  why = flash_why_not((b, chunk, h, k), (b, chunk, g, k), causal=True,
                      v_shape=(b, chunk, g, kv))
  if why is None:
    return None
  key = ((f"model.head_dim={k}" if m.mla is None else
          f"model.mla (q/k head {k}, v head {kv})") if "head_dim" in why
         else f"train.seq_len={t.seq_len}")
  return (f"model.attention_impl=pallas cannot run with {key}: {why}; use "
          "model.attention_impl=xla, or a shape the kernel tiles")
