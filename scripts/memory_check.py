"""On a lent GPU: does a layout run, or run out of memory? Settles what the predictor can only
note (XLA's remat pass warned that its estimate of the step did not get under the device
memory, while the step's buffers, as assigned, fit: on an H200 such a step ran).

    python3 scripts/memory_check.py --config configs/llama3_1b.yaml \\
        --layouts "train.batch_size=4 train.remat=none;train.batch_size=8 train.remat=none"

Each layout (`;`-separated override lists) trains `--steps` steps as `python -m jscale.train`
does (a subprocess: checkpoint.every=0, no eval) and appends a row to `--out`: ran, out of
memory, or failed, with the run's last line. A run that runs out of memory is the answer, not
an error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def check(config: str, overrides: list[str], steps: int) -> tuple[str, str]:
  """(outcome, the run's last line) of `steps` training steps of `config` + `overrides`."""
  with tempfile.TemporaryDirectory() as out:
    run = subprocess.run(
        [sys.executable, "-m", "jscale.train", "--config", config, *overrides,
         f"train.steps={steps}", "checkpoint.every=0", "train.eval_every=0", "logging.every=1",
         "logging.plot=false", "logging.progress=false", f"train.output_dir={out}"],
        cwd=ROOT, capture_output=True, text=True, check=False)
  said = (run.stdout if run.returncode == 0 else run.stderr).strip().splitlines()
  last = said[-1][:200] if said else ""
  if run.returncode == 0:
    return "ran", last
  oom = any(o in run.stdout + run.stderr for o in OOM)
  return ("out of memory" if oom else f"failed ({run.returncode})"), last


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/llama3_1b.yaml")
  p.add_argument("--layouts", required=True, help="';'-separated lists of config overrides")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out", default="results/memory_check.md")
  args = p.parse_args()
  path = os.path.join(ROOT, args.out)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if not os.path.exists(path):
    with open(path, "w", encoding="utf-8") as f:
      f.write("| config | overrides | outcome | last line |\n|---|---|---|---|\n")
  for layout in filter(None, (x.strip() for x in args.layouts.split(";"))):
    outcome, last = check(args.config, layout.split(), args.steps)
    row = f"| {args.config} | {layout} | {outcome} | {last.replace('|', '/')} |"
    print(row, flush=True)
    with open(path, "a", encoding="utf-8") as f:
      f.write(row + "\n")


if __name__ == "__main__":
  main()
