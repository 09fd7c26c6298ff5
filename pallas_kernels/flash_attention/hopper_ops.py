"""The Hopper attention kernels' products and register layouts: compiled, or interpreted.

Compiled, a product is a warpgroup MMA (wgmma) into an fp32 accumulator, and values live in
the wgmma register layout (vectors per row or per column of a tile: `Layout.WGMMA.reduce`).
JAX's Mosaic GPU interpreter (jax 0.10) cannot run those pieces: it has no `run_state` (the
accumulator carried through a loop), no wgmma with an operand in registers or read transposed
from shared memory, and no layout casts or layout-annotated loads. `Ops(interpret=True)`
computes the same products with `lax.dot_general` on the loaded values (bf16 operands, fp32
results, as wgmma) and drops the layouts. Everything else the kernels do runs as compiled in
the interpreter: TMA copies, barriers and their phases, the memory warpgroup, the compute
warpgroups' ping-pong schedule, masks, causal block skipping, GQA indexing, segment ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Mosaic GPU's accumulator ref, not in its module's __all__.
_ACC = plgpu.ACC  # pyright: ignore[reportPrivateImportUsage]


def _value(x):
  """A shared-memory ref's contents, or x itself when it already is a value."""
  # jax.ref is loaded lazily by JAX: its type stubs do not name it.
  abstract_ref = jax.ref.AbstractRef  # pyright: ignore[reportAttributeAccessIssue]
  if hasattr(x, "transforms") or isinstance(getattr(x, "aval", None), abstract_ref):
    return x[...]
  return x


def _dot(a, b, transpose_b: bool):
  contract = (((1,), (1 if transpose_b else 0,)), ((), ()))
  return lax.dot_general(_value(a), _value(b), contract, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Ops:
  """Products, zeros, vectors and masks of the Hopper kernels; `interpret` picks the forms
  JAX's GPU interpreter runs (module docstring)."""
  interpret: bool = False

  def product(self, shape, a_ref, b_ref, transpose_b: bool, issued=None):
    """fp32 [m, n] = a @ b (b read transposed when `transpose_b`), both shared-memory refs.
    `issued()` runs once the product is issued (compiled, before waiting for it)."""
    if self.interpret:
      out = _dot(a_ref, b_ref, transpose_b)
      if issued is not None:
        issued()
      return out

    def body(acc_ref):
      plgpu.wgmma(acc_ref, a_ref, plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref)
      if issued is not None:
        issued()
      return acc_ref[...]
    return pl.run_scoped(body, _ACC(shape, jnp.float32))

  def accumulate(self, accs, operands, issued=None) -> tuple[Any, ...]:
    """[acc + a @ b] for each acc and (a, b_ref, transpose_b) of `operands` (a in registers
    or shared memory): one wgmma group compiled (a single wait). `issued()` as in product."""
    if self.interpret:
      out = tuple(acc + _dot(a, b, t) for acc, (a, b, t) in zip(accs, operands))
      if issued is not None:
        issued()
      return out

    def body(refs):
      for ref, (a, b, t) in zip(refs, operands):
        plgpu.wgmma(ref, a, plgpu.transpose_ref(b, (1, 0)) if t else b)
      if issued is not None:
        issued()
    out = pl.run_state(body)(tuple(_ACC.init(acc) for acc in accs))
    return tuple(out)

  def zeros(self, shape, value: float = 0.0):
    """fp32 `value`s: a [m, n] accumulator tile, or a [m] per-row vector of one."""
    x = jnp.full(shape, value, jnp.float32)
    if self.interpret:
      return x
    layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
    return plgpu.layout_cast(x, layout)

  def vector(self, ref, axis: int, optimized: bool = True):
    """All of `ref` as one value per row (axis 0) or per column (axis 1) of a wgmma tile."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1 - axis), optimized=optimized)

  # HBM vectors take plain per-thread loads (optimized=False): Mosaic GPU has no optimised
  # load of these layouts, and they are once per tile (or a few bytes per step).
  def row_vector(self, ref, start, n: int):
    """ref[start:start + n] (HBM) laid out as one value per row of a [n, *] wgmma tile."""
    return self.vector(ref.at[pl.ds(start, n)], 0, optimized=False)

  def col_vector(self, ref, start, n: int):
    """ref[start:start + n] (HBM) laid out as one value per column of a [*, n] wgmma tile."""
    return self.vector(ref.at[pl.ds(start, n)], 1, optimized=False)

  def iota(self, shape, dim: int):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

  def mask(self, shape, row_start, col_start, causal: bool, row_seg=None, col_seg=None,
           rows_are_q: bool = True):
    """[rows, cols] visibility of keys to queries in a wgmma-layout tile, or None when all
    visible. Rows are queries (cols keys) unless `rows_are_q` is False (the transposed tiles
    of the dK/dV kernel). row_seg / col_seg: segment ids per row / column (row_vector /
    col_vector)."""
    visible = None
    if causal:
      rows = self.iota(shape, 0) + row_start
      cols = self.iota(shape, 1) + col_start
      visible = rows >= cols if rows_are_q else cols >= rows
    if row_seg is not None:
      same = (lax.broadcast_in_dim(row_seg, shape, [0])
              == lax.broadcast_in_dim(col_seg, shape, [1]))
      visible = same if visible is None else visible & same
    return visible
