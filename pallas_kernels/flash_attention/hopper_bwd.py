"""Flash attention backward for Hopper on Pallas' Mosaic GPU backend: a dK/dV and a dQ kernel.

Both recompute P = exp2(s * scale - lse) from the forward's base-2 lse and take
delta = rowsum(dO * O) (minus any lse cotangent) precomputed by XLA, as FlashAttention-2/3 do.

dK/dV: one CUDA block per (kv head, 2 * block_kv_dkv keys, batch row); each compute warpgroup
keeps its K / V tile in shared memory and dK / dV accumulators in registers, while the memory
warpgroup streams Q, dO, lse and delta blocks of every query head of the GQA group (so the
group's sum happens in registers, and dK / dV are written once, [B, S, G, K]). Under causal
masking the stream starts at the first query block that sees the CUDA block's keys.

dQ: one CUDA block per (query head, 2 * block_q_dq rows, batch row), K / V streamed as in the
forward (the same loader), stopping at the last block the rows see.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import hopper_config as hc


def _recompute_p(s, lse2, visible, scale: float, lse_dim: int):
  """exp2(s * scale - lse) with masked entries 0 (selected, not multiplied: they may be inf)."""
  p = jnp.exp2(s * scale - lax.broadcast_in_dim(lse2, s.shape, [lse_dim]))
  return p if visible is None else jnp.where(visible, p, 0.0)


def dkv(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, lse2_BHL, delta_BHL, do_BLHK,
        cfg: hc.Config):
  """dK, dV [B, S, G, K] in k's dtype (dK already scaled by sm_scale)."""
  b, l, h, d = q_BLHK.shape
  s, g = k_BSGK.shape[1:3]
  r, dtype = h // g, q_BLHK.dtype
  bq, bkv = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv
  n_q = l // bq
  scale = cfg.sm_scale * hc.LOG2E

  def first_q_block(kv_start):  # the first query block that sees key kv_start
    return lax.div(kv_start, jnp.array(bq, jnp.int32)) if cfg.causal else 0

  def flash_attention_dkv_hopper(*refs):  # named for GPU profiles
    q_ref, k_ref, v_ref, *refs = refs
    if cfg.segments:
      q_seg_ref, kv_seg_ref, *refs = refs
    lse_ref, delta_ref, do_ref, dk_ref, dv_ref, buffers, loaded, consumed = refs
    k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem = buffers
    k_loaded, v_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded = loaded
    batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("wg")
    tile, ops = lax.axis_index("kv_seq"), cfg.ops
    stream_from = first_q_block(tile * (hc.COMPUTE_WGS * bkv))
    per_head = n_q - stream_from
    slots = cfg.blocks.max_concurrent_steps

    @pl.when(wg < hc.COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      kv_base = tile * (hc.COMPUTE_WGS * bkv) + wg * bkv
      own = (batch, pl.ds(kv_base, bkv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[own], k_smem, k_loaded.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[own], v_smem, v_loaded.at[wg])
      kv_seg = ops.row_vector(kv_seg_ref.at[batch], kv_base, bkv) if cfg.segments else None
      plgpu.barrier_wait(k_loaded.at[wg])
      plgpu.barrier_wait(v_loaded.at[wg])
      first_seen = first_q_block(kv_base)
      # Query blocks from here on see every key of this tile (no causal mask).
      unmasked_from = (pl.cdiv(kv_base + bkv - 1, jnp.array(bq, jnp.int32)) if cfg.causal
                       else 0)

      def wait_loaded(slot):
        for barrier in (q_loaded, do_loaded, lse_loaded, delta_loaded):
          plgpu.barrier_wait(barrier.at[slot])

      def q_step(step, carry, causal: bool):
        dk, dv = carry
        head_step, i = step
        slot = hc.slot_of(head_step, slots)
        wait_loaded(slot)

        # Scores transposed: [keys, queries].
        sT = ops.product((bkv, bq), k_smem, q_smem.at[slot], transpose_b=True)
        lse2 = ops.vector(lse_smem.at[slot], 1)
        q_seg = ops.col_vector(q_seg_ref.at[batch], i * bq, bq) if cfg.segments else None
        visible = ops.mask((bkv, bq), kv_base, i * bq, causal, kv_seg, q_seg, rows_are_q=False)
        pT = _recompute_p(sT, lse2, visible, scale, 1)
        # One wgmma group: a single wait for both products.
        dv, dpT = ops.accumulate((dv, ops.zeros((bkv, bq))),
                                 [(pT.astype(dtype), do_smem.at[slot], False),
                                  (v_smem, do_smem.at[slot], True)])
        delta = ops.vector(delta_smem.at[slot], 1)
        dsT = pT * (dpT - lax.broadcast_in_dim(delta, dpT.shape, [1]))
        (dk,) = ops.accumulate((dk,), [(dsT.astype(dtype), q_smem.at[slot], False)])
        plgpu.barrier_arrive(consumed.at[slot])
        return dk, dv

      def skip(head_step, carry):  # a block only the other warpgroup sees: keep the phases
        slot = hc.slot_of(head_step, slots)
        wait_loaded(slot)
        plgpu.barrier_arrive(consumed.at[slot])
        return carry

      def head(j, carry):
        at = lambda i: j * per_head + i - stream_from  # stream step of query block i
        carry = lax.fori_loop(stream_from, first_seen, lambda i, c: skip(at(i), c), carry)
        masked = functools.partial(q_step, causal=cfg.causal)
        carry = lax.fori_loop(first_seen, jnp.maximum(first_seen, unmasked_from),
                              lambda i, c: masked((at(i), i), c), carry)
        plain = functools.partial(q_step, causal=False)
        return lax.fori_loop(jnp.maximum(first_seen, unmasked_from), n_q,
                             lambda i, c: plain((at(i), i), c), carry)

      dk, dv = lax.fori_loop(0, r, head, (ops.zeros((bkv, d)), ops.zeros((bkv, d))))
      k_smem[...] = (dk * cfg.sm_scale).astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[own], commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[own], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == hc.COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      total = r * per_head

      def load(step, slot, wait: bool):
        q_head = kv_head * r + lax.div(step, per_head)
        i = stream_from + lax.rem(step, per_head)
        rows, stats = (batch, pl.ds(i * bq, bq), q_head), (batch, q_head, pl.ds(i * bq, bq))
        if wait:
          plgpu.barrier_wait(consumed.at[slot])
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], lse_loaded.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], delta_loaded.at[slot])

      for i in range(slots):
        hc.when(i < total, functools.partial(load, jnp.int32(i), i, False))

      @pl.loop(0, total - slots)
      def _refill(step):
        load(step + slots, hc.slot_of(step, slots), True)

      hc.drain(total, slots, (consumed,))

  slots = cfg.blocks.max_concurrent_steps
  args = [q_BLHK, k_BSGK, v_BSGK] + ([q_seg_BL, kv_seg_BS] if cfg.segments else [])
  kv_out = jax.ShapeDtypeStruct(k_BSGK.shape, dtype)
  return plgpu.kernel(
      flash_attention_dkv_hopper,
      out_type=[kv_out, kv_out],
      scratch_types=[
          (hc.smem((hc.COMPUTE_WGS, bkv, d), dtype), hc.smem((hc.COMPUTE_WGS, bkv, d), dtype),
           hc.smem((slots, bq, d), dtype), hc.smem((slots, bq, d), dtype),
           plgpu.SMEM((slots, bq), jnp.float32), plgpu.SMEM((slots, bq), jnp.float32)),
          (plgpu.Barrier(num_barriers=hc.COMPUTE_WGS),) * 2
          + (plgpu.Barrier(num_barriers=slots),) * 4,
          plgpu.Barrier(num_arrivals=hc.COMPUTE_WGS, num_barriers=slots),
      ],
      grid=(g, s // (hc.COMPUTE_WGS * bkv), b),
      grid_names=("kv_heads", "kv_seq", "batch"),
      **hc.kernel_args(cfg.interpret),
  )(*args, lse2_BHL, delta_BHL, do_BLHK)


def dq(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, lse2_BHL, delta_BHL, do_BLHK,
       cfg: hc.Config):
  """dQ [B, L, H, K] in q's dtype (scaled by sm_scale)."""
  b, l, h, d = q_BLHK.shape
  s, g = k_BSGK.shape[1:3]
  r, dtype = h // g, q_BLHK.dtype
  bq, bkv = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq
  n_kv, n_tiles = s // bkv, l // (hc.COMPUTE_WGS * bq)
  slots = min(cfg.blocks.max_concurrent_steps, n_kv)
  scale = cfg.sm_scale * hc.LOG2E

  def flash_attention_dq_hopper(*refs):  # named for GPU profiles
    q_ref, k_ref, v_ref, *refs = refs
    if cfg.segments:
      q_seg_ref, kv_seg_ref, *refs = refs
    lse_ref, delta_ref, do_ref, dq_ref, buffers, loaded, consumed = refs
    q_smem2, do_smem2, k_smem, v_smem = buffers
    q_loaded, do_loaded, k_loaded, v_loaded = loaded
    k_consumed, v_consumed = consumed
    batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    tile, stream_steps = hc.q_tile(n_tiles, bq, bkv, n_kv, cfg.causal)
    ops = cfg.ops

    @pl.when(wg < hc.COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q_base = tile * (hc.COMPUTE_WGS * bq) + wg * bq
      rows = (batch, pl.ds(q_base, bq), q_head)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_loaded.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_loaded.at[wg])
      lse2 = ops.row_vector(lse_ref.at[batch, q_head], q_base, bq)
      delta = ops.row_vector(delta_ref.at[batch, q_head], q_base, bq)
      q_seg = ops.row_vector(q_seg_ref.at[batch], q_base, bq) if cfg.segments else None
      plgpu.barrier_wait(q_loaded.at[wg])
      plgpu.barrier_wait(do_loaded.at[wg])
      kv_steps, unmasked_steps = hc.kv_range(q_base, bq, bkv, n_kv, cfg.causal)

      def kv_step(step, dq_acc, causal: bool):
        slot = hc.slot_of(step, slots)
        plgpu.barrier_wait(k_loaded.at[slot])

        s_ = ops.product((bq, bkv), q_smem, k_smem.at[slot], transpose_b=True)
        plgpu.barrier_wait(v_loaded.at[slot])
        dp = ops.product((bq, bkv), do_smem, v_smem.at[slot], transpose_b=True)
        plgpu.barrier_arrive(v_consumed.at[slot])
        kv_seg = ops.col_vector(kv_seg_ref.at[batch], step * bkv, bkv) if cfg.segments else None
        visible = ops.mask((bq, bkv), q_base, step * bkv, causal, q_seg, kv_seg)
        p = _recompute_p(s_, lse2, visible, scale, 0)
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
        (dq_acc,) = ops.accumulate((dq_acc,), [(ds.astype(dtype), k_smem.at[slot], False)])
        plgpu.barrier_arrive(k_consumed.at[slot])
        return dq_acc

      dq_acc = ops.zeros((bq, d))
      dq_acc = lax.fori_loop(0, unmasked_steps, functools.partial(kv_step, causal=False), dq_acc)
      if cfg.causal:
        dq_acc = lax.fori_loop(unmasked_steps, kv_steps, functools.partial(kv_step, causal=True),
                               dq_acc)

        def release(step, _):  # blocks only the other warpgroup needs
          slot = hc.slot_of(step, slots)
          hc.observe_loaded((k_loaded, v_loaded), slot)
          plgpu.barrier_arrive(k_consumed.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
        lax.fori_loop(kv_steps, stream_steps, release, None)
      q_smem[...] = (dq_acc * cfg.sm_scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0)

    hc.stream_kv(wg, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded),
                 (k_consumed, v_consumed), batch, q_head, r, bkv, slots, stream_steps)

  args = [q_BLHK, k_BSGK, v_BSGK] + ([q_seg_BL, kv_seg_BS] if cfg.segments else [])
  return plgpu.kernel(
      flash_attention_dq_hopper,
      out_type=jax.ShapeDtypeStruct(q_BLHK.shape, dtype),
      scratch_types=[
          (hc.smem((hc.COMPUTE_WGS, bq, d), dtype), hc.smem((hc.COMPUTE_WGS, bq, d), dtype),
           hc.smem((slots, bkv, d), dtype), hc.smem((slots, bkv, d), dtype)),
          (plgpu.Barrier(num_barriers=hc.COMPUTE_WGS),) * 2
          + (plgpu.Barrier(num_barriers=slots),) * 2,
          (plgpu.Barrier(num_arrivals=hc.COMPUTE_WGS, num_barriers=slots),) * 2,
      ],
      grid=(h, n_tiles, b),
      grid_names=("heads", "q_seq", "batch"),
      **hc.kernel_args(cfg.interpret),
  )(*args, lse2_BHL, delta_BHL, do_BLHK)
