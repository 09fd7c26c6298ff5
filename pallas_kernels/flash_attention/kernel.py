"""Flash attention forward and backward as Pallas (Triton backend) GPU kernels.

Layout is the model's: q [B, L, H, K], k [B, S, G, K] and v [B, S, G, Kv] with H = G * r (GQA:
the kernels map query head h to kv head h // r through the index maps, K/V are never repeated in
memory); V's head size Kv may differ from K (e.g. MLA), the output is [B, L, H, Kv].
The forward keeps a running max / sum per query row (online softmax, fp32) and never writes the
[L, S] scores to HBM; it returns lse = log(sum(exp(scores))) for the backward (and for callers
that merge partial attentions, e.g. ring attention). Scores are kept in base 2 inside the
kernels (exp2 is one ex2.approx instruction on NVIDIA GPUs); lse is returned in natural log.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_attention.kernel_config import (
  BlockSizes,
  Config,
  check_shapes,
  validate,
  why_not,
)

__all__ = ["BlockSizes", "check_shapes", "flash_attention", "why_not"]

# Finite, so a row whose keys are all masked in one block gives exp2(0) instead of NaN; such
# rows are wiped by the rescale of the next visible block, or zeroed at the end if none is.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)


def _precision(dtype):
  # fp32 inputs ask for fp32 accuracy: on Triton DEFAULT would be TF32.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _dot(a, b, contract=(1, 0)):
  """a @ b contracting a's dim contract[0] with b's contract[1], fp32 accumulation."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                         precision=_precision(a.dtype))


def _mask(q_start, k_start, block_q, block_k, causal, q_seg, kv_seg):
  """[block_q, block_k] visibility of the keys to the queries, or None when all visible."""
  mask = None
  if q_seg is not None:
    mask = q_seg[:, None] == kv_seg[None, :]
  if causal:
    q_pos = q_start + jnp.arange(block_q)
    k_pos = k_start + jnp.arange(block_k)
    causal_mask = q_pos[:, None] >= k_pos[None, :]
    mask = causal_mask if mask is None else mask & causal_mask
  return mask


def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, *,
                cfg: Config):
  # Refs: q [bq, K] / o [bq, Kv] of one (batch, head); k [S, K] / v [S, Kv] of its kv head;
  # lse [bq].
  block_q, block_k = cfg.blocks.block_q, cfg.blocks.block_k
  i_q = pl.program_id(0)
  q = q_ref[...]
  q_seg = None if q_seg_ref is None else q_seg_ref[...]
  scale = cfg.sm_scale * LOG2E

  def body(j, carry):
    acc, m_prev, l_prev = carry
    k_slice = pl.ds(j * block_k, block_k)
    s = _dot(q, k_ref[k_slice, :], (1, 1)) * scale
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[k_slice]
    mask = _mask(i_q * block_q, j * block_k, block_q, block_k, cfg.causal, q_seg, kv_seg)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_prev - m_next)  # rescales what was accumulated under the old max
    p = jnp.exp2(s - m_next[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    v = v_ref[k_slice, :]
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  if cfg.causal:  # blocks right of the diagonal are fully masked: stop before them
    upper = lax.div((i_q + 1) * block_q + block_k - 1, block_k)
  else:
    upper = k_ref.shape[0] // block_k
  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = lax.fori_loop(0, upper, body, init)
  # A row that saw no key (only possible with distinct q / kv segment ids) outputs 0 and
  # lse -inf, so its backward contributes nothing.
  seen = m > 0.5 * MASK_VALUE
  o_ref[...] = jnp.where(seen[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(l)) / LOG2E, -jnp.inf)


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, cfg: Config):
  # Refs: q [L, r, K] / do [L, r, Kv] (the r query heads of one kv head); k / dk [bkv, K],
  # v / dv [bkv, Kv]; lse / delta [r, L]. Looping over the r heads here sums the GQA group's
  # dK/dV in registers.
  block_q, block_kv = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv
  i_kv = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  scale = cfg.sm_scale * LOG2E
  num_heads = q_ref.shape[1]

  def head(h, carry):
    def body(i, carry):
      dk, dv = carry
      q_slice = pl.ds(i * block_q, block_q)
      q, do = q_ref[q_slice, h, :], do_ref[q_slice, h, :]
      lse, delta = lse_ref[h, q_slice], delta_ref[h, q_slice]
      p = jnp.exp2(_dot(q, k, (1, 1)) * scale - lse[:, None] * LOG2E)
      q_seg = None if q_seg_ref is None else q_seg_ref[q_slice]
      mask = _mask(i * block_q, i_kv * block_kv, block_q, block_kv, cfg.causal, q_seg, kv_seg)
      if mask is not None:  # masked entries may overflow to inf above: select, not multiply
        p = jnp.where(mask, p, 0.0)
      dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
      ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
      return dk, dv

    # Under causal, query blocks above this kv block's diagonal never see it.
    lower = lax.div(i_kv * block_kv, block_q) if cfg.causal else 0
    return lax.fori_loop(lower, q_ref.shape[0] // block_q, body, carry)

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, num_heads, head, zeros)
  dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, cfg: Config):
  # Refs: q / dq [bq, K], do [bq, Kv]; k [S, K] / v [S, Kv] of the kv head; lse / delta [bq].
  block_q, block_kv = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq
  i_q = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse2 = lse_ref[...] * LOG2E
  delta = delta_ref[...]
  q_seg = None if q_seg_ref is None else q_seg_ref[...]
  scale = cfg.sm_scale * LOG2E

  def body(j, dq):
    k_slice = pl.ds(j * block_kv, block_kv)
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]
    p = jnp.exp2(_dot(q, k, (1, 1)) * scale - lse2[:, None])
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[k_slice]
    mask = _mask(i_q * block_q, j * block_kv, block_q, block_kv, cfg.causal, q_seg, kv_seg)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  if cfg.causal:
    upper = lax.div((i_q + 1) * block_q + block_kv - 1, block_kv)
  else:
    upper = k_ref.shape[0] // block_kv
  dq = lax.fori_loop(0, upper, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _compiler_params(cfg: Config, head_dim: int):
  num_warps = cfg.blocks.num_warps or (4 if head_dim <= 64 else 8)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=cfg.blocks.num_stages)


