"""The Hopper (Mosaic GPU) flash attention kernels.

On CPU: every kernel (forward, dK/dV, dQ) lowers through Pallas' Mosaic GPU pipeline for the
`cuda` platform (layouts, wgmma shapes, TMA transfers and the shared-memory budget are checked
there), the scores never exist outside them, bad shapes are refused with the fix, and the
model's `attention_impl: pallas` picks them on Hopper only. Values and gradients against the
reference run in JAX's Mosaic GPU interpreter: everything but the products and register
layouts, which jax 0.10's interpreter cannot run (no `run_state`, no wgmma from registers or a
transposed operand, no layout casts) and `hopper_ops` computes as plain dots there; and
compiled, on an H100 (skipped elsewhere).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_HOPPER
from close import assert_close
from conftest import small_config
from jscale import mesh as mesh_lib, runtime
from jscale.model.attention import pallas_backend
from pallas_kernels.flash_attention import hopper, reference
from pallas_kernels.flash_attention.hopper import HopperBlocks, blocks_for



def _fwd_bwd(causal, segments, with_dlse=False, interpret=False, blocks=None):
  def f(q, k, v, do, seg):
    fn = lambda q, k, v: hopper.flash_attention(q, k, v, causal=causal, segment_ids=seg,
                                                return_lse=True, block_sizes=blocks,
                                                interpret=interpret)
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    # An lse cotangent (ring attention's merge has one) exercises delta's dlse term.
    dlse = jnp.cos(lse) if with_dlse else jnp.zeros_like(lse)
    return out, lse, vjp((do, dlse))
  return f


# (batch, seq, heads, kv_heads, head_dim, causal, segments, dtype)
LOWERED = {
    "causal_gqa_d128_bf16": (1, 512, 4, 2, 128, True, False, jnp.bfloat16),
    "full_mha_d64_f16": (2, 256, 2, 2, 64, False, False, jnp.float16),
    "causal_segments_gqa_d64_bf16": (1, 512, 4, 1, 64, True, True, jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(LOWERED))
def test_kernels_lower_for_hopper(case):
  b, l, h, g, d, causal, segments, dtype = LOWERED[case]
  q = jax.ShapeDtypeStruct((b, l, h, d), dtype)
  kv = jax.ShapeDtypeStruct((b, l, g, d), dtype)
  seg = jax.ShapeDtypeStruct((b, l), jnp.int32) if segments else None
  lowered = jax.jit(_fwd_bwd(causal, segments)).trace(q, kv, kv, q, seg).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  # Forward, dK/dV and dQ: three Mosaic GPU kernels, and nothing [L, S]-sized around them.
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3, text[:2000]
  assert f"x{l}x{l}x" not in text and f"{l}x{l}xf32" not in text


@pytest.mark.parametrize("shape, kv_shape, dtype, match", [
    ((1, 256, 2, 96), (1, 256, 2, 96), jnp.bfloat16, "head_dim 96 must be 64 or 128"),
    ((1, 256, 2, 64), (1, 256, 2, 64), jnp.float32, "bf16 or fp16"),
    ((1, 192, 2, 64), (1, 192, 2, 64), jnp.bfloat16, r"sequence 192 is not a multiple of 128"),
    ((1, 256, 3, 64), (1, 256, 2, 64), jnp.bfloat16, "not a multiple of the 2 kv heads"),
])
def test_untileable_inputs_rejected(shape, kv_shape, dtype, match):
  with pytest.raises(ValueError, match=match):
    hopper.check_shapes(shape, kv_shape, dtype, causal=True)


def test_blocks_shrink_to_the_sequence():
  assert blocks_for(4096, 128) == HopperBlocks(block_q=64, block_kv=128)
  assert blocks_for(192, 64).block_kv == 64  # 128 does not divide 192


@pytest.mark.parametrize("cc, dtype, d, v_d, backend", [
    ("9.0", jnp.bfloat16, 128, 128, "hopper"),
    ("9.0", jnp.float16, 64, 64, "hopper"),
    ("8.0", jnp.bfloat16, 128, 128, "portable"),
    (None, jnp.bfloat16, 128, 128, "portable"),
    ("9.0", jnp.float32, 128, 128, "portable"),
    ("9.0", jnp.bfloat16, 32, 32, "portable"),
    ("9.0", jnp.bfloat16, 128, 64, "portable"),
])
def test_pallas_impl_picks_hopper_kernels_only_where_they_run(cc, dtype, d, v_d, backend):
  got, why = pallas_backend((1, 1024, 8, d), (1, 1024, 2, d), (1, 1024, 2, v_d), dtype, True, cc)
  assert got == backend, why


@pytest.mark.parametrize("overrides, kernels, why", [
    (("model.attention_impl=pallas", "model.kernel_interpret=true"), "portable", "interpreter"),
    (("model.attention_impl=pallas",), "portable", "not Hopper"),
    (("model.attention_impl=xla",), "", ""),
])
def test_runtime_reports_which_flash_kernels_run(overrides, kernels, why):
  cfg = small_config(None, *overrides)
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  got, got_why = runtime.pallas_kernels(cfg, mesh)
  assert got == kernels and why in got_why


@pytest.mark.skipif(not ON_HOPPER, reason="compiles only for Hopper GPUs (sm_90)")
@pytest.mark.parametrize("causal, g, d, segments", [
    (True, 2, 128, False), (False, 4, 64, False), (True, 1, 64, True), (False, 2, 128, True),
    (True, 2, 128, True)])  # d 128 with segments: the H200's NaN case, and its causal twin
def test_values_and_gradients_match_reference_on_hopper(causal, g, d, segments):
  _check_against_reference(causal, g, d, segments, b=2, l=512, h=4)


# The same kernels in JAX's Mosaic GPU interpreter, their products and layouts as `hopper_ops`
# substitutes them: 64-row tiles so causal blocks straddle, skip and release; GQA; segments.
SMALL = HopperBlocks(block_q=64, block_kv=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                     block_kv_dq=64)


@pytest.mark.parametrize("causal, g, d, segments", [
    (True, 1, 64, False), (False, 2, 64, True), (True, 1, 128, True)])
def test_values_and_gradients_match_reference_interpreted(causal, g, d, segments):
  _check_against_reference(causal, g, d, segments, b=1, l=256, h=2, interpret=True,
                           blocks=SMALL)


def test_cross_attention_shapes_interpreted():
  # Queries and keys of different lengths (one query tile, three K / V blocks of the default
  # 128), two batch rows, 2 query heads per kv head: the streams' slots wrap around.
  _check_against_reference(False, 1, 64, False, b=2, l=128, h=2, s=384, interpret=True)


def test_rows_whose_first_keys_are_all_masked_interpreted():
  # The H200's NaN (non-causal, segments, d=128): a row whose first K block holds no key of
  # its segment got exp2(fma(mask, scale, -round(mask * scale))) = exp2(+5.7e29) = inf from a
  # finite mask value, then inf * 0 = NaN at the next block. XLA:CPU contracts that FMA too.
  # Rows 100..127 see nothing in K block 0; kv has no segment 0, so rows 0..36 see no key.
  l, d = 128, 128
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal((1, l, 1, d), np.float32)).astype(jnp.bfloat16)
             for _ in range(3))
  q_seg = jnp.asarray(np.searchsorted([37, 100], np.arange(l), side="right")[None], jnp.int32)
  seg = (q_seg, q_seg.at[:, :37].set(1))
  out, lse = jax.jit(lambda q, k, v: hopper.flash_attention(
      q, k, v, causal=False, segment_ids=seg, return_lse=True, interpret=True,
      block_sizes=HopperBlocks(block_q=64, block_kv=64)))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ref_out, ref_lse = reference(f32(q), f32(k), f32(v), causal=False, segment_ids=seg)
  assert_close("out", out, ref_out, 2e-2)
  lse, seen = np.asarray(lse), np.isfinite(np.asarray(ref_lse))
  assert seen.sum() == 91 and np.all(lse[~seen] == -np.inf)  # rows 0..36 see no key
  assert_close("lse", lse[seen], np.asarray(ref_lse)[seen], 2e-2)


def _check_against_reference(causal, g, d, segments, *, b, l, h, s=None, interpret=False,
                             blocks=None):
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32)).astype(jnp.bfloat16)
  s = s or l
  q, do, k, v = normal(b, l, h, d), normal(b, l, h, d), normal(b, s, g, d), normal(b, s, g, d)
  # Segments of 37, 263 and the rest of 512 tokens (256: 37, 219): boundaries inside tiles.
  seg = (jnp.asarray(np.searchsorted([37, 300], np.arange(l), side="right")[None]
                     .repeat(b, 0), jnp.int32) if segments else None)
  fn = _fwd_bwd(causal, segments, with_dlse=True, interpret=interpret, blocks=blocks)
  out, lse, grads = jax.jit(fn)(q, k, v, do, seg)
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: reference(f32(q), f32(k), f32(v), causal=causal, segment_ids=seg)
  (ref_out, ref_lse), ref_vjp = jax.vjp(ref, q, k, v)
  ref_grads = ref_vjp((f32(do), jnp.cos(ref_lse)))
  assert_close("out", out, ref_out, 2e-2)
  assert_close("lse", lse, ref_lse, 2e-2)
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert got.dtype == jnp.bfloat16
    assert_close(name, got, want, 2e-2)


def test_shared_memory_budget_is_checked_on_cpu():
  """The CPU lowering is a real check: tiles that overflow an H100's 227 KiB fail there."""
  q = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  big = HopperBlocks(block_kv=256, max_concurrent_steps=4)
  fn = jax.jit(lambda q, k, v: hopper.flash_attention(q, k, v, block_sizes=big))
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    fn.trace(q, q, q).lower(lowering_platforms=("cuda",))


