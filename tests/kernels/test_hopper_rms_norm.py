"""The Hopper (Mosaic GPU) RMSNorm kernels.

On CPU they run in JAX's Mosaic GPU interpreter (shared memory, barriers, bulk copies, the
persistent walk over row slabs), checked against the plain-jnp reference and the portable
kernel on the same inputs, values and gradients; and they lower through Mosaic GPU for the
`cuda` platform at the model's widths (register layouts, bulk copies over 256 elements, the
shared-memory budget are checked there). `norm_impl: pallas` picks them on Hopper only. On an
H100 the same checks run compiled (`test_compiled_on_hopper`, skipped elsewhere).
"""

import jax
import jax.numpy as jnp
import pytest

import norm_check
from conftest import ON_HOPPER, small_config
from jscale import mesh as mesh_lib, runtime
from jscale.model.layers import norm_backend
from pallas_kernels.mosaic_gpu_env import H100_SMS
from pallas_kernels.rms_norm import hopper, hopper_pipeline as hp, rms_norm
from pallas_kernels.rms_norm.hopper import HopperNormBlocks



# (shape, dtype, weight dtype, residual, blocks). Interpret mode runs 2 CUDA blocks, so 6 slabs
# walk 3 steps each (one slab fetched inside the loop), 5 slabs split 3 / 2; D = 384 is three
# 128-element chunks, D = 2048 two 1024-element ones (16-byte bf16 vectors).
CASES = {
    "f32_d256_6slabs": ((12, 256), jnp.float32, jnp.float32, False,
                        HopperNormBlocks(block_rows=2)),
    "bf16_residual_d384_5slabs": ((5, 384), jnp.bfloat16, jnp.float32, True,
                                  HopperNormBlocks(block_rows=1, max_concurrent_steps=3)),
    "bf16_residual_d2048_default_blocks": ((2, 4, 2048), jnp.bfloat16, jnp.float32, True,
                                           HopperNormBlocks()),
    "bf16_bf16weight_d128_1slot": ((8, 128), jnp.bfloat16, jnp.bfloat16, False,
                                   HopperNormBlocks(block_rows=2, max_concurrent_steps=1)),
}


# Compiled on an H100: the model's widths, a row count no default slab size divides evenly
# over the 264 CUDA blocks, bf16 with the residual and without.
COMPILED = {
    "bf16_residual_d2048": ((3, 1000, 2048), jnp.bfloat16, jnp.float32, True, HopperNormBlocks()),
    "bf16_d4096": ((6000, 4096), jnp.bfloat16, jnp.float32, False, HopperNormBlocks()),
    "bf16_residual_d8192": ((1234, 8192), jnp.bfloat16, jnp.float32, True, HopperNormBlocks()),
    "f32_d2048": ((4096, 2048), jnp.float32, jnp.float32, False, HopperNormBlocks()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients(case):
  _check(case, *CASES[case], interpret=True)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("case", list(COMPILED))
def test_compiled_on_hopper(case):
  _check(case, *COMPILED[case], interpret=False)


def _check(case, shape, dtype, w_dtype, with_residual, blocks, interpret):
  """Against the reference, and against the portable kernel, which rounds as this one does."""
  kernel_fn = lambda x, w, res: hopper.rms_norm(x, w, eps=1e-5, residual_ND=res,
                                                block_sizes=blocks, interpret=interpret)
  portable_fn = lambda x, w, res: rms_norm(x, w, eps=1e-5, residual_ND=res, interpret=interpret)
  norm_check.check(case, kernel_fn, shape, dtype, w_dtype, with_residual,
                   others={"portable": portable_fn})


# (N, D, residual): the model's widths at a step's rows, and the fused residual variant.
LOWERED = [(16384, 2048, False), (16384, 4096, True), (8192, 8192, True)]


@pytest.mark.parametrize("n, d, with_residual", LOWERED)
def test_kernels_lower_for_hopper(n, d, with_residual):
  x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d,), jnp.float32)

  def fwd_bwd(x, w, r):
    out, vjp = jax.vjp(lambda x, w, r: hopper.rms_norm(x, w, residual_ND=r), x, w, r)
    return out, vjp(out)

  text = jax.jit(fwd_bwd).trace(x, w, x if with_residual else None).lower(
      lowering_platforms=("cuda",)).as_text()
  # One forward and one backward kernel, named as profiles show them.
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 2, text[:2000]
  assert "rms_norm_fwd_hopper" in text and "rms_norm_bwd_hopper" in text


def test_slabs_fit_shared_memory_and_fill_the_gpu():
  for d in (1024, 2048, 4096, 8192):
    for arrays in (2, 3, 4):  # x, out (+ residual, h); h, dout, dx (+ dh)
      cfg = hp.config(16384, d, 2, 1e-6, HopperNormBlocks(), arrays, interpret=False)
      used = hp.smem_bytes(cfg.block_rows, d, 2, arrays, cfg.max_concurrent_steps)
      assert cfg.block_rows * d * 2 <= hp.SLAB_BYTES or cfg.block_rows == 1
      assert used <= hp.SMEM_LIMIT // 2 or cfg.block_rows == 1, (d, arrays, used)
      assert cfg.num_blocks == H100_SMS * min(2, hp.SMEM_LIMIT // used)  # resident at once
  assert hp.config(6, 2048, 2, 1e-6, HopperNormBlocks(), 2, False).block_rows == 2  # divides N
  assert hp.config(6, 2048, 2, 1e-6, HopperNormBlocks(), 2, False).num_blocks == 3
  # Llama 405B's width: a bf16 row of each of four arrays, twice, and the weight exceed it.
  assert "exceed shared memory" in hp.why_not((8, 16384), jnp.bfloat16)


@pytest.mark.parametrize("shape, dtype, kwargs, match", [
    ((4, 96), jnp.bfloat16, {}, "D=96 is not a multiple of 128.*portable kernel"),
    ((4, 128), jnp.int32, {}, "dtype int32"),
    ((6, 128), jnp.bfloat16, dict(block_sizes=HopperNormBlocks(block_rows=4)),
     "block_rows=4 must divide the 6 rows"),
    ((4, 128), jnp.bfloat16, dict(residual_ND=jnp.zeros((4, 128), jnp.float32)),
     "residual .* must match x"),
])
def test_bad_inputs_are_refused_before_tracing(shape, dtype, kwargs, match):
  with pytest.raises(ValueError, match=match):
    hopper.rms_norm(jnp.zeros(shape, dtype), jnp.ones(shape[-1:]), interpret=True, **kwargs)


def test_norm_impl_pallas_picks_hopper_kernels_on_hopper_only():
  assert norm_backend((8, 2048), jnp.bfloat16, "9.0")[0] == "hopper"
  for capability in (None, "8.0", "10.0"):
    backend, why = norm_backend((8, 2048), jnp.bfloat16, capability)
    assert backend == "portable" and "not Hopper" in why
  backend, why = norm_backend((8, 96), jnp.bfloat16, "9.0")
  assert backend == "portable" and "multiple of 128" in why


@pytest.mark.parametrize("overrides, kernels, why", [
    (("model.norm_impl=pallas", "model.kernel_interpret=true"), "portable", "interpreter"),
    (("model.norm_impl=pallas",), "portable", "not Hopper"),
    (("model.norm_impl=xla",), "", ""),
])
def test_runtime_reports_which_norm_kernels_run(overrides, kernels, why):
  cfg = small_config(None, *overrides)
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  got, got_why = runtime.norm_kernels(cfg, mesh)
  assert got == kernels and why in got_why
