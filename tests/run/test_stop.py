"""Stopping within one step, with real processes and signals, at `logging.every=25` (the host
fetches values only every 25 steps, so a loop that read its stop flag only then, or ran ahead
of the device, would go on to step 50).

1 process (SIGTERM; Ctrl-C takes the same path, and is the signal of the last test here and of
tests/run/test_run_lifecycle.py): the step saved is at most one past the step the host had started
when the signal came (the process says which: "received at step N"; the device may be a step
behind it, no more). 2 processes, the signal to process 1 only: both save one step (a
collective save), at most two past it; the libraries' chatter (Gloo) goes to the run's log
files, not the console. A signal during the final save or the plot lets them finish, without a
traceback.
"""

import importlib.util
import os
import re
import signal
import time

from conftest import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "scripts", "soak.py"))
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

EVERY = 25
# ~0.15 s steps on a 2-core CPU: slow enough that the step the signal lands in is known to a
# few steps from outside, fast enough for 30 of them to take seconds.
MODEL = ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.seq_len=128",
         "train.batch_size=8", "train.eval_every=0", "logging.progress=false",
         "logging.plot=false", "logging.tensorboard=false"]


def _args(out, cache, *extra):
  return MODEL + [f"train.output_dir={out}", f"data.cache_dir={cache}", *extra]


def _at(text: str) -> int:
  """The step the process had started when the signal came, as it says."""
  return int(re.search(r"received at step (\d+)", text).group(1))


def _stopped(text: str) -> tuple[str, int]:
  m = re.search(r"stopped by (.+?) after step (\d+)(?: \(received at step \d+\))?:", text)
  return m.group(1), int(m.group(2))


def test_one_process_stops_within_one_step_of_the_signal(tmp_path, data_cache, child_env):
  (proc,) = soak.launch(_args(tmp_path, data_cache, "train.steps=100000",
                              f"logging.every={EVERY}", "checkpoint.every=1000"),
                        devices=1, env=child_env)
  at = soak.wait_for_step(str(tmp_path), EVERY, [proc])
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 75, out[-3000:]
  by, saved = _stopped(out)
  assert by == "SIGTERM"
  assert saved - _at(out) <= 1, out[-2000:]
  assert at == EVERY and saved <= EVERY + 5, out[-2000:]  # not on to the next logging step
  assert str(saved) in os.listdir(tmp_path / "checkpoints")
  assert "Traceback" not in out


def test_two_processes_agree_on_the_stop_step(tmp_path, data_cache, child_env):
  procs = soak.launch(_args(tmp_path, data_cache, "train.steps=100000", f"logging.every={EVERY}",
                            "checkpoint.every=1000"), processes=2, devices=1, env=child_env)
  soak.wait_for_step(str(tmp_path), EVERY, procs)
  procs[1].send_signal(signal.SIGTERM)  # one process only: process 0 learns it from its peer
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [75, 75], outs[0][-2000:] + outs[1][-2000:]
  by, saved = _stopped(outs[0])
  assert by == "SIGTERM to process 1"
  assert saved - _at(outs[1]) <= 2, outs[1][-2000:]
  assert saved <= EVERY + 6
  assert str(saved) in os.listdir(tmp_path / "checkpoints")
  assert not any("Traceback" in o for o in outs)
  # Gloo's connection lines go to each process's log, not to the console.
  assert not any("[Gloo]" in o for o in outs), outs[0][-2000:]
  assert all("[Gloo] Rank" in (tmp_path / "logs" / f"process{i}.log").read_text()
             for i in range(2))


def test_a_signal_during_the_final_save_or_plot_lets_it_finish(tmp_path, data_cache, child_env):
  (proc,) = soak.launch(TINY_RUN + [f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
                                    "logging.plot=true"], devices=1, env=child_env)
  while not (tmp_path / "checkpoints" / "12").exists():  # renamed into place once whole
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.01)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  # The signal lands in one of the end's phases, depending on timing: the save, its read-back
  # (`Checkpointer.check_last`), or the plot.
  assert re.search(r"SIGINT received during (the final checkpoint save|reading the last "
                   r"checkpoint back|the plot)", out), out
  assert "Traceback" not in out and "done: step 12" in out
  assert (tmp_path / "metrics.png").exists()
