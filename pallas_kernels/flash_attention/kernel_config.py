"""The portable flash kernels' static parameters and shape rules: tile sizes, one call's
configuration, and what the kernels cannot run (`why_not`, naming the fix)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (H100 starting points, not tuned) and Triton launch parameters.

  block_q / block_k tile the forward; *_dkv the dK/dV kernel (grid over kv blocks); *_dq the
  dQ kernel (grid over q blocks). Each is clamped to its sequence length; the sequence must be
  a multiple of the clamped block, which must be a power of two >= 16 (Triton tiles / tl.dot).
  num_warps=None picks 4 for head_dim <= 64, else 8.
  """
  block_q: int = 128
  block_k: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 128
  block_q_dq: int = 128
  block_kv_dq: int = 64
  num_warps: int | None = None
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Config:
  """Static, validated parameters of one call (hashable: a custom_vjp nondiff argument)."""
  causal: bool
  sm_scale: float
  blocks: BlockSizes  # clamped to the sequence lengths
  interpret: bool


# Each block size, the sequence it tiles ("seq_len": queries, "kv_seq_len": keys / values).
_BLOCKS = (("block_q", "seq_len"), ("block_k", "kv_seq_len"), ("block_q_dkv", "seq_len"),
           ("block_kv_dkv", "kv_seq_len"), ("block_q_dq", "seq_len"),
           ("block_kv_dq", "kv_seq_len"))


def _block_problem(name: str, block: int, seq_name: str, seq: int) -> str | None:
  """Why the block, clamped to the sequence, cannot tile it (None: it can)."""
  b = min(block, seq)
  if seq % b:
    return (f"{seq_name} {seq} is not a multiple of {name}={b}: pad the sequence "
            f"or pass BlockSizes({name}=...) dividing it")
  if b < 16 or b & (b - 1):
    return (f"{name}={b} (clamped to {seq_name} {seq}) must be a power of two >= 16 "
            f"(Triton tiles): pad the sequence to {max(16, pl.next_power_of_2(b))}")
  return None


def problem(q_shape, k_shape, v_shape, seg_shapes, causal: bool,
             blocks: BlockSizes) -> str | None:
  """What the kernels cannot run in these shapes, naming the fix (None: they can).
  `seg_shapes`: (q_seg, kv_seg) shapes, or None without segment ids."""
  if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4 or k_shape[:3] != v_shape[:3]:
    return (f"expected q [B, L, H, K], k [B, S, G, K] and v [B, S, G, Kv], got "
            f"q {q_shape}, k {k_shape}, v {v_shape}")
  (b, l, h, d), (bk, s, g, dk) = q_shape, k_shape
  if b != bk or d != dk or h % g:
    return (f"q {q_shape} and k/v {k_shape} disagree on batch or head_dim, or the "
            f"{h} query heads are not a multiple of the {g} kv heads")
  for name, dim in (("head_dim", d), ("v head_dim", v_shape[-1])):
    if dim < 16 or dim & (dim - 1):
      return f"{name} {dim} must be a power of two >= 16 (Triton tiles)"
  if causal and l != s:
    return f"causal attention needs q_len == kv_len, got {l} and {s}"
  if seg_shapes is not None and (seg_shapes[0] != (b, l) or seg_shapes[1] != (b, s)):
    return (f"segment ids must be [B, L] = {(b, l)} (and [B, S] = {(b, s)} for "
            f"kv), got {seg_shapes[0]} and {seg_shapes[1]}")
  seqs = {"seq_len": l, "kv_seq_len": s}
  return next((p for name, seq in _BLOCKS if (p := _block_problem(
      name, getattr(blocks, name), seq, seqs[seq])) is not None), None)


def validate(q, k, v, q_seg, kv_seg, causal: bool, blocks: BlockSizes) -> BlockSizes:
  """The block sizes clamped to the sequences; ValueError naming what the kernels cannot run."""
  segs = None if q_seg is None else (q_seg.shape, kv_seg.shape)
  why = problem(q.shape, k.shape, v.shape, segs, causal, blocks)
  if why is not None:
    raise ValueError(why)
  seqs = {"seq_len": q.shape[1], "kv_seq_len": k.shape[1]}
  return dataclasses.replace(blocks, **{name: min(getattr(blocks, name), seqs[seq])
                                        for name, seq in _BLOCKS})


def why_not(q_shape, kv_shape, *, causal: bool = True, block_sizes: BlockSizes = BlockSizes(),
            v_shape=None) -> str | None:
  """Why `flash_attention` cannot take q [B, L, H, K], k [B, S, G, K] and v `v_shape`
  [B, S, G, Kv] (default k's), naming the fix; None when it can (for config validation)."""
  v_shape = kv_shape if v_shape is None else v_shape
  return problem(tuple(q_shape), tuple(kv_shape), tuple(v_shape), None, causal, block_sizes)


def check_shapes(q_shape, kv_shape, *, causal: bool = True,
                 block_sizes: BlockSizes = BlockSizes(), v_shape=None) -> BlockSizes:
  """`flash_attention`'s shape check without arrays: the clamped block sizes, or the
  ValueError the call would raise (`why_not`)."""
  q = jax.ShapeDtypeStruct(tuple(q_shape), jnp.float32)
  k = jax.ShapeDtypeStruct(tuple(kv_shape), jnp.float32)
  v = k if v_shape is None else jax.ShapeDtypeStruct(tuple(v_shape), jnp.float32)
  return validate(q, k, v, None, None, causal, block_sizes)
