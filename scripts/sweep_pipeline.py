"""Pipeline layouts against the single-device reference, more of them than the test suite runs:
one step's loss and gradients, and whether the executor ran exactly the schedule's table.

  python scripts/sweep_pipeline.py [--all] [--only manual,interleaved] \
      [--out results/sweep_pipeline.md]

tests/parallel/test_pipeline.py checks a representative 12 layouts (in each mode every schedule, p = 2
and 4, m = 4 and 8, data, tensor, SP, ZeRO-1 and ZeRO-2 at least once). By default this runs
the 21 the suite checked before it was trimmed plus the two of its permute test and five
more of ZB-V and DualPipeV (tests/parallel/test_pipeline_v.py runs four); with `--all`,
every mode x schedule x p x m x extra below that fits on 8 devices and passes config validation
(272 of 352 fit; the rest are listed as skipped). `--only` keeps the layouts whose id contains
every comma-separated word (`--all --only xla,zero_bubble,p4`). On 8 simulated CPU devices a
layout takes ~15-30 s on 2 cores, so `--all` runs for hours. It uses the tests' harness
(tests/pipeline_harness.py, so the `test` extra) and tolerances (1e-5 relative); exits 1 if any
layout fails.
"""

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

# (mode, schedule, p, m, extra): the suite's layouts before it was trimmed.
CASES = [
    ("manual", "afab", 2, 4, ()), ("manual", "1f1b", 4, 8, ()),
    ("manual", "interleaved", 2, 4, ()), ("manual", "zero_bubble", 4, 8, ()),
    ("manual", "afab", 4, 8, ("mesh.data=2",)), ("manual", "1f1b", 2, 4, ("mesh.data=2",)),
    ("manual", "1f1b", 2, 4, ("mesh.data=2", "mesh.tensor=2")),
    ("manual", "interleaved", 4, 8, ("mesh.tensor=2",)),
    ("manual", "zero_bubble", 2, 8, ("mesh.data=2", "mesh.tensor=2",
                                     "parallel.sequence_parallel=true")),
    ("manual", "1f1b", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=1", "mesh.tensor=2")),
    ("manual", "zero_bubble", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=2", "mesh.data=2")),
    ("manual", "interleaved", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=2", "mesh.tensor=2")),
    ("xla", "afab", 4, 4, ()), ("xla", "1f1b", 2, 8, ()),
    ("xla", "interleaved", 4, 4, ()), ("xla", "zero_bubble", 2, 4, ()),
    ("xla", "1f1b", 2, 4, ("mesh.data=2", "mesh.tensor=2")),
    ("xla", "zero_bubble", 4, 8, ("mesh.data=2",)), ("xla", "interleaved", 2, 8, ("mesh.data=2",)),
    ("xla", "afab", 2, 8, ("mesh.tensor=2", "mesh.data=2")),
    ("xla", "1f1b", 4, 4, ("mesh.tensor=2", "parallel.sequence_parallel=true")),
    ("xla", "zero_bubble", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=1")),
    ("xla", "1f1b", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=2", "mesh.data=2")),
    # The V schedules beyond tests/parallel/test_pipeline_v.py's (which also runs them with MoE).
    ("manual", "dualpipev", 4, 8, ("mesh.data=2",)),
    ("manual", "zbv", 2, 4, ("mesh.tensor=2",)),
    ("xla", "zbv", 4, 8, ("mesh.fsdp=2", "parallel.zero_stage=1")),
    ("xla", "dualpipev", 4, 8, ("mesh.tensor=2",)),
    ("xla", "dualpipev", 2, 4, ("mesh.fsdp=2", "parallel.zero_stage=2")),
]
# `--all`: what each mode, schedule, p and m is crossed with.
EXTRAS = [(), ("mesh.data=2",), ("mesh.tensor=2",),
          ("mesh.tensor=2", "parallel.sequence_parallel=true"),
          ("mesh.data=2", "mesh.tensor=2"),
          ("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true"),
          ("mesh.fsdp=2", "parallel.zero_stage=1"), ("mesh.fsdp=2", "parallel.zero_stage=2"),
          ("mesh.fsdp=2", "parallel.zero_stage=1", "mesh.tensor=2"),
          ("mesh.fsdp=2", "parallel.zero_stage=2", "mesh.data=2"),
          ("mesh.fsdp=2", "parallel.zero_stage=2", "mesh.tensor=2")]
TOL = 1e-5


def all_cases():
  return [(mode, schedule, p, m, extra) for mode, schedule, p, m, extra in itertools.product(
      ("manual", "xla"), ("afab", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"), (2, 4), (4, 8), EXTRAS)]


def devices_needed(case):
  _, _, p, _, extra = case
  n = p
  for e in extra:
    if e.startswith("mesh."):
      n *= int(e.split("=")[1])
  return n


def check(case):
  """(status, loss rel err, grads max rel err, executed == table); status "skip: why" when
  the layout does not fit or is rejected before compile."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import pipeline_harness as ph  # pylint: disable=import-outside-toplevel
  from jscale.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jscale.step import pipelined  # pylint: disable=import-outside-toplevel
  if devices_needed(case) > len(jax.devices()):
    return f"skip: needs {devices_needed(case)} devices", None, None, None
  try:
    got = ph.pipeline_grads.__wrapped__(*ph.overrides(*case))  # uncached: one at a time
  except ConfigError as e:
    return f"skip: {str(e).splitlines()[0][:80]}", None, None, None
  ref_loss, ref_grads = ph.reference()
  p, codes = got.rt.mesh.shape["stage"], got.codes
  prog = pipelined.program_for(got.rt.cfg.pipeline, p)
  per_stage = codes.reshape(p, -1, codes.shape[-1])[:, 0]
  same_table = bool(np.array_equal(prog.executed(per_stage.T), prog.table.kind))
  loss_err = abs(got.loss - ref_loss) / abs(ref_loss)
  grad_err = ph.max_rel_err(got.grads, ref_grads)
  ok = loss_err <= TOL and grad_err <= TOL and same_table
  return ("ok" if ok else "FAIL"), loss_err, grad_err, same_table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--all", action="store_true", help="the whole cross-product")
  parser.add_argument("--only", default="", help="comma-separated words every id must contain")
  parser.add_argument("--out", default="", help="also write the markdown table here")
  args = parser.parse_args()
  import pipeline_harness as ph  # pylint: disable=import-outside-toplevel  (sets XLA_FLAGS)
  words = [w for w in args.only.split(",") if w]
  cases = [c for c in (all_cases() if args.all else CASES)
           if all(w in ph.case_id(c) for w in words)]
  fmt = lambda x: "" if x is None else f"{x:.1e}"
  lines = ["| layout | status | loss rel err | grads max rel err | ran the table | s |",
           "|---|---|---|---|---|---|"]
  print("\n".join(lines), flush=True)
  failed = 0
  for case in cases:
    t0 = time.perf_counter()
    status, loss_err, grad_err, same = check(case)
    failed += status == "FAIL"
    line = (f"| {ph.case_id(case)} | {status} | {fmt(loss_err)} | {fmt(grad_err)} | "
            f"{'' if same is None else same} | {time.perf_counter() - t0:.0f} |")
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
