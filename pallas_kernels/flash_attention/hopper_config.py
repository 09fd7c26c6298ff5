"""Block sizes, validation and shared pieces of the Hopper (Mosaic GPU) flash attention kernels.

The kernels (`hopper_fwd`, `hopper_bwd`) are warp specialised the way FlashAttention-3 is: each
CUDA block runs two compute warpgroups, each owning `block` rows of the resident operand, and
one memory warpgroup that streams the other operand's blocks through `max_concurrent_steps`
shared-memory slots with TMA copies and mbarriers. Products are warpgroup MMAs (wgmma) with
fp32 accumulators in registers; scores stay in base 2 (exp2 is one MUFU instruction).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.hopper_ops import Ops
from pallas_kernels.mosaic_gpu_env import interpret_params

LOG2E = math.log2(math.e)
COMPUTE_WGS = 2  # compute warpgroups per CUDA block; the memory warpgroup is the third


def kernel_args(interpret: bool) -> dict:
  """plgpu.kernel arguments every kernel shares: warpgroups as Pallas threads, exp2 / rcp
  approximations; in interpret mode, JAX's Mosaic GPU interpreter."""
  args = dict(num_threads=COMPUTE_WGS + 1, thread_name="wg",
              compiler_params=plgpu.CompilerParams(approx_math=True))
  if interpret:
    args["interpret"] = interpret_params()
  return args


@dataclasses.dataclass(frozen=True)
class HopperBlocks:
  """Tile sizes of the Hopper kernels (multiples of 64: one wgmma M tile per warpgroup).

  block_q / block_kv tile the forward (each compute warpgroup owns block_q query rows, so a
  CUDA block covers 2 * block_q); *_dkv the dK/dV kernel (each warpgroup owns block_kv_dkv
  keys and streams the query blocks of every head of its GQA group); *_dq the dQ kernel.
  max_concurrent_steps: shared-memory slots of the streamed operand (TMA runs that many ahead).
  """
  block_q: int = 64
  block_kv: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  max_concurrent_steps: int = 2


# Starting points by head_dim (FlashAttention-3's H100 forward tiles per warpgroup; the
# backward's 64 x 64 keeps dK and dV accumulators within the 240-register budget at K = 128).
# Not yet tuned on a GPU: scripts/bench_kernels.py measures them.
TUNED: dict[int, HopperBlocks] = {
    64: HopperBlocks(block_q=64, block_kv=128),
    128: HopperBlocks(block_q=64, block_kv=128),
}


def blocks_for(seq_len: int, head_dim: int) -> HopperBlocks:
  """The tuned tiles for `head_dim`, shrunk (by halving the kv tiles) to divide `seq_len`."""
  blocks = TUNED.get(head_dim, HopperBlocks())
  fit = lambda b: b if seq_len % b == 0 else max(64, math.gcd(b, seq_len))
  return dataclasses.replace(blocks, block_kv=fit(blocks.block_kv),
                             block_kv_dkv=fit(blocks.block_kv_dkv),
                             block_kv_dq=fit(blocks.block_kv_dq))


@dataclasses.dataclass(frozen=True)
class Config:
  """Static parameters of one call (hashable: a custom_vjp nondiff argument)."""
  causal: bool
  sm_scale: float
  blocks: HopperBlocks
  segments: bool
  interpret: bool = False

  @property
  def ops(self) -> Ops:
    """The products and layouts of this run (compiled, or in JAX's GPU interpreter)."""
    return Ops(self.interpret)


def problem(q, k, v, q_seg, kv_seg, causal: bool, blocks: HopperBlocks) -> str | None:
  """What the Hopper kernels cannot run, naming the fix (None: they can); arrays or
  ShapeDtypeStructs, before any tracing."""
  if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
    return (f"expected q [B, L, H, K] and k, v [B, S, G, K], got q {q.shape}, "
            f"k {k.shape}, v {v.shape} (the Hopper kernel needs V's head size equal "
            f"to K's: use the portable kernel for MLA-style heads)")
  (b, l, h, d), (bk, s, g, dk) = q.shape, k.shape
  if b != bk or d != dk or h % g:
    return (f"q {q.shape} and k/v {k.shape} disagree on batch or head_dim, or the "
            f"{h} query heads are not a multiple of the {g} kv heads")
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or not (
      q.dtype == k.dtype == v.dtype):
    return (f"the Hopper kernel takes bf16 or fp16 q, k, v of one dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}: set model.dtype=bfloat16")
  if d not in (64, 128):
    return (f"head_dim {d} must be 64 or 128 (wgmma tiles, the 128-byte swizzle, and "
            f"the backward's dK + dV accumulators within the register budget): use "
            f"the portable kernel")
  if causal and l != s:
    return f"causal attention needs q_len == kv_len, got {l} and {s}"
  for name, blk, seq in (("block_q", 2 * blocks.block_q, l), ("block_kv", blocks.block_kv, s),
                         ("block_q_dkv", blocks.block_q_dkv, l),
                         ("block_kv_dkv", 2 * blocks.block_kv_dkv, s),
                         ("block_q_dq", 2 * blocks.block_q_dq, l),
                         ("block_kv_dq", blocks.block_kv_dq, s)):
    if blk % 64 or seq % blk:
      return (f"sequence {seq} is not a multiple of {blk} ({name}"
              f"{' x 2 compute warpgroups' if blk != getattr(blocks, name) else ''}):"
              f" pad the sequence or pass HopperBlocks({name}=...)")
  if blocks.max_concurrent_steps < 2:
    return f"max_concurrent_steps={blocks.max_concurrent_steps} must be >= 2"
  if q_seg is not None and (q_seg.shape != (b, l) or kv_seg.shape != (b, s)):
    return (f"segment ids must be [B, L] = {(b, l)} (and [B, S] = {(b, s)} for "
            f"kv), got {q_seg.shape} and {kv_seg.shape}")
  return None


