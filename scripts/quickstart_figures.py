"""The README's quick-start figures, measured instead of typed: trains `configs/tiny.yaml` as the
README's first command does, counts the tests its second runs, writes `results/quickstart.json`
and rewrites the README's sentence between the `quickstart` markers from it (`doc_blocks`).

    python scripts/quickstart_figures.py            # train (~5 min on 2 cores), count, write
    python scripts/quickstart_figures.py --run runs/tiny   # read a finished run instead

tests/house/test_docs.py checks that the README says exactly what `results/quickstart.json` holds
(`doc_blocks.stale`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import doc_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "results", "quickstart.json")


def render(fig: dict) -> str:
  """The README's sentence for the figures `fig` (results/quickstart.json)."""
  return (f"On a {fig['cpus']}-core CPU it took {fig['wall_s'] / 60:.1f} "
          f"minutes for {fig['steps']} steps: from ln 256 = {math.log(256):.2f} at random init, "
          f"the first logged loss was {fig['first_loss']:.2f} and the last "
          f"{fig['last_loss']:.2f}, and the validation loss is "
          f"{fig['val_loss']:.4f} over {fig['val_batches']} batches ({fig['val_tokens']:,} "
          f"tokens). The suite has {fig['tests']:,} tests (commit {fig['commit']}).")


def block() -> str:
  """The README's quick-start block: `render` of the stored results/quickstart.json."""
  with open(RESULT, encoding="utf-8") as f:
    return render(json.load(f))


def read_run(run_dir: str) -> dict:
  """First and last logged training loss and the last eval row of a finished run."""
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  train = [r for r in rows if "loss" in r]
  val = [r for r in rows if "val_loss" in r][-1]
  return {"steps": train[-1]["step"], "first_loss": train[0]["loss"],
          "last_loss": train[-1]["loss"], "val_loss": val["val_loss"],
          "val_batches": val["val_batches"], "val_tokens": val["val_tokens"]}


def count_tests() -> int:
  """How many tests the README's test command collects."""
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return int(re.search(r"(\d+) tests? collected", out).group(1))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--run", help="a finished run directory to read instead of training one")
  args = ap.parse_args()
  wall = None
  with tempfile.TemporaryDirectory() as tmp:
    run_dir = args.run or os.path.join(tmp, "tiny")
    if not args.run:
      t0 = time.monotonic()
      subprocess.run([sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml",
                      f"train.output_dir={run_dir}", "logging.progress=false"], cwd=ROOT,
                     check=True)
      wall = time.monotonic() - t0
    fig = read_run(run_dir)
  if wall is None:
    if not os.path.exists(RESULT):
      sys.exit(f"--run reads a run's losses but not its wall time, which {RESULT} keeps from a "
               "measured run: run once without --run first")
    with open(RESULT, encoding="utf-8") as f:
      wall = json.load(f)["wall_s"]
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()
  fig.update(wall_s=round(wall, 1), cpus=os.cpu_count(), tests=count_tests(), commit=commit)
  with open(RESULT, "w", encoding="utf-8") as f:
    json.dump(fig, f, indent=1)
  doc_blocks.sync(["README.md"])
  print(render(fig))


if __name__ == "__main__":
  main()
