"""Sizing and the row-slab pipeline of the Hopper RMSNorm kernels (Mosaic GPU).

A norm reads and writes each element once, so the kernels are built around keeping HBM busy:
- persistent: `num_blocks` CUDA blocks (a few per SM) each walk row slabs p, p + P, ...;
- a slab is `block_rows` whole rows of [N, D] row-major arrays: one contiguous range, moved by
  one bulk copy (`cp.async.bulk`, no tensor map) per array, `max_concurrent_steps` slabs in
  flight per block, outputs leaving the same way while later slabs arrive;
- a row is processed in chunks of 128 * vec elements (one 16-byte vector per thread for bf16),
  warpgroup-strided, so registers hold one chunk per array whatever D is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_env

WARPGROUP = 128  # threads per CUDA block: one warpgroup
INTERPRET_BLOCKS = 2  # CUDA blocks in interpret mode: enough to exercise the persistent walk
SMEM_LIMIT = 227 * 1024
SLAB_BYTES = 16 * 1024  # per array per slot, before the shared-memory budget trims it


@dataclasses.dataclass(frozen=True)
class HopperNormBlocks:
  """Rows per slab (None: up to SLAB_BYTES per array, within the shared-memory budget of
  `blocks_per_sm` blocks), slabs in flight per block, and CUDA blocks per SM (at most as many
  as fit its shared memory)."""
  block_rows: int | None = None
  max_concurrent_steps: int = 2
  blocks_per_sm: int = 2


@dataclasses.dataclass(frozen=True)
class Config:
  """One kernel's static shape: hashable (a custom_vjp nondiff argument)."""
  d: int
  eps: float
  block_rows: int
  max_concurrent_steps: int
  num_blocks: int
  interpret: bool

  @property
  def vec_size(self) -> int:
    """Elements per thread per access: 8 (a 16-byte bf16 vector) when D allows."""
    return next(v for v in (8, 4, 2, 1) if self.d % (WARPGROUP * v) == 0)

  @property
  def chunks(self) -> list[Any]:
    """A row's chunks (`pl.Slice`s; `pl.ds` is typed as maybe a slice): 128 * vec_size
    elements each."""
    size = WARPGROUP * self.vec_size
    return [pl.ds(c * size, size) for c in range(self.d // size)]

  def strided(self, x):
    """`x` in the warpgroup-strided register layout every chunk shares, so their elementwise
    ops line up (the interpreter has no layouts)."""
    if self.interpret:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WG_STRIDED(x.shape, vec_size=self.vec_size))

  def load(self, ref, r: int, chunk: pl.Slice, dtype=jnp.float32):
    """Row `r`'s `chunk` of a slab (or of the weight when r is None), as `dtype`."""
    x = ref[chunk] if r is None else ref[r, chunk]
    return self.strided(x).astype(dtype)


def smem_bytes(block_rows: int, d: int, itemsize: int, row_arrays: int, slots: int) -> int:
  """Shared memory of one CUDA block: `slots` slabs of each row array, the weight, dweight."""
  return slots * row_arrays * block_rows * d * itemsize + 2 * d * 4


def why_not(shape, dtype) -> str | None:
  """Why the Hopper kernels cannot take x of this shape / dtype, or None when they can."""
  d = shape[-1]
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                              jnp.dtype(jnp.float32)):
    return f"dtype {jnp.dtype(dtype).name} (the kernels take bf16, fp16 or fp32)"
  if d % WARPGROUP:
    return f"D={d} is not a multiple of {WARPGROUP} (a warpgroup holds a row's chunk strided)"
  if smem_bytes(1, d, jnp.dtype(dtype).itemsize, 4, 2) > SMEM_LIMIT:
    return f"D={d}: two slots of one row of four arrays exceed shared memory"
  return None


def rows_for(n: int, d: int, itemsize: int, blocks: HopperNormBlocks, row_arrays: int) -> int:
  """Rows per slab: `blocks.block_rows`, else the largest power of two dividing n with at most
  SLAB_BYTES per array whose slots fit 1 / blocks_per_sm of shared memory (at least 1)."""
  if blocks.block_rows is not None:
    if blocks.block_rows < 1 or n % blocks.block_rows:
      raise ValueError(f"HopperNormBlocks.block_rows={blocks.block_rows} must divide the "
                       f"{n} rows")
    return blocks.block_rows
  budget = SMEM_LIMIT // max(blocks.blocks_per_sm, 1)
  rows = 1
  while (n % (2 * rows) == 0 and 2 * rows * d * itemsize <= SLAB_BYTES and
         smem_bytes(2 * rows, d, itemsize, row_arrays, blocks.max_concurrent_steps) <= budget):
    rows *= 2
  return rows


