"""What a train step holds at its memory peak on a GPU target, as XLA:GPU's buffer assignment
says: the step compiled for `--target` (`jscale.predict.compile_for`, the launcher's flags),
with XLA's dump of the program's live ranges, whose "Stack trace breakdown for peak usage"
names every buffer live at the peak by the JAX op that made it. The buffers are summed by
scope (the op name's first `--depth` parts after the step's own), beside the planner's
estimate of the layout (`jscale.plan.memory`, where the config is one of its layouts).

    JAX_PLATFORMS=cpu python scripts/peak_memory.py --target h100x1024 \\
        model.preset=deepseek_v3_671b model.n_layers=5 ... [--top 30] [--depth 4]

Found with it (DeepSeek-V3 671B, the planner's pick on 1,024 H100s, 5 layers): every manual
EP exchange's zero receive buffer was allocated at the step's start (fixed:
`ragged_exchange.landing_zeros`); the peak is the MTP block's recomputed MoE, beside the main
and MTP heads' fp32 dW accumulators and the last MoE layer's recompute, which the loop's
peeled (double-buffered) first iteration starts early (docs/deepseek.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

_DUMP = tempfile.mkdtemp(prefix="jscale_peak_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={_DUMP} --xla_dump_hlo_module_re=.*step.*")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jscale import predict  # noqa: E402  (after the environment is set)
from jscale.config_load import load_config  # noqa: E402

_ENTRY = re.compile(r"^( *)(?:[│ ]   )*[├└]── (.*) \([\d.]+%, total: [\d ]+ bytes, "
                    r"current: ([\d ]+) bytes")


def peak_buffers(live_range_text: str) -> tuple[int, list[tuple[str, int]]]:
  """(peak bytes, [(op name, bytes)]) from XLA's live-range dump: each top-level entry of the
  breakdown with the bytes live at the peak under it (the step's arguments are the entries
  `state` and `batch`)."""
  at = live_range_text.index("Stack trace breakdown for peak usage:")
  lines = live_range_text[at:].splitlines()
  peak = int(lines[0].split(":")[1].replace("bytes", "").replace(" ", ""))
  rows: dict[str, int] = collections.defaultdict(int)
  top = ""
  for line in lines[2:]:  # past the header and the program's own root entry
    m = _ENTRY.match(line)
    if not m:
      continue
    if line.startswith("      ├") or line.startswith("      └"):
      top = m.group(2)
    rows[top] += int(m.group(3).replace(" ", ""))
  return peak, list(rows.items())


def scope(op_name: str, depth: int) -> str:
  """The first `depth` parts of a JAX op name, past the step's and shard_map's own."""
  parts = [p for p in op_name.split("/") if p not in ("jit(step)", "shard_map")]
  return "/".join(parts[:depth]) or op_name


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None)
  p.add_argument("--target", default="h100x8")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--depth", type=int, default=4)
  p.add_argument("overrides", nargs="*")
  args = p.parse_args()
  cfg = load_config(args.config, args.overrides)
  _, held, _ = predict.compile_for(cfg, args.target)
  paths = glob.glob(os.path.join(_DUMP, "*after_optimizations-live-range.txt"))
  if not paths:
    sys.exit(f"no live-range dump in {_DUMP}: this XLA does not write one")
  peak, rows = peak_buffers(open(max(paths, key=os.path.getsize)).read())
  print(f"compiled: {held / 2**30:.2f} GiB a device; XLA's peak {peak / 2**30:.2f} GiB")
  by_scope = collections.Counter()
  for name, b in rows:
    by_scope[scope(name, args.depth)] += b
  for name, b in by_scope.most_common(args.top):
    print(f"{b / 2**30:8.2f} GiB  {name}")


if __name__ == "__main__":
  main()
