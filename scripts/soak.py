"""Soak test of the run lifecycle: a multi-process CPU training run killed again and again, each
time relaunched with the same command, must end with exactly the losses of an uninterrupted run.

    python scripts/soak.py --processes 2 --kills 6 --steps 400 --out /tmp/jscale-soak

1. Reference: the run once, uninterrupted (N processes on localhost, gloo collectives).
2. Soak: the same run in another directory; at a random step one process gets SIGKILL (a lost
   node; process 0, the coordinator, then 1, ... in turn), or every process SIGTERM (a
   scheduler's preemption), alternately. The survivors of a SIGKILL must exit on their own
   within the heartbeat bound; then the command is relaunched and resumes from the last
   complete checkpoint. After `--kills` interruptions it runs to the end.
3. Check: every step's loss in metrics.jsonl appears once and equals the reference bit for bit.

Prints a table (kills, resumes, steps, wall time, losses equal) and writes it as JSON to
`--results` (default results/soak.json). The helpers are shared with tests/run/test_run_lifecycle.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from launch_local import child_env, free_port  # noqa: E402  pylint: disable=wrong-import-position

# A model small enough that 2 CPU processes run a few hundred steps a minute.
SMALL = ["model.preset=tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=64", "model.dtype=float32", "train.seq_len=16",
         "train.batch_size=8", "train.warmup_steps=5", "train.eval_every=0", "logging.every=1",
         "logging.progress=false", "logging.plot=false", "logging.tensorboard=false"]


def launch(overrides: list[str], processes: int = 1, devices: int = 2,
           env: dict[str, str] | None = None, log_dir: str | None = None) -> list[subprocess.Popen]:
  """Starts `python -m jscale.train` as `processes` cooperating processes (each with `devices`
  CPU devices); stdout+stderr of process i go to `<log_dir>/proc<i>.log` (default: a pipe)."""
  port = free_port()
  procs = []
  for i in range(processes):
    argv = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", *overrides]
    if processes > 1:
      argv += [f"distributed.coordinator=localhost:{port}",
               f"distributed.num_processes={processes}", f"distributed.process_id={i}"]
    child = child_env(env or dict(os.environ), devices)
    child["PYTHONUNBUFFERED"] = "1"
    out = (open(os.path.join(log_dir, f"proc{i}.log"), "a", encoding="utf-8") if log_dir
           else subprocess.PIPE)
    procs.append(subprocess.Popen(argv, cwd=ROOT, env=child, stdout=out,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True))
  return procs


def losses(output_dir: str) -> dict[int, float]:
  """step -> loss from metrics.jsonl; a step written twice raises (one clean series)."""
  out: dict[int, float] = {}
  path = os.path.join(output_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return out
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue  # the line being written
      if "loss" in row:
        if row["step"] in out:
          raise AssertionError(f"step {row['step']} twice in {path}")
        out[row["step"]] = row["loss"]
  return out


def wait_for_step(output_dir: str, step: int, procs: list[subprocess.Popen],
                  timeout: float = 300) -> int:
  """Polls metrics.jsonl until a step >= `step` is logged (or a process exits); returns the
  last logged step."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    done = max(losses(output_dir), default=0)
    if done >= step or any(p.poll() is not None for p in procs):
      return done
    time.sleep(0.02)
  raise TimeoutError(f"step {step} not reached in {timeout} s in {output_dir}")


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
  """Return codes of every process; kills what is still running after `timeout` (a hang)."""
  deadline = time.monotonic() + timeout
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      codes.append(p.wait())
      codes[-1] = f"hung (killed after {timeout:.0f} s)"
  return codes


