"""Adam's moments in bf16 against fp32 (`train.moments_dtype`, issue 52): the final validation
loss of 300 steps of the test model (tests/conftest.py's small_config: 2 layers, d_model 64, on
the standard library), over more seeds than the test's three, on this CPU (measured).

    python scripts/moments_dtype_loss.py [--seeds 8]   # -> results/moments_dtype_loss.md

Each seed is one pair of runs that differ only in the moments' dtype. The table gives every
pair's losses and their ratio, then the means and the spread of the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
from jscale import train as train_lib  # noqa: E402
from jscale.analysis import tables  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "moments_dtype_loss.md")
# tests/conftest.py's small_config, and tests/step/test_moments_dtype.py's run
SHAPE = ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.batch_size=8",
         "train.seq_len=32", "train.steps=300", "train.warmup_steps=20", "train.eval_every=300",
         "train.eval_batches=16", "logging.progress=false", "logging.every=50",
         "logging.plot=false", "checkpoint.every=0"]


def val_loss(out: str, seed: int, moments: str) -> float:
  cfg = load_config(None, SHAPE + [f"train.output_dir={out}/{moments}{seed}",
                                   f"train.seed={seed}", f"train.moments_dtype={moments}"])
  return train_lib.run(cfg)["val_loss"]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=8)
  args = p.parse_args()
  head = tables.head_commit()
  rows = []
  with tempfile.TemporaryDirectory() as out:
    for seed in range(args.seeds):
      fp32, bf16 = val_loss(out, seed, "float32"), val_loss(out, seed, "bfloat16")
      rows.append((seed, fp32, bf16))
      print(rows[-1], flush=True)
  ratios = [b / f - 1 for _, f, b in rows]
  fp32_mean = statistics.mean(f for _, f, _ in rows)
  bf16_mean = statistics.mean(b for _, _, b in rows)
  lines = ["# Adam's moments in bf16 against fp32: final validation loss (measured, CPU)\n",
           f"`python scripts/moments_dtype_loss.py --seeds {args.seeds}` at {head}: 300 steps "
           "of the test model on the standard library, one pair of runs per seed.\n",
           "| seed | fp32 moments | bf16 moments | bf16 / fp32 - 1 |", "|---|---|---|---|",
           *(f"| {s} | {f:.4f} | {b:.4f} | {b / f - 1:+.2%} |" for s, f, b in rows),
           f"| mean | {fp32_mean:.4f} | {bf16_mean:.4f} | {bf16_mean / fp32_mean - 1:+.2%} |",
           "", f"Per-seed difference: mean {statistics.mean(ratios):+.2%}, standard deviation "
           f"{statistics.stdev(ratios):.2%}, range {min(ratios):+.2%} to {max(ratios):+.2%}."]
  tables.write_markdown(lines, OUT)


if __name__ == "__main__":
  sys.exit(main())