def _seg_specs(q_block, kv_block, q_index, kv_index, q_seg, kv_seg):
  if q_seg is None:
    return [None, None]
  return [pl.BlockSpec((None, q_block), q_index), pl.BlockSpec((None, kv_block), kv_index)]


def forward(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, cfg: Config):
  """Runs the forward kernel: (out [B, L, H, Kv] in q's dtype, lse [B, H, L] fp32)."""
  b, l, h, d = q_BLHK.shape
  s, g, dv = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[-1]
  r = h // g
  bq = cfg.blocks.block_q
  q_spec = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, b_, h_: (b_, i, h_, 0))
  kv_spec = lambda d: pl.BlockSpec((None, s, None, d),
                                   lambda i, b_, h_: (b_, 0, lax.div(h_, r), 0))
  seg_specs = _seg_specs(bq, s, lambda i, b_, h_: (b_, i), lambda i, b_, h_: (b_, 0),
                         q_seg_BL, kv_seg_BS)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid=(l // bq, b, h),
      in_specs=[q_spec(d), kv_spec(d), kv_spec(dv), *seg_specs],
      out_specs=[q_spec(dv), pl.BlockSpec((None, None, bq), lambda i, b_, h_: (b_, h_, i))],
      out_shape=[jax.ShapeDtypeStruct((b, l, h, dv), q_BLHK.dtype),
                 jax.ShapeDtypeStruct((b, h, l), jnp.float32)],
      compiler_params=_compiler_params(cfg, max(d, dv)),
      interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS)


def backward(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, out_BLHK, lse_BHL, do_BLHK,
             dlse_BHL, cfg: Config):
  """Runs the dK/dV and dQ kernels: (dq, dk, dv) in the inputs' dtypes."""
  # delta = rowsum(dO * O) is elementwise + reduce: XLA fuses it into one pass, no kernel
  # needed. An lse cotangent adds p * dlse to dS = p * (dP - delta): fold it into delta.
  delta_BHL = jnp.sum(out_BLHK.astype(jnp.float32) * do_BLHK.astype(jnp.float32), axis=-1)
  delta_BHL = delta_BHL.transpose(0, 2, 1) - dlse_BHL
  return backward_from_stats(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, lse_BHL, delta_BHL,
                             do_BLHK, cfg)


