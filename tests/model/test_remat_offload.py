"""`train.remat=offload`: the residuals selective remat saves go to the host's pinned memory
(`jscale.model.remat`; under a pipeline, the executor's stored residuals between F and B).
Against one device without remat (losses and gradient norms, both collective modes, pipelines
included), and in the XLA:GPU programs for H100s: the residuals in host memory (space S(5)),
the device's buffers down to full remat's, their copies asynchronous around the compute, and
`jscale.predict` pricing them over the host link."""

import re

import jax
import numpy as np
import parity
import pytest

from jscale import predict
from jscale.analysis import gpu_target, overlap
from jscale.config_load import load_config


@pytest.mark.parametrize("layout", [
    ("mesh.data=1",),
    ("mesh.data=2", "mesh.fsdp=2", "parallel.zero_stage=3", "train.microbatches=2"),
    ("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
     "parallel.collectives=manual"),
], ids=["one device", "xla dp x zero3, accumulation", "manual dp x tp+sp"])
def test_offload_matches_no_remat_on_one_device(layout):
  want = parity.losses(("mesh.data=1", "train.remat=none"), jax.devices()[:1], 3)
  n = int(np.prod([int(o.split("=")[1]) for o in layout if o.startswith("mesh.")]))
  got = parity.losses((*layout, "train.remat=offload"), jax.devices()[:n], 3)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("layout", [
    ("mesh.stage=2", "mesh.data=1", "pipeline.microbatches=2"),
    ("mesh.stage=2", "mesh.data=1", "pipeline.microbatches=2", "parallel.collectives=manual"),
    ("model.n_layers=4", "mesh.stage=2", "mesh.data=2", "pipeline.microbatches=4",
     "pipeline.schedule=zbv", "pipeline.virtual_stages=2"),
], ids=["xla 1f1b", "manual 1f1b", "xla zbv (pairs)"])
def test_offload_under_a_pipeline_matches_no_remat(layout):
  """The pipeline executor keeps each chunk's stored residuals in host memory from its F to
  its B (`executor.run(offload=True)`)."""
  layers = [o for o in layout if o.startswith("model.")]
  want = parity.losses(("mesh.data=1", "train.remat=none", *layers), jax.devices()[:1], 3)
  n = int(np.prod([int(o.split("=")[1]) for o in layout if o.startswith("mesh.")]))
  got = parity.losses((*layout, "train.remat=offload"), jax.devices()[:n], 3)
  np.testing.assert_allclose(got, want, rtol=1e-5)


H100_TINY = ("model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=8",
             "train.seq_len=512", "model.d_model=256", "model.d_ff=512")
PIPELINE = ("model.n_layers=4", "mesh.stage=2", "mesh.data=1", "pipeline.microbatches=4")


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_a_pipelines_stored_residuals_wait_in_host_memory_on_h100s():
  """2 stages on 2 H100s: the executor's residual buffers in host memory, read back by async
  copies (no host compute), and the device's memory down by their size."""
  memory, texts = {}, {}
  for remat in ("selective", "offload"):
    cfg = load_config("configs/tiny.yaml", [*H100_TINY, *PIPELINE, f"train.remat={remat}"])
    texts[remat], memory[remat], _ = predict.compile_for(cfg, "h100x2")
  assert re.search(r"dynamic-slice-start[.\d]* = \(\(bf16\[[\d,]+\]\{[\d,]+:S\(5\)\}",
                   texts["offload"])
  assert not re.search(r":S\(5\)", texts["selective"])
  assert memory["offload"] < 0.75 * memory["selective"]


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_offloaded_residuals_live_in_host_memory_on_h100():
  programs = {}
  for remat in ("selective", "offload", "full"):
    cfg = load_config("configs/tiny.yaml", [*H100_TINY, f"train.remat={remat}"])
    text, memory, warned = predict.compile_for(cfg, "h100x1")
    programs[remat] = (cfg, text, memory, warned)
  cfg, text, memory, warned = programs["offload"]
  assert re.search(r":S\(5\)", text) and not re.search(r":S\(5\)", programs["selective"][1])
  # The device holds what full remat holds (the layers' inputs), not selective's residuals.
  assert memory < 1.1 * programs["full"][2] < 0.7 * programs["selective"][2]
  # Each residual goes out and comes back by an async copy with compute scheduled around it.
  copies = overlap.windows(text, "fusion")
  assert len(copies) >= 16 and sum(w.count(r"^(fusion|custom-call)") > 0 for w in copies) >= 8
  # The host link prices them: the step is the slower for it at this size (64 GB/s each way).
  offload = predict.predict_config(cfg, "h100x1", text, memory_bytes=memory, remat=warned)
  s_cfg, s_text, s_memory, s_warned = programs["selective"]
  selective = predict.predict_config(s_cfg, "h100x1", s_text, memory_bytes=s_memory,
                                     remat=s_warned)
  assert offload.by_category["copies"] > selective.by_category["copies"]
  assert offload.step_s > selective.step_s
