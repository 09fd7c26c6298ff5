"""The FP8 combine (`model.moe.combine_dtype: e4m3`, issue 50): what rounding the experts'
outputs to e4m3 on their way back, and the inputs' gradients on theirs
(`model.moe.combine_grad_dtype: e4m3`), costs the tiny DeepSeek-V3's loss.

    python scripts/fp8_combine.py [--seeds 8] [--lr 1e-3] [--runs wire,combine,control,grads_back]
    # -> results/fp8_combine_loss.md (+ .csv, one row per run)

`configs/deepseek_v3_tiny.yaml` in bf16, 200 steps, on 4 simulated CPU devices: its 8 experts
in 2 groups over `mesh.expert=4`, manual mode's node-limited exchange (two hops, as
DeepSeek-V3 671B's over 8 nodes), the experts' products in FP8 scaled per row and the rows
and their gradients out in e4m3 (the 671B's program in `docs/deepseek.md`). Each seed four
times: that program (wire); the same with the experts' outputs back in e4m3 too (combine);
with the inputs' gradients back in e4m3 as well (`model.moe.combine_grad_dtype`, grads_back);
and a control, the wire program with each batch in two micro-batches (the same gradient
summed in another order: how far two runs that differ only in rounding drift apart).
Measured on this CPU; the table and its helpers are `fp8_experts.py`'s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Four CPU devices for the expert axis, before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=wrong-import-position
import fp8_experts as fe  # noqa: E402

WIRE = ("mesh.data=1", "mesh.expert=4", "parallel.collectives=manual",
        "model.moe.exchange=node_limited", *fe.FP8, "fp8.experts_scaling=row",
        "model.moe.dispatch_dtype=e4m3", "model.moe.dispatch_grad_dtype=e4m3")
COMBINE = fe.Study(
    os.path.join(fe.ROOT, "results", "fp8_combine_loss.csv"),
    {"wire": WIRE, "combine": (*WIRE, "model.moe.combine_dtype=e4m3"),
     "control": (*WIRE, "train.microbatches=2"),
     "grads_back": (*WIRE, "model.moe.combine_dtype=e4m3", "model.moe.combine_grad_dtype=e4m3")},
    {"control": "wire, 2 micro-batches (control)", "combine": "wire + the outputs back in e4m3",
     "grads_back": "wire + the outputs and the inputs' gradients back in e4m3"},
    base="wire", base_name="wire", column="exchange")
OUT = os.path.join(fe.ROOT, "results", "fp8_combine_loss.md")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", type=int, default=8)
  ap.add_argument("--runs", default=",".join(COMBINE.runs),
                  help="loss runs to make where missing")
  ap.add_argument("--lr", type=float, default=1e-3, help="the runs' peak learning rate")
  args = ap.parse_args()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=fe.ROOT,
                        capture_output=True, text=True, check=False).stdout.strip()
  fe.run_missing(COMBINE, args.seeds, head, [r for r in args.runs.split(",") if r], args.lr)
  lines = [f"# The FP8 combine (`model.moe.combine_dtype: e4m3`, `model.moe.combine_grad_dtype: "
           f"e4m3`), at {head}", "",
           "The tiny DeepSeek-V3 (`configs/deepseek_v3_tiny.yaml`, bf16), 200 steps, on 4 "
           "simulated devices (expert 4, node-limited exchange in two hops, FP8 experts "
           f"scaled per row, rows and their gradients out in e4m3), mean over {args.seeds} "
           "seeds; measured on a CPU. The control (each batch in two micro-batches) shows how "
           "far two runs that differ only in rounding end apart:", "",
           *fe.loss_tables(COMBINE, args.seeds)]
  with open(OUT, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
