"""Compile time of the train step vs depth: the scanned layer stack keeps it flat.

  python scripts/compile_time.py [--layers 4 32] [--out results/compile_time.md]

Lowers and compiles one train step (abstract inputs, nothing runs) for each depth at the same
width and writes a markdown table (+ CSV beside it).
"""

import argparse

import doc_blocks

from jscale.analysis import introspect, tables
from jscale.config_load import load_config


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
  p.add_argument("--repeats", type=int, default=2, help="best of N compiles per depth")
  p.add_argument("--out", default="results/compile_time.md")
  p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=512")
  args = p.parse_args()
  rows = []
  for n in args.layers:
    cfg = load_config("configs/tiny.yaml", [f"model.n_layers={n}", *args.overrides])
    best = min((introspect.compile_train_step(cfg)[1] for _ in range(args.repeats)),
               key=lambda t: t["lower_s"] + t["compile_s"])
    rows.append({"n_layers": n, "d_model": cfg.model.d_model, **best,
                 "total_s": best["lower_s"] + best["compile_s"]})
    print(rows[-1], flush=True)
  base = rows[0]["total_s"]
  print(tables.write_table(rows, [
      ("layers", lambda r: str(r["n_layers"])), ("d_model", lambda r: str(r["d_model"])),
      ("lower (s)", lambda r: f"{r['lower_s']:.2f}"),
      ("compile (s)", lambda r: f"{r['compile_s']:.2f}"),
      ("total (s)", lambda r: f"{r['total_s']:.2f}"),
      ("vs first", lambda r: f"{r['total_s'] / base:.2f}x")], args.out))
  print("\n".join(f"rewrote {d}" for d in doc_blocks.sync()))


if __name__ == "__main__":
  main()
