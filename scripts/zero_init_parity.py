"""XLA:GPU's zero-init elimination (`jscale.xla_flags`: a loop's stacked outputs allocated, not
zero-filled) changes no value: the tiny DeepSeek-V3 trained N steps on this GPU with the
launcher's flags, and again with the flag turned off (XLA_FLAGS the user gives win), their
logged losses compared.

    python scripts/zero_init_parity.py [--steps 30]   # on a GPU; exit 1 if the losses differ
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF = "--xla_gpu_enable_dus_accumulator_zero_init_elimination=false"


def losses(out_dir: str, steps: int, flags: str) -> dict[int, float]:
  """The losses `python -m jscale.train` logs for the tiny DeepSeek-V3 under `flags`."""
  env = {**os.environ, "XLA_FLAGS": flags}
  subprocess.run([sys.executable, "-m", "jscale.train", "--config",
                  "configs/deepseek_v3_tiny.yaml", "model.dtype=bfloat16", f"train.steps={steps}",
                  "train.eval_every=0", "checkpoint.every=0", "logging.every=1",
                  "logging.plot=false", "logging.tensorboard=false",
                  f"train.output_dir={out_dir}"], check=True, cwd=ROOT, env=env)
  with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=30)
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    on = losses(os.path.join(tmp, "on"), args.steps, "")
    off = losses(os.path.join(tmp, "off"), args.steps, OFF)
  worst = max(abs(on[s] - off[s]) / abs(off[s]) for s in off)
  print(f"{len(off)} steps: losses with the zero fills elided against without, largest relative "
        f"difference {worst:.2e} (last {on[max(on)]:.6f} / {off[max(off)]:.6f})")
  return 0 if on.keys() == off.keys() and worst <= 1e-6 else 1


if __name__ == "__main__":
  sys.exit(main())
