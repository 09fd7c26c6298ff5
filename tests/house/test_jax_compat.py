"""Each private JAX hook of `jscale.jax_compat`, one test each: a JAX upgrade that moves one
fails here, by name."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn
from jax._src.interpreters import pxla
from jax.experimental import pallas as pl

from jscale import jax_compat
from jscale.analysis import gpu_target


def test_the_coordination_client_is_none_without_jax_distributed():
  assert jax_compat.coordination_client() is None  # multi-process use: test_run_lifecycle


def test_appended_compile_options_reach_the_compile_and_are_undone():
  original = pxla.create_compile_options
  with jax_compat.appended_compile_options(b""):
    assert pxla.create_compile_options is not original
    assert float(jax.jit(lambda x: x + 1).lower(1.0).compile()(1.0)) == 2.0
  assert pxla.create_compile_options is original


def test_kernel_names_read_a_pallas_calls_name():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                        interpret=True, name="doubling_kernel")
  eqn = next(e for e in jax.make_jaxpr(call)(jnp.ones(8)).eqns)
  assert any("doubling_kernel" in n for n in jax_compat.kernel_names(eqn.primitive, eqn.params))


def test_jit_cache_size_counts_compiled_programs():
  f = jax.jit(lambda x: x * 2)
  f(jnp.ones(2))
  f(jnp.ones(3))
  assert jax_compat.jit_cache_size(f) == 2


def test_cudnn_attention_checks_see_the_given_gpu_generation_then_this_ones():
  assert not cudnn.check_compute_capability("9.0")  # no GPU here: no Hopper
  with jax_compat.cudnn_compute_capability("9.0"):
    assert cudnn.check_compute_capability("9.0") and not cudnn.check_compute_capability("10.0")
  assert not cudnn.check_compute_capability("9.0")


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)  # cuDNN's version
def test_cudnn_mla_attention_takes_v_head_sizes_apart_from_q_on_hopper():
  q = jax.ShapeDtypeStruct((1, 128, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
  assert jax_compat.cudnn_mla_supported("9.0") and not jax_compat.cudnn_mla_supported("8.0")
  with jax_compat.cudnn_compute_capability("9.0"):
    assert jax_compat.cudnn_mla_supported()
    out = jax.eval_shape(lambda q, k, v: jax_compat.cudnn_mla_attention(q, k, v, True), q, q, v)
  assert out.shape == (1, 128, 2, 128)
