"""manual mode (hand-written collectives in one shard_map) on 8 simulated devices: every layout
reproduces the single-device losses and gradient norms, as xla mode does (test_parallel_xla)."""

import numpy as np
import pytest

from parity import ACCUMULATE, LAYOUTS, losses, reference

MANUAL = ("parallel.collectives=manual",)


@pytest.mark.parametrize("numerics", [(), ACCUMULATE[0]], ids=["plain", "accumulate+remat_full"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "+".join(c))
def test_layout_matches_single_device(layout, numerics):
  got = losses(layout + numerics + MANUAL)
  np.testing.assert_allclose(got, reference(*numerics), rtol=1e-5)


@pytest.mark.parametrize("layout", [LAYOUTS[2], LAYOUTS[-1]], ids=["zero2", "3d"])
def test_selective_remat_and_small_buckets(layout):
  numerics = ACCUMULATE[1]
  got = losses(layout + numerics + MANUAL + ("parallel.bucket_mb=0.02",))
  np.testing.assert_allclose(got, reference(*numerics), rtol=1e-5)


@pytest.mark.parametrize("layout", [LAYOUTS[5], LAYOUTS[-1]], ids=["tp_sp", "3d"])
def test_collective_matmul_matches_single_device(layout):
  """SP's gather / scatter as ring steps fused with the projections: the same losses and
  gradient norms as one device, with recomputation and micro-batches too."""
  numerics = ACCUMULATE[1]
  got = losses(layout + numerics + MANUAL + ("parallel.collective_matmul=true",))
  np.testing.assert_allclose(got, reference(*numerics), rtol=1e-5)
