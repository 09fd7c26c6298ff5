"""The real XLA:GPU compiler for GPUs that are not here: device descriptions of N H100s to lower
and compile a step against (`memory_analysis()`, the collectives XLA:GPU emits, its fusions and
custom calls), from any machine with JAX's CUDA plugin — one GPU, or none at all.

`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x1x8")` describes 8
GPUs like the local one. With no GPU present it fails ("No visible GPU devices") unless the
plugin is also given a `target_config`: the GPU as the compiler sees it (SM count, shared
memory, HBM size, compute capability, cuDNN version; `gpu_specs/*.txtpb`). Found with jax
0.10.2 on a CPU-only machine: with `jax[cuda13-local]` (the plugin, no CUDA wheels) a matmul
compiles; jscale's train step also needs `nvidia-cudnn-cu13`, because cuDNN attention asks
cuDNN's version while tracing and builds its graph while compiling. Nothing runs: there is no
autotuning (XLA picks its default gemm algorithms), which changes no buffer or collective.

The memory XLA plans for: on a GPU, JAX compiles with `device_memory_size` = its allocator's
limit (total x XLA_PYTHON_CLIENT_MEM_FRACTION, 0.9 under `python -m jscale.train`), which
XLA:GPU's scheduler and rematerialisation budget against; a compile for a topology has no
allocator and would plan for 0.8 x total (llama3_1b batch 8 on an H100: 86 instructions
rematerialised that a launched run keeps). `launched_memory` sets a figure
(`introspect.compile_as_launched`: the launcher's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import re

import jax

from jscale import hardware, jax_compat

# name (`jscale.hardware.GPUS`) -> its spec file in gpu_specs/
TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
INSTALL = ("pip install -e \".[gpu-compile]\" in the jscale checkout (JAX's CUDA plugin and "
           "cuDNN, about 2 GB of wheels; no GPU needed)")


def parse(target: str) -> tuple[str, int]:
  """'h100x8' -> ('h100', 8); ValueError naming the accepted form otherwise."""
  m = re.fullmatch(r"([a-z0-9]+)x(\d+)", target.strip().lower())
  if not m or m.group(1) not in TARGETS or int(m.group(2)) < 1:
    raise ValueError(f"--target {target!r}: expected <gpu>x<count> with gpu one of "
                     f"{', '.join(TARGETS)} (e.g. h100x8, h100x64)")
  return m.group(1), int(m.group(2))


def topology_name(n: int, per_node: int) -> str:
  """The plugin's 'partitions x hosts x devices-per-host' for `n` GPUs, nodes filled first."""
  if n <= per_node:
    return f"1x1x{n}"
  if n % per_node:
    raise ValueError(f"{n} GPUs do not fill whole nodes of {per_node}")
  return f"1x{n // per_node}x{per_node}"


def spec(gpu: str) -> str:
  """The target_config text of `gpu` (a key of TARGETS)."""
  return (importlib.resources.files("jscale.analysis") / "gpu_specs" /
          TARGETS[gpu]).read_text()


def devices(target: str) -> list[jax.Device]:
  """Device descriptions of `target` ('h100x8'), to build a Mesh over and compile for (they
  cannot hold arrays or run). RuntimeError naming the install when the plugin is missing."""
  return list(_topology(*parse(target)))


@functools.lru_cache(maxsize=None)
def _topology(gpu: str, n: int) -> tuple[jax.Device, ...]:
  from jax.experimental import topologies
  target = f"{gpu}x{n}"
  try:
    topo = topologies.get_topology_desc(platform="cuda",
                                        topology=topology_name(n, hardware.GPUS[gpu].gpus_per_node),
                                        target_config=spec(gpu))
  except (NotImplementedError, RuntimeError) as e:  # no plugin / a plugin that cannot load
    raise RuntimeError(f"cannot compile for {target}: the real XLA:GPU compiler comes with "
                       f"JAX's CUDA plugin, which is missing or failed to load "
                       f"({str(e).splitlines()[0][:160]}); {INSTALL}") from e
  return tuple(topo.devices)


def available() -> bool:
  """Whether this machine can compile for GPU targets (the CUDA plugin is installed)."""
  try:
    devices("h100x1")
  except RuntimeError:
    return False
  return True


def memory_bytes(device: jax.Device) -> int | None:
  """Device memory of a GPU of TARGETS (its spec's figure); None for another device."""
  gpu = next((g for g in TARGETS if f'name: "{device.device_kind}"' in spec(g)), None)
  return int(re.search(r"device_memory_size:\s*(\d+)", spec(gpu)).group(1)) if gpu else None


@contextlib.contextmanager
def tracing_for(device: jax.Device):
  """Traces inside see `device`'s GPU generation where JAX asks the local one: a GPU target
  compiled on a machine without that GPU (JAX's cuDNN attention checks take head sizes up to
  256 on Hopper, 128 on what it takes for no GPU)."""
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or capability is None or jax.default_backend() == "gpu":
    yield
    return
  with jax_compat.cudnn_compute_capability(capability):
    yield


@contextlib.contextmanager
def launched_memory(size: int | None):
  """Compiles inside plan for `size` bytes of device memory, as on a GPU (None: XLA's own
  choice). JAX has no option for it: the serialised CompileOptions get
  ExecutableBuildOptionsProto.device_memory_size (field 15 of field 3) appended, which
  protobuf merges into the message."""
  if size is None:
    yield
    return
  def varint(n: int) -> bytes:
    out = bytearray()
    while True:
      b, n = n & 0x7F, n >> 7
      out.append(b | (0x80 if n else 0))
      if not n:
        return bytes(out)
  inner = b"\x78" + varint(size)
  extra = b"\x1a" + varint(len(inner)) + inner
  with jax_compat.appended_compile_options(extra):
    yield
