"""A run's lifecycle with real processes and signals: kill -9 and SIGTERM mid-run then resume
give the uninterrupted losses exactly; an unreadable latest checkpoint falls back to the one
before; a checkpoint restores onto another mesh and another device count; NaNs stop or skip.

The uninterrupted reference runs in this process; the interrupted runs are `python -m
jscale.train` subprocesses with the same 8 CPU devices and XLA flags, so the programs are the
same and the losses must be bit-identical (scripts/soak.py does the same at length with 2
processes).
"""

import contextlib
import glob
import importlib.util
import io
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jscale import train as train_lib
from jscale.config_load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "scripts", "soak.py"))
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

STEPS = 60


def _overrides(out, cache, *extra):
  return soak.SMALL + [f"train.steps={STEPS}", "checkpoint.every=10", "checkpoint.keep=3",
                       f"train.output_dir={out}", f"data.cache_dir={cache}", *extra]


def _cfg(out, cache, *extra):
  return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), _overrides(out, cache, *extra))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
  out = tmp_path_factory.mktemp("reference")
  summary = train_lib.run(_cfg(out, data_cache))
  assert soak.losses(str(out)) == summary["losses"] and len(summary["losses"]) == STEPS
  return summary["losses"]


def _launch(out, cache, *extra, devices=8):
  (proc,) = soak.launch(_overrides(out, cache, *extra), devices=devices)
  return proc


def _finish(out, cache, *extra, devices=8):
  proc = _launch(out, cache, *extra, devices=devices)
  stdout, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, stdout[-3000:]
  return stdout


def test_kill9_at_a_random_step_then_resume_is_exact(reference, tmp_path, data_cache):
  k = random.Random().randint(12, 40)
  proc = _launch(tmp_path, data_cache)
  at = soak.wait_for_step(str(tmp_path), k, [proc])
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL and at < STEPS, f"not killed mid-run (step {at})"
  stdout = _finish(tmp_path, data_cache)
  first = stdout.splitlines()[0]
  assert first.startswith(f"resuming {tmp_path} from step ") or first.startswith("starting")
  assert soak.losses(str(tmp_path)) == reference, f"killed at step ~{at}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_sigterm_saves_the_step_and_resumes_exactly(reference, tmp_path, data_cache, sig):
  proc = _launch(tmp_path, data_cache)
  at = soak.wait_for_step(str(tmp_path), 15, [proc])
  proc.send_signal(sig)
  stdout, _ = proc.communicate(timeout=120)
  assert proc.returncode == 75, stdout[-3000:]  # exit_codes.PREEMPTED
  saved = int(stdout.split(f"stopped by {sig.name} after step ")[1].split()[0].rstrip(":"))
  assert at <= saved < STEPS
  assert f"checkpoint step {saved} saved in {tmp_path}/checkpoints" in stdout
  assert str(saved) in os.listdir(tmp_path / "checkpoints")
  with open(tmp_path / "run.json", encoding="utf-8") as f:  # the command as typed
    assert " -m jscale.train --config configs/tiny.yaml " in json.load(f)["command"]
  stdout = _finish(tmp_path, data_cache)
  assert f"resuming {tmp_path} from step {saved}" in stdout.splitlines()[0]
  assert soak.losses(str(tmp_path)) == reference


def test_a_second_ctrl_c_exits_at_once_and_the_checkpoints_stay_whole(tmp_path, data_cache):
  proc = _launch(tmp_path, data_cache, "train.steps=100000")
  soak.wait_for_step(str(tmp_path), 12, [proc])
  while not (tmp_path / "checkpoints" / "10").exists():  # renamed into place once complete
    assert proc.poll() is None
    time.sleep(0.1)
  proc.send_signal(signal.SIGINT)
  seen = ""
  while "SIGINT received" not in seen:  # the first is handled (two at once arrive as one)
    line = proc.stdout.readline()
    assert line, seen[-2000:]
    seen += line
  proc.send_signal(signal.SIGINT)
  stdout, _ = proc.communicate(timeout=60)
  stdout = seen + stdout
  assert proc.returncode == 130, stdout[-3000:]  # exit_codes.INTERRUPTED, unsaved
  # What is on disk is whole: the same command resumes from the last complete checkpoint.
  stdout = _finish(tmp_path, data_cache, "train.steps=14")
  assert f"resuming {tmp_path} from step " in stdout.splitlines()[0]
  assert max(soak.losses(str(tmp_path))) == 14


