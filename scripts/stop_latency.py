"""How soon a run stops after SIGTERM: steps past the one started when the signal came, and
seconds from the signal to the process's exit (the checkpoint save included).

    python scripts/stop_latency.py [--processes 1|2] [--every 25]

Trains the model of tests/run/test_stop.py (~0.15 s steps on a 2-core CPU) on CPU devices, sends
SIGTERM to the last process `--delay` seconds after step `--every` is logged (between two
logging steps, where a host running ahead of its device has the most steps queued), and prints
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402  pylint: disable=wrong-import-position

MODEL = ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.seq_len=128",
         "train.batch_size=8", "train.eval_every=0", "logging.progress=false",
         "logging.plot=false", "logging.tensorboard=false", "train.steps=100000",
         "checkpoint.every=1000"]


def measure(processes: int, every: int, delay: float) -> dict:
  """One run stopped by SIGTERM `delay` s after step `every` is logged; the figures."""
  with tempfile.TemporaryDirectory() as out:
    procs = soak.launch(MODEL + [f"train.output_dir={out}", f"logging.every={every}"],
                        processes=processes, devices=1)
    logged = soak.wait_for_step(out, every, procs)
    time.sleep(delay)
    sent = time.monotonic()
    procs[-1].send_signal(signal.SIGTERM)
    text = procs[0].communicate(timeout=300)[0]
    exited = time.monotonic() - sent
    for p in procs[1:]:
      text += p.communicate(timeout=60)[0]
  received = [int(x) for x in re.findall(r"received at step (\d+)", text)]
  saved = re.search(r"stopped by .+? after step (\d+)", text)
  return {"processes": processes, "logging_every": every, "signal_s_after_log": delay,
          "logged_when_signalled": logged,
          "received_at_step": received[0] if received else None,
          "saved_step": int(saved.group(1)) if saved else None,
          "seconds_to_exit": round(exited, 2),
          "exit_codes": [p.returncode for p in procs]}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--processes", type=int, default=1)
  p.add_argument("--every", type=int, default=25, help="logging.every")
  p.add_argument("--delay", type=float, default=1.5,
                 help="seconds from the logged step to the signal")
  args = p.parse_args()
  print(json.dumps(measure(args.processes, args.every, args.delay)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
