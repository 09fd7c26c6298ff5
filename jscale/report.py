"""`python -m jscale.report plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: pictures of runs.

Train (solid) and val (dashed) loss, tokens/s and MFU against steps, one colour per run, from
each run's metrics.jsonl (`jscale.analysis.plots`). Default output: `<first RUN_DIR>/metrics.png`
(what every run writes when it ends).
"""

from __future__ import annotations

import argparse
import sys

from jscale import exit_codes
from jscale.analysis import plots


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jscale.report",
                              description="Pictures of training runs.")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  plot = sub.add_parser("plot", help="loss, tokens/s and MFU against steps, runs overlaid")
  plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.output_dir of a run")
  plot.add_argument("--out", default=None, metavar="PNG",
                    help="output file (default: <first RUN_DIR>/metrics.png)")
  return p


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; exit 2 with one line for a missing run or metrics file."""
  args = _parser().parse_args(argv)
  try:
    print(f"wrote {plots.plot_runs(args.run_dirs, args.out)}")
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  return 0


if __name__ == "__main__":
  sys.exit(main())
