"""The model's matmuls in the compute dtype, forward and backward, and the few fp32 on purpose.

Mixed precision as the hardware does it: operands in the compute dtype (bf16), the products
accumulated in fp32 by the tensor cores, the result rounded to the compute dtype. Asking XLA
for an fp32 result (`preferred_element_type=float32`) and casting it back would make the
backward's cotangent fp32, and JAX's transpose rules would then run both backward products (dx
and dW) with fp32 operands: TF32 gemms at half rate plus converts (measured on one H100:
62% of the GPU time of a llama3_1b step, `results/h100_measured/`).

  * `einsum`: a linear layer's matmul; result in the compute dtype.
  * `einsum_f32`: an fp32 result where a softmax reads it (attention scores, logits), with a
    backward that casts the cotangent to the operands' dtype first, so dx and dW still multiply
    in the compute dtype (FlashAttention does the same with dS).
  * `FP32_MATMULS`: the matmuls that take fp32 operands on purpose, each with its reason; they
    run under `fp32_scope(name)`, whose name the lowered program's locations carry
    (`jscale.analysis.dots` reads them; tests/model/test_precision.py allows only these).
  * `FP32_ELEMENTWISE`: where else the step computes in fp32 on purpose (no matmul).

Both einsums take `dot_general` (default `jax.lax.dot_general`): the hook a low-precision matmul
plugs into, forward and backward (FP8: `jscale.fp8`). A model's linear layers pick theirs with
`for_linear(dot_general, name)`, so the hook may also be a per-layer factory; a layer's product
may keep state between steps (`DotState` variables, e.g. FP8's amax histories) and reduce over
devices through the model's seam (`on_seam`). `einsum_f32`'s hook (the head, attention scores)
must be a pure, hashable function: its custom_vjp takes it as a static argument.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

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


class DotState(nnx.Variable):
  """State a linear layer's product keeps between steps (FP8's amax histories). Not a parameter:
  the optimizer never sees it; the train step takes its new value from the backward (the
  product's custom_vjp returns it as the state's cotangent). Stacked and scanned with its layer;
  the train state holds it as `dot_state`."""


def for_linear(dot_general: Any, name: str) -> Any:
  """The product of the linear layer whose weight is `name`: `dot_general` itself, or, if it is a
  per-layer factory (has `for_linear`, e.g. `jscale.fp8.linears.Fp8Linears`), what it builds
  for that layer (a function, or an nnx.Module holding `DotState`)."""
  build = getattr(dot_general, "for_linear", None)
  return build(name) if build is not None else dot_general


def for_experts(dot_general: Any) -> Any:
  """The routed experts' per-tile products (`grouped_tiles.tile_products`'s signature) if the
  model's `dot_general` is a factory that gives them (`for_experts`, e.g. FP8 experts:
  `jscale.fp8.grouped`), else None: the plain products."""
  build = getattr(dot_general, "for_experts", None)
  return build() if build is not None else None


def for_expert_kernel(dot_general: Any) -> Any:
  """The routed experts' whole grouped matmul on the Hopper kernel (`grouped_matmul`'s
  signature) if the model's `dot_general` gives one (`for_expert_kernel`, e.g. FP8 experts
  scaled per row: `jscale.fp8.grouped_kernel`), else None: the kernel in bf16."""
  build = getattr(dot_general, "for_expert_kernel", None)
  return build() if build is not None else None


def expert_columns_e4m3(dot_general: Any) -> bool:
  """Whether the routed experts' forward products quantise each weight column to e4m3 (FP8
  experts scaled per row, `dot_general`'s `expert_columns_e4m3`): then the forward may gather
  the weights so (`jscale.fp8.weight_columns`), the values its products take."""
  return bool(getattr(dot_general, "expert_columns_e4m3", False))


def on_seam(dot_general: Any, seam: Any) -> DotGeneral:
  """A layer's product as a plain dot_general for one call: a product that reduces over the
  devices holding its operands' shards (FP8's amaxes; it has `on(seam)`) is bound to the seam."""
  bind = getattr(dot_general, "on", None)
  return bind(seam) if bind is not None else dot_general


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype,
           dot_general: DotGeneral = jax.lax.dot_general) -> jax.Array:
  """`jnp.einsum(spec, x, w)` with both operands cast to the compute `dtype`; the result is in
  `dtype` (accumulated in fp32 by the hardware), and so is the backward's cotangent. The
  product is one `dot_general(x, w, dimension_numbers)`, forward and backward."""
  return contract(spec, x.astype(dtype), w.astype(dtype), dot_general)


def contract(spec: str, a: jax.Array, b: jax.Array, dot_general: DotGeneral = jax.lax.dot_general,
             preferred_element_type=None) -> jax.Array:
  """`jnp.einsum(spec, a, b)` as one call of `dot_general` (the model's hook; JAX's einsum takes
  one only through a private argument), then the transpose to the spec's output order."""
  dims, transpose = _contraction(spec)
  y = dot_general(a, b, dims, preferred_element_type=preferred_element_type)
  return y if transpose is None else jnp.transpose(y, transpose)


@functools.lru_cache(maxsize=None)
def _contraction(spec: str):
  """An einsum of two operands as dot_general dimension numbers and the permutation from the
  dot's output order (batch, lhs-free, rhs-free) to the spec's (None: already in order)."""
  ins, out = spec.replace(" ", "").split("->")
  a, b = ins.split(",")
  if len(set(a)) < len(a) or len(set(b)) < len(b) or not set(out) <= set(a) | set(b) or \
      (set(a) ^ set(b)) - set(out):
    raise ValueError(f"einsum {spec!r}: a linear layer contracts two operands (no traces, "
                     "no summed-away free indices)")
  contract = [c for c in a if c in b and c not in out]
  batch = [c for c in a if c in b and c in out]
  dims = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
          (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
  got = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
  return dims, None if got == list(out) else tuple(got.index(c) for c in out)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array, dtype,
               dot_general: DotGeneral = jax.lax.dot_general) -> jax.Array:
  """`einsum` with an fp32 result (scores, logits); its backward multiplies in `dtype`."""
  return _einsum_f32(spec, dot_general, a.astype(dtype), b.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum_f32(spec: str, dot_general: DotGeneral, a: jax.Array, b: jax.Array) -> jax.Array:
  return contract(spec, a, b, dot_general, preferred_element_type=jnp.float32)


def _einsum_f32_fwd(spec, dot_general, a, b):
  return _einsum_f32(spec, dot_general, a, b), (a, b)


def _einsum_f32_bwd(spec, dot_general, res, g):
  a, b = res
  _, pullback = jax.vjp(lambda a, b: contract(spec, a, b, dot_general), a, b)
  return pullback(g.astype(a.dtype))


_einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)
