"""The planner against XLA:GPU at real sizes (seq 4096) for every layout of the sweep: model
state, the rest of the peak and manual mode's collective volume, estimated and compiled for
H100s on this machine (`jscale.analysis.gpu_target`, no GPU). tests/plan/test_gpu_compile.py checks
one layout per axis (`CHECKED`); this runs all of `LAYOUTS` (~1 min each on 2 cores).

    JAX_PLATFORMS=cpu python scripts/planner_vs_gpu.py [--out results/planner_vs_gpu.md]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for GPUs from their descriptions

# pylint: disable=wrong-import-position
from jscale.analysis import gpu_target  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale import hardware  # noqa: E402
from jscale.plan.layout import Layout  # noqa: E402
from jscale.plan.rank import evaluate  # noqa: E402
from jscale.plan.verify import compare  # noqa: E402

H100 = hardware.GPUS["h100"]
B1, B3, B8 = ("llama3_1b", ()), ("llama3_3b", ()), ("llama3_8b", ("model.n_layers=8",))
# (model, GPUs, layout): the ones tests/plan/test_gpu_compile.py checks in CI.
CHECKED = [(B1, 1, Layout(mbs=2, remat="selective")),
           (B1, 8, Layout(data=8, remat="selective")),
           (B1, 8, Layout(fsdp=8, zero_stage=3, remat="selective")),
           (B1, 8, Layout(data=2, tensor=4, sequence_parallel=True, mbs=2, remat="selective")),
           (B1, 8, Layout(data=2, sequence=4, remat="selective")),
           (B1, 8, Layout(data=2, stage=4, accum=8, remat="selective")),
           (B1, 8, Layout(fsdp=8, zero_stage=2, accum=4, remat="selective")),
           (B8, 8, Layout(fsdp=8, zero_stage=3, remat="full"))]
LAYOUTS = CHECKED + [
    (B1, 1, Layout(mbs=2, remat="none")), (B1, 1, Layout(mbs=4, remat="full")),
    (B1, 8, Layout(fsdp=8, zero_stage=1, remat="none")),
    (B1, 8, Layout(data=2, tensor=4, mbs=2, remat="selective")),
    (B1, 8, Layout(data=8, accum=4, remat="selective")),
    (B1, 8, Layout(fsdp=8, zero_stage=3, accum=4, remat="selective")),
    (B1, 8, Layout(fsdp=8, zero_stage=1, accum=2, remat="selective")),
    (B3, 1, Layout(mbs=2, remat="full")), (B8, 1, Layout(remat="full")),
    (B8, 8, Layout(data=2, tensor=4, sequence_parallel=True, remat="selective"))]


FIELDS = ("state_estimate", "state_compiled", "rest_estimate", "rest_compiled",
          "volume_estimate", "volume_compiled")


def check(model, n: int, lay: Layout) -> dict:
  """Estimated against compiled: state, the rest of the peak, manual mode's collective volume."""
  preset, overrides = model
  row = evaluate(load_config(None, [f"model.preset={preset}", *overrides]).model, lay, 4096, H100)
  return compare(preset, list(overrides), row, 4096, H100, gpu_target.devices(f"h100x{n}"),
                 collectives="manual")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="results/planner_vs_gpu.md")
  args = ap.parse_args()
  rows = []
  for model, n, lay in LAYOUTS:
    r = check(model, n, lay)
    rows.append({"model": model[0], "gpus": n, "layout": lay.describe(),
                 **{k: r[k] for k in FIELDS}})
    print(rows[-1], flush=True)
  gb = lambda k: lambda r: f"{r[k] / 2**30:.2f}"
  write_table(rows, [("model", lambda r: r["model"]), ("GPUs", lambda r: str(r["gpus"])),
                     ("layout", lambda r: r["layout"]),
                     *[(f"{k.replace('_', ' ')} (GiB)", gb(k)) for k in FIELDS]], args.out)


if __name__ == "__main__":
  sys.exit(main())