def test_a_closed_output_pipe_does_not_stop_the_run(tmp_path, data_cache):
  """`python -m jscale.train ... 2>&1 | head -1`: the reader goes away, the run trains on."""
  proc = _launch(tmp_path, data_cache, "train.steps=12", "logging.every=1")
  assert proc.stdout.readline().startswith("starting a new run in")
  proc.stdout.close()
  assert proc.wait(timeout=120) == 0
  assert max(soak.losses(str(tmp_path))) == 12 and "12" in os.listdir(tmp_path / "checkpoints")


def test_unreadable_latest_checkpoints_fall_back(reference, tmp_path, data_cache):
  cfg = _cfg(tmp_path, data_cache)
  train_lib.run(cfg, stop_after=30)  # checkpoints 10, 20, 30
  ckpts = tmp_path / "checkpoints"
  # Truncated array files (which data file holds which array varies run to run: cut them all).
  for name in glob.glob(str(ckpts / "30" / "state" / "**" / "d" / "*"), recursive=True):
    with open(name, "r+b") as f:
      f.truncate(os.path.getsize(name) // 2)
  os.remove(ckpts / "20" / "state" / "_METADATA")  # a missing metadata file
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    summary = train_lib.run(cfg)
  log = err.getvalue()
  assert "checkpoint step 30 in" in log and "resuming from step 20 instead" in log
  assert "checkpoint step 20 in" in log and "resuming from step 10 instead" in log
  assert "Traceback" not in log and len(log.strip().splitlines()) == 2
  assert sorted(summary["losses"]) == list(range(11, STEPS + 1))
  moved = sorted(d for d in os.listdir(ckpts) if ".damaged-" in d)
  assert [d.split(".")[0] for d in moved] == ["20", "30"]  # moved aside, not deleted
  assert soak.losses(str(tmp_path)) == reference  # rows past step 10 were rewritten once


def test_restore_onto_another_mesh_and_device_count(reference, tmp_path, data_cache):
  a = train_lib.run(_cfg(tmp_path, data_cache, "mesh.data=2", "mesh.fsdp=4"), stop_after=10)
  b = train_lib.run(_cfg(tmp_path, data_cache, "mesh.data=4", "mesh.tensor=2"), stop_after=10)
  assert sorted(b["losses"]) == list(range(11, 21))
  # 4 devices instead of 8, data=2 x tensor=2, in a fresh process.
  stdout = _finish(tmp_path, data_cache, "mesh.data=2", "mesh.tensor=2", devices=4)
  assert "changed since the checkpoint: mesh.data 4 -> 2" in stdout
  got = soak.losses(str(tmp_path))
  assert sorted(got) == list(range(1, STEPS + 1)) and a["losses"][10] == got[10]
  want = np.array([reference[s] for s in sorted(got)])
  np.testing.assert_allclose(np.array([got[s] for s in sorted(got)]), want, rtol=2e-5)


def test_nonfinite_loss_stops_or_is_skipped(tmp_path, data_cache, monkeypatch):
  monkeypatch.setenv("JSCALE_XLA_FLAGS", "0")
  bad = ["train.lr=1e30", "train.warmup_steps=0", "train.clip_norm=0", "train.steps=4",
         "checkpoint.every=2", "logging.every=2"]
  args = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"),
          *_overrides(tmp_path / "stop", data_cache, *bad)]
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    code = train_lib.main(args)
  assert code == 3, err.getvalue()[-2000:]  # exit_codes.NONFINITE
  assert "non-finite loss or gradient norm at step 2" in err.getvalue()
  assert not os.path.exists(tmp_path / "stop" / "checkpoints" / "2")  # nothing saved after it
  summary = train_lib.run(_cfg(tmp_path / "skip", data_cache, *bad, "train.on_nan=skip"))
  assert summary["stopped"] is None and summary["final_step"] == 4
  rows = soak.losses(str(tmp_path / "skip"))
  assert sorted(rows) == [2, 4]
  last = [json.loads(l) for l in open(tmp_path / "skip" / "metrics.jsonl")][-1]
  assert last["nonfinite_steps"] == 3  # steps 2, 3, 4: dropped, counted
  params = jax.tree.leaves(summary["state"]["params"])
  assert all(np.isfinite(np.asarray(p)).all() for p in params)


