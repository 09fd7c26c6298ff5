"""Ulysses context parallelism (`parallel.context_impl=ulysses`): every layout reproduces the
single-device losses and gradient norms in both modes; the token-order permutation round-trips;
the all-to-alls in the compiled step carry the formula's bytes and nothing else runs over
`sequence`; layouts the heads do not divide are refused before compile."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from jscale import predict, runtime
from jscale.analysis import gpu_target, hlo, introspect
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.parallel.context.order import token_order
from jscale.parallel.context.ulysses import to_sequence_order, to_slot_order
from parity import BASE, losses, reference

ULYSSES = ("parallel.context_impl=ulysses",)
CP4 = ("mesh.sequence=4", "mesh.data=2") + ULYSSES
CP_TP = ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2") + ULYSSES
MANUAL = ("parallel.collectives=manual",)

LAYOUTS = {
    "xla_cp4": CP4,
    "xla_cp4_contiguous": CP4 + ("parallel.context_layout=contiguous",),
    "xla_cp2_tp2_sp": CP_TP + ("parallel.sequence_parallel=true",),
    "manual_cp4": CP4 + MANUAL,
    "manual_cp2_tp2_sp": CP_TP + MANUAL + ("parallel.sequence_parallel=true",),
    "manual_cp2_fsdp2_zero3_tp2": ("mesh.sequence=2", "mesh.fsdp=2", "mesh.tensor=2",
                                   "mesh.data=1", "parallel.zero_stage=3") + ULYSSES + MANUAL,
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_device(layout):
  np.testing.assert_allclose(losses(layout), reference(), rtol=1e-5)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sequence_order_round_trip(layout):
  n, l = 4, 16
  slots = token_order(l, n, layout)
  x_BL = jnp.asarray(np.broadcast_to(slots, (2, l)))  # each slot holds its token's position
  np.testing.assert_array_equal(to_sequence_order(x_BL, n, layout), np.broadcast_to(
      np.arange(l), (2, l)))
  np.testing.assert_array_equal(to_slot_order(to_sequence_order(x_BL, n, layout), n, layout),
                                x_BL)


# GQA (2 K/V heads for 4 query heads) over 2 sequence shards: the K/V all-to-alls move half
# the query's bytes.
GQA_CP2 = ("mesh.sequence=2", "mesh.data=4", "model.n_kv_heads=2") + ULYSSES


@pytest.mark.parametrize("remat", ["selective", "full"])
@pytest.mark.parametrize("mode", ["xla", "manual"])
def test_all_to_all_bytes(mode, remat):
  """Per layer: the forward's all-to-alls of q, k, v and the output, the backward's of their
  cotangents, and under full remat the forward's again (selective keeps what they exchanged:
  `attention.CP_EXCHANGED`); each all-to-all's result is one device's [B, L/n, heads, dim]. No
  other collective runs over `sequence` (no K/V all-gather, no ring)."""
  cfg = small_config(None, *BASE, *GQA_CP2, f"parallel.collectives={mode}",
                     f"train.remat={remat}")
  text = introspect.compile_train_step(cfg)[0].as_text()
  m, t, n = cfg.model, cfg.train, 2
  h, g, k = m.n_heads, m.attention_kv_heads, m.qk_head_dim
  rows = t.batch_size // 4 * t.seq_len // n  # this device's tokens
  per_pass = rows * (h * k + g * k + g * m.v_head_dim + h * m.v_head_dim) * 4  # fp32
  passes = 3 if remat == "full" else 2
  found = hlo.collectives(text)
  exchanged = [c for c in found if c.kind == "all-to-all"]
  assert sum(c.bytes_per_step for c in exchanged) == m.n_layers * passes * per_pass
  assert all(c.group_size == n for c in exchanged)
  assert not [c for c in found if c.kind in ("all-gather", "collective-permute")]


@pytest.mark.parametrize("overrides, key", [
    (CP4 + ("model.n_kv_heads=2",), "model.n_kv_heads=2 is not divisible by mesh.sequence=4"),
    (CP_TP + ("model.n_kv_heads=2",), "model.n_kv_heads=2 is not divisible by mesh.sequence=2"
                                      " x mesh.tensor=2"),
    (CP4 + ("model.attention_impl=ring",), "model.attention_impl=ring"),
    (CP4 + ("parallel.context_impl=spiral",), "parallel.context_impl"),
])
def test_bad_layouts_fail_before_compile(overrides, key):
  with pytest.raises(ConfigError, match=key):
    runtime.build(small_config(None, *BASE, *overrides))


def test_auto_attends_whole_sequence():
  """`attention_impl: auto` under Ulysses is what one device runs (not the ring's blocks)."""
  rt = runtime.build(small_config(None, *BASE, *CP4))
  assert rt.cfg.model.attention_impl == "xla"


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_cudnn_attends_the_whole_sequence_on_h100s():
  """Compiled by XLA:GPU for 8 H100s (on this CPU machine): `attention_impl: auto` is cuDNN's
  fused attention under Ulysses, each call over all L tokens of one device's H/n heads, between
  the all-to-alls; the ring's impl would take L/n-token blocks in plain XLA."""
  n, l, h = 8, 1024, 8
  cfg = load_config("configs/tiny.yaml", [
      "model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=1", "model.d_model=512",
      f"model.n_heads={h}", f"model.n_kv_heads={h}", f"train.seq_len={l}",
      f"model.max_seq_len={l}", f"mesh.sequence={n}", "mesh.data=1", *ULYSSES])
  text = predict.compile_for(cfg, "h100x8")[0]
  forwards = re.findall(r"= \((\w+\[[\d,]+\])\{[^}]*\}, f32\[[\d,]+\]\{[^}]*\}, u8\[0\]\{0\}\) "
                        r"custom-call\([^)]*\), custom_call_target=\"__cudnn\$fmhaSoftmax\"", text)
  assert forwards and set(forwards) == {f"bf16[1,{h // n},{l},{cfg.model.qk_head_dim}]"}
  exchanged = [c for c in hlo.collectives(text) if c.kind == "all-to-all"]
  assert exchanged and all(c.group_size == n for c in exchanged)
