"""`jscale.predict`'s rates for the Hopper grouped matmul kernels: the measured one, and the
lower one of the row-grouped kernel on 64-column tiles, which reproduces what the H200 measured
for DeepSeek-V3's 1408-wide experts in the step it compiled itself."""

import gzip

import pytest

from jscale import predict
from jscale.predict import launches, rates, timing

CHIP = rates.chip("h200")
H200_STEP = "results/h200_measured/dsv3_proxy_step_h200.hlo.txt.gz"
# results/h200_measured/bench_train_deepseek.md: grouped_matmul_mosaic_gpu_kernel, 34.29 ms over
# the 2 profiled steps (48 launches)
MEASURED_GROUPED_MS = 34.29 / 2


def _kernel(label: str, n: int, k: int, dtype: str = "bf16") -> launches.Launch:
  return launches.Launch("k", "custom-call", "kernel", label, "", bytes=1.0, dtype=dtype,
                         mnk=(1, 49152, n, k))


@pytest.mark.parametrize("label, n, k, rate", [
    ("grouped_matmul", 1408, 2048, rates.GROUPED_NARROW),  # gate or up alone: 64-column tiles
    ("grouped_matmul", 2816, 2048, rates.GROUPED["grouped_matmul"]),  # [gate | up]
    ("grouped_matmul", 2048, 1408, rates.GROUPED["grouped_matmul"]),  # down
    ("transposed_grouped_matmul", 1408, 2048, rates.GROUPED["transposed_grouped_matmul"]),
])
def test_rate_by_the_tiles_the_kernel_runs(label, n, k, rate):
  t = timing.time_launch(_kernel(label, n, k), CHIP)
  assert t.seconds == pytest.approx(2 * 49152 * n * k / rate) and t.bound == "measured"


def test_fp8_operands_scale_the_rate_of_their_tiles():
  t = timing.time_launch(_kernel("grouped_matmul", 2816, 2048, "f8"), CHIP)
  rate = rates.GROUPED["grouped_matmul"] * CHIP.peak["f8"] / CHIP.peak["bf16"]
  assert t.seconds == pytest.approx(2 * 49152 * 2816 * 2048 / rate)


def test_the_narrow_rate_reproduces_the_h200s_deepseek_step():
  """The step jax 0.11.2 compiled on the H200 (gate and up as separate products then): its 24
  row-grouped kernels predicted at the measured 17.1 ms."""
  with gzip.open(H200_STEP, "rt") as f:
    text = f.read()
  timed = predict.predict(text, "h200", routed_rows=49152).timed
  grouped = [t for t in timed if t.launch.label == "grouped_matmul"]
  assert sum(t.runs for t in grouped) == 24
  ms = sum(t.seconds * t.runs for t in grouped) * 1e3
  assert ms == pytest.approx(MEASURED_GROUPED_MS, rel=0.01)
