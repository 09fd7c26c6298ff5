"""The launcher's XLA:GPU overlap flags (`jscale/xla_flags.py`), measured on the compiled
program rather than guessed (issue 49): for ZeRO-2, ZeRO-3 and TP layouts on 8 H100s, the step
compiled with every flag, with each one turned off, and with each combine threshold at the
other values of `THRESHOLDS`, timed by `jscale.predict` (predictions, not measurements).

    python scripts/overlap_flags.py [--out results/overlap_flags_h100x8.md]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: the GPUs are descriptions

# pylint: disable=wrong-import-position
from jscale import predict, xla_flags  # noqa: E402
from jscale.analysis import gpu_target, introspect  # noqa: E402
from jscale.analysis.tables import write_predicted_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

B8 = ("model.preset=llama3_8b", "train.seq_len=4096", "model.dtype=bfloat16",
      "train.remat=selective", "checkpoint.every=0")
LAYOUTS = {  # name -> overrides (8 H100s)
    "8B fsdp8 ZeRO-3, 2 x 8 micro-batches": (*B8, "mesh.data=1", "mesh.fsdp=8",
                                            "parallel.zero_stage=3", "train.batch_size=128",
                                            "train.microbatches=8"),
    "8B fsdp8 ZeRO-3 manual, 2 x 8": (*B8, "mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3",
                                      "train.batch_size=128", "train.microbatches=8",
                                      "parallel.collectives=manual"),
    "8B fsdp8 ZeRO-2, 2 x 8 micro-batches": (*B8, "mesh.data=1", "mesh.fsdp=8",
                                            "parallel.zero_stage=2", "train.batch_size=128",
                                            "train.microbatches=8"),
    "8B fsdp4 ZeRO-1 tensor2+SP, 4 x 4": (*B8, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                                          "parallel.zero_stage=1",
                                          "parallel.sequence_parallel=true",
                                          "train.batch_size=64", "train.microbatches=4"),
}
BOOL_FLAGS = [f[2:].split("=")[0] for f in xla_flags.GPU_OVERLAP_FLAGS if f.endswith("=true")]
# the combine thresholds, each also tried at these values (0: no combining)
THRESHOLDS = {f"xla_gpu_{kind}_combine_threshold_bytes": (0, 8 * 2**20, 128 * 2**20)
              for kind in ("all_gather", "reduce_scatter", "all_reduce")}
COLUMNS = [("layout", lambda r: r["layout"]), ("flags", lambda r: r["flags"]),
           ("predicted step (ms)", lambda r: f"{1e3 * r['step']:.0f}"),
           ("vs all on", lambda r: f"{r['vs']:+.1%}"),
           ("exposed collectives (ms)", lambda r: f"{1e3 * r['exposed']:.0f}"),
           ("memory (GiB)", lambda r: f"{r['memory'] / 2**30:.1f}")]


def predicted(cfg, options: dict) -> dict:
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices("h100x8"),
                                              {**predict.AUTOTUNED_GEMMS, **options})
  memory = introspect.device_bytes(introspect.memory(compiled))
  r = predict.predict_config(cfg, "h100x8", compiled.as_text(), memory_bytes=memory)
  return {"step": r.step_s, "exposed": r.exposed_collectives_s, "memory": memory}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(ROOT, "results", "overlap_flags_h100x8.md"))
  args = p.parse_args()
  rows = []
  for name, overrides in LAYOUTS.items():
    cfg = load_config(None, list(overrides))
    base = predicted(cfg, {})
    rows.append({"layout": name, "flags": "all on (the launcher's)", **base, "vs": 0.0})
    for flag in BOOL_FLAGS:
      if flag not in xla_flags.compiler_options(cfg):
        continue  # the launcher leaves it off for this layout already
      r = predicted(cfg, {flag: False})
      rows.append({"layout": name, "flags": f"{flag}=false", **r,
                   "vs": r["step"] / base["step"] - 1})
      print(rows[-1], flush=True)
    launched = xla_flags.compiler_options(cfg)
    for flag, values in THRESHOLDS.items():
      for value in values:
        if value == launched[flag]:
          continue
        r = predicted(cfg, {flag: value})
        rows.append({"layout": name, "flags": f"{flag}={value}", **r,
                     "vs": r["step"] / base["step"] - 1})
        print(rows[-1], flush=True)
  print(write_predicted_table(rows, COLUMNS, args.out, "The launcher's overlap flags on 8 "
                              "H100s, each turned off in turn, and each combine threshold at "
                              "other values", "scripts/overlap_flags.py"))


if __name__ == "__main__":
  main()
