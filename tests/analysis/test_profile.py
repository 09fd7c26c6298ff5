"""`python -m jscale.profile`: device time by category and top kernels, from a real trace."""

import pytest

from jscale import profile


@pytest.mark.parametrize("name, category", [
    # kernel names from an H100 trace of a llama3_1b step (results/h100_measured/)
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32", "gemm"),
    ("gemm_fusion_dot_24", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "attention"),
    ("flash_attention_dkv", "attention"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collectives"),
    ("memcpy128", "copies"),
    ("loop_dynamic_update_slice_fusion_9", "copies"),
    ("loop_add_multiply_fusion", "elementwise/fusion"),
    ("wrapped_convert_9", "elementwise/fusion"),
    ("rms_norm_fwd", "elementwise/fusion"),
])
def test_categories_of_gpu_kernels(name, category):
  assert profile.categorize(name) == category


def test_summary_of_a_cpu_training_trace(traced_run, tmp_path, capsys):
  run_dir = str(traced_run[0])
  s = profile.summarize(run_dir)
  assert s.device.startswith("/host:CPU") and s.steps == 2
  assert s.by_category["gemm"] > 0 and s.by_category["elementwise/fusion"] > 0
  assert 0 < s.busy_ns <= s.span_ns and s.kernel_ns >= s.busy_ns
  assert s.by_category["collectives"] > 0  # the gradient all-reduce over the 8 devices
  assert abs(sum(k.total_ns for k in s.kernels) - s.kernel_ns) < 1e-3 * s.kernel_ns
  assert s.kernels[0].total_ns >= s.kernels[-1].total_ns and all(k.count > 0 for k in s.kernels)
  # the layer scan's matmuls ran once per layer per traced step: counts are per-step multiples
  assert any(k.category == "gemm" and k.count % 2 == 0 for k in s.kernels)

  assert profile.main([run_dir, "--top", "5"]) == 0
  out = capsys.readouterr().out
  assert "ms per step (2 steps)" in out and "idle" in out and "top 5 kernels" in out
  assert profile.main([str(tmp_path / "nothing")]) == 2


def test_bench_train_quick(tmp_path):
  """scripts/bench_train.py end to end on CPU (`--quick`): a row with metrics and shares."""
  import csv
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "bench_train.md"
  subprocess.run([sys.executable, "scripts/bench_train.py", "--quick", "--steps", "6",
                  "--every", "2", "--exact", "--only", "tiny b8", "--out", str(out)], cwd=root,
                 check=True,
                 env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
  (row,) = csv.DictReader(open(tmp_path / "bench_train.csv"))
  assert row["status"] == "ok" and float(row["tokens_per_sec"]) > 0
  # The kernels' union and idle make the span; XLA:CPU runs independent thunks at once, so the
  # categories (overlaps counted twice) sum to that union or more, by up to the host's threads.
  total = sum(float(row[f"share_{k}"]) for k in ("gemm", "attention", "collectives",
                                                 "elementwise", "copies", "idle"))
  assert 0.99 <= total <= 1 + (os.cpu_count() or 1) and 0 <= float(row["share_idle"]) <= 1
  assert "### tiny b8" in out.read_text()
