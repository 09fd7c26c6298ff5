"""Pipeline schedules: bubble (theory and the executed table), step time and compiled memory
per device for AFAB, 1F1B, interleaved, zero-bubble (ZB-H1), ZB-V and DualPipeV, plus their
timeline pictures.

  python scripts/bench_pipeline.py [--stages 4] [--microbatches 4,8,16] [--steps 3] \
      [--schedules afab,1f1b,...] [--out results/bench_pipeline.md] [overrides...]

The micro-batch size is fixed (2 sequences), so the batch grows with m and memory shows what
each schedule keeps alive. On CPU the stages are simulated devices sharing 2 cores: idle ticks
free a core for the busy stages, so step time tracks total work more than the bubble; run it on
GPUs for step times that show the bubble. Writes a markdown table, a CSV, ASCII timelines and
PNGs (results/pipeline_<schedule>.png).
"""

import argparse
import os

SHAPE = ["model.preset=tiny", "model.d_model=64", "model.n_layers=8", "model.n_heads=4",
         "model.n_kv_heads=4", "model.d_ff=128", "model.dtype=float32", "train.seq_len=256",
         "train.warmup_steps=0", "mesh.data=1", "parallel.collectives=manual"]
SCHEDULES = {"afab": [], "1f1b": [], "interleaved": ["pipeline.virtual_stages=2"],
             "zero_bubble": [], "zbv": ["pipeline.virtual_stages=2"],
             "dualpipev": ["pipeline.virtual_stages=2"]}


def _measure(cfg, devices, steps):
  """(median step seconds, temp bytes per device, first loss)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jscale import runtime  # pylint: disable=import-outside-toplevel
  from jscale.analysis import introspect
  rt = runtime.build(cfg, devices)
  compiled = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg)).compile()
  rng, b, l = np.random.default_rng(0), cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  batch = jax.device_put({"tokens": t[:, :-1], "labels": t[:, 1:],
                          "loss_mask": np.ones((b, l), np.float32)}, rt.layouts.batch())
  step_s, loss = introspect.time_steps(compiled, rt.init_state(), batch, steps)
  return step_s, introspect.memory(compiled)["temp"], loss


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--microbatches", default="4,8,16")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--schedules", default=",".join(SCHEDULES))
  parser.add_argument("--out", default="results/bench_pipeline.md")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  import jax  # pylint: disable=import-outside-toplevel
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  from jscale.parallel.pipeline import lockstep, schedules, timeline  # pylint: disable=import-outside-toplevel
  p = args.stages
  if len(jax.devices()) < p:
    raise SystemExit(f"needs {p} devices: on CPU set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={p}")
  outdir = os.path.dirname(args.out) or "."
  os.makedirs(outdir, exist_ok=True)
  rows, pictures = [], []
  for m in (int(x) for x in args.microbatches.split(",")):
    for name in args.schedules.split(","):
      extra = SCHEDULES[name]
      v = 2 if extra else 1
      if schedules.why_not(name, p, m, v):  # DualPipeV: m >= 2p
        continue
      table = schedules.make_table(name, p, m, v)
      schedules.validate(table)
      if m == 8:
        pictures.append(timeline.ascii_timeline(table))
        timeline.render_png(table, os.path.join(outdir, f"pipeline_{name}.png"))
      cfg = load_config(None, [*SHAPE, f"mesh.stage={p}", f"pipeline.schedule={name}",
                               f"pipeline.microbatches={m}", f"train.batch_size={2 * m}",
                               *extra, *args.overrides])
      step_s, temp, loss = _measure(cfg, jax.devices()[:p], args.steps)
      rows.append({"schedule": name, "p": p, "m": m, "v": v, "ticks": table.ticks,
                   "bubble": table.bubble(), "theory": schedules.theory_bubble(name, p, m, v),
                   "executed": lockstep.executed_table(name, p, m, v).lockstep_bubble(),
                   "residual_sets": int(table.live().max()), "step_ms": 1e3 * step_s,
                   "tokens_per_s": 2 * m * cfg.train.seq_len / step_s, "temp_mb": temp / 1e6,
                   "loss": loss})
      print(rows[-1], flush=True)
  head = list(rows[0])
  with open(os.path.splitext(args.out)[0] + ".csv", "w") as f:
    f.write(",".join(head) + "\n")
    f.writelines(",".join(str(r[k]) for k in head) + "\n" for r in rows)
  lines = [f"Devices: {p} × {jax.devices()[0].device_kind} (mesh.stage={p}, manual mode); "
           "2 sequences of 256 tokens per micro-batch, 8 layers of d_model 64; bubble = idle / "
           "useful ticks of the papers' table (F = B = W = 1), executed = of the table the "
           "executor runs in lockstep (`lockstep.executed_table`); memory = compiled temp per "
           "device.", "",
           "| schedule | m | ticks | bubble | theory | executed | residual sets / stage | "
           "step (ms) | tokens/s | temp / device (MB) | first loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['schedule']}{' v=2' if r['v'] > 1 else ''} | {r['m']} | {r['ticks']} | "
            f"{r['bubble']:.3f} | {r['theory']:.3f} | {r['executed']:.3f} | "
            f"{r['residual_sets']} | {r['step_ms']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['temp_mb']:.1f} | {r['loss']:.4f} |" for r in rows]
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(outdir, "pipeline_timelines.txt"), "w") as f:
    f.write("\n\n".join(pictures) + "\n")
  print("\n".join(lines))
  print("\n\n".join(pictures))


if __name__ == "__main__":
  main()
