"""model.attention_impl=auto: the impl chosen per backend and layout, resolved once by the
runtime, printed at start and written to the run's metadata; explicit choices still win."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from jscale import runtime
from jscale.model import attention as attn_lib
from jscale.model import llama


@pytest.mark.parametrize("args, impl, why", [
    (("cpu", jnp.float32, 64), "xla", "cpu"),
    (("cpu", jnp.bfloat16, 64), "xla", "cpu"),
    (("gpu", jnp.bfloat16, 64), "cudnn", "cuDNN flash attention"),
    (("gpu", jnp.float16, 128), "cudnn", "cuDNN flash attention"),
    (("gpu", jnp.float32, 64), "xla", "model.dtype=float32"),
    (("gpu", jnp.bfloat16, 256), "xla", "head_dim=256"),
    (("gpu", jnp.bfloat16, 60), "xla", "head_dim=60"),
    (("gpu", jnp.bfloat16, 64, False, True, "7.0"), "xla", "compute capability 7.0"),
    (("gpu", jnp.bfloat16, 64, False, True, "9.0"), "cudnn", "cuDNN"),
    # MLA: q / k 192, v 128: Hopper's cuDNN takes head sizes up to 256, and since 9.10 V's
    # apart from Q's (jax_compat.cudnn_mla_supported), with no padding
    (("gpu", jnp.bfloat16, 192, False, True, "9.0", 128), "cudnn", "V's 128 as it is"),
    (("gpu", jnp.bfloat16, 192, False, True, "8.0", 128), "xla", "at most 128 before Hopper"),
    (("gpu", jnp.bfloat16, 64, False, True, "9.0", 128), "xla", "v head_dim 128 > q head_dim"),
    (("gpu", jnp.bfloat16, 64, True, True), "pallas", "flash-kernel blocks"),
    (("gpu", jnp.bfloat16, 64, True, False), "ring", "does not tile"),
    (("cpu", jnp.float32, 64, True), "ring", "ring attention"),
])
def test_auto_choices(args, impl, why):
  got, reason = attn_lib.auto_impl(*args)
  assert got == impl and why in reason, (got, reason)


def test_runtime_resolves_auto_and_keeps_explicit_choices():
  rt = runtime.build(small_config(None), jax.devices()[:1])
  assert small_config(None).model.attention_impl == "auto"
  assert (rt.cfg.model.attention_impl, rt.kernels.attention_why) == ("xla",
                                                                    "cpu: plain XLA attention")
  rt = runtime.build(small_config(None, "model.attention_impl=ring"), jax.devices()[:1])
  assert (rt.cfg.model.attention_impl, rt.kernels.attention_why) == ("ring", "")


def test_auto_without_a_runtime_is_the_backends_choice():
  """A model built straight from a config (HF interop, notebooks) resolves auto at call."""
  cfg = small_config(None).model
  tokens = jnp.arange(2 * 16).reshape(2, 16) % cfg.vocab_size
  auto = llama.create(cfg)(tokens)
  xla = llama.create(dataclasses.replace(cfg, attention_impl="xla"))(tokens)
  np.testing.assert_array_equal(auto, xla)


def test_train_prints_and_records_the_choice(traced_run):
  run_dir, stdout = traced_run
  assert "attention: xla (model.attention_impl=auto: cpu: plain XLA attention)" in stdout
  info = json.loads((run_dir / "run.json").read_text())
  assert (info["attention_impl"], info["attention_impl_requested"]) == ("xla", "auto")
  # the config as given (what a resume compares with); the resolution beside it
  assert info["config"]["model"]["attention_impl"] == "auto" and info["backend"] == "cpu"
  assert info["devices"] == 8 and info["mesh"]["data"] == 8
