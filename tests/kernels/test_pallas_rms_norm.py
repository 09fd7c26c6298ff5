"""Pallas fused RMSNorm (interpret mode on CPU) against the plain-jnp reference and the model's
RMSNorm. fp32 must match to 1e-5 of the reference's largest value; bf16 outputs to one bf16
rounding of the same formula, bf16 gradients to 2e-2 of fp32 math on the same inputs.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import norm_check
from close import assert_close
from norm_check import normal as _normal
from pallas_kernels.rms_norm import BlockSizes, rms_norm


# (shape, dtype, weight dtype, residual, block sizes): 21 and 132 rows are not multiples of
# their row blocks (masked rows); D = 96 is not a power of two (masked columns).
CASES = {
    "f32_rows21_d96_masked": ((3, 7, 96), jnp.float32, jnp.float32, False,
                              BlockSizes(block_rows=8, block_rows_bwd=4)),
    "f32_residual_rows128_d128": ((2, 64, 128), jnp.float32, jnp.float32, True,
                                  BlockSizes(block_rows=16, block_rows_bwd=8)),
    "bf16_residual_rows132_d256_defaultblocks": ((4, 33, 256), jnp.bfloat16, jnp.float32, True,
                                                 BlockSizes()),
    "bf16_bf16weight_rows10_d64": ((10, 64), jnp.bfloat16, jnp.bfloat16, False,
                                   BlockSizes(block_rows=4, block_rows_bwd=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients(case):
  shape, dtype, w_dtype, with_residual, blocks = CASES[case]
  kernel_fn = lambda x, w, res: rms_norm(x, w, eps=1e-5, residual_ND=res, block_sizes=blocks,
                                         interpret=True)
  norm_check.check(case, kernel_fn, shape, dtype, w_dtype, with_residual)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_model_rmsnorm(dtype):
  """Drop-in for jscale.model.layers.RMSNorm: same values (fp32 master weight, `dtype` compute)."""
  from jscale.model.layers import RMSNorm
  rng = np.random.default_rng(1)
  x = _normal(rng, (2, 16, 128), dtype)
  norm = RMSNorm(128, 1e-5, dtype, jnp.float32)
  norm.scale[...] = _normal(rng, (128,), jnp.float32, mean=1.0, std=0.2)
  got = rms_norm(x, norm.scale[...], eps=1e-5, interpret=True)
  want = norm(x)
  assert got.dtype == want.dtype
  assert_close(f"model RMSNorm {jnp.dtype(dtype).name}", got, want,
                1e-6 if dtype == jnp.float32 else 1e-2)


def test_bad_arguments_rejected():
  x = jnp.zeros((4, 64))
  with pytest.raises(ValueError, match=r"weight \(32,\) must be \[D\]"):
    rms_norm(x, jnp.ones(32), interpret=True)
  with pytest.raises(ValueError, match="residual .* must match x"):
    rms_norm(x, jnp.ones(64), residual_ND=x.astype(jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
    rms_norm(x, jnp.ones(64), block_sizes=BlockSizes(block_rows=3), interpret=True)
