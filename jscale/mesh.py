"""The device mesh: named axes, sizes from `mesh.*`, slow axes outermost and tensor innermost.

Axis order (outermost first) is `data, stage, fsdp, expert, sequence, tensor`: the axes that
communicate least often (gradient all-reduce once per step, pipeline hand-offs) span the slow
links between nodes; tensor parallelism, which communicates inside every layer, gets the
fastest links. For multi-node GPU runs the mesh is hybrid (as in MaxText): `mesh.<axis>` is the
degree inside a node (NVLink) and `mesh.dcn_<axis>` the degree across nodes (the data-center
network), laid out by `mesh_utils.create_hybrid_device_mesh`.

Axis types are Auto: in "xla" mode GSPMD propagates shardings from the annotations jscale places
(the point of that mode); "manual" mode enters `jax.shard_map` explicitly over the same mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jscale.config import ConfigError, MeshConfig

AXES = tuple(f.name for f in dataclasses.fields(MeshConfig) if not f.name.startswith("dcn_"))


def axis_sizes(cfg: MeshConfig, n_devices: int) -> dict[str, tuple[int, int]]:
  """{axis: (ici degree, dcn degree)} with -1 resolved so the product is `n_devices`."""
  ici = {a: getattr(cfg, a) for a in AXES}
  dcn = {a: getattr(cfg, f"dcn_{a}") for a in AXES}
  known = math.prod(v for v in ici.values() if v != -1) * math.prod(dcn.values())
  free = [a for a, v in ici.items() if v == -1]
  if free:
    if n_devices % known:
      raise ConfigError(
          f"mesh.{free[0]}=-1: the other mesh sizes multiply to {known}, which does not divide "
          f"the {_devices(n_devices)}; change the mesh sizes")
    ici[free[0]] = n_devices // known
  total = math.prod(ici.values()) * math.prod(dcn.values())
  if total != n_devices:
    sizes = " x ".join(f"{a}={ici[a] * dcn[a]}" for a in AXES if ici[a] * dcn[a] > 1) or "1"
    raise ConfigError(f"mesh sizes multiply to {total} ({sizes}) but the run has "
                      f"{_devices(n_devices)}: make the product of mesh.* (times mesh.dcn_*) "
                      "equal the device count, or set one axis to -1")
  return {a: (ici[a], dcn[a]) for a in AXES}


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the mesh over `devices` (default: all global devices)."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = axis_sizes(cfg, len(devices))
  ici_shape = [sizes[a][0] for a in AXES]
  dcn_shape = [sizes[a][1] for a in AXES]
  if math.prod(dcn_shape) > 1:
    grid = _hybrid_grid(ici_shape, dcn_shape, devices)
  else:
    grid = _ici_grid(ici_shape, devices)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def partition_devices(m: Mesh) -> tuple[int, ...]:
  """The device id each partition of an SPMD program over `m` runs on: its device assignment,
  in the partition order its collectives' replica groups name (a hybrid mesh's is a
  permutation of the ids)."""
  return tuple(int(d.id) for d in m.devices.flat)


def _ici_grid(shape: list[int], devices: Sequence[jax.Device]) -> np.ndarray:
  """`devices` of one node (or slice) laid out as `shape`."""
  if devices[0].platform in ("gpu", "tpu"):
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  return np.asarray(devices, dtype=object).reshape(shape)  # CPU: device-id order


def _hybrid_grid(ici_shape: list[int], dcn_shape: list[int],
                 devices: Sequence[jax.Device]) -> np.ndarray:
  """One granule per node, each laid out as `ici_shape`, the granules tiled as `dcn_shape`. A
  TPU's granule is its slice (JAX's rule). A GPU's is a node: consecutive devices in process
  order, as clusters number them (one process per node or per GPU) and as `gpu_target`'s
  topologies describe them; JAX's GPU rule (a process per granule) fits only the first."""
  if devices[0].platform == "tpu":
    return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                allow_split_physical_axes=True)
  n = math.prod(dcn_shape)
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  per = len(ordered) // n
  blocks = np.empty(n, dtype=object)
  for i in range(n):
    blocks[i] = _ici_grid(ici_shape, ordered[i * per:(i + 1) * per])
  return np.block(blocks.reshape(dcn_shape).tolist())


def _devices(n: int) -> str:
  return f"{n} device" if n == 1 else f"{n} devices"
