"""The tiny DeepSeek-V3 model (MLA, sigmoid group-limited routing with the balancing bias, a
shared expert, a dense first layer, MTP) under every parallelism, in both collective modes,
against one device: loss and gradient norm of 5 steps (`tests/parity.py`), the bias moved
each step by the loads summed across devices.

Compiles dominate (one per layout and mode), so each layout combines several axes:
- data x fsdp (ZeRO-3) x tensor with sequence parallelism, MTP on;
- expert x sequence (context parallelism) x tensor, MTP off (it shifts labels along the
  sequence, which CP splits: refused by `validate.check_mesh`);
- stage x (expert or tensor): pipelines, MTP in the last stage, the dense layer in the first.
"""

import jax
import numpy as np
import pytest

import deepseek_case
import parity

DS = (*deepseek_case.DS, "model.n_layers=3")
NO_MTP = ("model.mtp=null",)
# (layout overrides, devices, the reference's numerics / model overrides)
LAYOUTS = {
    "dp-zero3-tp-sp": (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3",
                        "parallel.sequence_parallel=true"), 8, ()),
    "ep-cp-tp": (("mesh.data=1", "mesh.expert=2", "mesh.sequence=2", "mesh.tensor=2", *NO_MTP),
                 8, NO_MTP),
    # The reference accumulates the same 2 micro-batches: MTP's and the sequence-wise
    # balance loss's terms are per micro-batch means, as under train.microbatches.
    "pp-ep": (("mesh.data=1", "mesh.stage=2", "mesh.expert=2", "pipeline.microbatches=2"), 4,
              ("train.microbatches=2",)),
}


@pytest.mark.parametrize("mode", ["xla", "manual"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_layout_matches_one_device(name, mode):
  layout, n, ref = LAYOUTS[name]
  got = parity.losses((*DS, *layout, f"parallel.collectives={mode}"), jax.devices()[:n])
  np.testing.assert_allclose(got, parity.reference(*DS, *ref), rtol=1e-4)
