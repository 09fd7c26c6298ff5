"""XLA-sharded vs hand-written collectives, strategy by strategy: loss parity with one device,
median step time, the collectives of the compiled HLO next to the playbook's volume, and
compiled memory per device.

  python scripts/compare_collectives.py [--steps 8] [--only dp,zero3] \
      [--out results/compare_collectives.md] [overrides...]
  python scripts/compare_collectives.py --target h100x8   # XLA:GPU's program, compile only

Writes a markdown table, a CSV beside it and a PNG chart. On CPU it simulates 8 devices; on a
GPU host it uses the GPUs present (the strategies below need 8). `--target h100x8` compiles
every strategy for 8 H100s with the real XLA:GPU compiler instead (`jscale.analysis.gpu_target`:
JAX's CUDA plugin, no GPU needed) and runs nothing: collectives, memory, and the step time
`jscale.predict` gives each compiled program (with the exposed part of its collectives). Volume is per device per step,
counted as the playbook does (`jscale.analysis.volume`): all-reduce 2x its size, all-gather and
reduce-scatter the full size. Step times on simulated CPU devices measure compute on 2 shared
cores, not communication: read them on GPUs.
"""

import argparse
import csv
import os
import statistics
import time

import doc_blocks

H100X8_CSV = os.path.join(doc_blocks.ROOT, "results", "compare_collectives_h100x8.csv")

SHAPE = ["model.preset=tiny", "model.d_model=128", "model.n_layers=4", "model.n_heads=8",
         "model.n_kv_heads=8", "model.d_ff=512", "model.dtype=float32", "train.batch_size=16",
         "train.seq_len=64", "train.warmup_steps=0"]
STRATEGIES = {
    "dp": ["mesh.data=8"],
    "zero1": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=1"],
    "zero2": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=2"],
    "zero3": ["mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3"],
    "tp": ["mesh.data=1", "mesh.tensor=8"],
    "tp_sp": ["mesh.data=1", "mesh.tensor=8", "parallel.sequence_parallel=true"],
    "dp×tp": ["mesh.data=2", "mesh.tensor=4"],
    "zero1×tp_sp": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "parallel.zero_stage=1",
                    "parallel.sequence_parallel=true"],
    "dp×zero3×tp_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3",
                       "parallel.sequence_parallel=true"],
    # Context parallelism: xla mode all-gathers K/V, manual mode runs the zig-zag ring.
    "dp×cp": ["mesh.data=2", "mesh.sequence=4", "model.attention_impl=xla"],
    "dp×cp×tp_sp": ["mesh.data=2", "mesh.sequence=2", "mesh.tensor=2",
                    "parallel.sequence_parallel=true", "model.attention_impl=xla"],
    # Ulysses: all-to-alls in both modes (xla mode: GSPMD's, from the head-split constraints).
    "dp×ulysses": ["mesh.data=2", "mesh.sequence=4", "parallel.context_impl=ulysses"],
    "dp×ulysses×tp_sp": ["mesh.data=2", "mesh.sequence=2", "mesh.tensor=2",
                         "parallel.sequence_parallel=true", "parallel.context_impl=ulysses"],
}
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def _batches(cfg, n):
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  out = []
  for _ in range(n):
    t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
    out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": np.ones((b, l), np.float32)})
  return out


def _run(cfg, devices, steps):
  """Compiles and runs `steps` steps: (losses, median step seconds, compiled, runtime); with
  steps 0 (a compile target without devices) only compiles: losses and time are None."""
  import jax  # pylint: disable=import-outside-toplevel
  from jscale import runtime  # pylint: disable=import-outside-toplevel
  from jscale.analysis import introspect
  from jscale import predict  # pylint: disable=import-outside-toplevel
  rt = runtime.build(cfg, devices)
  compiled = introspect.compile_as_launched(  # GPUs: the gemms as the autotuner picks them
      rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg)), rt,
      predict.AUTOTUNED_GEMMS)
  if not steps:
    return None, None, compiled, rt
  state, losses, times, reorder = rt.init_state(), [], [], rt.reorder()
  for b in _batches(cfg, steps):
    b = jax.device_put(reorder(b) if reorder else b, rt.layouts.batch())
    t0 = time.perf_counter()
    state, m = compiled(state, b)
    losses.append(float(m["loss"]))  # waits for the step
    times.append(time.perf_counter() - t0)
  return losses, statistics.median(times[1:] or times), compiled, rt


