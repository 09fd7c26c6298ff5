"""Mixture of experts: dense vs MoE at equal active parameters, and an expert-parallel degree
sweep (throughput, compiled memory per device, and the collectives of the compiled step).

  python scripts/bench_moe.py [--devices 8] [--ep 1,2,4,8] [--steps 5] [--quick] \
      [--out results] [overrides...]

1. On one device: a dense model with d_ff = F against an MoE with 8 experts, top-2, experts of
   width F/2 (the same active MLP width), dropless and capacity (factor 1.25).
2. mesh.expert = 1, 2, 4, 8 (mesh.data=1, so the global batch is split over `expert` too), both
   dispatches, parallel.collectives = xla and manual: tokens/s, compiled temp and argument
   memory per device (expert weights and their optimizer state are split over `expert`), and
   per-step collective counts and bytes from the compiled HLO (`jscale.analysis.hlo.summary`).

On a GPU, dropless at scale (the grouped matmul kernel, capacity, dense at equal active
parameters, tokens/s and MFU) is scripts/bench_moe_gpu.py.

On CPU the devices are simulated (--xla_force_host_platform_device_count) and share the
machine's cores, so tokens/s tracks the total work of all devices, not parallel speed. Writes
<out>/bench_moe.md, <out>/bench_moe.csv and <out>/bench_moe.png, and prints the markdown.
"""

import argparse
import os
import time

# fp32, 4 layers of d_model 128, 8 sequences of 128 tokens per step (8 divides every degree).
SHAPE = ["model.preset=tiny", "model.d_model=128", "model.n_layers=4", "model.n_heads=4",
         "model.n_kv_heads=4", "model.d_ff=512", "model.dtype=float32", "train.batch_size=8",
         "train.seq_len=128", "train.warmup_steps=0", "mesh.data=1"]
MOE = ["model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=256",
       "model.moe.capacity_factor=1.25"]
