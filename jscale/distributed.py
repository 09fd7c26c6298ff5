"""Multi-process (multi-host) setup: `initialize`, global batches from per-process shards.

One jscale process drives all the devices of its host (or of its slice of a host); several
processes form one JAX program over every device (`jax.devices()` is global,
`jax.local_devices()` this process's). `initialize(cfg.distributed)` must run before anything
touches a JAX backend (`jax.devices()`, `device_put`, a jitted call), and picks the mode:

* explicit: `distributed.coordinator` (`host:port` of process 0), `distributed.num_processes`
  and `distributed.process_id` all given (as `scripts/launch_local.py` passes them): those are
  used verbatim and cluster auto-detection is off, so each process sees all of its local
  devices (restrict GPUs per process with CUDA_VISIBLE_DEVICES or JAX_LOCAL_DEVICE_IDS).
* SLURM: all three null and `SLURM_NTASKS` > 1 inside an `srun` step: `jax.distributed.
  initialize()` reads SLURM's variables itself (coordinator = first node of
  SLURM_STEP_NODELIST, port from the job id or JAX_COORDINATOR_PORT; SLURM_NTASKS processes;
  id SLURM_PROCID). With one task on the node, this process keeps all of the node's GPUs
  (jax would otherwise pin it to GPU SLURM_LOCALID); with one task per GPU, jax's default
  (task i on local GPU i) holds. See scripts/slurm/README.md.
* otherwise: one process; nothing to do.

On CPU, cross-process collectives go through gloo (`jax_cpu_collectives_implementation`),
which is set before the distributed runtime starts unless another implementation was chosen.
Connecting is bounded by `distributed.init_timeout_s` (a peer that never starts cannot hang the
others), the run afterwards by JAX's heartbeats (`distributed.heartbeat_timeout_s`).

`global_batch` turns each process's local rows into global `jax.Array`s laid out by a
`NamedSharding` whose batch axis spans the processes (process p's rows become the p-th block
of the global batch, for a mesh whose devices are ordered by process as `jax.make_mesh` does).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Mapping

import jax
import numpy as np

from jscale import exit_codes
from jscale.config import ConfigError, DistributedConfig

_EXPLICIT_KEYS = ("coordinator", "num_processes", "process_id")
# What jax's SLURM cluster detection needs (jax/_src/clusters/slurm_cluster.py); the step
# variables exist only in tasks that srun started.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


def validate(dist_cfg: DistributedConfig) -> None:
  """Checks the `distributed` section alone (no JAX call); raises ConfigError naming the key."""
  if dist_cfg.heartbeat_timeout_s < 1:
    raise ConfigError(f"distributed.heartbeat_timeout_s={dist_cfg.heartbeat_timeout_s} must be "
                      ">= 1 (seconds before a silent process is declared lost)")
  if dist_cfg.init_timeout_s < 1:
    raise ConfigError(f"distributed.init_timeout_s={dist_cfg.init_timeout_s} must be >= 1 "
                      "(seconds for every process to reach the coordinator)")
  given = {k: getattr(dist_cfg, k) for k in _EXPLICIT_KEYS}
  if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
    missing = [f"distributed.{k}" for k, v in given.items() if v is None]
    have = [f"distributed.{k}={v}" for k, v in given.items() if v is not None]
    raise ConfigError(f"{', '.join(have)} needs {' and '.join(missing)} as well: give all of "
                      "distributed.coordinator, num_processes and process_id, or none of them "
                      "(then SLURM's environment, or a single process)")
  if given["coordinator"] is None:
    return
  host, sep, port = str(dist_cfg.coordinator).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"distributed.coordinator={dist_cfg.coordinator!r}: give host:port of "
                      "process 0, e.g. distributed.coordinator=10.0.0.1:1234")
  n, pid = dist_cfg.num_processes, dist_cfg.process_id
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ConfigError(f"distributed.num_processes={n!r} must be a positive integer")
  if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < n:
    raise ConfigError(f"distributed.process_id={pid!r} must lie in [0, distributed."
                      f"num_processes={n}): number the processes 0 .. {n - 1}")


def initialize(dist_cfg: DistributedConfig) -> None:
  """Starts JAX's distributed runtime when this run spans several processes; idempotent.

  Call before any other JAX use. Explicit settings, else SLURM (> 1 task), else nothing.
  """
  validate(dist_cfg)
  if jax.distributed.is_initialized():
    return
  if dist_cfg.coordinator is not None:
    _use_gloo_on_cpu()
    # All three given: "deactivate" keeps jax from filling local_device_ids from a cluster
    # environment it happens to see (under SLURM it would pin one GPU per process).
    with _bounded(dist_cfg, f"process {dist_cfg.process_id} of {dist_cfg.num_processes}",
                  dist_cfg.coordinator):
      jax.distributed.initialize(coordinator_address=dist_cfg.coordinator,
                                 num_processes=dist_cfg.num_processes,
                                 process_id=dist_cfg.process_id,
                                 cluster_detection_method="deactivate",
                                 **_timeouts(dist_cfg))
    return
  ntasks = _slurm_ntasks(os.environ)
  if ntasks is None or ntasks <= 1:
    return  # one process: the default single-process runtime needs no setup
  missing = [v for v in _SLURM_VARS if v not in os.environ]
  if missing:
    raise ConfigError(
        f"SLURM_NTASKS={ntasks} but {', '.join(missing)} unset: this process was not started by "
        "srun, so its peers do not exist; launch with `srun python -m jscale.train ...`, or set "
        "distributed.coordinator/num_processes/process_id explicitly")
  _use_gloo_on_cpu()
  # local_device_ids=[] means "every local device" (jax only restricts visibility for a
  # non-empty list, and auto-detection only fills it when it is None); None keeps jax's default.
  with _bounded(dist_cfg, f"SLURM task {os.environ.get('SLURM_PROCID', '?')} of {ntasks}",
                "SLURM's first node"):
    jax.distributed.initialize(local_device_ids=slurm_local_device_ids(os.environ),
                               **_timeouts(dist_cfg))


def _timeouts(dist_cfg: DistributedConfig) -> dict[str, int]:
  # JAX's own start-up deadline stays behind `_bounded`'s: it aborts without naming a cause.
  return {"heartbeat_timeout_seconds": dist_cfg.heartbeat_timeout_s,
          "initialization_timeout": dist_cfg.init_timeout_s + 30}


@contextlib.contextmanager
def _bounded(dist_cfg: DistributedConfig, me: str, coordinator: str):
  """Exits this process (`exit_codes.PEERS_MISSING`) with a message if the block, connecting to the
  coordinator, has not finished within `distributed.init_timeout_s`: every process blocks
  there until all have registered, so a peer that never started or died while starting would
  hang the others."""
  done = threading.Event()

  def watchdog():
    if not done.wait(dist_cfg.init_timeout_s):
      print(f"error: {me}: not every process reached the coordinator at {coordinator} within "
            f"distributed.init_timeout_s={dist_cfg.init_timeout_s} s: a process failed to start "
            "or died while starting (see its log); relaunch the same command on every process "
            "(a run with checkpoints resumes)", file=sys.stderr, flush=True)
      os._exit(exit_codes.PEERS_MISSING)  # at once: JAX's blocked threads never return

  threading.Thread(target=watchdog, name="jscale-init-watchdog", daemon=True).start()
  try:
    yield
  finally:
    done.set()


def is_main() -> bool:
  """True in process 0 (the one that logs, writes metrics and prints summaries)."""
  return jax.process_index() == 0


def global_batch(local_batch: Mapping[str, np.ndarray],
                 sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
  """Global arrays from this process's rows of every batch entry.

  `sharding` partitions the leading (batch) dim over mesh axes whose devices span the
  processes, e.g. `NamedSharding(mesh, P("data"))` or `P(("dcn_data", "data"))`; trailing dims
  follow its spec (usually replicated). Each process passes `local_batch[k]` with
  `global_rows / process_count` rows (the rows its devices hold) and gets `[global_rows, ...]`.
  On one process this is a `device_put`. Axes that do not span processes must see identical
  local data on every process (replicas), as `jax.make_array_from_process_local_data` requires.
  """
  out = {}
  for name, value in local_batch.items():
    value = np.asarray(value)
    try:
      out[name] = jax.make_array_from_process_local_data(sharding, value)
    except ValueError as e:
      raise ValueError(
          f"global_batch[{name!r}]: local shape {value.shape} does not fit sharding "
          f"{sharding.spec} over mesh {dict(sharding.mesh.shape)} on process "
          f"{jax.process_index()} of {jax.process_count()} (each process passes its own rows, "
          f"a multiple of the devices it holds along the batch axes): {e}") from e
  return out


# ------------------------------------------------------------------ helpers

def _use_gloo_on_cpu() -> None:
  """Cross-process CPU collectives need an implementation: gloo unless one was chosen (mpi)."""
  # A flag JAX defines at run time (its config has no static attribute for it).
  if getattr(jax.config, "jax_cpu_collectives_implementation") is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _slurm_ntasks(env: Mapping[str, str]) -> int | None:
  value = env.get("SLURM_NTASKS")
  if value is None:
    return None
  try:
    return int(value)
  except ValueError as e:
    raise ConfigError(f"SLURM_NTASKS={value!r} is not an integer") from e


def _expand_tasks_per_node(spec: str) -> list[int]:
  """SLURM's compressed per-node task counts: '2(x3),1' -> [2, 2, 2, 1]."""
  counts = []
  for part in spec.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not m:
      raise ValueError(spec)
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
  """How many tasks of this srun step run on this node (None: cannot tell)."""
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  if spec:
    try:
      counts = _expand_tasks_per_node(spec)
      if len(set(counts)) == 1:
        return counts[0]
      node = int(env.get("SLURM_NODEID", "-1"))
      if 0 <= node < len(counts):
        return counts[node]
    except ValueError:
      pass
  ntasks = env.get("SLURM_NTASKS")
  nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
  if ntasks and nodes and ntasks == nodes:
    return 1
  return None


def slurm_local_device_ids(env: Mapping[str, str]) -> list[int] | None:
  """The `local_device_ids` for jax.distributed.initialize() under SLURM.

  [] (all local devices) when this task is alone on its node, or when SLURM already gave each
  task its own GPUs (CUDA/ROCR/HIP_VISIBLE_DEVICES lists fewer GPUs than tasks on the node);
  None (jax's default: JAX_LOCAL_DEVICE_IDS if set, else local GPU SLURM_LOCALID) otherwise.
  """
  if env.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  local_tasks = slurm_tasks_on_node(env)
  if local_tasks == 1:
    return []
  if local_tasks is not None:
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
      visible = env.get(var)
      if visible and len([d for d in visible.split(",") if d.strip()]) < local_tasks:
        return []
  return None
