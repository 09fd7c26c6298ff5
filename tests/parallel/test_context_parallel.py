"""Context parallelism in training: every CP layout reproduces the single-device losses and
gradient norms in both collective modes; the token order; the ring's collectives in the HLO;
bad layouts fail before compile; the train loop runs with mesh.sequence > 1."""

import json

import jax
import numpy as np
import pytest

from conftest import small_config
from jscale import runtime
from jscale.analysis import hlo, introspect
from jscale import train as train_lib
from jscale.config import ConfigError
from jscale.data import make_train_iterator
from jscale.parallel.context.order import Reorder, token_order
from parity import ACCUMULATE, BASE, losses, reference

CP4 = ("mesh.sequence=4", "mesh.data=2")
CP_TP = ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2")
MANUAL, RING = ("parallel.collectives=manual",), ("model.attention_impl=ring",)
ALL_GATHER = ("model.attention_impl=xla",)  # explicit: attention_impl=auto runs the ring

LAYOUTS = {
    "xla_allgather_cp4": CP4 + ALL_GATHER,
    "xla_allgather_cp2_tp2_dp2": CP_TP + ALL_GATHER,
    "xla_ring_cp4": CP4 + RING,
    "xla_ring_cp2_tp2_sp_dp2": CP_TP + RING + ("parallel.sequence_parallel=true",),
    "manual_cp4": CP4 + MANUAL,
    "manual_cp4_contiguous": CP4 + MANUAL + ("parallel.context_layout=contiguous",),
    "manual_cp2_tp2_dp2": CP_TP + MANUAL,
    "manual_cp2_tp2_sp_dp2": CP_TP + MANUAL + ("parallel.sequence_parallel=true",),
    "manual_cp2_fsdp2_zero3_tp2": ("mesh.sequence=2", "mesh.fsdp=2", "mesh.tensor=2",
                                   "mesh.data=1", "parallel.zero_stage=3") + MANUAL,
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_device(layout):
  np.testing.assert_allclose(losses(layout), reference(), rtol=1e-5)


@pytest.mark.parametrize("mode", [RING, MANUAL], ids=["xla_ring", "manual"])
def test_accumulation_and_full_remat(mode):
  np.testing.assert_allclose(losses(CP4 + mode + ACCUMULATE[0]), reference(*ACCUMULATE[0]),
                             rtol=1e-5)


def test_zigzag_token_order():
  # 2n = 8 chunks of 2: device i holds chunks i and 7 - i.
  np.testing.assert_array_equal(token_order(16, 4, "zigzag").reshape(4, 4),
                                [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
  np.testing.assert_array_equal(token_order(16, 4, "contiguous"), np.arange(16))
  example = {"tokens": np.arange(16) + 100, "labels": np.arange(16) + 200,
             "loss_mask": np.arange(16) % 2}
  out = Reorder(16, 4, "zigzag")(example)
  order = out["positions"]
  for key in ("tokens", "labels", "loss_mask"):  # every (token, label, mask) triple kept
    np.testing.assert_array_equal(out[key], example[key][order])


def test_pipeline_applies_the_order(data_cache):
  cfg = small_config(None, f"data.cache_dir={data_cache}")
  plain = next(make_train_iterator(cfg.data, 32, 8))
  reordered = next(make_train_iterator(cfg.data, 32, 8, transform=Reorder(32, 4, "zigzag")))
  order = token_order(32, 4, "zigzag")
  np.testing.assert_array_equal(reordered["tokens"], plain["tokens"][:, order])
  np.testing.assert_array_equal(reordered["positions"], np.broadcast_to(order, (8, 32)))


@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_manual_ring_collectives(remat):
  """Per layer the forward passes K/V n-1 hops; the backward passes them again and dK/dV n hops
  (fp32); no K/V all-gather over sequence. Selective remat keeps the ring's output and lse,
  so only full remat runs the forward ring twice."""
  cfg = small_config(None, *BASE, *CP4, *MANUAL, f"train.remat={remat}")
  text = introspect.compile_train_step(cfg)[0].as_text()
  permutes = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
  m, n = cfg.model, 4
  kv = 16 // 2 * (cfg.train.seq_len // n) * m.n_kv_heads * m.resolved_head_dim * 4
  forwards = 2 if remat == "full" else 1
  expected = m.n_layers * ((forwards + 1) * (n - 1) * 2 * kv + n * 2 * kv)
  assert sum(c.bytes_per_step for c in permutes) == expected
  assert not [c for c in hlo.collectives(text) if c.kind == "all-gather"]


@pytest.mark.parametrize("overrides, key", [
    (CP4 + ("train.seq_len=36", "model.max_seq_len=64"), "train.seq_len"),  # 8 zigzag chunks
    (CP4 + ("model.attention_impl=cudnn",), "model.attention_impl"),
    (("parallel.context_layout=diagonal",), "parallel.context_layout"),
])
def test_bad_layouts_fail_before_compile(overrides, key):
  with pytest.raises(ConfigError, match=key):
    runtime.build(small_config(None, *BASE, *overrides))


def test_auto_is_the_ring_under_context_parallelism():
  for mode in (("parallel.collectives=xla",), MANUAL):
    rt = runtime.build(small_config(None, *BASE, *CP4, *mode))
    assert rt.cfg.model.attention_impl == "ring" and "ring" in rt.kernels.attention_why


def test_missing_positions_is_an_error():
  rt = runtime.build(small_config(None, *BASE, *CP4))
  b = {k: np.zeros((16, 32), np.int32) for k in ("tokens", "labels", "loss_mask")}
  with pytest.raises(ValueError, match="positions"):
    rt.train_step()(rt.init_state(), jax.device_put(b, rt.layouts.batch()))


def test_train_loop_with_context_parallelism(tmp_path, data_cache):
  cfg = small_config(None, f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
                     "mesh.sequence=2", "mesh.data=4", *MANUAL, "train.eval_every=3")
  train_lib.run(cfg)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  losses_ = [r["loss"] for r in rows if "loss" in r]
  assert len(losses_) == 6 and np.all(np.isfinite(losses_)) and losses_[-1] < losses_[0]
  assert all(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)
