"""Context parallelism: step time and compiled memory per device vs sequence length and CP
degree n, ring attention (manual mode; and xla mode with attention_impl=ring) against the
all-gather variant (xla mode: K/V all-gathered, (S/n) x S scores per device).

  python scripts/bench_context_parallel.py [--seq 512,1024,2048] [--cp 1,2,4,8] [--steps 3] \
      [--out results/bench_context_parallel.md] [overrides...]

One sequence per step on n devices (mesh.sequence=n, nothing else), so memory per device shows
what CP saves. On CPU it simulates 8 devices and the times are compute on 2 shared cores; run it
on GPUs for step times that mean something. Writes a markdown table, a CSV and a PNG chart.
"""

import argparse
import os

SHAPE = ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "model.dtype=float32", "train.batch_size=1",
         "train.warmup_steps=0", "mesh.data=1"]
VARIANTS = {
    "all_gather (xla)": ["parallel.collectives=xla", "model.attention_impl=xla"],
    "ring (xla)": ["parallel.collectives=xla", "model.attention_impl=ring"],
    "ring (manual)": ["parallel.collectives=manual", "model.attention_impl=ring"],
}


def _measure(cfg, devices, steps):
  """(median step seconds, compiled temp + argument bytes, temp bytes, first loss) per device."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jscale import runtime  # pylint: disable=import-outside-toplevel
  from jscale.analysis import introspect
  rt = runtime.build(cfg, devices)
  compiled = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg)).compile()
  mem = introspect.memory(compiled)
  rng, l = np.random.default_rng(0), cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (1, l + 1)).astype(np.int32)
  batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": np.ones((1, l), np.float32)}
  reorder = rt.reorder()
  batch = jax.device_put(reorder(batch) if reorder else batch, rt.layouts.batch())
  step_s, loss = introspect.time_steps(compiled, rt.init_state(), batch, steps)
  return step_s, mem["temp"] + mem["argument"], mem["temp"], loss


def _chart(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  seqs = sorted({r["seq"] for r in rows})
  fig, axes = plt.subplots(1, len(seqs), figsize=(4 * len(seqs), 3.4), squeeze=False)
  for ax, s in zip(axes[0], seqs):
    for v in VARIANTS:
      pts = sorted((r["cp"], r["temp_mb"]) for r in rows if r["seq"] == s and r["variant"] == v)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"S = {s}")
    ax.set_xlabel("CP degree n")
    ax.set_ylabel("compiled temp memory / device (MB)")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", default="512,1024,2048")
  parser.add_argument("--cp", default="1,2,4,8")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--out", default="results/bench_context_parallel.md")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() == "cpu" and len(jax.devices()) < 8:
    raise SystemExit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  rows = []
  for s in (int(x) for x in args.seq.split(",")):
    for n in (int(x) for x in args.cp.split(",")):
      if n > len(jax.devices()):
        continue
      for name, overrides in VARIANTS.items():
        cfg = load_config(None, [*SHAPE, f"train.seq_len={s}", f"model.max_seq_len={s}",
                                 f"mesh.sequence={n}", *overrides, *args.overrides])
        step_s, total, temp, loss = _measure(cfg, jax.devices()[:n], args.steps)
        rows.append({"seq": s, "cp": n, "variant": name, "step_ms": 1e3 * step_s,
                     "tokens_per_s": s / step_s, "temp_mb": temp / 1e6, "mem_mb": total / 1e6,
                     "loss": loss})
        print(rows[-1], flush=True)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  head = ["seq", "cp", "variant", "step_ms", "tokens_per_s", "temp_mb", "mem_mb", "loss"]
  with open(os.path.splitext(args.out)[0] + ".csv", "w") as f:
    f.write(",".join(head) + "\n")
    f.writelines(",".join(str(r[k]) for k in head) + "\n" for r in rows)
  lines = [f"Devices: {len(jax.devices())} × {jax.devices()[0].device_kind}; one sequence per "
           "step; memory = compiled temp (and temp + arguments) per device.", "",
           "| S | n | variant | step (ms) | tokens/s | temp / device (MB) | temp + args (MB) "
           "| first loss |", "|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['seq']} | {r['cp']} | {r['variant']} | {r['step_ms']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['temp_mb']:.1f} | {r['mem_mb']:.1f} | "
            f"{r['loss']:.4f} |" for r in rows]
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  _chart(rows, os.path.splitext(args.out)[0] + ".png")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
