"""jscale.distributed and scripts/launch_local.py with real processes on localhost.

The multi-process tests start 2 Python processes (tests/mp_worker.py), each with 2 simulated
CPU devices and its own environment (the pytest process itself has 8 devices, see conftest),
which join one JAX program over 4 devices through jax.distributed (gloo collectives) and
reduce a global batch built from per-process rows. Validation tests run in-process and never
reach jax.distributed.
"""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import TINY_RUN
from jscale import distributed
from jscale.config import ConfigError, DistributedConfig
from jscale.config_load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "mp_worker.py")
LAUNCHER = os.path.join(ROOT, "scripts", "launch_local.py")
SBATCH = os.path.join(ROOT, "scripts", "slurm", "train.sbatch")
TIMEOUT = 120  # a hung rendezvous fails the test instead of the session

_spec = importlib.util.spec_from_file_location("mp_worker", WORKER)
mp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp_worker)


def _free_port() -> int:
  try:
    import portpicker  # pylint: disable=import-outside-toplevel  (not a jscale dependency)
    return portpicker.pick_unused_port()
  except ImportError:
    with socket.socket() as s:
      s.bind(("", 0))
      return s.getsockname()[1]


def _base_env(devices: int) -> dict[str, str]:
  """This environment minus pytest's 8-device flag and any SLURM variables, for a child."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run_all(cmds_envs) -> list[subprocess.CompletedProcess]:
  """Starts every (argv, env) at once, waits for all (killing all on timeout)."""
  procs = [subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for argv, env in cmds_envs]
  deadline = time.monotonic() + TIMEOUT
  results = []
  try:
    for p, (argv, _) in zip(procs, cmds_envs):
      out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
      results.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return results


def _results(stdout: str) -> list[dict]:
  return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines()
          if "RESULT " in line]


def _expected(n_proc: int, devices: int) -> tuple[int, int]:
  """Global sum and row-index-weighted sum of the concatenated per-process rows."""
  rows = mp_worker.ROWS_PER_DEVICE * devices
  full = np.concatenate([mp_worker.local_rows(p, rows) for p in range(n_proc)]).astype(np.int64)
  row_sums = full.sum(axis=1)
  return int(row_sums.sum()), int((row_sums * np.arange(len(row_sums))).sum())


def _check(results: list[dict], n_proc: int = 2, devices: int = 2) -> None:
  total, weighted = _expected(n_proc, devices)
  assert sorted(r["process_index"] for r in results) == list(range(n_proc))
  for r in results:
    assert r["process_count"] == n_proc
    assert r["local_device_count"] == devices
    assert r["device_count"] == n_proc * devices
    assert r["global_shape"] == [n_proc * devices * mp_worker.ROWS_PER_DEVICE, mp_worker.SEQ]
    assert r["sum"] == total, r
    assert r["weighted_sum"] == weighted, r  # process p's rows are the p-th block
    assert r["weights_sum"] == sum((p + 1) * devices * mp_worker.ROWS_PER_DEVICE
                                   for p in range(n_proc))
    assert r["is_main"] == (r["process_index"] == 0)
    assert r["cpu_collectives"] == "gloo"


# ------------------------------------------------------------------ real multi-process runs

def test_two_processes_explicit_config_global_batch_reduction():
  port, env = _free_port(), _base_env(2)
  runs = _run_all([
      ([sys.executable, WORKER, f"distributed.coordinator=localhost:{port}",
        "distributed.num_processes=2", f"distributed.process_id={i}"], env) for i in range(2)])
  for r in runs:
    assert r.returncode == 0, r.stdout + r.stderr
  results = [res for r in runs for res in _results(r.stdout)]
  assert len(results) == 2
  _check(results)
  assert all(r["cuda_visible_devices"] == "all" for r in results)  # explicit: no pinning


@pytest.mark.parametrize("tasks_per_node", ["2", "1(x2)"])
def test_two_processes_from_slurm_environment(tasks_per_node):
  """No distributed.* settings: jax reads SLURM's variables (as srun sets them)."""
  port = _free_port()
  one_per_node = tasks_per_node != "2"
  cmds = []
  for i in range(2):
    env = _base_env(2)
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(i), SLURM_LOCALID="0" if one_per_node else str(i),
               SLURM_NODEID=str(i) if one_per_node else "0",
               SLURM_STEP_TASKS_PER_NODE=tasks_per_node, JAX_COORDINATOR_PORT=str(port))
    cmds.append(([sys.executable, WORKER], env))
  runs = _run_all(cmds)
  for r in runs:
    assert r.returncode == 0, r.stdout + r.stderr
  results = [res for r in runs for res in _results(r.stdout)]
  _check(results)
  for r in results:
    # Two tasks on a node: jax pins task i to local GPU i; one task per node keeps them all.
    want = "all" if one_per_node else str(r["process_index"])
    assert r["cuda_visible_devices"] == want


