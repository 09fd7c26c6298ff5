"""Compiled per-device memory of one train step for ZeRO stages 0-3, against the playbook formula.

  python scripts/zero_memory.py [--fsdp 8] [--out results/zero_memory.md] [overrides...]

Runs on simulated CPU devices (nothing is allocated: each step is only compiled); the default
shape is `jscale.analysis.introspect.ZERO_SHAPE`.
"""

import argparse
import csv
import os

import doc_blocks

CSV = os.path.join(doc_blocks.ROOT, "results", "zero_memory.csv")


def summary(path: str = CSV) -> str:
  """The README's table (formula, compiled, ratio per ZeRO stage) from the stored CSV."""
  with open(path, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  line = lambda name, cells: "| " + " | ".join([name, *cells]) + " |"
  mb = lambda key: [f"{float(r[key]) / 1e6:.1f}" for r in rows]
  return "\n".join([line("ZeRO stage", [r["stage"] for r in rows]),
                    "|" + "---|" * (len(rows) + 1),
                    line("formula (MB)", mb("f_total")), line("compiled (MB)", mb("measured")),
                    line("ratio", [f"{float(r['ratio']):.3f}" for r in rows])])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--fsdp", type=int, default=8)
  p.add_argument("--out", default="results/zero_memory.md")
  p.add_argument("overrides", nargs="*", help="config overrides")
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.fsdp}")
  from jscale.analysis import introspect, tables  # after XLA_FLAGS: jax reads it once
  rows = introspect.zero_memory_rows(args.fsdp, args.overrides)
  mb = lambda k: (lambda r: f"{r[k] / 1e6:.1f}")
  print(tables.write_table(rows, [
      ("zero_stage", lambda r: str(r["stage"])), ("params (MB)", mb("f_params")),
      ("grads (MB)", mb("f_grads")), ("optimizer (MB)", mb("f_optimizer")),
      ("formula (MB)", mb("f_total")), ("arguments (MB)", mb("argument")),
      ("temp (MB)", mb("temp")), ("measured (MB)", mb("measured")),
      ("measured / formula", lambda r: f"{r['ratio']:.3f}")], args.out))
  print("\n".join(f"rewrote {d}" for d in doc_blocks.sync()))


if __name__ == "__main__":
  main()