def config(n: int, d: int, itemsize: int, eps: float, blocks: HopperNormBlocks,
           row_arrays: int, interpret: bool) -> Config:
  """The Config of a kernel over n rows moving `row_arrays` [N, D] arrays; ValueError when
  `blocks` cannot run."""
  if blocks.max_concurrent_steps < 1 or blocks.blocks_per_sm < 1:
    raise ValueError(f"{blocks}: max_concurrent_steps and blocks_per_sm must be >= 1")
  rows = rows_for(n, d, itemsize, blocks, row_arrays)
  used = smem_bytes(rows, d, itemsize, row_arrays, blocks.max_concurrent_steps)
  if used > SMEM_LIMIT:
    raise ValueError(f"{blocks} with {rows} rows of D={d} needs more than the H100's "
                     f"{SMEM_LIMIT // 1024} KiB of shared memory: fewer rows or slots")
  # Only as many blocks per SM as fit its shared memory: more would run as a second wave.
  resident = min(blocks.blocks_per_sm, SMEM_LIMIT // used)
  sms = INTERPRET_BLOCKS if interpret else mosaic_gpu_env.num_sms() * resident
  return Config(d=d, eps=float(eps), block_rows=rows,
                max_concurrent_steps=blocks.max_concurrent_steps,
                num_blocks=max(1, min(sms, n // rows)), interpret=interpret)


def copy_in(gmem, smem, barrier):
  """GMEM -> SMEM. In bounds by construction, which lets Mosaic GPU move a contiguous slab
  with one bulk copy instead of a zero-filling tiled TMA (limited to 256 per dim)."""
  plgpu.copy_gmem_to_smem(gmem, smem, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)


def walk(cfg: Config, n: int, body, in_gmem, out_gmem, in_smem, out_smem, loaded,
         carry=None):
  """Runs `body(in slabs, out slabs, carry) -> carry` over this CUDA block's row slabs
  p, p + P, ... with `max_concurrent_steps` slabs in flight.

  Slot s of every input shares the barrier `loaded[s]` (one arrival per input); an output
  slot is rewritten only once the store issued from it `slots` steps ago has read it.
  (Written out rather than `plgpu.emit_pipeline`: JAX's GPU interpreter cannot run that
  pipeline's predicated stores, and a slab's index is all this walk needs.)
  """
  p = lax.axis_index("block")
  slots, rows = cfg.max_concurrent_steps, cfg.block_rows
  steps = (n // rows - p + cfg.num_blocks - 1) // cfg.num_blocks
  slab = lambda i: pl.ds((p + i * cfg.num_blocks) * rows, rows)

  def fetch(i, slot):
    for gmem, smem in zip(in_gmem, in_smem):
      copy_in(gmem.at[slab(i)], smem.at[slot], loaded.at[slot])

  for i in range(slots):
    pl.when(i < steps)(functools.partial(fetch, i, i))

  def step(i, carry):
    slot = lax.rem(i, slots)
    plgpu.barrier_wait(loaded.at[slot])
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # this slot's last store read it
    carry = body([s.at[slot] for s in in_smem], [s.at[slot] for s in out_smem], carry)
    plgpu.commit_smem()  # the slab's outputs are written and its inputs read, by every thread
    for smem, gmem in zip(out_smem, out_gmem):
      plgpu.copy_smem_to_gmem(smem.at[slot], gmem.at[slab(i)], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    pl.when(i + slots < steps)(lambda: fetch(i + slots, slot))
    return carry

  carry = lax.fori_loop(0, steps, step, carry)
  plgpu.wait_smem_to_gmem(0)
  return carry


def kernel(name: str, fn, cfg: Config, ins, out_type, n_slab_outs: int, extra_scratch=()):
  """Calls one persistent kernel over `ins` ([N, D] arrays, the weight [D] second):
  `fn(in_gmem, out_gmem, in_smem, out_smem, loaded, w_smem, w_loaded, *extra_scratch)`,
  where the first `n_slab_outs` outputs are [N, D] and get slab slots."""
  n_in, d = len(ins) - 1, cfg.d

  def body(*refs):
    in_gmem, out_gmem = refs[:len(ins)], refs[len(ins):len(ins) + len(out_type)]
    scratch = refs[len(ins) + len(out_type):]
    in_smem, out_smem = scratch[:n_in], scratch[n_in:n_in + n_slab_outs]
    fn(in_gmem, out_gmem, in_smem, out_smem, *scratch[n_in + n_slab_outs:])
  body.__name__ = name  # what GPU profiles (and remat policies) see of the kernel

  slab = lambda dtype: plgpu.SMEM((cfg.max_concurrent_steps, cfg.block_rows, d), dtype)
  args = dict(grid=(cfg.num_blocks,), grid_names=("block",))
  if cfg.interpret:
    args["interpret"] = mosaic_gpu_env.interpret_params()
  return plgpu.kernel(
      body, out_type=out_type,
      scratch_types=[*[slab(ins[0].dtype)] * n_in, *[slab(out_type[0].dtype)] * n_slab_outs,
                     plgpu.Barrier(num_arrivals=n_in, num_barriers=cfg.max_concurrent_steps),
                     plgpu.SMEM((d,), ins[1].dtype), plgpu.Barrier(), *extra_scratch],
      **args,
  )(*ins)
