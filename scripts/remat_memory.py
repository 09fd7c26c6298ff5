"""Compiled per-device memory of one train step for train.remat = none / selective / full.

  python scripts/remat_memory.py [--out results/remat_memory.md] [overrides...]

The default shape (long sequence, many small heads) makes attention activations dominate, the
regime where selective recomputation pays (playbook: drop the attention scores, keep matmuls).
"""

import argparse

import doc_blocks

from jscale.analysis import introspect, tables
from jscale.config_load import load_config

DEFAULT = ["model.d_model=64", "model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=8",
           "model.n_layers=2", "model.d_ff=128", "train.seq_len=512", "train.batch_size=2"]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/remat_memory.md")
  p.add_argument("overrides", nargs="*", help="config overrides (default: an attention-heavy shape)")
  args = p.parse_args()
  rows = []
  for remat in ("none", "selective", "full"):
    cfg = load_config("configs/tiny.yaml", [*DEFAULT, *args.overrides, f"train.remat={remat}"])
    compiled, _ = introspect.compile_train_step(cfg)
    rows.append({"remat": remat, **introspect.memory(compiled)})
    print(rows[-1], flush=True)
  print(tables.write_table(rows, [
      ("remat", lambda r: r["remat"]), ("temp (MB)", lambda r: f"{r['temp'] / 1e6:.1f}"),
      ("arguments (MB)", lambda r: f"{r['argument'] / 1e6:.1f}"),
      ("vs none", lambda r: f"{r['temp'] / rows[0]['temp']:.2f}x")], args.out))
  print("\n".join(f"rewrote {d}" for d in doc_blocks.sync()))


if __name__ == "__main__":
  main()
