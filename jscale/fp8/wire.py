"""FP8 rows on the wire: DeepSeek-V3's FP8 dispatch (`model.moe.dispatch_dtype: e4m3`).

The rows an expert exchange sends out travel as e4m3 with a power-of-two scale per row, packed
into one byte array so one all-to-all carries both:

  encode   q[r] = x[r] / s[r] in e4m3,   s[r] = scale_for(max_d |x[r, d]|)
           bytes[r] = q[r] (D bytes) ++ s[r] (4 bytes, fp32)          [S, D] -> u8[S, D + 4]
  decode   x'[r] = q[r] * s[r]                                        in the compute dtype

A row of D bf16 values (2·D bytes) goes out as D + 4 bytes. DeepSeek-V3 scales 1×128 blocks
of each row; a scale per row is the one the routed experts' FP8 products take
(`fp8.experts_scaling: row`, `jscale.fp8.grouped.scales_along`), and re-quantising a decoded
row that way is exact: its amax is max|q|·s with max|q| in [224, 448], so its scale is s (or
s/2 when max|q| rounded down to 224, and 2q is on the e4m3 grid too). With them the FP8
dispatch adds no rounding. Zero bytes decode to a zero row (scale 0), so a receive buffer's
untouched rows read as zeros.

The dispatch's transpose sends the inputs' gradients back in the compute dtype (DeepSeek-V3's
combine and its backward are bf16 too), so the gradient passes straight through the forward's
rounding, as an FP8 product's does, unless asked otherwise (`model.moe.combine_grad_dtype:
e4m3`, not DeepSeek-V3's: rounded per row and hop, each token's gradient then summed over its
rows in fp32). The backward's rows to the experts (the outputs'
gradients, the combine's transpose) travel through a wire of their own where asked
(`model.moe.dispatch_grad_dtype: e4m3`, as DeepSeek-V3 sends them): those are rounded. So do
the experts' outputs on their way back where asked (`model.moe.combine_dtype: e4m3`; not
DeepSeek-V3's, which keeps the combine in bf16, and not exact: the outputs were never e4m3,
so each hop rounds them to 3 mantissa bits), their gradient straight through. `Wires` holds
the four.

Rows that arrived in e4m3 need not be decoded to be used (`Encoded`: the decoded rows for
autodiff beside the bytes they came as): the node-limited exchange's relay sends hop 1's bytes
on to hop 2 as they are, and the experts' FP8 product on the Hopper kernel reads its e4m3
operand and row scales from them (`jscale.fp8.grouped_kernel`). Both are exact: encoding a
decoded row gives back its values (above), so the rows a relay re-encoded and the operand a
product re-quantised are those it was sent.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jscale.fp8 import grouped, scaling
from jscale.fp8.scaling import E4M3

_SCALE_BYTES = 4  # one fp32 scale per row


@dataclasses.dataclass(frozen=True)
class Wire:
  """How [S, D] rows of `dtype` travel: `encode` to bytes, `decode` back (module docstring)."""
  dtype: jnp.dtype

  def encode(self, x_SD: jax.Array) -> jax.Array:
    """u8[S, D + 4]: each row in e4m3 with its fp32 scale's bytes after it."""
    s_S1 = grouped.scales_along(x_SD, 1, E4M3)
    q_SD = jax.lax.bitcast_convert_type(scaling.quantize(x_SD, s_S1, E4M3), jnp.uint8)
    s_S4 = jax.lax.bitcast_convert_type(s_S1[:, 0], jnp.uint8)
    return jnp.concatenate([q_SD, s_S4], axis=1)

  def decode(self, b_SW: jax.Array) -> jax.Array:
    """[S, D] in `dtype` from `encode`'s bytes (zero bytes: a zero row)."""
    return scaling.dequantize(*split(b_SW), self.dtype)


def split(b_SW: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(e4m3 [S, D], fp32 scales [S, 1]) of `Wire.encode`'s bytes: the values it carries are
  their product."""
  q_SD = jax.lax.bitcast_convert_type(b_SW[:, :-_SCALE_BYTES], E4M3)
  s_S = jax.lax.bitcast_convert_type(b_SW[:, -_SCALE_BYTES:], jnp.float32)
  return q_SD, s_S[:, None]


class Encoded(NamedTuple):
  """Rows that came over a `Wire`: `rows` decoded ([S, D], differentiable) and the `bytes`
  (u8[S, D + 4], no gradient) they came as, for a consumer that takes them so (module
  docstring). A consumer that does not reads `rows`; the decode runs only where one does."""
  rows: jax.Array
  bytes: jax.Array

  def astype(self, dtype) -> "Encoded":
    return Encoded(self.rows.astype(dtype), self.bytes)

  def take(self, rows: Callable[[jax.Array], jax.Array], index_S: jax.Array,
           real_S: jax.Array) -> "Encoded":
    """`rows(self.rows)` (a differentiable gather of rows `index_S`), the bytes gathered
    alike (zero bytes, a zero row, where not `real_S`)."""
    b = jnp.take(self.bytes, index_S, axis=0, mode="clip")
    return Encoded(rows(self.rows), jnp.where(real_S[:, None], b, jnp.zeros((), b.dtype)))


def rows_of(x: "jax.Array | Encoded") -> jax.Array:
  """The decoded rows of `x` (an array: itself)."""
  return x.rows if isinstance(x, Encoded) else x


@dataclasses.dataclass(frozen=True)
class Wires:
  """How an expert exchange's rows travel (None: as they are, in the compute dtype): `out` the
  rows to the experts, `out_grad` the outputs' gradients to the experts in the backward,
  `back` the experts' outputs returning (the combine), `back_grad` the inputs' gradients
  returning in the backward (the dispatch's transpose)."""
  out: Wire | None = None
  out_grad: Wire | None = None
  back: Wire | None = None
  back_grad: Wire | None = None


def e4m3_rows(dtype) -> Wire:
  """The FP8 dispatch's wire format for rows of the compute `dtype`."""
  return Wire(jnp.dtype(dtype))
