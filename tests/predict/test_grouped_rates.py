"""`jscale.predict`'s rates for the Hopper grouped matmul kernels (the measured one, and the
row-grouped kernel's on 64-column tiles) and MLA's attention, against the DeepSeek proxy's
step traced on an H200."""

import gzip

import pytest

from jscale import predict
from jscale.predict import launches, rates, timing

CHIP = rates.chip("h200")
# jax 0.11.2's program of the DeepSeek proxy (compiled on the H200 for an H100; its launches are
# the H200's) and the trace of its run (results/h200_measured/README.md, 2026-11-29)
STEP_2026_11_29 = "results/h200_measured/dsv3_proxy_h100_jax0112.hlo.txt.gz"


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


def test_the_2026_11_29_step_its_kernels_as_traced():
  """The DeepSeek proxy's step as jax 0.11.2 compiled it (bf16 moments and logits, [gate | up]
  as one product, down's dx padded to 1536 columns), against its H200 trace of 2026-11-29: the
  14 row-grouped and 6 transposed launches, 13.6 ms traced, predicted 12.9 (the row kernel ran
  at 555-655 TFLOP/s on groups of ~768 rows, under the 732 measured at 4096; the transposed one
  at 489-573, over the derived 501); MLA's cuDNN attention at head 192, whose rate comes from
  this trace (8.9 ms a step)."""
  with gzip.open(STEP_2026_11_29, "rt") as f:
    text = f.read()
  timed = predict.predict(text, "h200", routed_rows=49152).timed
  runs = lambda label: sum(t.runs for t in timed if t.launch.label == label)
  ms = lambda pick: sum(t.seconds * t.runs for t in timed if pick(t)) * 1e3
  assert (runs("grouped_matmul"), runs("transposed_grouped_matmul")) == (14, 6)
  assert ms(lambda t: "grouped_matmul" in t.launch.label) == pytest.approx(13.63, rel=0.1)
  attention = [t for t in timed if t.launch.kind == "attention"]
  assert attention and not [t for t in attention if "head dim" in t.note]
  assert ms(lambda t: t.launch.kind == "attention") == pytest.approx(8.95, rel=0.03)


def test_the_2026_11_29_step_its_online_softmax_as_traced():
  """The chunked loss's one-pass (max, sum-exp) reductions in that step: 4 launches over 4096 x
  102,400 bf16 logits, which the trace has at 5.54 ms over its 2 steps (0.69 ms each, 1.2
  TB/s); priced by their bytes they were 0.8 ms a step, at `rates.ONLINE_SOFTMAX` as traced."""
  with gzip.open(STEP_2026_11_29, "rt") as f:
    timed = predict.predict(f.read(), "h200", routed_rows=49152).timed
  full = [t for t in timed if t.launch.online >= 4096 * 102400]  # XLA fused two in one here
  assert sum(t.launch.online * t.runs for t in full) == 4 * 4096 * 102400
  assert all(t.bound == "measured" for t in full)
  assert sum(t.seconds * t.runs for t in full) * 1e3 == pytest.approx(5.54 / 2, rel=0.05)


@pytest.mark.parametrize("backward, share", [(False, (192 + 128) / (2 * 192)),
                                             (True, (3 * 192 + 2 * 128) / (5 * 192))])
def test_mla_attention_at_its_own_head_sizes_takes_its_share_of_the_padded_time(backward,
                                                                                 share):
  """cuDNN's attention with V's 128 beside Q's 192 (MLA, `jax_compat.cudnn_mla_attention`)
  does QKᵀ over 192 and PV over 128 (the backward dQ, dK and the recomputed QKᵀ over 192, dP
  and dV over 128): at the padded kernel's measured rate, that share of its time, with a note
  that this kernel's own rate was not timed."""
  def launch(v_head_dim: int) -> launches.Launch:
    a = {"pass": "bwd" if backward else "fwd", "seq": 4096, "head_dim": 192, "causal": True,
         "impl": "cudnn", "v_head_dim": v_head_dim}
    flops = launches._attention_flops(2, 16, 4096, 4096, 192, True, backward, v_head_dim)
    return launches.Launch("a", "custom-call", "attention", "", "", flops=flops, attention=a)

  own, padded = (timing.time_launch(launch(kv), CHIP) for kv in (128, 192))
  assert own.seconds == pytest.approx(share * padded.seconds)
  assert "not timed" in own.note and "not timed" not in padded.note