# ------------------------------------------------------------------ launch_local.py

def _launch(*args: str, env=None, timeout=TIMEOUT) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, LAUNCHER, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env or _base_env(8))


def test_launch_local_runs_n_processes_with_env_and_overrides():
  code = ("import os, sys; print('FLAGS', os.environ['XLA_FLAGS'], os.environ['JAX_PLATFORMS']);"
          " print('ARGS', ' '.join(sys.argv[1:]))")
  r = _launch("-n", "3", "--devices-per-process", "4", "--", sys.executable, "-c", code)
  assert r.returncode == 0, r.stdout + r.stderr
  lines = r.stdout.splitlines()
  for i in range(3):
    flags = [l for l in lines if l.startswith(f"[{i}] FLAGS")]
    assert len(flags) == 1, r.stdout
    # pytest's own 8-device flag is replaced, not appended to.
    assert re.findall(r"device_count=(\d+)", flags[0]) == ["4"]
    assert flags[0].endswith(" cpu")
    args = [l for l in lines if l.startswith(f"[{i}] ARGS")]
    assert len(args) == 1
    assert re.fullmatch(rf"\[{i}\] ARGS distributed.coordinator=localhost:\d+ "
                        rf"distributed.num_processes=3 distributed.process_id={i}", args[0])
  ports = {re.search(r"localhost:(\d+)", l).group(1) for l in lines if "ARGS" in l}
  assert len(ports) == 1  # one coordinator for all


def test_launch_local_propagates_first_failure_and_stops_the_others():
  # Process 1 fails fast with 7; the others would sleep far past the test's timeout.
  code = ("import sys, time; pid = int(sys.argv[-1].split('=')[1]); print('up', flush=True);"
          " time.sleep(0.3); sys.exit(7) if pid == 1 else time.sleep(300)")
  start = time.monotonic()
  r = _launch("-n", "3", "--grace", "2", "--", sys.executable, "-c", code, timeout=60)
  assert r.returncode == 7, r.stdout + r.stderr
  assert time.monotonic() - start < 30
  assert {l[:3] for l in r.stdout.splitlines() if l.endswith("up")} == {"[0]", "[1]", "[2]"}
  assert "process 1 exited with 7" in r.stderr


def _losses(out) -> dict[int, float]:
  with open(out / "metrics.jsonl", encoding="utf-8") as f:
    return {(r := json.loads(line))["step"]: r["loss"] for line in f if '"loss"' in line}


def test_a_run_resumes_on_another_process_count_with_the_same_examples(tmp_path, data_cache,
                                                                       child_env):
  """Saved by 2 processes, resumed by 1, then by 2 again: every step's loss equals that of one
  process's uninterrupted run on the same mesh (the same global batches: none repeated, none
  skipped), and no checkpoint is moved aside (2 -> 1 used to move every one as unreadable).
  A constant learning rate: each leg's train.steps would otherwise stretch the schedule."""
  train = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", *TINY_RUN,
           "checkpoint.every=1", "train.eval_every=0", "logging.every=1", "mesh.data=2",
           "train.warmup_steps=0", "train.min_lr_ratio=1.0", f"data.cache_dir={data_cache}"]
  one_env = {**child_env, "XLA_FLAGS": child_env.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=1", "--xla_force_host_platform_device_count=2")}

  def run(processes: int, out, steps: int) -> None:
    args = [*train, f"train.output_dir={out}", f"train.steps={steps}"]
    r = (_launch("-n", "2", "--devices-per-process", "1", "--", *args, env=child_env,
                 timeout=240) if processes == 2 else
         subprocess.run(args, cwd=ROOT, env=one_env, capture_output=True, text=True,
                        timeout=240, check=False))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

  run(2, tmp_path / "switch", 2)
  run(1, tmp_path / "switch", 4)
  run(2, tmp_path / "switch", 6)
  run(1, tmp_path / "whole", 6)
  got, want = _losses(tmp_path / "switch"), _losses(tmp_path / "whole")
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=1e-5)
  assert not [d for d in os.listdir(tmp_path / "switch" / "checkpoints") if "damaged" in d]


