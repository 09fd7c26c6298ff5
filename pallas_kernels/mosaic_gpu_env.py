"""What the Hopper (Mosaic GPU) kernels ask of where they run: the GPU's SM count (their
persistent grids have one CUDA block per SM, or a few), and JAX's Mosaic GPU interpreter
(their interpret modes, for CPU tests)."""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

H100_SMS = 132  # when lowering without a GPU (AOT compiles, tests)


def num_sms() -> int:
  """SMs of this process's GPU; an H100's when there is none."""
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or H100_SMS) if dev.platform == "gpu" else H100_SMS


def interpret_params():
  """The interpreter's parameters, passed as `interpret=` to `plgpu.kernel` (public from jax
  0.11; jax 0.10 has them private)."""
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params as p
    params = p.InterpretGPUParams
  return params()
