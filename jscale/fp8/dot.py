"""The FP8 matmul: a `jax.lax.dot_general` with e4m3 operands forward and an e5m2 output
gradient backward, per-tensor scales, fp32 accumulation, the result in the compute dtype.

  forward    y  = (q(x) . q(w)) * sx * sw              q(x) = x / sx in e4m3, likewise w
  backward   dx = (q(g) . q(w)^T) * sg * sw            q(g) = g / sg in e5m2
             dw = (q(x)^T . q(g)) * sx * sg

Every product takes FP8 operands in the lowered program (`stablehlo.dot_general` of f8E4M3FN /
f8E5M2 tensors); XLA's GPU compiler turns such a dot and the multiply by the scales that
follows into one cuBLASLt FP8 gemm on Hopper (`__cublas$lt$matmul$f8`), and upcasts elsewhere.
The pairs are e4m3 x e4m3, e5m2 x e4m3 and e4m3 x e5m2: the three cuBLASLt accepts.

Its three products run under the named scope `GEMM_SCOPE`, which the lowered program's
metadata carries: XLA:GPU compiled without a GPU forms no cuBLASLt FP8 gemm and upcasts
(sometimes dropping the e4m3 rounding as excess precision), and `jscale.predict` finds the
FP8 products by that name to time them as a GPU runs them.

Scales come from amaxes: this step's (`Recipe.delayed=False`) or the previous steps' histories
(delayed), which then ride through the custom_vjp as inputs whose "cotangents" are their
updated values (Flax's overwrite-with-gradient): the step reads the new histories out of the
gradient, with no side channel and no host sync. `amax` reduces a tensor's max |x| over the
devices holding its shards (the model's seam: identity on global arrays, a pmax in manual mode).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jscale.fp8 import scaling
from jscale.fp8.scaling import E4M3, E5M2

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
# The named scope of the three FP8 products (module docstring).
GEMM_SCOPE = "fp8_gemm"
# (x, w, g) amax histories, newest first; None under current scaling.
Histories = tuple[jax.Array, jax.Array, jax.Array] | None


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How scales are chosen: `delayed` (from amax histories) or current; `margin`: a scale leaves
  2**margin headroom below the format's max."""
  delayed: bool = True
  margin: int = 0

  def scale(self, current: jax.Array, history: jax.Array | None, fmt) -> jax.Array:
    amax = scaling.delayed_amax(history, current) if self.delayed else current
    return scaling.scale_for(amax, fmt, self.margin)


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Dims, recipe: Recipe,
                    amax: Callable[[jax.Array], jax.Array] = scaling.amax,
                    histories: Histories = None) -> jax.Array:
  """`lax.dot_general(lhs, rhs, dimension_numbers)` in FP8 (module docstring), in lhs's dtype.
  Differentiating it with respect to `histories` gives their updated values."""
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"fp8_dot_general: operands in one compute dtype, got {lhs.dtype}, "
                     f"{rhs.dtype}")
  return _fp8_dot(dimension_numbers, recipe, amax, lhs, rhs, histories)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_dot(dims, recipe, amax, lhs, rhs, histories):
  return _forward(dims, recipe, amax, lhs, rhs, histories)[0]


def _forward(dims, recipe, amax, lhs, rhs, histories):
  hx, hw, _ = histories if histories is not None else (None,) * 3
  ax, aw = amax(lhs), amax(rhs)
  sx, sw = recipe.scale(ax, hx, E4M3), recipe.scale(aw, hw, E4M3)
  qx, qw = scaling.quantize(lhs, sx, E4M3), scaling.quantize(rhs, sw, E4M3)
  with jax.named_scope(GEMM_SCOPE):
    y = jax.lax.dot_general(qx, qw, dims, preferred_element_type=jnp.float32)
  # The FP8 residuals travel as their bytes: under a remat policy that saves them, JAX rounds
  # every saved float with reduce_precision(finfo(dtype)), which for e4m3fn (no infinities)
  # turns the top binade (256..448) into inf / NaN.
  bytes_ = tuple(jax.lax.bitcast_convert_type(q, jnp.uint8) for q in (qx, qw))
  return (y * (sx * sw)).astype(lhs.dtype), (*bytes_, sx, sw, ax, aw, histories)


def _bwd(dims, recipe, amax, res, g):
  qx, qw, sx, sw, ax, aw, histories = res
  qx, qw = (jax.lax.bitcast_convert_type(q, E4M3) for q in (qx, qw))
  ag = amax(g)
  sg = recipe.scale(ag, None if histories is None else histories[2], E5M2)
  qg = scaling.quantize(g, sg, E5M2)
  with jax.named_scope(GEMM_SCOPE):
    dx_ = _lhs_cotangent(qg, qw, dims, qx.ndim, g.dtype)
    dw_ = _rhs_cotangent(qx, qg, dims, qw.ndim, g.dtype)
  dx = dx_ * (sg * sw).astype(g.dtype)
  dw = dw_ * (sx * sg).astype(g.dtype)
  if histories is None:
    return dx, dw, None
  return dx, dw, tuple(scaling.push(h, a) for h, a in zip(histories, (ax, aw, ag)))


_fp8_dot.defvjp(_forward, _bwd)


def _free(ndim: int, *used) -> list[int]:
  return [i for i in range(ndim) if not any(i in u for u in used)]


def _lhs_cotangent(g, rhs, dims, lhs_ndim, dtype):
  """dlhs = g . rhs^T (dot_general's transpose rule): g's rhs-free dims against rhs's."""
  (lc, rc), (lb, rb) = dims
  lfree, rfree = _free(lhs_ndim, lc, lb), _free(rhs.ndim, rc, rb)
  g_rfree = tuple(range(len(lb) + len(lfree), len(lb) + len(lfree) + len(rfree)))
  out = jax.lax.dot_general(g, rhs, ((g_rfree, tuple(rfree)), (tuple(range(len(lb))), rb)),
                            preferred_element_type=dtype)
  # out's dims: batch, lhs-free, then rhs's contracting dims in rhs order (= lhs's, paired)
  order = list(lb) + lfree + [lc[i] for i in np.argsort(rc)]
  return jax.lax.transpose(out, tuple(np.argsort(order)))


def _rhs_cotangent(lhs, g, dims, rhs_ndim, dtype):
  """drhs = lhs^T . g: lhs's free dims against g's lhs-free dims."""
  (lc, rc), (lb, rb) = dims
  lfree = _free(lhs.ndim, lc, lb)
  g_lfree = tuple(range(len(lb), len(lb) + len(lfree)))
  out = jax.lax.dot_general(lhs, g, ((tuple(lfree), g_lfree), (lb, tuple(range(len(lb))))),
                            preferred_element_type=dtype)
  # out's dims: batch, lhs's contracting dims in lhs order (= rhs's, paired), rhs-free
  order = list(rb) + [rc[i] for i in np.argsort(lc)] + _free(rhs_ndim, rc, rb)
  return jax.lax.transpose(out, tuple(np.argsort(order)))