def _kernel_names(jaxpr) -> list[str]:
  """Names of the Pallas kernels in a jaxpr, its nested jaxprs included."""
  names = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "mpmd_map"):
      names.append(str(eqn.params.get("name") or eqn.params.get("name_and_src_info")))
    for v in eqn.params.values():
      for x in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(x, "jaxpr", x)
        names += _kernel_names(sub) if hasattr(sub, "eqns") else []
  return names


def test_selective_remat_saves_the_hopper_forward():
  """`remat: selective` keeps the Hopper forward's output and lse for the backward kernels (a
  Mosaic GPU kernel reaches the policy wrapped in a `custom_vmap_call`; unrecognised, the
  backward reran the forward kernel). Traced on CPU: a gradient runs each kernel once."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  from jscale.model.remat import remat_policy  # pylint: disable=import-outside-toplevel
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  loss = jax.checkpoint(lambda q, k, v: hopper.flash_attention(q, k, v).astype(jnp.float32).sum(),
                        policy=remat_policy("selective"))
  saved = [(a.shape, a.dtype) for a, why in saved_residuals(loss, q, kv, kv)
           if "custom_vmap_call" in why]
  assert saved == [((1, 512, 4, 64), jnp.bfloat16), ((1, 4, 512), jnp.float32)], saved
  names = _kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv).jaxpr)
  assert sorted(names) == ["flash_attention_dkv_hopper", "flash_attention_dq_hopper",
                           "flash_attention_fwd_hopper"], names
