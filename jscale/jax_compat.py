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
- `cudnn_mla_supported` / `cudnn_mla_attention`: cuDNN's fused attention with V's head size
  apart from Q's (MLA's 128 beside 192; cuDNN 9.10+ on Hopper). JAX's cuDNN path runs it, but
  `jax.nn.dot_product_attention` checks V's shape against K's first, so the call goes under it.
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
from jax._src.lib import cuda_versions as _cuda_versions  # pyright: ignore[reportPrivateImportUsage]
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


# cuDNN's first version whose fused attention takes V's head size apart from Q's: JAX's own
# check (`check_is_flash_attention`, "mla requires cudnn version >= 9.10 and at least hopper").
CUDNN_MLA = 91000


def cudnn_mla_supported(compute_capability: str | None = None) -> bool:
  """Whether JAX's cuDNN attention takes a V head size apart from Q's: cuDNN >= 9.10 on Hopper
  or newer, the GPU's `compute_capability` ("9.0"; None: as JAX's check sees this process's
  GPU, or the generation `cudnn_compute_capability` gives)."""
  if _cuda_versions is None or _cuda_versions.cudnn_get_version() < CUDNN_MLA:
    return False
  if compute_capability is None:
    return _cudnn_attention.check_compute_capability("9.0")
  return float(compute_capability) >= 9.0


def cudnn_mla_attention(q_BLHK: Any, k_BSGK: Any, v_BSGV: Any, causal: bool,
                        mask: Any = None) -> Any:
  """cuDNN's fused attention with V [B, S, G, Kv] as it is (Kv below K: no padding): [B, L, H,
  Kv], scaled by 1/sqrt(K), `mask` a boolean [B, 1, L, S] or None; what
  `jax.nn.dot_product_attention(..., implementation="cudnn")` runs, without its V-shape check."""
  mask_type = (_cudnn_attention.MaskType.CAUSAL if causal
               else _cudnn_attention.MaskType.NO_MASK)
  return _cudnn_attention.dot_product_attention(
      q_BLHK, k_BSGK, v_BSGV, mask=mask, scale=float(q_BLHK.shape[-1]) ** -0.5,
      mask_type=mask_type, qkv_layout="BTNH")


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