KINDS = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def _measure(cfg, devices, steps):
  """Compiles and runs the train step of `cfg` on `devices`: a dict of measurements."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jscale import runtime  # pylint: disable=import-outside-toplevel
  from jscale.analysis import hlo, introspect
  rt = runtime.build(cfg, devices)
  t0 = time.perf_counter()
  compiled = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg)).compile()
  compile_s = time.perf_counter() - t0
  mem = introspect.memory(compiled)
  colls = hlo.summary(compiled.as_text())
  rng, b, l = np.random.default_rng(0), cfg.train.batch_size, cfg.train.seq_len
  t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  batch = jax.device_put({"tokens": t[:, :-1], "labels": t[:, 1:],
                          "loss_mask": np.ones((b, l), np.float32)}, rt.layouts.batch())
  seen = []

  def step(state, batch):  # keeps the first step's metrics (the dropped fraction)
    state, metrics = compiled(state, batch)
    if not seen:
      seen.append(metrics)
    return state, metrics

  step_s, loss = introspect.time_steps(step, rt.init_state(), batch, steps)
  dropped = float(seen[0]["dropped_fraction"]) if "dropped_fraction" in seen[0] else None
  row = {"step_ms": 1e3 * step_s, "tokens_per_s": b * l / step_s,
         "temp_mb": mem["temp"] / 1e6, "arg_mb": mem["argument"] / 1e6,
         "loss": loss, "dropped": dropped, "compile_s": compile_s}
  for kind in KINDS:
    s = colls.get(kind, {"count": 0, "bytes": 0})
    row[f"{kind}_count"], row[f"{kind}_kb"] = s["count"], s["bytes"] / 1e3
  return row


def _a2a_min_kb(cfg, ep):
  """Minimum all-to-all bytes per device per step (kB): each of a device's T = tokens / ep
  tokens sends K rows of D fp32 values to its experts and gets them back, forward and again
  (transposed) in the backward: 2 · T · D · K · 4 bytes per layer per direction-pair, x 2."""
  if ep == 1:
    return 0.0
  t = cfg.train.batch_size * cfg.train.seq_len // ep
  return 2 * 2 * t * cfg.model.d_model * cfg.model.moe.top_k * 4 * cfg.model.n_layers / 1e3


def _chart(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  sweep = [r for r in rows if r["section"] == "ep"]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  panels = [("tokens_per_s", "tokens/s (all devices, shared cores)", 1),
            ("temp_mb", "compiled memory / device (MB)", 1),
            ("all-to-all_kb", "all-to-all kB / device / step", 2)]
  for ax, (key, label, first) in zip(axes, panels):
    for mode in ("xla", "manual"):
      for dispatch in ("dropless", "capacity"):
        pts = sorted((r["ep"], r[key]) for r in sweep
                     if r["mode"] == mode and r["dispatch"] == dispatch and r["ep"] >= first)
        if pts:
          ax.plot(*zip(*pts), marker="o", ls="-" if mode == "manual" else "--",
                  label=f"{dispatch} ({mode})" + (" temp" if key == "temp_mb" else ""))
    if key == "temp_mb":
      pts = sorted({(r["ep"], r["arg_mb"]) for r in sweep})
      ax.plot(*zip(*pts), color="k", ls=":", marker="s", label="arguments (every variant)")
    if key == "all-to-all_kb":
      pts = sorted({(r["ep"], r["a2a_min_kb"]) for r in sweep if r["ep"] >= first})
      if pts:
        ax.plot(*zip(*pts), color="k", ls=":", label="minimum 2·(2·T·D·K·4)·layers")
    if key != "tokens_per_s":
      ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mesh.expert")
    ax.set_ylabel(label)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _fmt(x, spec):
  return "—" if x is None else format(x, spec)


def _markdown(rows, n_devices, kind, steps, cfg, elapsed):
  m = cfg.model
  tokens = cfg.train.batch_size * cfg.train.seq_len
  out = ["# MoE: dense vs MoE at equal active parameters, and expert parallelism", "",
         f"Devices: up to {n_devices} × {kind}, simulated on this machine's CPU cores (2 here, "
         "shared): the simulated devices run on the same cores, so tokens/s tracks the total "
         "work of all devices, not parallel speed; run on GPUs for step times that show what "
         "EP buys. Shape: fp32, {nl} layers, d_model {d}, {h} heads, vocab {v}, {b} sequences × "
         "{l} tokens = {tok} tokens per step; dense d_ff {f}; MoE {e} experts, top-{k}, expert "
         "d_ff {fe} (top-{k} × {fe} = the dense {f}: equal active MLP width). Timing: median of "
         "{steps} steps after one warm-up step (jscale.analysis.introspect.time_steps). Memory: XLA's "
         "compiled memory analysis per device. Whole run: {el:.0f} s.".format(
             nl=m.n_layers, d=m.d_model, h=m.n_heads, v=m.vocab_size, b=cfg.train.batch_size,
             l=cfg.train.seq_len, tok=tokens, f=m.d_ff, e=m.moe.n_experts, k=m.moe.top_k,
             fe=m.moe.d_ff, steps=steps, el=elapsed), ""]
  out += ["## 1. Dense vs MoE on one device", "",
          "| model | mode | step (ms) | tokens/s | temp / device (MB) | args / device (MB) | "
          "total params | active params | dropped | first loss |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["section"] == "dense_vs_moe":
      out.append(f"| {r['model']} | {r['mode']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
                 f"{r['temp_mb']:.1f} | {r['arg_mb']:.1f} | {r['params_total']:,} | "
                 f"{r['params_active']:,} | {_fmt(r['dropped'], '.3f')} | {r['loss']:.4f} |")
  out += ["", "- step / tokens/s: median train-step time (forward, backward, AdamW) and "
          f"{tokens} tokens divided by it.",
          "- temp / args: XLA's temporary buffers (activations, dispatch buffers, gradients) "
          "and argument buffers (params, optimizer state, batch) per device.",
          "- total / active params: `jscale.metrics.param_counts` total, and its matmul count "
          "(router + top-k experts as a token sees them, attention, LM head; no embedding).",
          "- dropped: share of the token-expert assignments dropped by capacity (first step).",
          "", "## 2. Expert-parallel sweep (mesh.expert = n, mesh.data = 1)", "",
          "| mode | dispatch | n | step (ms) | tokens/s | temp / dev (MB) | args / dev (MB) | "
          "dropped | all-to-all ops | all-to-all kB | min a2a kB | a2a / min | all-gather kB | "
          "all-reduce kB | other kB |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["section"] == "ep":
      a2a, mn = r["all-to-all_kb"], r["a2a_min_kb"]
      other = r["reduce-scatter_kb"] + r["collective-permute_kb"]
      out.append(
          f"| {r['mode']} | {r['dispatch']} | {r['ep']} | {r['step_ms']:.0f} | "
          f"{r['tokens_per_s']:.0f} | {r['temp_mb']:.1f} | {r['arg_mb']:.1f} | "
          f"{_fmt(r['dropped'], '.3f')} | {r['all-to-all_count']} | {a2a:.0f} | {mn:.0f} | "
          f"{_fmt(a2a / mn if mn else None, '.2f')} | {r['all-gather_kb']:.0f} "
          f"({r['all-gather_count']}) | {r['all-reduce_kb']:.0f} ({r['all-reduce_count']}) | "
          f"{other:.0f} ({r['reduce-scatter_count'] + r['collective-permute_count']}) |")
  out += ["", "- mode: parallel.collectives (xla: GSPMD partitions a slot buffer whose expert "
          "dim is constrained onto `expert`; manual: shard_map with explicit all_to_all).",
          "- n: mesh.expert; each device holds 8 / n experts and 1/n of the batch "
          f"({tokens} / n tokens).",
          "- temp / args per device: as above; args shrink with n as the expert weights and "
          "their AdamW moments are split over `expert` (the rest is replicated).",
          "- all-to-all ops / kB: all-to-all instructions executed per step and the sum of their "
          "result sizes per device (`jscale.analysis.hlo.summary`; layer-scan bodies counted once per "
          "layer). The result includes the block a device keeps for itself, a 1/n share.",
          "- min a2a kB: the minimum all-to-all traffic per device per step, see below; a2a / "
          "min: measured over it (capacity ≈ capacity_factor; dropless pays for static-shape "
          "padding).",
          "- all-gather / all-reduce / other kB (ops): the same for the other collectives "
          "(other: reduce-scatter + collective-permute); gradient all-reduces of the replicated "
          "(non-expert) parameters over `expert` are here.", "",
          "Minimum all-to-all bytes: with T = tokens per device, K = top_k, D = d_model, fp32, "
          "the forward of one MoE layer sends each token's K rows to their experts and brings "
          "them back: **2 · T · D · K · 4 bytes per layer per direction-pair** (dispatch + "
          "combine). A train step also runs the backward, whose transposed all-to-alls move "
          "the same again, so min a2a = 2 · (2 · T · D · K · 4) · n_layers "
          f"(here {_a2a_min_kb(cfg, 2):.0f} kB at n = 2, halving with each doubling of n).",
          "", "How the two modes run the experts (jscale/parallel/xla.py, manual.py, expert.py):",
          "", "- xla: a GShard [groups, E, C, D] slot buffer per step, whose expert dim is moved "
          "onto `expert` by a sharding constraint (GSPMD emits the all-to-all). Dropless "
          "uses C = T (every token has a slot at every expert), so the experts compute and the "
          "all-to-alls move E · T rows instead of T · K: E / K = "
          f"{cfg.model.moe.n_experts // cfg.model.moe.top_k}× the routed work, on one device "
          "too. In the compiled step (op_name metadata) each layer has 2 forward "
          "all-to-alls and 4 in the backward (one re-run in the rematerialised forward, "
          "one on all layers' saved buffers hoisted out of the layer loop): 1.5× the 4 a "
          "transposed forward needs. The router probabilities are all-gathered over `expert` "
          "before top_k (the all-gather column): every device routes every token.",
          "- manual: shard_map; at n = 1 dropless is sort + grouped matmul (ragged_dot) over "
          "the T · K assignments; at n > 1 it sends per-destination blocks padded to "
          "T · min(K, E / n) rows (n · min(K, E / n) / K × the minimum) plus the per-expert "
          "counts (small int all-to-alls, forward only); capacity sends the [E, C, D] buffer "
          "in one tiled all-to-all each way (capacity_factor × the minimum)."]
  return "\n".join(out) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--ep", default="1,2,4,8", help="mesh.expert degrees")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--quick", action="store_true", help="smoke run: n = 1, 2; 1 step")
  parser.add_argument("--out", default="results", help="output directory")
  parser.add_argument("overrides", nargs="*", help="config overrides")
  args = parser.parse_args()
  if args.quick:
    args.ep, args.steps = "1,2", 1
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax  # pylint: disable=import-outside-toplevel  # after XLA_FLAGS: jax reads it once
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  from jscale.metrics import param_counts  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  devices = jax.devices()
  rows = []

  def run(section, overrides, ep, **labels):
    cfg = load_config(None, [*SHAPE, *overrides, f"mesh.expert={ep}", *args.overrides])
    counts = param_counts(cfg.model)
    row = {"section": section, **labels, "ep": ep, "params_total": counts["total"],
           "params_active": counts["matmul"],
           **_measure(cfg, devices[:ep], args.steps),
           "a2a_min_kb": _a2a_min_kb(cfg, ep) if cfg.model.moe else 0.0}
    rows.append(row)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return cfg

  one = {}  # (mode, dispatch) -> the one-device row, reused as the sweep's n = 1
  for dispatch in ("", "dropless", "capacity"):
    for mode in ("xla", "manual"):
      moe = [*MOE, f"model.moe.dispatch={dispatch}"] if dispatch else []
      run("dense_vs_moe", [*moe, f"parallel.collectives={mode}"], 1,
          model=f"MoE {dispatch}" if dispatch else "dense", mode=mode, dispatch=dispatch)
      one[mode, dispatch] = rows[-1]
  for mode in ("xla", "manual"):
    for dispatch in ("dropless", "capacity"):
      for ep in (int(x) for x in args.ep.split(",")):
        if ep > len(devices):
          continue
        if ep == 1:
          rows.append({**one[mode, dispatch], "section": "ep"})
          continue
        run("ep", [*MOE, f"model.moe.dispatch={dispatch}", f"parallel.collectives={mode}"],
                  ep, model=f"MoE {dispatch}", mode=mode, dispatch=dispatch)
  os.makedirs(args.out, exist_ok=True)
  head = list(rows[-1])
  with open(os.path.join(args.out, "bench_moe.csv"), "w", encoding="utf-8") as f:
    f.write(",".join(head) + "\n")
    f.writelines(",".join("" if r.get(k) is None else str(r.get(k)) for k in head) + "\n"
                 for r in rows)
  cfg = load_config(None, [*SHAPE, *MOE, *args.overrides])
  text = _markdown(rows, len(devices), devices[0].device_kind, args.steps, cfg,
                   time.perf_counter() - start)
  with open(os.path.join(args.out, "bench_moe.md"), "w", encoding="utf-8") as f:
    f.write(text)
  try:
    _chart(rows, os.path.join(args.out, "bench_moe.png"))
  except ImportError:
    print("matplotlib not installed: no chart")
  print(text)


if __name__ == "__main__":
  main()
