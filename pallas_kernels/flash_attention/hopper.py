"""Flash attention for Hopper GPUs (sm_90): Pallas kernels on the Mosaic GPU backend.

The same interface as `pallas_kernels.flash_attention.flash_attention` (the portable,
Triton-lowered kernel that also runs in the interpreter), for bf16 / fp16 q, k, v with head
sizes that are multiples of 64: warp-specialised TMA + wgmma kernels (`hopper_fwd`,
`hopper_bwd`), causal block skipping, GQA without repeating K / V, segment ids, lse out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import hopper_bwd, hopper_fwd
from pallas_kernels.flash_attention import hopper_config as hc
from pallas_kernels.flash_attention.hopper_config import HopperBlocks, blocks_for
from pallas_kernels.flash_attention.kernel import split_segments

__all__ = ["HopperBlocks", "blocks_for", "check_shapes", "flash_attention", "why_not"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg):
  out, lse2 = hopper_fwd.forward(q, k, v, q_seg, kv_seg, cfg)
  return out, lse2 / hc.LOG2E


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
  out, lse2 = hopper_fwd.forward(q, k, v, q_seg, kv_seg, cfg)
  return (out, lse2 / hc.LOG2E), (q, k, v, q_seg, kv_seg, out, lse2)


def _flash_bwd(cfg, res, cotangents):
  q, k, v, q_seg, kv_seg, out, lse2 = res
  do, dlse = cotangents
  # delta = rowsum(dO * O): one fused XLA pass. An lse cotangent adds p * dlse to
  # dS = p * (dP - delta): fold it into delta (as the portable kernel does).
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  delta = delta.transpose(0, 2, 1) - dlse
  dk, dv = hopper_bwd.dkv(q, k, v, q_seg, kv_seg, lse2, delta, do, cfg)
  dq = hopper_bwd.dq(q, k, v, q_seg, kv_seg, lse2, delta, do, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def why_not(q_shape, kv_shape, dtype=jnp.bfloat16, *, causal: bool = True,
            block_sizes: HopperBlocks | None = None) -> str | None:
  """Why `flash_attention` cannot take q [B, L, H, K] and k, v [B, S, G, K] of `dtype`,
  naming the fix; None when it can (for choosing a kernel and for config validation)."""
  q = jax.ShapeDtypeStruct(tuple(q_shape), dtype)
  k = jax.ShapeDtypeStruct(tuple(kv_shape), dtype)
  blocks = block_sizes or blocks_for(q_shape[1], q_shape[-1])
  return hc.problem(q, k, k, None, None, causal, blocks)


def check_shapes(q_shape, kv_shape, dtype=jnp.bfloat16, *, causal: bool = True,
                 block_sizes: HopperBlocks | None = None) -> HopperBlocks:
  """`flash_attention`'s checks without arrays: the block sizes it would use, or the
  ValueError it would raise (`why_not`)."""
  if (why := why_not(q_shape, kv_shape, dtype, causal=causal,
                     block_sizes=block_sizes)) is not None:
    raise ValueError(why)
  return block_sizes or blocks_for(q_shape[1], q_shape[-1])


def flash_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, segment_ids=None,
                    sm_scale: float | None = None, block_sizes: HopperBlocks | None = None,
                    return_lse: bool = False, interpret: bool = False):
  """Softmax(q kᵀ * sm_scale) v on Hopper, differentiable.

  Args:
    q_BLHK: queries [B, L, H, K]; k_BSGK, v_BSGK: [B, S, G, K], H % G == 0; bf16 or fp16,
      K a multiple of 64 (<= 256).
    causal: query i sees keys j <= i (needs L == S).
    segment_ids: int [B, L] shared by q and kv, or a (q_seg [B, L], kv_seg [B, S]) tuple; a
      query that sees no key outputs 0 (lse -inf).
    sm_scale: defaults to 1 / sqrt(K).
    block_sizes: tiles (default `blocks_for(L, K)`); sequences must be multiples of them.
    return_lse: also return lse [B, H, L] fp32 (natural log, differentiable).
    interpret: run in JAX's Mosaic GPU interpreter (CPU tests), products and layouts as
      `hopper_ops` describes.

  Returns:
    out [B, L, H, K] in q's dtype, or (out, lse) when return_lse.
  """
  q_seg, kv_seg = split_segments(segment_ids)
  blocks = block_sizes or blocks_for(q_BLHK.shape[1], q_BLHK.shape[-1])
  hc.validate(q_BLHK, k_BSGK, v_BSGK, q_seg, kv_seg, causal, blocks)
  sm_scale = 1.0 / math.sqrt(q_BLHK.shape[-1]) if sm_scale is None else sm_scale
  cfg = hc.Config(causal=causal, sm_scale=float(sm_scale), blocks=blocks,
                  segments=q_seg is not None, interpret=interpret)
  # partial(custom_vjp)'s result is typed as object
  out, lse = _flash(q_BLHK, k_BSGK, v_BSGK, q_seg, kv_seg, cfg)  # pyright: ignore[reportGeneralTypeIssues]
  return (out, lse) if return_lse else out