def backward_from_stats(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, lse_BHL, delta_BHL,
                        do_BLHK, cfg: Config):
  """The dK/dV and dQ kernels given the softmax statistics (lse, delta = rowsum(dO·O)) of the
  output being differentiated, which may span more keys than this call's (ring attention's
  blocks use the final output's): (dq, dk, dv) in the inputs' dtypes."""
  b, l, h, d = q_BLHK.shape
  s, g, dv = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[-1]
  r = h // g
  params = _compiler_params(cfg, max(d, dv))

  bq, bkv = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv
  group_spec = lambda d: pl.BlockSpec((None, l, r, d), lambda j, b_, g_: (b_, 0, g_, 0))
  kv_spec = lambda d: pl.BlockSpec((None, bkv, None, d), lambda j, b_, g_: (b_, j, g_, 0))
  stat_spec = pl.BlockSpec((None, r, l), lambda j, b_, g_: (b_, g_, 0))
  seg_specs = _seg_specs(l, bkv, lambda j, b_, g_: (b_, 0), lambda j, b_, g_: (b_, j),
                         q_seg_BL, kv_seg_BS)
  dk_BSGK, dv_BSGK = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg),
      grid=(s // bkv, b, g),
      in_specs=[group_spec(d), kv_spec(d), kv_spec(dv), *seg_specs, group_spec(dv), stat_spec,
                stat_spec],
      out_specs=[kv_spec(d), kv_spec(dv)],
      out_shape=[jax.ShapeDtypeStruct(k_BSGK.shape, k_BSGK.dtype),
                 jax.ShapeDtypeStruct(v_BSGK.shape, v_BSGK.dtype)],
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dkv",
  )(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, do_BLHK, lse_BHL, delta_BHL)

  bq, bkv = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq
  q_spec = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, b_, h_: (b_, i, h_, 0))
  kv_spec = lambda d: pl.BlockSpec((None, s, None, d),
                                   lambda i, b_, h_: (b_, 0, lax.div(h_, r), 0))
  stat_spec = pl.BlockSpec((None, None, bq), lambda i, b_, h_: (b_, h_, i))
  seg_specs = _seg_specs(bq, s, lambda i, b_, h_: (b_, i), lambda i, b_, h_: (b_, 0),
                         q_seg_BL, kv_seg_BS)
  dq_BLHK = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(l // bq, b, h),
      in_specs=[q_spec(d), kv_spec(d), kv_spec(dv), *seg_specs, q_spec(dv), stat_spec,
                stat_spec],
      out_specs=q_spec(d),
      out_shape=jax.ShapeDtypeStruct(q_BLHK.shape, q_BLHK.dtype),
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dq",
  )(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, do_BLHK, lse_BHL, delta_BHL)
  return dq_BLHK, dk_BSGK, dv_BSGK


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg):
  return forward(q, k, v, q_seg, kv_seg, cfg)


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
  out, lse = forward(q, k, v, q_seg, kv_seg, cfg)
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(cfg, res, cotangents):
  q, k, v, q_seg, kv_seg, out, lse = res
  do, dlse = cotangents
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, out, lse, do, dlse, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def split_segments(segment_ids):
  """(q_seg, kv_seg) int32 from `segment_ids`: one [B, L] array shared by q and kv, a
  (q_seg, kv_seg) pair, or None (no segments: (None, None))."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  return jnp.asarray(q_seg).astype(jnp.int32), jnp.asarray(kv_seg).astype(jnp.int32)


def flash_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, segment_ids=None,
                    sm_scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                    interpret: bool = False, return_lse: bool = False):
  """Softmax(q kᵀ * sm_scale) v with GQA, causal and segment masking, differentiable.

  Args:
    q_BLHK: queries [B, L, H, K]. k_BSGK, v_BSGK: keys [B, S, G, K] / values [B, S, G, Kv],
      H % G == 0 (Kv may differ from K; a power of two >= 16 like K).
    causal: query i sees keys j <= i (needs L == S).
    segment_ids: int32 [B, L] shared by q and kv (self-attention), or a (q_seg [B, L],
      kv_seg [B, S]) tuple; a query sees only keys of its segment. A query that sees no key
      at all outputs 0 (lse -inf).
    sm_scale: defaults to 1 / sqrt(K).
    block_sizes: tiles; sequences must be multiples of them (checked here, before tracing).
    interpret: run the kernels in the Pallas interpreter (CPU tests).
    return_lse: also return lse [B, H, L] fp32 (differentiable).

  Returns:
    out [B, L, H, Kv] in q's dtype, or (out, lse) when return_lse.
  """
  q_seg, kv_seg = split_segments(segment_ids)
  blocks = validate(q_BLHK, k_BSGK, v_BSGK, q_seg, kv_seg, causal, block_sizes)
  sm_scale = 1.0 / math.sqrt(q_BLHK.shape[-1]) if sm_scale is None else sm_scale
  cfg = Config(causal=causal, sm_scale=float(sm_scale), blocks=blocks, interpret=interpret)
  # partial(custom_vjp)'s result is typed as object
  out, lse = _flash(q_BLHK, k_BSGK, v_BSGK, q_seg, kv_seg, cfg)  # pyright: ignore[reportGeneralTypeIssues]
  return (out, lse) if return_lse else out
