"""Expert-parallel layouts against one device, more of them than the test suite runs: the first
5 steps' losses and gradient norms of dropless MoE training (tests/parity.py), one row each.

  python scripts/sweep_moe.py [--all] [--only manual,ep4] [--out results/sweep_moe.md]

tests/model/test_moe.py checks a representative 8 (in each mode one local expert and several, with
data, tensor (+SP), ZeRO and gradient accumulation; xla mode also ep=4 and the shared expert).
By default this runs the 13 the suite checked before it was trimmed; with `--all`, every mode x
mesh.expert x extra below that fits on 8 devices (44 of 66; the rest, and any that config
validation rejects, are listed as skipped). `--only` keeps the layouts whose id contains every
comma-separated word. On 8 simulated CPU devices a layout takes ~15-30 s on 2 cores, plus a
reference per distinct model or numerics override. It uses the tests' harness and tolerance
(1e-4 relative; so the `test` extra); exits 1 if any layout fails.
"""

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "model")]

# (mode, mesh.expert, extra): the suite's layouts before it was trimmed.
CASES = [(mode, ep, extra) for mode in ("xla", "manual")
         for ep, extra in ((2, ()), (4, ()), (8, ()), (2, ("mesh.data=2",)))]
CASES += [("manual", 2, ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=3")),
          ("xla", 4, ("model.moe.shared_d_ff=32",)),
          ("manual", 2, ("train.microbatches=2",)),
          ("manual", 2, ("mesh.tensor=2", "mesh.data=2", "parallel.sequence_parallel=true")),
          ("xla", 2, ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=1"))]
# `--all`: what each mode and expert degree is crossed with.
EXTRAS = [(), ("mesh.data=2",), ("mesh.tensor=2",),
          ("mesh.tensor=2", "parallel.sequence_parallel=true"),
          ("mesh.tensor=2", "mesh.data=2", "parallel.sequence_parallel=true"),
          ("mesh.fsdp=2", "parallel.zero_stage=1"), ("mesh.fsdp=2", "parallel.zero_stage=3"),
          ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=1"),
          ("mesh.tensor=2", "mesh.fsdp=2", "parallel.zero_stage=3"),
          ("model.moe.shared_d_ff=32",), ("train.microbatches=2",)]
RTOL = 1e-4


def check(case):
  """(status, max relative error of the losses and gradient norms)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import parity  # pylint: disable=import-outside-toplevel
  from jscale.config import ConfigError  # pylint: disable=import-outside-toplevel
  from test_moe import ep_overrides  # pylint: disable=import-outside-toplevel
  overrides, n, ref = ep_overrides(*case)
  if n > len(jax.devices()):
    return f"skip: needs {n} devices", None
  try:
    got = parity.losses(overrides, jax.devices()[:n])
  except ConfigError as e:
    return f"skip: {str(e).splitlines()[0][:80]}", None
  want = parity.reference(*ref)
  err = float(np.max(np.abs(got - want) / np.abs(want)))
  return ("ok" if err <= RTOL else "FAIL"), err


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--all", action="store_true", help="the whole cross-product")
  parser.add_argument("--only", default="", help="comma-separated words every id must contain")
  parser.add_argument("--out", default="", help="also write the markdown table here")
  args = parser.parse_args()
  from test_moe import ep_id  # pylint: disable=import-outside-toplevel  (sets XLA_FLAGS)
  words = [w for w in args.only.split(",") if w]
  every = list(itertools.product(("xla", "manual"), (2, 4, 8), EXTRAS))
  cases = [c for c in (every if args.all else CASES) if all(w in ep_id(*c) for w in words)]
  lines = ["| layout | status | max rel err (losses, grad norms) | s |", "|---|---|---|---|"]
  print("\n".join(lines), flush=True)
  failed = 0
  for case in cases:
    t0 = time.perf_counter()
    status, err = check(case)
    failed += status == "FAIL"
    line = (f"| {ep_id(*case)} | {status} | {'' if err is None else f'{err:.1e}'} | "
            f"{time.perf_counter() - t0:.0f} |")
    lines.append(line)
    print(line, flush=True)
  print(f"{len(cases)} layouts, {failed} failed")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