def soak(out: str, processes: int, kills: int, steps: int, seed: int,
         heartbeat_s: int = 10) -> dict:
  """Reference run, then the killed-and-relaunched one; returns the figures."""
  rng = random.Random(seed)
  common = SMALL + [f"train.steps={steps}", "checkpoint.every=10", "checkpoint.keep=2",
                    f"distributed.heartbeat_timeout_s={heartbeat_s}"]
  ref_dir, soak_dir = os.path.join(out, "reference"), os.path.join(out, "soak")
  os.makedirs(out, exist_ok=True)
  t0 = time.monotonic()
  codes = wait_all(launch(common + [f"train.output_dir={ref_dir}"], processes,
                          log_dir=out), 900)
  if codes != [0] * processes:
    raise SystemExit(f"the reference run failed: exit codes {codes}; see {out}/proc*.log")
  reference = losses(ref_dir)
  events, slowest_exit = [], 0.0
  t1 = time.monotonic()
  for k in range(kills):
    procs = launch(common + [f"train.output_dir={soak_dir}"], processes, log_dir=out)
    start = max(losses(soak_dir), default=0)
    target = min(steps - 1, start + rng.randint(5, max(6, steps // (kills + 1))))
    at = wait_for_step(soak_dir, target, procs)
    how = "SIGKILL" if k % 2 == 0 else "SIGTERM"
    victim = (k // 2) % processes  # the coordinator (process 0) and the others, in turn
    t_kill = time.monotonic()
    for i, p in enumerate(procs):
      if how == "SIGTERM" or i == victim:
        os.killpg(p.pid, getattr(signal, how))
    codes = wait_all(procs, 3 * heartbeat_s + 60)
    slowest_exit = max(slowest_exit, time.monotonic() - t_kill)
    events.append({"kill": k + 1, "signal": how, "process": victim if how == "SIGKILL" else "all",
                   "at_step": at, "exit_codes": codes,
                   "exit_s": round(time.monotonic() - t_kill, 1)})
    print(f"kill {k + 1}: {how} to {events[-1]['process']} at step ~{at}; exit codes {codes} "
          f"after {events[-1]['exit_s']} s", flush=True)
    if any(isinstance(c, str) for c in codes):
      raise SystemExit(f"a process hung after {how}: {codes}")
  codes = wait_all(launch(common + [f"train.output_dir={soak_dir}"], processes, log_dir=out),
                   900)
  got = losses(soak_dir)
  equal = got == reference
  return {"processes": processes, "steps": steps, "kills": kills, "resumes": kills,
          "final_exit_codes": codes, "losses_equal": equal,
          "steps_compared": len(got), "slowest_exit_after_kill_s": round(slowest_exit, 1),
          "heartbeat_timeout_s": heartbeat_s, "reference_s": round(t1 - t0, 1),
          "soak_s": round(time.monotonic() - t1, 1), "events": events,
          "first_difference": next((s for s in sorted(reference) if got.get(s) != reference[s]),
                                   None)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--kills", type=int, default=6)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--heartbeat", type=int, default=10, help="distributed.heartbeat_timeout_s")
  parser.add_argument("--out", default="/tmp/jscale-soak")
  parser.add_argument("--results", default=os.path.join(ROOT, "results", "soak.json"))
  args = parser.parse_args()
  if os.path.exists(args.out) and os.listdir(args.out):
    raise SystemExit(f"--out {args.out} is not empty: give a new directory")
  r = soak(args.out, args.processes, args.kills, args.steps, args.seed, args.heartbeat)
  print("| processes | steps | kills survived | resumes | losses equal (steps) | slowest exit "
        "after a kill | wall (reference / soak) |")
  print("|---|---|---|---|---|---|---|")
  print(f"| {r['processes']} | {r['steps']} | {r['kills']} | {r['resumes']} | "
        f"{r['losses_equal']} ({r['steps_compared']}) | {r['slowest_exit_after_kill_s']} s | "
        f"{r['reference_s']} s / {r['soak_s']} s |")
  os.makedirs(os.path.dirname(args.results), exist_ok=True)
  with open(args.results, "w", encoding="utf-8") as f:
    json.dump(r, f, indent=1)
  return 0 if r["losses_equal"] and r["final_exit_codes"] == [0] * r["processes"] else 1


if __name__ == "__main__":
  sys.exit(main())
