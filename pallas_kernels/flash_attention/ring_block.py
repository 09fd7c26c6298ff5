"""The flash kernels as ring attention's block functions (`jscale.model.blockwise_attention`
contract): forward returns the block's output and log-sum-exp, which the ring merges across
K/V blocks; backward takes the *final* output's lse and delta, so each block's gradients are
its exact share of the whole softmax's (no P or S for the full sequence ever exists)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels.flash_attention import kernel
from pallas_kernels.flash_attention.kernel_config import BlockSizes, Config, check_shapes


def _config(q, k, v, causal: bool, interpret: bool, blocks: BlockSizes) -> Config:
  checked = check_shapes(q.shape, k.shape, causal=causal, block_sizes=blocks, v_shape=v.shape)
  return Config(causal, 1.0 / math.sqrt(q.shape[-1]), checked, interpret)


def block_fns(interpret: bool = False, block_sizes: BlockSizes = BlockSizes()):
  """(forward, backward) for `BlockFns`: forward(q, k, v, causal, q_seg, kv_seg) -> (out fp32
  [B, L, H, Kv], lse [B, L, H]); backward(q, k, v, dout, lse, delta, causal, q_seg, kv_seg)
  -> fp32 (dq, dk, dv); the segment ids [B, L] / [B, S] (documents) or None."""

  def forward(q_BLHK, k_BSGK, v_BSGK, causal: bool, q_seg_BL=None, kv_seg_BS=None):
    cfg = _config(q_BLHK, k_BSGK, v_BSGK, causal, interpret, block_sizes)
    out, lse_BHL = kernel.forward(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, cfg)
    return out.astype(jnp.float32), lse_BHL.transpose(0, 2, 1)

  def backward(q_BLHK, k_BSGK, v_BSGK, dout_BLHK, lse_BLH, delta_BLH, causal: bool,
               q_seg_BL=None, kv_seg_BS=None):
    cfg = _config(q_BLHK, k_BSGK, v_BSGK, causal, interpret, block_sizes)
    grads = kernel.backward_from_stats(
        q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, lse_BLH.transpose(0, 2, 1),
        delta_BLH.transpose(0, 2, 1), dout_BLHK.astype(q_BLHK.dtype), cfg)
    return tuple(g.astype(jnp.float32) for g in grads)

  return forward, backward