def test_a_killed_process_stops_its_peers_within_the_bound_then_relaunch_resumes(tmp_path,
                                                                                   data_cache):
  """2 processes (gloo): SIGKILL one mid-run; the other exits non-zero within
  distributed.heartbeat_timeout_s (+ margin) naming the lost process; the same command resumes."""
  heartbeat = 5
  args = _overrides(tmp_path, data_cache, "train.steps=100000",
                    f"distributed.heartbeat_timeout_s={heartbeat}")
  procs = soak.launch(args, processes=2, devices=2, env=_base_env())
  soak.wait_for_step(str(tmp_path), 25, procs)  # checkpoint 10 is complete by then
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.monotonic()
  out, _ = procs[0].communicate(timeout=heartbeat + 60)
  waited = time.monotonic() - t0
  procs[1].communicate()
  assert procs[0].returncode not in (0, None) and waited < heartbeat + 30, (waited, out[-2000:])
  assert "stopped sending heartbeats" in out and "unhealthy" in out  # names task 1 below it
  assert out.split("stopped sending heartbeats):")[1].split()[0] == "1"
  saved = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  procs = soak.launch(_overrides(tmp_path, data_cache, f"train.steps={saved + 5}"), processes=2,
                      devices=2, env=_base_env())
  codes = soak.wait_all(procs, 240)
  first = procs[0].stdout.read()
  assert codes == [0, 0], first[-3000:]
  assert f"resuming {tmp_path} from step {saved}" in first
  assert max(soak.losses(str(tmp_path))) == saved + 5


def test_a_peer_that_never_starts_stops_the_others_within_the_bound(tmp_path, data_cache):
  """Process 0 of 2 alone (its peer never started, or died while starting): it exits with
  exit_codes.PEERS_MISSING (69) after distributed.init_timeout_s, naming the key and the way out,
  instead of waiting on JAX's own 300 s start-up deadline and aborting without a cause."""
  timeout = 5
  argv = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml",
          *_overrides(tmp_path, data_cache), f"distributed.coordinator=localhost:{soak.free_port()}",
          "distributed.num_processes=2", "distributed.process_id=0",
          f"distributed.init_timeout_s={timeout}"]
  t0 = time.monotonic()
  proc = subprocess.run(argv, cwd=ROOT, env=soak.child_env(_base_env(), 2), capture_output=True,
                        text=True, timeout=timeout + 90, check=False)
  waited = time.monotonic() - t0
  assert proc.returncode == 69 and waited < timeout + 60, (waited, proc.stderr[-2000:])
  assert ("process 0 of 2: not every process reached the coordinator at localhost:"
          in proc.stderr and "distributed.init_timeout_s=5 s" in proc.stderr), proc.stderr[-2000:]


def _base_env():
  """This environment minus SLURM variables (each child gets its own device-count flag)."""
  return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def test_timed_saves_and_a_finished_run(tmp_path, data_cache):
  cfg = _cfg(tmp_path, data_cache, "train.steps=6", "checkpoint.every=1000",
             "checkpoint.every_minutes=1e-9")  # due after every step
  train_lib.run(cfg)
  assert sorted(d for d in os.listdir(tmp_path / "checkpoints")) == ["4", "5", "6"]  # keep=3
  again = train_lib.run(cfg)  # nothing left: said, not silently "done"
  assert again["final_step"] == 6 and not again["losses"]
  assert "train.steps=6 already reached (checkpoint step 6): nothing to train" in again["message"]