def validate(q, k, v, q_seg, kv_seg, causal: bool, blocks: HopperBlocks) -> None:
  """Raises ValueError naming what the Hopper kernels cannot run (`problem`)."""
  if (why := problem(q, k, v, q_seg, kv_seg, causal, blocks)) is not None:
    raise ValueError(why)


def smem(shape, dtype):
  """A shared-memory buffer in the layout TMA and wgmma share: 8 x 64 tiles, 128-byte swizzle
  (a 64-wide bf16 row is one 128-byte line: conflict-free for both)."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def q_tile(n_tiles: int, block_q: int, block_kv: int, n_kv: int, causal: bool):
  """(tile, stream_steps) of a CUDA block over query tiles of COMPUTE_WGS * block_q rows: its
  tile (heaviest causal tiles launch first) and the K / V blocks its last row sees."""
  tile = n_tiles - 1 - lax.axis_index("q_seq")
  if not causal:
    return tile, n_kv
  return tile, pl.cdiv((tile + 1) * (COMPUTE_WGS * block_q), jnp.array(block_kv, jnp.int32))


def kv_range(q_base, block_q: int, block_kv: int, n_kv: int, causal: bool):
  """(kv_steps, unmasked_steps) of a warpgroup's block_q rows from q_base: the K / V blocks
  they see, and how many of those lie fully below the diagonal (no causal mask)."""
  if not causal:
    return n_kv, n_kv
  return (pl.cdiv(q_base + block_q, jnp.array(block_kv, jnp.int32)),
          lax.div(q_base, jnp.array(block_kv, jnp.int32)))


def slot_of(step, slots: int):
  """The shared-memory slot that holds stream step `step`."""
  return lax.rem(step, jnp.array(slots, step.dtype))


def observe_loaded(barriers, slot) -> None:
  """Waits on a released slot's `loaded` barriers (K, V), the data unused, so every thread
  that arrives on a slot's `consumed` barrier has seen each of its loads complete and barrier
  phases stay in step (JAX's GPU interpreter checks that no phase goes unobserved). Costs only
  this warpgroup's idle tail: the other one is still computing on those blocks."""
  for barrier in barriers:
    plgpu.barrier_wait(barrier.at[slot])


def when(cond, fn) -> None:
  """fn() under a traced condition, or now / never for a Python bool."""
  if isinstance(cond, bool):
    if cond:
      fn()
  else:
    pl.when(cond)(fn)


def stream_kv(wg, k_ref, v_ref, k_smem, v_smem, loaded, consumed, batch, q_head, r: int,
              block: int, slots: int, steps) -> None:
  """The memory warpgroup (wg == COMPUTE_WGS): K / V blocks 0..steps-1 of query head q_head's
  kv head (q_head // r) into slot step % slots, each copy arriving on its `loaded` barrier; a
  slot is refilled once both compute warpgroups arrived on its `consumed` barrier."""
  (k_loaded, v_loaded), (k_consumed, v_consumed) = loaded, consumed

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")  # the compute warpgroups get the rest
    kv_head = lax.div(q_head, jnp.array(r, q_head.dtype))

    def load(step, slot, wait: bool):
      idx = (batch, pl.ds(step * block, block), kv_head)
      if wait:
        plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[idx], k_smem.at[slot], k_loaded.at[slot])
      if wait:
        plgpu.barrier_wait(v_consumed.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[idx], v_smem.at[slot], v_loaded.at[slot])

    for i in range(slots):
      when(i < steps, functools.partial(load, i, i, False))

    @pl.loop(0, steps - slots)
    def _refill(step):
      load(step + slots, slot_of(step, slots), True)

    drain(steps, slots, (k_consumed, v_consumed))


def drain(steps, slots: int, consumed) -> None:
  """The memory warpgroup's last waits: the `consumed` phases of the final `slots` stream steps
  (no load follows them), so it observes every phase of its barriers, as JAX's GPU
  interpreter checks. The compute warpgroups are finishing those blocks meanwhile."""
  @pl.loop(jnp.maximum(steps - slots, 0), steps)
  def _drain(step):
    for barrier in consumed:
      plgpu.barrier_wait(barrier.at[slot_of(step, slots)])
