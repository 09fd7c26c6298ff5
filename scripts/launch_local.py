"""Run N cooperating JAX processes on this machine, each with its own simulated CPU devices.

    python scripts/launch_local.py -n 2 --devices-per-process 4 -- \
        python -m jscale.train --config configs/tiny.yaml mesh.data=8 ...

starts the command after `--` N times, as one multi-process JAX program on localhost. Child i
gets:

* the environment of this launcher plus `JAX_PLATFORMS=cpu` and
  `XLA_FLAGS=... --xla_force_host_platform_device_count=<devices-per-process>` (an inherited
  device-count flag is replaced; other XLA flags are kept), and PYTHONUNBUFFERED=1;
* the config overrides `distributed.coordinator=localhost:<port> distributed.num_processes=N
  distributed.process_id=i` appended to its command line (`--no-overrides` leaves the command
  as given), which jscale.distributed.initialize turns into jax.distributed.initialize(...).
  The port is a free one (portpicker, else a bound port 0) unless `--port` names one.

Every line a child writes (stdout and stderr, merged) is printed prefixed with `[i] `. The
launcher waits for all children; when one exits non-zero it stops the others (SIGTERM to
their process groups, SIGKILL after --grace seconds) and exits with that first failing exit
code (128+signal for a child killed by a signal). Ctrl-C / SIGTERM to the launcher stops
every child. Exit 0 when all children exit 0.

The processes see `jax.process_count() == N` and `jax.device_count() == N * devices-per-
process`; cross-process CPU collectives use gloo. Useful to test multi-host code paths (global
batches, multi-process checkpoints, process-0-only logging) without a cluster.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
  """A TCP port nothing listens on now (for the coordinator that process 0 starts)."""
  try:
    import portpicker  # pylint: disable=import-outside-toplevel
    return portpicker.pick_unused_port()
  except Exception:  # pylint: disable=broad-except  (not installed, or no port found)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("", 0))
      return s.getsockname()[1]


def child_env(base: dict[str, str], devices_per_process: int) -> dict[str, str]:
  """`base` with JAX_PLATFORMS=cpu and exactly one host device-count flag in XLA_FLAGS."""
  env = dict(base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if f != _DEVICE_COUNT_FLAG and not f.startswith(_DEVICE_COUNT_FLAG + "=")]
  flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def child_command(command: list[str], coordinator: str, n: int, i: int,
                  overrides: bool = True) -> list[str]:
  if not overrides:
    return list(command)
  return list(command) + [f"distributed.coordinator={coordinator}",
                          f"distributed.num_processes={n}", f"distributed.process_id={i}"]


_print_lock = threading.Lock()


def _pump(i: int, stream, out) -> None:
  """Copies `stream` to `out` line by line, each line prefixed with `[i] `."""
  prefix = f"[{i}] "
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    with _print_lock:
      out.write(prefix + line + "\n")
      out.flush()
  stream.close()


def _exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
  except (ProcessLookupError, PermissionError):
    pass


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
  """SIGTERM every running child's process group, SIGKILL what is left after `grace` s."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in running:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.poll() is None:
      _signal_group(p, signal.SIGKILL)
      p.wait()


def launch(command: list[str], n: int, devices_per_process: int, *, port: int | None = None,
           overrides: bool = True, grace: float = 5.0, out=None) -> int:
  """Runs `command` as `n` processes (see the module docstring); returns the exit code."""
  out = out or sys.stdout
  coordinator = f"localhost:{port or free_port()}"
  env = child_env(dict(os.environ), devices_per_process)
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  failed: int | None = None

  def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")

  in_main = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, on_signal) if in_main else None
  try:
    for i in range(n):
      argv = child_command(command, coordinator, n, i, overrides)
      p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True)
      procs.append(p)
      t = threading.Thread(target=_pump, args=(i, p.stdout, out), daemon=True)
      t.start()
      pumps.append(t)
    while failed is None and any(p.poll() is None for p in procs):
      for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and code != 0:
          failed = _exit_code(code)
          with _print_lock:
            print(f"launch_local: process {i} exited with {code}; stopping the others",
                  file=sys.stderr, flush=True)
          break
      time.sleep(0.05)
    if failed is None:  # all exited: the first non-zero one (in process order), else 0
      failed = next((_exit_code(p.returncode) for p in procs if p.returncode), 0)
  except KeyboardInterrupt:
    failed = 128 + signal.SIGINT
  finally:
    _stop(procs, grace)
    for t in pumps:
      t.join(timeout=5)
    if in_main:
      signal.signal(signal.SIGTERM, previous)
  return failed


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" in argv:
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1:]
  else:
    own, command = argv, []
  parser = argparse.ArgumentParser(
      prog="python scripts/launch_local.py",
      usage="%(prog)s -n N [--devices-per-process K] [--port P] -- COMMAND ...",
      description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=1,
                      help="simulated CPU devices in each process (default 1)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port on localhost (default: a free one)")
  parser.add_argument("--no-overrides", action="store_true",
                      help="do not append the distributed.* overrides to the command")
  parser.add_argument("--grace", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL when stopping children")
  args = parser.parse_args(own)
  if not command:
    parser.error("give the command to run after `--`")
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("-n and --devices-per-process must be positive")
  print(f"launch_local: {args.num_processes} x {shlex.join(command)} "
        f"({args.devices_per_process} CPU devices each)", file=sys.stderr, flush=True)
  return launch(command, args.num_processes, args.devices_per_process, port=args.port,
                overrides=not args.no_overrides, grace=args.grace)


if __name__ == "__main__":
  sys.exit(main())
