"""`train.remat=offload`: the residuals selective remat saves go to the host's pinned memory
(`jscale.model.remat`). Against one device without remat (losses and gradient norms, both
collective modes), refused under a pipeline, and in the XLA:GPU program for an H100: the
residuals in host memory (space S(5)), the device's buffers down to full remat's, their
copies asynchronous around the compute, and `jscale.predict` pricing them over the host link."""

import re

import jax
import numpy as np
import parity
import pytest
from conftest import small_config

from jscale import predict, runtime
from jscale.analysis import gpu_target, overlap
from jscale.config import ConfigError
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


def test_offload_under_a_pipeline_is_refused():
  cfg = small_config(None, "mesh.stage=2", "mesh.data=1", "pipeline.microbatches=2",
                     "train.remat=offload")
  with pytest.raises(ConfigError, match="train.remat=offload with mesh.stage=2.*selective or full"):
    runtime.build(cfg, jax.devices()[:2])


H100_TINY = ("model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=8",
             "train.seq_len=512", "model.d_model=256", "model.d_ff=512")


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
