"""Collectives XLA runs in one train step for each xla-mode layout, from the compiled HLO.

  python scripts/collectives.py [--out results/collectives.md] [overrides...]

Compiles (does not run) the step on 8 simulated CPU devices; bytes are per device per step
(`jscale.analysis.hlo`: loop bodies count once per iteration). Note XLA:CPU's lowering: gradient
reduce-scatter appears as all-reduce + dynamic-slice, and bf16 collectives run in f32.
"""

import argparse
import os

import doc_blocks

# Small model (fp32, batch 16 x 32 tokens, 2 layers of d_model 64): what the tests compile.
SHAPE = ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.n_kv_heads=4", "model.d_ff=128", "model.dtype=float32", "train.batch_size=16",
         "train.seq_len=32"]
LAYOUTS = {
    "DP (data=8)": ["mesh.data=8"],
    "ZeRO-1 (fsdp=8)": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=1"],
    "ZeRO-2 (fsdp=8)": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=2"],
    "ZeRO-3 (fsdp=8)": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3"],
    "ZeRO-3, remat full": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3",
                           "train.remat=full"],
    "TP (data=2, tensor=4)": ["mesh.data=2", "mesh.tensor=4"],
    "TP + SP": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "data=2 fsdp=2 tensor=2, ZeRO-3 + SP": [
        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3",
        "parallel.sequence_parallel=true"],
}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/collectives.md")
  p.add_argument("overrides", nargs="*", help="config overrides")
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  from jscale import metrics  # after XLA_FLAGS: jax reads it once
  from jscale.analysis import hlo, introspect, tables
  from jscale.config_load import load_config
  rows = []
  for name, layout in LAYOUTS.items():
    cfg = load_config(None, [*SHAPE, *layout, *args.overrides])
    compiled, _ = introspect.compile_train_step(cfg)
    summary = hlo.summary(compiled.as_text())
    rows.append({"layout": name, "summary": summary,
                 "param_kb": 4 * metrics.param_counts(cfg.model)["total"] / 1e3})
    print(name, summary, flush=True)
  kinds = sorted({k for r in rows for k in r["summary"]})
  cell = lambda k: (lambda r: f"{r['summary'][k]['bytes'] / 1e3:.0f} kB ({r['summary'][k]['count']} ops)"
                    if k in r["summary"] else "—")
  print(tables.write_table(rows, [("layout", lambda r: r["layout"]),
                                  ("fp32 params (kB)", lambda r: f"{r['param_kb']:.0f}"),
                                  *[(k, cell(k)) for k in kinds]], args.out))

  print("\n".join(f"rewrote {d}" for d in doc_blocks.sync()))


if __name__ == "__main__":
  main()
