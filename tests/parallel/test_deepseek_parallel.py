"""The tiny DeepSeek-V3 model (MLA, sigmoid group-limited routing with the balancing bias, a
shared expert, a dense first layer, MTP) under every parallelism, in both collective modes,
against one device: loss and gradient norm of 2 steps (`tests/parity.py`; step 2 runs on the
weights and the bias that step 1 moved, the bias by the loads summed across devices).

Compiles dominate (one per layout and mode, one per reference), so each layout combines
several axes, the single-device references are computed once for the module, and a layout
starts from one device's initial state placed in its own shardings (`parity.initial_state`:
not a compiled init of its own, the same values):
- data x fsdp (ZeRO-3) x tensor with sequence parallelism, 2 accumulated micro-batches, MTP
  on (MTP's loss is a token sum over the step's token count, as the token loss: the split into
  micro-batches and devices does not change it, `accumulate.TOKEN_SUMS`);
- expert x sequence (context parallelism: the ring, and Ulysses, whose V head size differs
  from Q's here) x tensor, MTP off (it shifts labels along the sequence, which CP splits:
  refused by `validate.check_mesh`);
- stage x expert: a pipeline, MTP in the last stage, the dense layer in the first.
"""

import functools

import jax
import numpy as np
import pytest

import deepseek_case
import parity

STEPS = 2
# 8 rows of 16 tokens: data x fsdp x micro-batches divides them in every layout.
DS = (*deepseek_case.DS, "model.n_layers=3", "train.batch_size=8", "train.seq_len=16")
NO_MTP = ("model.mtp=null",)
# (layout overrides, devices, the reference's numerics / model overrides)
LAYOUTS = {
    "dp-zero3-tp-sp-accum": (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                              "parallel.zero_stage=3", "parallel.sequence_parallel=true",
                              "train.microbatches=2"), 8, ()),
    "ep-cp-tp": (("mesh.data=1", "mesh.expert=2", "mesh.sequence=2", "mesh.tensor=2", *NO_MTP),
                 8, NO_MTP),
    "ep-ulysses-tp": (("mesh.data=1", "mesh.expert=2", "mesh.sequence=2", "mesh.tensor=2",
                       "parallel.context_impl=ulysses", *NO_MTP), 8, NO_MTP),
    "pp-ep": (("mesh.data=1", "mesh.stage=2", "mesh.expert=2", "pipeline.microbatches=2"), 4,
              ()),
}


def _losses(overrides, devices):
  """[STEPS, 2]: loss and gradient norm of each step (`parity.losses`: one device's initial
  state placed in the layout)."""
  return parity.losses((*DS, *overrides), devices, STEPS)


@pytest.fixture(scope="module")
def reference():
  """The single-device losses for a reference's overrides, computed once per module."""
  return functools.cache(lambda ref: _losses(("mesh.data=1", *ref), jax.devices()[:1]))


@pytest.mark.parametrize("mode", ["xla", "manual"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_layout_matches_one_device(name, mode, reference):
  layout, n, ref = LAYOUTS[name]
  want = reference(ref)
  got = _losses((*layout, f"parallel.collectives={mode}"), jax.devices()[:n])
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_deepseek_node_limited_dispatch_matches_one_device(reference):
  # Manual EP over 4 devices as 2 "nodes" of the tiny model's 2 groups of 4 experts
  # (topk_group 1): DeepSeek-V3's two-hop dispatch (tests/parallel/test_node_limited.py) in training.
  want = reference(())
  got = _losses(("mesh.data=2", "mesh.expert=4", "parallel.collectives=manual",
                 "model.moe.exchange=node_limited"), jax.devices()[:8])
  np.testing.assert_allclose(got, want, rtol=1e-4)
