"""Every private JAX hook jscale uses, in one file, each with a one-line test
(tests/house/test_jax_compat.py): a JAX upgrade that moves one breaks here, by name. The kernels'
own hooks stay with them (`pallas_kernels/mosaic_gpu_env.py`).

- `coordination_client`: the distributed coordination service's key-value store (agreeing on
  a stop step across processes). Public JAX has no handle on it.
- `appended_compile_options`: bytes appended to the serialised CompileOptions of every compile
  inside it (protobuf merges them): how a compile for GPUs not here plans for a device memory
  size (`jscale.analysis.gpu_target.launched_memory`). JAX has no option for it.
- `jit_cache_size`: how many programs a jitted function has compiled (generation checks its
  decode step compiles once). Public JAX exposes no count.
- `cudnn_compute_capability`: the GPU generation JAX's cuDNN attention checks ask about while
  tracing. With no GPU here (a compile for GPUs that are not here) JAX answers as for no GPU,
  so head sizes over 128, which Hopper's cuDNN takes (MLA's 192), are refused. JAX has no
  option for it.
- `kernel_names`: the names of the kernels a jaxpr equation runs (a `pallas_call`'s name
  parameter, spelled differently across JAX versions, or inside the `custom_vmap_call` a Mosaic
  GPU kernel is wrapped in), for the remat policy that saves the flash kernels' outputs.
"""

from __future__ import annotations

import contextlib
from typing import Any

from jax._src import distributed as _distributed
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention
from jax._src.interpreters import pxla as _pxla

# Private by design: this file is the one home of JAX's private hooks.
from jax._src.lib import xla_client as _xla_client  # pyright: ignore[reportPrivateImportUsage]


def coordination_client() -> Any:
  """The coordination service's client (`key_value_set`, `blocking_key_value_get`, ...); None
  when `jax.distributed` was not initialised."""
  return _distributed.global_state.client


@contextlib.contextmanager
def appended_compile_options(extra: bytes):
  """Inside it, every compile's serialised CompileOptions get `extra` appended."""
  original = _pxla.create_compile_options

  def with_extra(*args, **kwargs):
    opts = original(*args, **kwargs)
    return _xla_client.CompileOptions.ParseFromString(opts.SerializeAsString() + extra)

  _pxla.create_compile_options = with_extra
  try:
    yield
  finally:
    _pxla.create_compile_options = original


@contextlib.contextmanager
def cudnn_compute_capability(capability: str):
  """Inside it, JAX's cuDNN attention asks whether the GPU is at least a given generation of a
  GPU of `capability` ("9.0"), not of this process's devices."""
  original = _cudnn_attention.check_compute_capability
  ours = tuple(int(x) for x in capability.split("."))
  _cudnn_attention.check_compute_capability = (
      lambda wanted: ours >= tuple(int(x) for x in wanted.split(".")))
  try:
    yield
  finally:
    _cudnn_attention.check_compute_capability = original


def jit_cache_size(fn: Any) -> int:
  """The number of compiled programs in jitted function `fn`'s cache."""
  return fn._cache_size()


def kernel_names(prim: Any, params: dict) -> list[str]:
  """The kernel names a jaxpr equation (`prim`, `params`) runs: a pallas_call's own (an
  `mpmd_map` in jax 0.10), or those inside the `custom_vmap_call` a Mosaic GPU kernel
  (`plgpu.kernel`) is wrapped in, which is what a remat policy sees of it."""
  if prim.name in ("pallas_call", "mpmd_map"):
    return [str(params.get("name") or params.get("name_and_src_info"))]
  call = params.get("call") if prim.name == "custom_vmap_call" else None
  if call is None:
    return []
  return [n for eqn in call.jaxpr.eqns for n in kernel_names(eqn.primitive, eqn.params)]
