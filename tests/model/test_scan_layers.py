"""`model.scan_layers: false`: the layer stacks as straight-line code instead of a loop.

Against the scanned stacks on the same inputs (losses and gradient norms over 3 steps: one
device with accumulation, ZeRO-3 in both modes, the tiny DeepSeek with its dense first layer,
a pipeline); in the compiled program: no loop over the layers, and remat still recomputes
(the backward's recomputation is not merged into the forward). For 8 H100s (XLA:GPU), the
Llama 2 7B shape at 4 layers: no residual stacks to fill and copy into, less memory and a
shorter predicted step; the gradient reduce-scatters of different layers kept apart (the
planner's `--scan-layers both`: tests/plan/test_gpu_compile.py).
"""

import re

import jax
import numpy as np
import parity
import pytest
from conftest import small_config
from deepseek_case import DS

from jscale import predict, xla_flags
from jscale.analysis import gpu_target, introspect
from jscale.config_load import load_config


def _devices(layout) -> int:
  return int(np.prod([int(o.split("=")[1]) for o in layout if o.startswith("mesh.")]))


@pytest.mark.parametrize("layout", [
    ("mesh.data=1", "train.microbatches=2", "train.remat=selective"),
    ("mesh.data=1", "mesh.fsdp=2", "parallel.zero_stage=3", "train.remat=full"),
    ("mesh.data=1", "mesh.fsdp=2", "parallel.zero_stage=3", "train.remat=full",
     "parallel.collectives=manual"),
    ("mesh.data=1", *DS, "train.remat=selective"),
    ("mesh.data=1", "model.n_layers=4", "mesh.stage=2", "pipeline.microbatches=2",
     "parallel.collectives=manual"),
], ids=["one device, accumulation", "xla zero3", "manual zero3", "deepseek", "manual 1f1b"])
def test_unrolled_layers_match_the_scanned_loop(layout):
  devices = jax.devices()[:_devices(layout)]
  want = parity.losses((*layout, "model.scan_layers=true"), devices, 3)
  got = parity.losses((*layout, "model.scan_layers=false"), devices, 3)
  np.testing.assert_allclose(got, want, rtol=2e-5)


def _cpu_program(*overrides: str) -> str:
  cfg = small_config(None, "model.n_layers=3", *overrides)
  return introspect.compile_train_step(cfg, jax.devices()[:1])[0].as_text()


def _layer_loops(text: str) -> int:
  return len(re.findall(r" while\(.*op_name=\"[^\"]*/layers/while\"", text))


def _dots(text: str) -> int:
  return len(re.findall(r"= \S+ dot\(", text))


def test_unrolled_program_has_no_layer_loop_and_still_recomputes():
  scanned = _cpu_program("train.remat=full")
  unrolled = {r: _cpu_program("train.remat=" + r, "model.scan_layers=false")
              for r in ("none", "full")}
  assert _layer_loops(scanned) == 2  # the forward's and the backward's
  assert all(_layer_loops(text) == 0 for text in unrolled.values())
  # Full remat reruns each layer's forward matmuls in the backward: straight-line code could
  # let XLA merge them with the forward's (and keep what remat drops) but for the fence.
  assert _dots(unrolled["full"]) > _dots(unrolled["none"])


# Llama 2 7B (MaxText's peer row in results/peers_h100.md) at 4 layers on 8 H100s: fsdp 8,
# manual ZeRO-3, 2 micro-batches of 2 sequences, selective remat.
LLAMA2_7B_4L = ("model.preset=llama3_8b", "model.vocab_size=32000", "model.n_kv_heads=32",
                "model.d_ff=11008", "model.rope_theta=10000", "model.rope_scaling=null",
                "model.n_layers=4", "model.dtype=bfloat16", "checkpoint.every=0",
                "mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3",
                "parallel.collectives=manual", "train.remat=selective", "train.seq_len=4096",
                "train.batch_size=32", "train.microbatches=2")


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_unrolled_layers_are_faster_and_smaller_on_h100s():
  """Predicted (`jscale.predict` on XLA:GPU's program): the scanned loop zero-fills its
  residual stacks and copies each layer's residuals into them; unrolled, neither runs."""
  r = {}
  for scan in ("true", "false"):
    cfg = load_config(None, [*LLAMA2_7B_4L, f"model.scan_layers={scan}"])
    r[scan] = predict.predict_config(cfg, "h100x8")
  scanned, unrolled = r["true"], r["false"]
  assert unrolled.by_category["copies"] < 0.5 * scanned.by_category["copies"]
  assert unrolled.memory_bytes < 0.95 * scanned.memory_bytes
  assert unrolled.step_s < 0.97 * scanned.step_s


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_unrolled_layers_reduce_scatter_each_layers_gradient_alone():
  """Unrolled, XLA's combiner would merge different layers' gradient reduce-scatters into one
  that waits for the last, every layer's full gradient held until then; the launcher's flags
  keep them apart (`xla_flags`). Llama 3 70B's layers, 4 of them, data2 × fsdp64 manual
  ZeRO-3 on 128 H100s, full remat: temporaries as the scan's, not a quarter more."""
  layout = ["model.preset=llama3_70b", "model.n_layers=4", "model.dtype=bfloat16",
            "checkpoint.every=0", "mesh.data=2", "mesh.fsdp=64", "parallel.zero_stage=3",
            "train.remat=full", "train.seq_len=8192", "train.batch_size=256",
            "parallel.collectives=manual"]
  devices = gpu_target.devices("h100x128")
  temp = lambda scan, options=None: introspect.memory(introspect.compile_train_step(
      load_config(None, [*layout, f"model.scan_layers={scan}"]), devices, options)[0])["temp"]
  unrolled = load_config(None, [*layout, "model.scan_layers=false"])
  assert xla_flags.compiler_options(unrolled)["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 0
  scanned = temp(True)
  assert temp(False) < 1.02 * scanned
  assert temp(False, {"xla_gpu_reduce_scatter_combine_threshold_bytes": 2**27}) > 1.2 * scanned
