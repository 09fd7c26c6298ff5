"""The FP8 matmul against plain references: power-of-two scales, quantisation error within each
format's bound, the product and both backward products equal to dequantise-then-multiply
exactly, e5m2 for the output gradient, delayed scaling's histories."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jscale.fp8 import scaling
from jscale.fp8.dot import Recipe, fp8_dot_general
from jscale.fp8.scaling import E4M3, E5M2
from jscale.model import matmul

CURRENT, DELAYED = Recipe(delayed=False), Recipe(delayed=True)
# (format, mantissa bits, smallest normal exponent)
FORMATS = [(E4M3, 3, -6), (E5M2, 2, -14)]


def _is_power_of_two(s) -> bool:
  m, _ = np.frexp(np.float32(s))
  return m == 0.5


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_is_the_smallest_power_of_two_that_fits(fmt, margin):
  top = scaling.format_max(fmt) / 2 ** margin
  amaxes = np.concatenate([np.float32(10.0) ** np.arange(-20, 8, 0.37),  # many binades
                           scaling.format_max(fmt) * np.float32(2.0) ** np.arange(-30, 5)])
  for a in amaxes.astype(np.float32):
    s = float(scaling.scale_for(jnp.float32(a), fmt, margin))
    assert _is_power_of_two(s), (a, s)
    assert a / s <= top and a / (s / 2) > top, (a, s)
  for a in (0.0, np.inf, np.nan):
    assert float(scaling.scale_for(jnp.float32(a), fmt, margin)) == 1.0


@pytest.mark.parametrize("fmt, mantissa, min_exp", FORMATS)
def test_quantisation_error_is_within_the_format_bound(fmt, mantissa, min_exp):
  # Values over ~33 binades below the amax: normals round to within half an ulp (relative
  # 2**-(mantissa+1)), subnormals to within half the subnormal spacing (absolute).
  x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) *
                  10.0 ** np.random.default_rng(1).uniform(-10, 0, 4096), jnp.float32)
  s = scaling.scale_for(scaling.amax(x), fmt)
  q = scaling.quantize(x, s, fmt)
  assert q.dtype == fmt
  err = np.abs(np.asarray(scaling.dequantize(q, s, jnp.float32) - x))
  xs = np.abs(np.asarray(x / s))
  normal = xs >= 2.0 ** min_exp
  rel = 2.0 ** -(mantissa + 1)
  assert np.all(err[normal] <= rel * np.abs(np.asarray(x))[normal])
  assert np.all(err[~normal] <= float(s) * 2.0 ** (min_exp - mantissa - 1))
  assert normal.sum() > 100 and (~normal).sum() > 100  # both regimes were exercised
  # Saturation instead of inf / NaN when a (delayed) scale is too small.
  assert float(scaling.dequantize(scaling.quantize(x * 1e3, s, fmt), s, jnp.float32).max()) \
      == scaling.format_max(fmt) * float(s)


def _fake_quant(x, fmt, scale):
  """The reference: quantise, dequantise to fp32."""
  return scaling.dequantize(scaling.quantize(x, scale, fmt), scale, jnp.float32)


def _scale(x, fmt):
  return scaling.scale_for(scaling.amax(x), fmt)


SPECS = ["BLD,DF->BLF", "BLD,DHK->BLHK", "BLHK,HKD->BLD", "BIJ,BJK->BIK"]
SHAPES = {"B": 2, "L": 8, "D": 32, "F": 48, "H": 4, "K": 8, "I": 8, "J": 16}


def _operands(spec, seed=0):
  a, b = spec.split("->")[0].split(",")
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, [SHAPES[c] for c in a], jnp.float32).astype(jnp.bfloat16)
  w = (0.05 * jax.random.normal(k2, [SHAPES[c] for c in b], jnp.float32)).astype(jnp.bfloat16)
  return x, w


def _fp8_einsum(spec, x, w, recipe=CURRENT, histories=None):
  dims, perm = matmul._contraction(spec)  # pylint: disable=protected-access
  y = fp8_dot_general(x, w, dims, recipe, histories=histories)
  return y if perm is None else jnp.transpose(y, perm)


@functools.partial(jax.jit, static_argnums=0)
def _product_and_references(spec, x, w, g):
  sx, sw = _scale(x, E4M3), _scale(w, E4M3)
  fx, fw = _fake_quant(x, E4M3, sx), _fake_quant(w, E4M3, sw)
  y, pullback = jax.vjp(lambda x, w: _fp8_einsum(spec, x, w), x, w)
  ref, ref_pullback = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), fx, fw)
  # The reference's backward products take the gradient fake-quantised to e5m2 ...
  got = (y, *pullback(g))
  want = (ref.astype(x.dtype),
          *(r.astype(x.dtype) for r in ref_pullback(_fake_quant(g, E5M2, _scale(g, E5M2)))))
  # ... and to e4m3 it would not give the same dx (e5m2 is really used).
  e4m3_dx = ref_pullback(_fake_quant(g, E4M3, _scale(g, E4M3)))[0].astype(x.dtype)
  return got, want, e4m3_dx


@pytest.mark.parametrize("spec", SPECS)
def test_fp8_product_and_its_gradients_equal_fake_quant_references_exactly(spec):
  x, w = _operands(spec)
  y_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
  g = jax.random.normal(jax.random.key(7), y_shape, jnp.float32).astype(jnp.bfloat16) * 1e-3
  got, want, e4m3_dx = _product_and_references(spec, x, w, g)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert not np.array_equal(np.asarray(got[1], np.float32), np.asarray(e4m3_dx, np.float32))


def test_every_product_takes_fp8_operands_in_the_lowered_program():
  x, w = _operands("BLD,DF->BLF")

  def loss(x, w):
    return _fp8_einsum("BLD,DF->BLF", x, w).astype(jnp.float32).sum()

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
  pairs = sorted(line.split(":")[-1].split("->")[0].strip()
                 for line in text.splitlines() if "stablehlo.dot_general" in line)
  assert pairs == sorted([  # forward, dx, dw: the three pairs cuBLASLt's FP8 gemm accepts
      "(tensor<2x8x32xf8E4M3FN>, tensor<32x48xf8E4M3FN>)",
      "(tensor<2x8x48xf8E5M2>, tensor<32x48xf8E4M3FN>)",
      "(tensor<2x8x32xf8E4M3FN>, tensor<2x8x48xf8E5M2>)"]), pairs


def test_delayed_scaling_reads_the_history_and_returns_it_updated():
  spec = "BLD,DF->BLF"
  x, w = _operands(spec)
  n = 4
  # A history whose max (16) is far above this step's amax: the scale comes from it.
  hist = (jnp.array([1.0, 16.0, 0.0, 0.0]), jnp.array([0.5, 0.0, 0.0, 0.0]),
          jnp.array([2e-3, 0.0, 0.0, 0.0]))
  y = _fp8_einsum(spec, x, w, DELAYED, hist)
  sx, sw = scaling.scale_for(16.0, E4M3), scaling.scale_for(0.5, E4M3)
  assert float(sx) != float(_scale(x, E4M3))
  want = jnp.einsum(spec, _fake_quant(x, E4M3, sx), _fake_quant(w, E4M3, sw)).astype(x.dtype)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))

  g = jnp.full(y.shape, 1e-3, jnp.bfloat16)
  _, pullback = jax.vjp(lambda x, w, h: _fp8_einsum(spec, x, w, DELAYED, h), x, w, hist)
  new = pullback(g)[2]  # the histories' "cotangents" are their new values
  for h, old, cur in zip(new, hist, (scaling.amax(x), scaling.amax(w), scaling.amax(g))):
    assert h.shape == (n,)
    np.testing.assert_array_equal(np.asarray(h), np.concatenate([[cur], np.asarray(old)[:-1]]))

  # An empty (first-step) history falls back to this step's amax: current scaling.
  zeros = tuple(jnp.zeros(n) for _ in range(3))
  np.testing.assert_array_equal(np.asarray(_fp8_einsum(spec, x, w, DELAYED, zeros), np.float32),
                                np.asarray(_fp8_einsum(spec, x, w), np.float32))