def test_launch_local_runs_the_distributed_worker():
  r = _launch("-n", "2", "--devices-per-process", "2", "--", sys.executable, WORKER)
  assert r.returncode == 0, r.stdout + r.stderr
  results = _results(r.stdout)
  _check(results)
  for res in results:  # each RESULT line carries its process's prefix
    assert f"[{res['process_index']}] RESULT " in r.stdout


# ------------------------------------------------------------------ in-process checks

@pytest.mark.parametrize("kwargs, keys", [
    (dict(coordinator="localhost:1234"), ["distributed.num_processes", "distributed.process_id"]),
    (dict(num_processes=2, process_id=0), ["distributed.coordinator"]),
    (dict(coordinator="localhost:1234", num_processes=2), ["distributed.process_id"]),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=2),
     ["distributed.process_id=2"]),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=-1),
     ["distributed.process_id=-1"]),
    (dict(coordinator="localhost:1234", num_processes=0, process_id=0),
     ["distributed.num_processes=0"]),
    (dict(coordinator="localhost", num_processes=2, process_id=0), ["distributed.coordinator"]),
    (dict(coordinator="host:port", num_processes=2, process_id=0), ["distributed.coordinator"]),
])
def test_invalid_settings_raise_config_error(kwargs, keys, monkeypatch):
  called = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: called.append(1))
  with pytest.raises(ConfigError) as e:
    distributed.initialize(DistributedConfig(**kwargs))
  for key in keys:
    assert key in str(e.value)
  assert not called


def test_single_process_is_a_no_op(monkeypatch):
  for var in [v for v in os.environ if v.startswith("SLURM_")]:
    monkeypatch.delenv(var)
  monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task SLURM job is one process too
  called = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: called.append(1))
  distributed.initialize(DistributedConfig())
  distributed.initialize(DistributedConfig())
  assert not called and not jax.distributed.is_initialized()


def test_slurm_tasks_outside_srun_is_an_error(monkeypatch):
  for var in [v for v in os.environ if v.startswith("SLURM_")]:
    monkeypatch.delenv(var)
  monkeypatch.setenv("SLURM_NTASKS", "4")  # an sbatch script's own shell, not an srun task
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  with pytest.raises(ConfigError, match="srun"):
    distributed.initialize(DistributedConfig())


@pytest.mark.parametrize("env, want", [
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_NODEID": "2"}, []),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "8,1", "SLURM_NODEID": "1"}, []),
    ({"SLURM_STEP_TASKS_PER_NODE": "8,1", "SLURM_NODEID": "0"}, None),
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, []),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "3"}, []),  # --gpus-per-task
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "JAX_LOCAL_DEVICE_IDS": "0,1"}, None),
    ({}, None),
])
def test_slurm_local_device_ids(env, want):
  assert distributed.slurm_local_device_ids(env) == want


def test_cpu_collectives_default_to_gloo():
  before = jax.config.jax_cpu_collectives_implementation
  try:
    jax.config.update("jax_cpu_collectives_implementation", None)  # none chosen
    distributed._use_gloo_on_cpu()  # pylint: disable=protected-access
    assert jax.config.jax_cpu_collectives_implementation == "gloo"
    jax.config.update("jax_cpu_collectives_implementation", "mpi")  # a user's choice stays
    distributed._use_gloo_on_cpu()  # pylint: disable=protected-access
    assert jax.config.jax_cpu_collectives_implementation == "mpi"
  finally:
    jax.config.update("jax_cpu_collectives_implementation", before)