def _chart(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  names = list(dict.fromkeys(r["strategy"] for r in rows))
  get = lambda mode, key: [next(r[key] for r in rows if r["strategy"] == n and r["mode"] == mode)
                           for n in names]
  x, w = range(len(names)), 0.27
  fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8, len(names) * 1.1), 7))
  a1.bar([i - w for i in x], [v / 1e6 for v in get("manual", "playbook_bytes")], w,
         label="playbook", color="0.6")
  a1.bar(list(x), [v / 1e6 for v in get("manual", "volume_bytes")], w, label="manual")
  a1.bar([i + w for i in x], [v / 1e6 for v in get("xla", "volume_bytes")], w, label="xla")
  a1.set_ylabel("volume / device / step (MB)")
  a1.legend()
  if rows[0]["step_ms"] is not None:
    a2.bar([i - w / 2 for i in x], get("manual", "step_ms"), w, label="manual")
    a2.bar([i + w / 2 for i in x], get("xla", "step_ms"), w, label="xla")
    a2.set_ylabel("median step (ms)")
  else:  # compiled for a target, not run: memory instead of time
    a2.bar([i - w / 2 for i in x], [v / 1e6 for v in get("manual", "memory_bytes")], w,
           label="manual")
    a2.bar([i + w / 2 for i in x], [v / 1e6 for v in get("xla", "memory_bytes")], w,
           label="xla")
    a2.set_ylabel("compiled memory / device (MB)")
  a2.legend()
  for a in (a1, a2):
    a.set_xticks(list(x), names, rotation=20)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def summary(path: str = H100X8_CSV) -> str:
  """The README's table (volume over the playbook's, predicted step, memory; xla and manual)
  from the stored `--target h100x8` CSV."""
  with open(path, encoding="utf-8") as f:
    rows = {(r["strategy"], r["mode"]): r for r in csv.DictReader(f)}
  out = ["| strategy | volume / playbook, xla | manual | predicted step ms, xla | manual | "
         "memory / device MB, xla / manual |", "|---|---|---|---|---|---|"]
  for name in dict.fromkeys(s for s, _ in rows):
    x, m = rows[name, "xla"], rows[name, "manual"]
    vol = lambda r: f"{int(r['volume_bytes']) / float(r['playbook_bytes']):.2f}"
    mem = lambda r: f"{int(r['memory_bytes']) / 1e6:.1f}"
    out.append(f"| {name} | {vol(x)} | {vol(m)} | {float(x['predicted_ms']):.2f} | "
               f"{float(m['predicted_ms']):.2f} | {mem(x)} / {mem(m)} |")
  return "\n".join(out)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/compare_collectives.md")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--only", default="", help="comma-separated strategies (default: all)")
  p.add_argument("--target", default=None, metavar="GPUxN",
                 help="compile for GPUs with XLA:GPU instead of running (e.g. h100x8)")
  p.add_argument("overrides", nargs="*", help="config overrides")
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  if args.target:  # nothing runs: CPU is the platform, the GPUs are descriptions
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.steps = 0
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS: read once)
  from jscale.analysis import hlo, introspect, tables  # pylint: disable=import-outside-toplevel
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  from jscale.analysis import volume  # pylint: disable=import-outside-toplevel
  from jscale.plan import cost  # pylint: disable=import-outside-toplevel
  from jscale import predict  # pylint: disable=import-outside-toplevel

  names = [n for n in args.only.split(",") if n] or list(STRATEGIES)
  unknown = set(names) - set(STRATEGIES)
  if unknown:
    raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {list(STRATEGIES)}")
  if args.target:
    from jscale.analysis import gpu_target  # pylint: disable=import-outside-toplevel
    devices = gpu_target.devices(args.target)
  else:
    devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"the strategies need 8 devices, found {len(devices)}")
  devices = devices[:8]
  ref, _, _, _ = _run(load_config(None, [*SHAPE, "mesh.data=1", *args.overrides]), devices[:1],
                      args.steps)
  rows = []
  for name in names:
    for mode in ("xla", "manual"):
      cfg = load_config(None, [*SHAPE, *STRATEGIES[name], f"parallel.collectives={mode}",
                               *args.overrides])
      losses, step_s, compiled, rt = _run(cfg, devices, args.steps)
      colls = hlo.collectives(compiled.as_text())
      mem = introspect.memory(compiled)
      row = {"strategy": name, "mode": mode,
             "loss_rel_diff": (max(abs(a / b - 1) for a, b in zip(losses[:5], ref[:5]))
                               if losses else None),
             "step_ms": 1e3 * step_s if step_s else None,
             "volume_bytes": volume.hlo_volume(colls)["total"],
             "playbook_bytes": cost.playbook_volume(rt)["total"],
             "memory_bytes": introspect.device_bytes(mem)}
      for kind in KINDS:
        ours = [c for c in colls if c.kind == kind and c.group_size != 1]
        row[f"{kind}_runs"] = sum(c.executions for c in ours)
        row[f"{kind}_bytes"] = sum(c.bytes_per_step for c in ours)
      if args.target:  # the compiled program's step on the target, kernel by kernel
        p = predict.predict_config(cfg, args.target, compiled.as_text())
        row.update(predicted_ms=1e3 * p.step_s, exposed_ms=1e3 * p.exposed_collectives_s)
      rows.append(row)
      print(name, mode, {k: v for k, v in row.items() if not k.endswith(("_runs", "_bytes"))},
            flush=True)

  def kinds(r):
    cells = [f"{k} ×{r[f'{k}_runs']} {r[f'{k}_bytes'] / 1e3:.0f} kB" for k in KINDS
             if r[f"{k}_runs"]]
    return "<br>".join(cells) or "—"

  print(tables.write_table(rows, [
      ("strategy", lambda r: r["strategy"]), ("mode", lambda r: r["mode"]),
      ("loss vs 1 device (max rel.)",
       lambda r: "—" if r["loss_rel_diff"] is None else f"{r['loss_rel_diff']:.1e}"),
      ("step (ms)", lambda r: "—" if r["step_ms"] is None else f"{r['step_ms']:.0f}"),
      *([("predicted step (ms)", lambda r: f"{r['predicted_ms']:.3f}"),
         ("exposed collectives (ms)", lambda r: f"{r['exposed_ms']:.3f}")] if args.target
        else []),
      ("collectives per step (runs, result bytes)", kinds),
      ("volume (kB)", lambda r: f"{r['volume_bytes'] / 1e3:.0f}"),
      ("playbook (kB)", lambda r: f"{r['playbook_bytes'] / 1e3:.0f}"),
      ("volume / playbook", lambda r: f"{r['volume_bytes'] / r['playbook_bytes']:.2f}"),
      ("memory / device (MB)", lambda r: f"{r['memory_bytes'] / 1e6:.1f}"),
  ], args.out))
  _chart(rows, os.path.splitext(args.out)[0] + ".png")
  print("\n".join(f"rewrote {d}" for d in doc_blocks.sync()))


if __name__ == "__main__":
  main()
