"""Flash attention forward for Hopper on Pallas' Mosaic GPU backend (FlashAttention-3's shape).

One CUDA block per (query head, 2 * block_q query rows, batch row). Two compute warpgroups
each own block_q rows (their Q tile stays in shared memory, accumulators in registers); the
memory warpgroup streams the kv head's K / V blocks through `slots` shared-memory buffers with
TMA, each slot guarded by a "loaded" barrier (TMA arrives) and a "consumed" barrier (both
compute warpgroups arrive). The compute warpgroups ping-pong on a schedule barrier so one's
softmax overlaps the other's wgmmas. Under causal masking a block streams only the K / V blocks
its last row sees, and each warpgroup masks only the blocks that straddle its diagonal.
GQA: the kv head is q_head // r, read in place (never repeated).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import hopper_config as hc


def forward(q_BLHK, k_BSGK, v_BSGK, q_seg_BL, kv_seg_BS, cfg: hc.Config):
  """Runs the forward kernel: (out [B, L, H, K] in q's dtype, lse [B, H, L] fp32 in base 2)."""
  b, l, h, d = q_BLHK.shape
  s, g = k_BSGK.shape[1:3]
  r, dtype = h // g, q_BLHK.dtype
  bq, bkv = cfg.blocks.block_q, cfg.blocks.block_kv
  n_kv, n_tiles = s // bkv, l // (hc.COMPUTE_WGS * bq)
  slots = min(cfg.blocks.max_concurrent_steps, n_kv)
  scale = cfg.sm_scale * hc.LOG2E

  # The kernel's name is its pallas_call's: GPU profiles show it, and `remat: selective`
  # saves this forward's outputs by it (the backward then never reruns it).
  def flash_attention_fwd_hopper(*refs):
    q_ref, k_ref, v_ref, *refs = refs
    if cfg.segments:
      q_seg_ref, kv_seg_ref, *refs = refs
    out_ref, lse_ref, buffers, loaded, consumed, schedule = refs
    qo_smem2, k_smem, v_smem, lse_smem2 = buffers
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    batch, q_head = lax.axis_index("batch"), lax.axis_index("heads")
    wg, ops = lax.axis_index("wg"), cfg.ops
    tile, stream_steps = hc.q_tile(n_tiles, bq, bkv, n_kv, cfg.causal)

    def take_turn():  # the two compute warpgroups alternate on the tensor cores
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < hc.COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
      q_base = tile * (hc.COMPUTE_WGS * bq) + wg * bq
      kv_steps, unmasked_steps = hc.kv_range(q_base, bq, bkv, n_kv, cfg.causal)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), q_head], qo_smem,
                              q_loaded.at[wg])
      q_seg = ops.row_vector(q_seg_ref.at[batch], q_base, bq) if cfg.segments else None
      plgpu.barrier_wait(q_loaded.at[wg])
      m, l_sum, acc = ops.zeros((bq,), -jnp.inf), ops.zeros((bq,)), ops.zeros((bq, d))
      plgpu.barrier_wait(k_loaded.at[0])
      hc.when(wg == 1, take_turn)

      def kv_step(step, carry, causal: bool):
        acc, m, l_sum = carry
        slot = hc.slot_of(step, slots)

        qk = ops.product((bq, bkv), qo_smem, k_smem.at[slot], transpose_b=True,
                         issued=take_turn)
        plgpu.barrier_arrive(k_consumed.at[slot])
        kv_seg = ops.col_vector(kv_seg_ref.at[batch], step * bkv, bkv) if cfg.segments else None
        visible = ops.mask((bq, bkv), q_base, step * bkv, causal, q_seg, kv_seg)
        if visible is not None:
          qk = jnp.where(visible, qk, -jnp.inf)
        # Online softmax in base 2; the scale folds into one FMA per score.
        m_new = jnp.maximum(m, qk.max(axis=1) * scale)
        m_sub = m_new
        if cfg.segments:
          # A row that has seen no key yet (segments only: causal rows see key 0 first) has
          # m_new = -inf: subtract 0 so its p are exp2(-inf) = 0, not NaN (FA3's Check_inf).
          # A finite mask is not safe here: fma(mask, scale, -round(mask * scale)) is the
          # product's rounding error, ~1e30, and exp2 of it inf (NaN after the next rescale).
          m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_sub)
        p = jnp.exp2(qk * scale - lax.broadcast_in_dim(m_sub, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_sum *= alpha
        p16 = p.astype(dtype)

        def softmax_done():
          plgpu.barrier_arrive(schedule)
          plgpu.barrier_wait(v_loaded.at[slot])
          plgpu.barrier_wait(schedule)
        # The order JAX's FA3 example found fastest for each head size.
        if d <= 128:
          l_sum += p.sum(axis=1)
          acc, l_sum, m_new, p16 = lax.optimization_barrier((acc, l_sum, m_new, p16))
          softmax_done()
        else:
          softmax_done()
          l_sum += p.sum(axis=1)

        def prefetch_wait():  # while the product runs: the next K block's arrival
          nxt = step + 1
          hc.when(nxt < kv_steps,
                  lambda: plgpu.barrier_wait(k_loaded.at[hc.slot_of(nxt, slots)]))
        (acc,) = ops.accumulate((acc,), [(p16, v_smem.at[slot], False)], issued=prefetch_wait)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_new, l_sum

      carry = (acc, m, l_sum)
      # Blocks fully below the diagonal need no causal mask (segment masks still apply).
      carry = lax.fori_loop(0, unmasked_steps, functools.partial(kv_step, causal=False), carry)
      if cfg.causal:
        carry = lax.fori_loop(unmasked_steps, kv_steps,
                              functools.partial(kv_step, causal=True), carry)

        def release(step, _):  # blocks only the other warpgroup needs: hand their slots back
          slot = hc.slot_of(step, slots)
          hc.observe_loaded((k_loaded, v_loaded), slot)
          plgpu.barrier_arrive(k_consumed.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
          take_turn()
          take_turn()
        lax.fori_loop(kv_steps, stream_steps, release, None)
      acc, m, l_sum = carry
      hc.when(wg == 0, take_turn)

      out = acc / lax.broadcast_in_dim(l_sum, acc.shape, [0])
      lse = m + jnp.log2(l_sum)
      if cfg.segments:  # a row that saw no key (m, l_sum: -inf, 0) outputs 0, lse -inf
        seen = m > -jnp.inf
        out = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]), out, 0.0)
        lse = jnp.where(seen, lse, -jnp.inf)
      qo_smem[...] = out.astype(dtype)
      lse_smem[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, bq), q_head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    hc.stream_kv(wg, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded),
                 (k_consumed, v_consumed), batch, q_head, r, bkv, slots, stream_steps)

  args = [q_BLHK, k_BSGK, v_BSGK] + ([q_seg_BL, kv_seg_BS] if cfg.segments else [])
  out, lse2 = plgpu.kernel(
      flash_attention_fwd_hopper,
      out_type=[jax.ShapeDtypeStruct(q_BLHK.shape, dtype),
                jax.ShapeDtypeStruct((b, h, l), jnp.float32)],
      scratch_types=[
          (hc.smem((hc.COMPUTE_WGS, bq, d), dtype), hc.smem((slots, bkv, d), dtype),
           hc.smem((slots, bkv, d), dtype), plgpu.SMEM((hc.COMPUTE_WGS, bq), jnp.float32)),
          (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
           plgpu.Barrier(num_barriers=hc.COMPUTE_WGS)),
          (plgpu.Barrier(num_arrivals=hc.COMPUTE_WGS, num_barriers=slots),) * 2,
          plgpu.Barrier(num_arrivals=hc.COMPUTE_WGS),
      ],
      grid=(h, n_tiles, b),
      grid_names=("heads", "q_seq", "batch"),
      **hc.kernel_args(cfg.interpret),
  )(*args)
  return out, lse2