def test_global_batch_single_process():
  """One process: the global batch is the local one, laid out by the sharding."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P("data"))
  local = {"tokens": np.arange(16 * 4, dtype=np.int32).reshape(16, 4),
           "mask": np.ones((16, 4), np.float32)}
  out = distributed.global_batch(local, sharding)
  assert set(out) == {"tokens", "mask"}
  assert out["tokens"].shape == (16, 4) and out["tokens"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(out["tokens"]), local["tokens"])
  assert distributed.is_main()
  with pytest.raises(ValueError, match="tokens"):
    distributed.global_batch({"tokens": np.zeros((3, 4), np.int32)}, sharding)


def test_launcher_xla_flags_exist_in_this_jaxlib():
  """XLA aborts on an unknown flag: every flag jscale.train (or the sbatch script) sets must
  parse, and flags the user gave win."""
  from jscale import xla_flags
  # the scheduler's memory (`parallel.scheduler_memory_percent`) as a flag and a compile option
  roomy = load_config(None, ["parallel.scheduler_memory_percent=200"])
  assert "--xla_gpu_memory_limit_slop_factor=200" in xla_flags.overlap_flags(roomy)
  assert xla_flags.compiler_options(roomy)["xla_gpu_memory_limit_slop_factor"] == 200
  assert xla_flags.compiler_options(load_config(None, []))["xla_gpu_memory_limit_slop_factor"] == 95
  assert "xla_gpu_memory_limit_slop_factor" not in xla_flags.compiler_options()
  flags = sorted(set(re.findall(r"--xla_[a-z0-9_]+=[^\s\"']*", open(SBATCH).read())) |
                 set(xla_flags.overlap_flags(roomy)))
  assert any("latency_hiding_scheduler" in f for f in flags)
  mine = xla_flags.with_overlap_flags("--xla_gpu_enable_pipelined_all_gather=false")
  assert "--xla_gpu_enable_pipelined_all_gather=true" not in mine.split()
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in mine.split()
  # Not the pipelined all-gather with micro-batches (tests/plan/test_gpu_compile.py,
  # scripts/overlap_flags.py): under any ZeRO stage or TP, it peels the micro-batch loop.
  for zero in (1, 3):
    acc = load_config(None, [f"parallel.zero_stage={zero}", "mesh.fsdp=2", "train.microbatches=2"])
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in xla_flags.with_overlap_flags("", acc)
  assert "--xla_gpu_enable_pipelined_all_gather=true" in xla_flags.overlap_flags()
  assert xla_flags.compiler_options()["xla_gpu_all_gather_combine_threshold_bytes"] == 2**27
  # jax 0.11's XLA refuses the pipeliner's booleans as compile options (XLA_FLAGS still parse):
  # its modes instead, the one left out with micro-batches left out there too
  assert xla_flags.compiler_options(None, (0, 10, 2))["xla_gpu_enable_pipelined_all_reduce"]
  new = xla_flags.compiler_options(None, (0, 11, 2))
  assert not [k for k in new if "pipelined" in k]
  assert new["xla_gpu_pipeline_all_reduce"] == "COLLECTIVE_PIPELINING_MODE_ON"
  assert new["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
  assert "xla_gpu_pipeline_all_gather" not in xla_flags.compiler_options(acc, (0, 12, 0))
  assert not xla_flags.pipeliner_booleans_are_options((0, 12, 0))
  # xla mode's ZeRO-3 keeps each weight's gradient reduce-scatter apart (8 MiB), manual 128 MiB
  rs = "xla_gpu_reduce_scatter_combine_threshold_bytes"
  for mode, want in (("xla", 2**23), ("manual", 2**27)):
    z3 = load_config(None, ["parallel.zero_stage=3", "mesh.fsdp=2",
                            f"parallel.collectives={mode}"])
    assert xla_flags.compiler_options(z3)[rs] == want, mode
  # The allocator's share: the planner's budget unless the user gave one.
  code = ("import os; from jscale import xla_flags; xla_flags.apply(); "
          "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
  for given, want in ((None, xla_flags.MEM_FRACTION), ("0.5", "0.5")):
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    env.update({"XLA_PYTHON_CLIENT_MEM_FRACTION": given} if given else {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT, check=True).stdout.split()
    assert out == [want], out
  env = _base_env(1)
  env["XLA_FLAGS"] += " " + " ".join(flags)
  r = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"], env=env,
                     capture_output=True, text=True, timeout=TIMEOUT)
  assert r.returncode == 0, r.stderr[-2000:]
