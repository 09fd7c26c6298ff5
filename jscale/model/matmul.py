"""The model's matmuls in the compute dtype, forward and backward, and the few fp32 on purpose.

Mixed precision as the hardware does it: operands in the compute dtype (bf16), the products
accumulated in fp32 by the tensor cores, the result rounded to the compute dtype. Asking XLA
for an fp32 result (`preferred_element_type=float32`) and casting it back would make the
backward's cotangent fp32, and JAX's transpose rules would then run both backward products (dx
and dW) with fp32 operands: TF32 gemms at half rate plus converts (measured on one H100:
62% of the GPU time of a llama3_1b step, `shared/measurements`).

  * `einsum`: a linear layer's matmul; result in the compute dtype.
  * `einsum_f32`: an fp32 result where a softmax reads it (attention scores, logits), with a
    backward that casts the cotangent to the operands' dtype first, so dx and dW still multiply
    in the compute dtype (FlashAttention does the same with dS).
  * `FP32_MATMULS`: the matmuls that take fp32 operands on purpose, each with its reason; they
    run under `fp32_scope(name)`, whose name the lowered program's locations carry
    (`jscale.analysis.dots` reads them; tests/test_precision.py allows only these).
  * `FP32_ELEMENTWISE`: where else the step computes in fp32 on purpose (no matmul).

Both einsums take `dot_general` (default `jax.lax.dot_general`, jnp.einsum's own): the hook a
low-precision matmul (FP8: scaled casts around the product) plugs into, forward and backward.
It must be a pure, hashable function: jnp.einsum is jitted with it as a static argument, so it
is traced once per distinct einsum signature, not once per call.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

# jax.lax.dot_general's signature: (lhs, rhs, dimension_numbers, precision=None,
# preferred_element_type=None, out_sharding=None) -> Array.
DotGeneral = Callable[..., jax.Array]

FP32_MATMULS: dict[str, str] = {
    "router": "MoE router logits: top-k choices and the z-loss's logsumexp² flip or blow up "
              "under bf16 rounding of logits; [tokens, d_model] x [d_model, experts] is tiny.",
}
FP32_ELEMENTWISE: dict[str, str] = {
    "softmax": "attention scores and their softmax / log-sum-exp statistics (xla impl, ring "
               "blocks, flash kernels): exp() of bf16-rounded scores loses ~3 digits.",
    "rms_norm": "RMSNorm's mean of squares and rsqrt (HF LlamaRMSNorm semantics).",
    "loss": "logits, log-sum-exp and the token losses; sums over tokens and micro-batches.",
    "gradients": "gradient accumulation over micro-batches, ZeRO reductions, the optimizer "
                 "(fp32 master weights and Adam moments).",
}
SCOPE_PREFIX = "fp32_"


def fp32_scope(name: str):
  """The named scope of an fp32-on-purpose matmul listed in `FP32_MATMULS`."""
  if name not in FP32_MATMULS:
    raise KeyError(f"{name!r} is not in FP32_MATMULS: list it there with its reason")
  return jax.named_scope(SCOPE_PREFIX + name)


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype,
           dot_general: DotGeneral = jax.lax.dot_general) -> jax.Array:
  """`jnp.einsum(spec, x, w)` with both operands cast to the compute `dtype`; the result is in
  `dtype` (accumulated in fp32 by the hardware), and so is the backward's cotangent. The
  product is `dot_general`'s (jnp.einsum's contraction hook), forward and backward."""
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), _dot_general=dot_general)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array, dtype,
               dot_general: DotGeneral = jax.lax.dot_general) -> jax.Array:
  """`einsum` with an fp32 result (scores, logits); its backward multiplies in `dtype`."""
  return _einsum_f32(spec, dot_general, a.astype(dtype), b.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum_f32(spec: str, dot_general: DotGeneral, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, _dot_general=dot_general)


def _einsum_f32_fwd(spec, dot_general, a, b):
  return _einsum_f32(spec, dot_general, a, b), (a, b)


def _einsum_f32_bwd(spec, dot_general, res, g):
  a, b = res
  _, pullback = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, _dot_general=dot_general), a, b)
  return pullback(g.astype(a.dtype))


_einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)
