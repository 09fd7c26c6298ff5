"""TP collective matmul (`parallel.collective_matmul`, issue 49), predicted: the step of a
tensor-parallel layout with SP's all-gather / reduce-scatter as they are, and as ring steps
fused with the projections, compiled for H100s by XLA:GPU on this machine and timed by
`jscale.predict` (predictions, not measurements).

    python scripts/collective_matmul.py [--out results/collective_matmul_h100x8.md]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: the GPUs are descriptions

# pylint: disable=wrong-import-position
from jscale import predict  # noqa: E402
from jscale.analysis.tables import write_predicted_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

TP8 = ("mesh.data=1", "mesh.tensor=8", "parallel.sequence_parallel=true",
       "parallel.collectives=manual", "train.remat=selective", "model.dtype=bfloat16")
# name -> overrides: Llama 3 8B's shape (8 of its layers) on one node of 8, TP 8 + SP
SHAPES = {
    "8B, 8 layers, seq 4096, batch 2": ("model.preset=llama3_8b", "model.n_layers=8",
                                        "train.seq_len=4096", "train.batch_size=2"),
    "8B, 8 layers, seq 8192, batch 4": ("model.preset=llama3_8b", "model.n_layers=8",
                                        "train.seq_len=8192", "train.batch_size=4"),
}
COLUMNS = [("shape", lambda r: r["shape"]), ("collective matmul", lambda r: r["cm"]),
           ("predicted step (ms)", lambda r: f"{1e3 * r['step']:.1f}"),
           ("predicted MFU", lambda r: f"{r['mfu']:.1%}"),
           ("exposed collectives (ms)", lambda r: f"{1e3 * r['exposed']:.1f}"),
           ("elementwise (ms)", lambda r: f"{1e3 * r['elementwise']:.1f}"),
           ("idle (ms)", lambda r: f"{1e3 * r['idle']:.1f}")]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(ROOT, "results", "collective_matmul_h100x8.md"))
  args = p.parse_args()
  rows = []
  for shape, overrides in SHAPES.items():
    for cm in ("false", "true"):
      cfg = load_config(None, [*overrides, *TP8, f"parallel.collective_matmul={cm}",
                               "checkpoint.every=0"])
      r = predict.predict_config(cfg, "h100x8")
      rows.append({"shape": shape, "cm": cm, "step": r.step_s, "mfu": r.mfu,
                   "exposed": r.exposed_collectives_s,
                   "elementwise": r.by_category["elementwise/fusion"],
                   "idle": r.by_category["idle"]})
      print(rows[-1], flush=True)
  print(write_predicted_table(rows, COLUMNS, args.out, "TP 8 + SP on 8 H100s, manual mode",
                              "scripts/collective_matmul.py"))


if __name__ == "__main__":
  main()
