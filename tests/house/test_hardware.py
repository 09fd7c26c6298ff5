"""The GPU facts' one home (`jscale.hardware`): device kinds resolve to the right card, and the
compiler's target descriptions (`jscale/analysis/gpu_specs/`) agree with it."""

import re

import pytest

from jscale import hardware, metrics
from jscale.analysis import gpu_target
from jscale.plan import memory
from jscale.predict import rates
from jscale.xla_flags import MEM_FRACTION


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("cpu", None)])
def test_device_kinds_resolve_to_their_card(kind, name):
  gpu = hardware.of_device_kind(kind)
  assert (gpu.name if gpu else None) == name


@pytest.mark.parametrize("gpu", sorted(gpu_target.TARGETS))
def test_compile_targets_agree_with_the_hardware_table(gpu):
  spec, card = gpu_target.spec(gpu), hardware.GPUS[gpu]
  assert int(re.search(r"core_count:\s*(\d+)", spec).group(1)) == card.sms
  # The spec's device_memory_size (what CUDA gives a process) against nvidia-smi's figure.
  size = int(re.search(r"device_memory_size:\s*(\d+)", spec).group(1))
  assert abs(size - card.hbm_bytes) < hardware.GiB


def test_every_reader_takes_the_same_figures():
  h100 = hardware.GPUS["h100"]
  chip = rates.chip("h100")
  assert chip.peak["bf16"] == h100.peak_flops["bf16"] == 989.5e12
  assert (chip.sms, chip.per_node, chip.hbm_bytes_s) == (132, 8, h100.hbm_bytes_s)
  assert memory.usable_bytes(h100) == pytest.approx(float(MEM_FRACTION) * 79.6 * 2**30)
  assert hardware.predictable("NVIDIA H100 PCIe") is None  # no copy bandwidth measured
  assert metrics.device_peak_flops(type("D", (), {"device_kind": "NVIDIA H100 PCIe"})()) == 756e12
