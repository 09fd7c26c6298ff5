"""Token-to-expert dispatch math for one group of tokens (pure jnp, no communication).

Two ways to get each token's k chosen experts applied:
  * dropless: sort the T·k assignments by expert and run the experts as grouped matmuls
    (`jax.lax.ragged_dot`) over the sorted rows; nothing is dropped, no padding is computed.
  * capacity: every expert has C slots; assignments are queued in a fixed order (all tokens'
    first choices, then all second choices, ..., each in token order) and those past slot C
    are dropped. The [E, C, D] buffer is a dense batched matmul (GShard / Switch), and the
    layout expert parallelism exchanges with a fixed-size all-to-all.

Shape suffixes: T tokens, D model dim, F expert hidden, E experts, K experts per token,
A = T·K assignments, C slots per expert.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jscale.model import matmul
from jscale.model.moe_gemm import GroupedDot

# The routed experts' weight stacks by their logical axes: [E, K, ...N], each product contracting
# dim 1 (K). ZeRO-3's forward pieces may carry them as e4m3 columns under FP8 experts scaled per
# row (`jscale.parallel.zero_prefetch.Chunked.forward`).
GATE_UP_AXES = ("experts", "embed", "gate_up", "mlp")
DOWN_AXES = ("experts", "mlp", "embed")
ROUTED_WEIGHT_AXES = (GATE_UP_AXES, DOWN_AXES)


class ExpertWeights(NamedTuple):
  """SwiGLU experts stacked on a leading expert dim (all experts, or this device's): gate and
  up as one [E, D, 2, F] array (`moe.gate_up_param`), X = 2 (gate, up)."""
  gate_up_EDXF: jax.Array
  down_EFD: jax.Array

  @property
  def n_experts(self) -> int:
    return self.gate_up_EDXF.shape[0]


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
  """Slots per expert for a group of `tokens`: ceil(factor · tokens · k / experts), at most
  `tokens` (a token picks an expert at most once, so more slots are never used)."""
  return max(1, min(tokens, math.ceil(factor * tokens * k / n_experts)))


def ragged_ffn(x_AD: jax.Array, sizes_E: jax.Array, w: ExpertWeights, dtype,
               gemm: GroupedDot = GroupedDot(), wire_AW: jax.Array | None = None) -> jax.Array:
  """SwiGLU of rows sorted by expert (`sizes_E` rows each, in order); rows past sum(sizes_E)
  come out zero. Operands and result in `dtype` (so are the backward's: `jscale.model.matmul`).
  `wire_AW`: the rows as the FP8 wire's bytes, for a grouped matmul that reads them so
  (`GroupedDot.reads_wire`; `jscale.fp8.wire.Encoded`).

  The gate and up products are one grouped matmul against each expert's [gate | up] columns
  (Megatron's fused fc1): the same values, half the launches, and twice the output width, which
  the Hopper kernel tiles better. DeepSeek-V3's experts are 1408 wide = 5.5 x 256, not whole
  CUDA-block tiles: the kernel runs the last 128 columns on 64-column tiles
  (`hopper_config.column_parts`; those ran 477 TFLOP/s forward against 545 at 2816, H200);
  together they are 2816 = 11 x 256, all whole tiles. The parameter holds them so
  (`ExpertWeights.gate_up_EDXF`): the [E, D, 2F] operand is a reshape, no copy."""
  dot = lambda x, m, wire=None: gemm(x, m, sizes_E, dtype, wire)
  x_AD = checkpoint_name(x_AD, "moe_in")
  e, d, _, f = w.gate_up_EDXF.shape
  gate_up_AF = dot(x_AD, w.gate_up_EDXF.reshape(e, d, 2 * f), wire_AW)
  gate_AF, up_AF = jnp.split(gate_up_AF, 2, axis=-1)
  gate_AF, up_AF = checkpoint_name(gate_AF, "mlp_gate"), checkpoint_name(up_AF, "mlp_up")
  return dot(jax.nn.silu(gate_AF) * up_AF, w.down_EFD)


def dense_ffn(x_ECD: jax.Array, w: ExpertWeights, dtype) -> jax.Array:
  """SwiGLU of every expert's slot buffer (a batched matmul over experts)."""
  dot = lambda spec, x, m: matmul.einsum(spec, x, m, dtype)
  x_ECD = checkpoint_name(x_ECD, "moe_in")
  # The pair axis kept (no [E, D, 2F] reshape): under GSPMD F is split over `tensor`.
  gate_up_ECXF = dot("ECD,EDXF->ECXF", x_ECD, w.gate_up_EDXF)
  gate_ECF = checkpoint_name(gate_up_ECXF[:, :, 0], "mlp_gate")
  up_ECF = checkpoint_name(gate_up_ECXF[:, :, 1], "mlp_up")
  return dot("ECF,EFD->ECD", jax.nn.silu(gate_ECF) * up_ECF, w.down_EFD)


@jax.custom_vjp
def permute(x_AD: jax.Array, perm_A: jax.Array, inverse_A: jax.Array) -> jax.Array:
  """x_AD[perm_A] for a permutation perm_A with inverse inverse_A: its transpose is the gather
  g[inverse_A] (XLA would otherwise transpose a gather into a scatter-add)."""
  return x_AD[perm_A]


def _permute_fwd(x, perm, inverse):
  return x[perm], (perm, inverse)


def _permute_bwd(res, g):
  perm, inverse = res
  zero = lambda i: np.zeros(i.shape, jax.dtypes.float0)
  return g[inverse], zero(perm), zero(inverse)


permute.defvjp(_permute_fwd, _permute_bwd)


def inverse_permutation(perm_A: jax.Array) -> jax.Array:
  """inv with inv[perm[i]] = i (an int32 scatter of A indices, no rows)."""
  return jnp.zeros_like(perm_A).at[perm_A].set(jnp.arange(perm_A.shape[0], dtype=perm_A.dtype))


class Sorted(NamedTuple):
  """The T·K assignments (a = token · K + choice) sorted by expert: sorted row r holds
  assignment order_A[r]; assignment a sits at row rank_A[a]."""
  order_A: jax.Array
  rank_A: jax.Array
  expert_A: jax.Array  # by sorted row
  sizes_E: jax.Array
  k: int = 1  # experts per token (the source token of sorted row r is order_A[r] // k)


def sort_by_expert(ids_TK: jax.Array, n_experts: int) -> Sorted:
  """Stable sort of the T·K assignments by expert (ties keep token order). Ids >= n_experts
  ("none": an exchange's rows going nowhere) sort last and are not counted in sizes_E."""
  k = ids_TK.shape[1]
  flat_A = ids_TK.reshape(-1)
  order_A = jnp.argsort(flat_A, stable=True).astype(jnp.int32)
  rank_A = inverse_permutation(order_A)
  sizes_E = jnp.zeros((n_experts,), jnp.int32).at[flat_A].add(1, mode="drop")
  return Sorted(order_A, rank_A, flat_A[order_A], sizes_E, k)


def dispatch_sorted(x_TD: jax.Array, s: Sorted) -> jax.Array:
  """[T·K, D]: each token's copy for each of its experts, in sorted order (gathers only)."""
  t, d = x_TD.shape
  copies_AD = jnp.broadcast_to(x_TD[:, None], (t, s.k, d)).reshape(t * s.k, d)
  return permute(copies_AD, s.order_A, s.rank_A)


def combine_sorted(out_AD: jax.Array, s: Sorted, gate_TK: jax.Array) -> jax.Array:
  """Σ_k gate · expert output back onto the tokens: a gather into [T, K, D] and an fp32
  weighted sum over K (elementwise, fused), in `out_AD`'s dtype."""
  out_AD = checkpoint_name(out_AD, "moe_out")  # the gates' gradient reads it
  out_TKD = permute(out_AD, s.rank_A, s.order_A).reshape(*gate_TK.shape, -1)
  y_TD = jnp.sum(out_TKD.astype(jnp.float32) * gate_TK[..., None], axis=1)
  return y_TD.astype(out_AD.dtype)


def dropless(x_TD: jax.Array, ids_TK, gates_TK, w: ExpertWeights, dtype,
             gemm: GroupedDot = GroupedDot()) -> jax.Array:
  """All experts on this group's tokens, nothing dropped."""
  s = sort_by_expert(ids_TK, w.n_experts)
  out_AD = ragged_ffn(dispatch_sorted(x_TD.astype(dtype), s), s.sizes_E, w, dtype, gemm)
  return combine_sorted(out_AD, s, gates_TK)


def slots(ids_TK: jax.Array, n_experts: int) -> jax.Array:
  """Queue position of each assignment at its expert: first choices of every token (in token
  order) first, then second choices, and so on. Positions >= capacity are dropped."""
  onehot_KTE = jax.nn.one_hot(ids_TK.T, n_experts, dtype=jnp.int32)
  pos_KTE = jnp.cumsum(onehot_KTE.reshape(-1, n_experts), axis=0).reshape(onehot_KTE.shape) - 1
  return jnp.sum(pos_KTE * onehot_KTE, axis=-1).T


def dispatch(x_TD: jax.Array, ids_TK, pos_TK, n_experts: int, cap: int) -> jax.Array:
  """[E, C, D] slot buffer: token t's row at (expert, slot) for every kept assignment."""
  k = ids_TK.shape[1]
  rows_TKD = jnp.broadcast_to(x_TD[:, None], (x_TD.shape[0], k, x_TD.shape[1]))
  buf_ECD = jnp.zeros((n_experts, cap, x_TD.shape[1]), x_TD.dtype)
  return buf_ECD.at[ids_TK, pos_TK].add(rows_TKD, mode="drop")  # slot >= C: dropped


def combine(y_ECD: jax.Array, ids_TK, pos_TK, gates_TK) -> jax.Array:
  """Σ_k gate · y[expert, slot] for the kept assignments; dropped ones add nothing."""
  cap = y_ECD.shape[1]
  y_ECD = checkpoint_name(y_ECD, "moe_out")  # the gates' gradient reads it
  kept_TK = pos_TK < cap
  rows_TKD = y_ECD[ids_TK, jnp.minimum(pos_TK, cap - 1)].astype(jnp.float32)
  w_TK = jnp.where(kept_TK, gates_TK, 0.0)
  # An fp32 weighted sum over the k choices (elementwise: no fp32 matmul in the step).
  return jnp.sum(rows_TKD * w_TK[..., None], axis=1).astype(y_ECD.dtype)


def with_capacity(x_TD: jax.Array, ids_TK, gates_TK, w: ExpertWeights, dtype,
                  factor: float) -> tuple[jax.Array, jax.Array]:
  """Experts with C slots each (one group): (output, number of dropped assignments)."""
  e = w.n_experts
  cap = capacity(x_TD.shape[0], ids_TK.shape[1], e, factor)
  pos_TK = slots(ids_TK, e)
  y_ECD = dense_ffn(dispatch(x_TD.astype(dtype), ids_TK, pos_TK, e, cap), w, dtype)
  return combine(y_ECD, ids_TK, pos_TK, gates_TK), jnp.sum(pos_TK >= cap)
