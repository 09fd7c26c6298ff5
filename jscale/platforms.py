"""Which JAX platforms a command starts, decided before any JAX backend does.

With JAX's CUDA plugin installed (the `gpu-compile` extra, for `jscale.predict` and `jscale.plan
--verify`) on a machine without an NVIDIA GPU, JAX tries the plugin first: it fails with a
"Jax plugin configuration error" / "Unable to load cuFFT" traceback, then falls back to the CPU.
`settle()` asks for the CPU alone there, so no command prints that. `JAX_PLATFORMS`, where set,
wins; a machine with a GPU is left to JAX.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def cuda_plugin_installed() -> bool:
  """Whether one of JAX's CUDA plugins is installed (found, not imported)."""
  return importlib.util.find_spec("jax_plugins") is not None and any(
      importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def has_nvidia_gpu() -> bool:
  """Whether the NVIDIA driver exposes a GPU here (its device files)."""
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def settle() -> None:
  """The CPU alone where the CUDA plugin is installed, no NVIDIA GPU is here and JAX_PLATFORMS
  is not set; call it before anything starts a JAX backend."""
  if "JAX_PLATFORMS" not in os.environ and cuda_plugin_installed() and not has_nvidia_gpu():
    jax.config.update("jax_platforms", "cpu")
