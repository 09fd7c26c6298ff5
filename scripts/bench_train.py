"""Training throughput on the GPU it finds: tokens/s, MFU, step time, peak memory and where the
device time goes, per (preset, batch, remat, attention) setting.

  python scripts/bench_train.py                      # the sweep below -> results/bench_train.*
  python scripts/bench_train.py --only 1b            # rows whose name contains "1b"
  python scripts/bench_train.py --only 3b,8b --out results/bench_train_large.md
  python scripts/bench_train.py --steps 30 -- train.seq_len=8192   # extra overrides, every row
  python scripts/bench_train.py --quick              # CPU smoke run of the script itself
  python scripts/bench_train.py --only 1b --keep results/kept   # + each row's program, trace

Each row is one `python -m jscale.train` process (an out-of-memory row fails alone) on
configs/tiny.yaml's data (stdlib bytes; the vocab is the preset's, so the head is full size)
with bf16 compute, no checkpoints, no eval. Steps 2..N are timed by the trainer's own metrics
(the first step holds the compile); the figure is the mean over the logged intervals after the
first, excluding the profiled steps. Then `train.profile_steps` traces two steps and
`jscale.profile` splits their device time into gemm / attention / collectives /
elementwise / copies / idle, with the top kernels; beside them `jscale.predict`'s figures for
the step program the run compiled (XLA dumps it: the autotuned program). MFU is the trainer's: 6·N + causal attention
FLOPs per token over the device's dense bf16 peak (989 TFLOP/s for an H100 SXM).

Writes results/bench_train.md (table, then each row's profile summary) and .csv. The whole sweep
takes ~20 minutes on one H100 (each row ~1-2: start, compile, 20 steps); where one command may
run for less, split it with --only and --out.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jscale import hardware, predict, profile  # noqa: E402
from jscale.predict import rates, summary  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402

L1B, L3B, L8B = ("model.preset=llama3_1b",), ("model.preset=llama3_3b",), (
    "model.preset=llama3_8b", "model.n_layers=8")  # 8B's layers, 8 of them: fits one GPU
# name -> overrides (seq 4096 unless given). Attention "auto" is cuDNN on an H100.
ROWS: dict[str, tuple[str, ...]] = {
    "1b selective b4": (*L1B, "train.batch_size=4", "train.remat=selective"),
    "1b selective b8": (*L1B, "train.batch_size=8", "train.remat=selective"),
    "1b selective b16": (*L1B, "train.batch_size=16", "train.remat=selective"),
    "1b selective b8 cublas gemms": (*L1B, "train.batch_size=8", "train.remat=selective"),
    "1b none b2": (*L1B, "train.batch_size=2", "train.remat=none"),
    "1b none b4": (*L1B, "train.batch_size=4", "train.remat=none"),
    "1b full b8": (*L1B, "train.batch_size=8", "train.remat=full"),
    "1b selective b4 unchunked loss": (*L1B, "train.batch_size=4", "train.remat=selective",
                                       "train.logits_chunk_mb=0"),
    "1b selective b4 pallas": (*L1B, "train.batch_size=4", "train.remat=selective",
                               "model.attention_impl=pallas", "model.norm_impl=pallas"),
    "1b selective b4 xla attention": (*L1B, "train.batch_size=4", "train.remat=selective",
                                      "model.attention_impl=xla"),
    # packed documents masked (issue 51): `auto` runs the Hopper flash kernel with segment ids
    "1b selective b4 document mask": (*L1B, "train.batch_size=4", "train.remat=selective",
                                      "data.document_mask=true"),
    # the layers unrolled into straight-line code (model.scan_layers=false): predicted on an
    # H100 at 556 -> 528 ms for the first, no residual stacks to zero-fill and copy into
    "1b selective b8 unrolled": (*L1B, "train.batch_size=8", "train.remat=selective",
                                 "model.scan_layers=false"),
    "3b full b2": (*L3B, "train.batch_size=2", "train.remat=full"),
    "3b selective b2": (*L3B, "train.batch_size=2", "train.remat=selective"),
    "8b-8L full b1": (*L8B, "train.batch_size=1", "train.remat=full"),
    "8b-8L selective b2": (*L8B, "train.batch_size=2", "train.remat=selective"),
    "8b-8L selective b2 unrolled": (*L8B, "train.batch_size=2", "train.remat=selective",
                                    "model.scan_layers=false"),
    # Long context (issue 52): one GPU's slice of Llama 3 8B at 32k tokens, cuDNN and the Hopper
    # flash kernel (what each device runs under Ulysses, scripts/long_context.py)
    "8b-8L full b1 32k": (*L8B, "train.batch_size=1", "train.remat=full",
                          "train.seq_len=32768", "model.max_seq_len=32768"),
    "8b-8L full b1 32k pallas": (*L8B, "train.batch_size=1", "train.remat=full",
                                 "train.seq_len=32768", "model.max_seq_len=32768",
                                 "model.attention_impl=pallas"),
    # DeepSeek-V3 16B-like (docs/deepseek.md): its first 3 layers (1 dense + 2 MoE of 64
    # experts, top-6, 2 shared) + its MTP module fit one GPU; attention auto (V's head size
    # differs from Q's: not cuDNN), experts' matmul auto (the Hopper grouped kernel on an H100).
    "dsv3-16b-3L selective b2": ("model.preset=deepseek_v3_16b", "model.n_layers=3",
                                 "train.batch_size=2", "train.remat=selective"),
    # the same with Adam's moments in bf16 (as DeepSeek-V3 trained): the experts' update moves
    # 20 bytes per parameter instead of 28
    "dsv3-16b-3L selective b2 bf16 moments": (
        "model.preset=deepseek_v3_16b", "model.n_layers=3", "train.batch_size=2",
        "train.remat=selective", "train.moments_dtype=bfloat16"),
    # and the head's logits in bf16 (softmax and loss fp32): half the bytes of the loss's passes
    "dsv3-16b-3L selective b2 bf16 moments bf16 logits": (
        "model.preset=deepseek_v3_16b", "model.n_layers=3", "train.batch_size=2",
        "train.remat=selective", "train.moments_dtype=bfloat16", "train.logits_dtype=bfloat16"),
    # and each head's loss over its logits at once (8,192 x 102,400 bf16, 1.6 GiB: one GPU
    # has the room), not in chunks of tokens: autodiff's two plain softmax reductions, no
    # online one, no fp32 dW running sum (predicted 1.4 ms a step faster on an H100, 2026-12-01)
    "dsv3-16b-3L selective b2 bf16 moments bf16 logits whole": (
        "model.preset=deepseek_v3_16b", "model.n_layers=3", "train.batch_size=2",
        "train.remat=selective", "train.moments_dtype=bfloat16", "train.logits_dtype=bfloat16",
        "train.logits_chunk_mb=4096"),
    # and its routed experts in FP8, current scaling per expert (tiled: jscale/fp8/grouped.py)
    "dsv3-16b-3L selective b2 bf16 moments fp8 experts": (
        "model.preset=deepseek_v3_16b", "model.n_layers=3", "train.batch_size=2",
        "train.remat=selective", "train.moments_dtype=bfloat16", "fp8.enabled=true",
        "fp8.targets=[experts]"),
    # scaled per row instead: on Hopper the grouped kernel's FP8 path (forward and dx in e4m3,
    # dW in bf16: jscale/fp8/grouped_kernel.py)
    "dsv3-16b-3L selective b2 bf16 moments fp8 experts rows": (
        "model.preset=deepseek_v3_16b", "model.n_layers=3", "train.batch_size=2",
        "train.remat=selective", "train.moments_dtype=bfloat16", "fp8.enabled=true",
        "fp8.targets=[experts]", "fp8.experts_scaling=row"),
}
# Rows run with these XLA flags added (XLA's Triton gemm fusions read the fp32 master weights
# and cast inside the gemm; without them cuBLAS runs every gemm after a separate convert).
ROW_XLA_FLAGS = {"1b selective b8 cublas gemms": "--xla_gpu_enable_triton_gemm=false"}
QUICK: dict[str, tuple[str, ...]] = {  # CPU: the script's plumbing, not a measurement
    "tiny b8": ("model.n_layers=2", "train.batch_size=8", "train.seq_len=64",
                "model.dtype=float32"),
}
STEP_MODULE = "jit_step"  # the train step's jitted function is `step`
PREDICTED = ("gemm", "attention", "collectives", "elementwise", "copies", "idle")
COMMON = ("model.dtype=bfloat16", "train.seq_len=4096", "checkpoint.every=0", "train.eval_every=0",
          "data.val_fraction=0", "logging.progress=false", "logging.tensorboard=false",
          "train.warmup_steps=5")


def run_row(name: str, overrides: tuple[str, ...], steps: int, every: int, workdir: str,
            extra: tuple[str, ...], keep: str | None = None) -> dict:
  """One training process; its steady-state metrics and profile summary as a table row.
  `keep`: a folder that gets the row's step program and trace, gzipped (`_kept`)."""
  out = os.path.join(workdir, name.replace(" ", "_"))
  first = steps - every + 1  # the last logging interval is traced, and not timed
  cmd = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", *COMMON,
         *overrides, *extra, f"train.steps={steps}", f"logging.every={every}",
         f"train.profile_steps=[{first},{first + 1}]", f"train.output_dir={out}"]
  print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
  env = dict(os.environ)
  # The train step's optimised program as the GPU compiled it (autotuned), for jscale.predict.
  dump = (f"--xla_dump_to={os.path.join(out, 'hlo')} --xla_dump_hlo_as_text "
          f"--xla_dump_hlo_module_re={STEP_MODULE}")
  flags = " ".join(f for f in (env.get("XLA_FLAGS", ""), ROW_XLA_FLAGS.get(name, ""), dump) if f)
  env["XLA_FLAGS"] = flags
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  row = {"name": name, "overrides": " ".join(overrides + extra) + (
      f" XLA_FLAGS+={ROW_XLA_FLAGS[name]}" if name in ROW_XLA_FLAGS else "")}
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    oom = any("RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower() for line in tail)
    print("\n".join(tail[-15:]), file=sys.stderr)
    return {**row, "status": "out of memory" if oom else f"failed: {tail[-1][:120] if tail else ''}"}
  with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  timed = [r for r in rows if "step_time_s" in r and every < r["step"] <= steps - every]
  timed = timed or [r for r in rows if "step_time_s" in r]
  mean = lambda k: sum(r[k] for r in timed) / len(timed) if timed and timed[0].get(k) else None
  with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
    info = json.load(f)
  s = profile.summarize(out)
  shares = s.shares()
  peak = max((r.get("peak_memory_bytes") or 0) for r in rows) or None
  measured = {**row, "status": "ok", "device": info["device_kind"],
              "attention": info["attention_impl"], "tokens_per_sec": mean("tokens_per_sec"),
              "mfu": mean("mfu"), "step_time_s": mean("step_time_s"),
              "peak_memory_gib": peak / 2**30 if peak else None,
              **{f"share_{k.split('/')[0]}": v for k, v in shares.items()},
              "top_kernels": "; ".join(f"{k.name[:48]} ({k.total_ns / s.span_ns:.0%})"
                                       for k in s.kernels[:3]),
              "profile": profile.format_summary(s, top=12)}
  dump = os.path.join(out, "hlo")
  pred = predicted(dump, measured)
  if keep:
    _kept(dump, profile.find_trace(out), keep, name.replace(" ", "_"))
  shutil.rmtree(dump, ignore_errors=True)  # a GPU host's /tmp is small
  return {**measured, **pred}


def _kept(dump_dir: str, trace: str, keep: str, slug: str) -> None:
  """<keep>/<slug>.hlo.txt.gz (the step program XLA dumped) and <slug>.xplane.pb.gz (its
  trace): what joins measured kernels to predicted ones, name by name."""
  os.makedirs(keep, exist_ok=True)
  for src, dst in ((_dumped_step(dump_dir), f"{slug}.hlo.txt.gz"),
                   (trace, f"{slug}.xplane.pb.gz")):
    if src:
      with open(src, "rb") as f, gzip.open(os.path.join(keep, dst), "wb") as g:
        shutil.copyfileobj(f, g)


def _dumped_step(dump_dir: str) -> str | None:
  """The optimised step program XLA dumped into `dump_dir` (the largest module of that name:
  the step, not a helper jit of the same name), or None."""
  found = sorted(glob.glob(os.path.join(dump_dir, f"*{STEP_MODULE}*after_optimizations.txt")),
                 key=os.path.getsize)
  return found[-1] if found else None


def predicted(dump_dir: str, row: dict) -> dict:
  """`jscale.predict` of the step program the run compiled (XLA's dump), beside what it
  measured: predicted step time and MFU (the measured MFU scaled by measured / predicted step:
  same model FLOPs) and the predicted time by category. Empty where there is no GPU program
  or no prediction for the device."""
  found = _dumped_step(dump_dir)
  gpu = hardware.predictable(row.get("device") or "")
  if not found or gpu is None or not row.get("step_time_s"):
    return {}
  with open(found, encoding="utf-8") as f:
    sched = predict.predict(f.read(), gpu)
  r = summary.summarize(sched, rates.chip(gpu), 0.0, 0)
  return {"predicted_step_s": r.step_s,
          "predicted_mfu": row["mfu"] * row["step_time_s"] / r.step_s if row["mfu"] else None,
          **{f"predicted_ms_{k.split('/')[0]}": 1e3 * v for k, v in r.by_category.items()}}


def _fmt(v, spec):
  return "—" if v is None else format(v, spec)


COLUMNS = [
    ("setting", lambda r: r["name"]), ("attention", lambda r: r.get("attention", "—")),
    ("tokens/s", lambda r: _fmt(r.get("tokens_per_sec"), ",.0f")),
    ("MFU", lambda r: _fmt(r.get("mfu"), ".1%")),
    ("step (ms)", lambda r: _fmt(r.get("step_time_s") and 1e3 * r["step_time_s"], ".0f")),
    ("peak (GiB)", lambda r: _fmt(r.get("peak_memory_gib"), ".1f")),
    ("predicted MFU (step ms)", lambda r: "—" if r.get("predicted_mfu") is None else
     f"{r['predicted_mfu']:.1%} ({1e3 * r['predicted_step_s']:.0f})"),
    ("gemm / attn / coll / elem / copy / idle", lambda r: " / ".join(
        f"{100 * r[k]:.0f}" for k in ("share_gemm", "share_attention", "share_collectives",
                                      "share_elementwise", "share_copies", "share_idle"))
     if r["status"] == "ok" else r["status"]),
]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="",
                  help="comma-separated: run the rows whose name contains one of these")
  p.add_argument("--exact", action="store_true", help="--only names whole rows")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--every", type=int, default=5, help="logging interval (timed blocks)")
  p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny rows")
  p.add_argument("--out", default="results/bench_train.md")
  p.add_argument("--keep", default=None,
                 help="a folder for each row's step program and trace (gzipped)")
  p.add_argument("extra", nargs="*", help="overrides added to every row")
  args = p.parse_args()
  # Asked in a child: starting JAX here would take 75% of the GPU's memory away from the
  # training processes this script launches (XLA preallocates on backend start).
  backend = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True, check=True).stdout.split()[-1]
  if backend != "gpu" and not args.quick:
    raise SystemExit(f"no GPU here (backend {backend}): the sweep measures GPU training; "
                     "`--quick` runs the script's plumbing on CPU")
  rows_in = QUICK if args.quick else ROWS
  extra = tuple(args.extra) + (("train.seq_len=64",) if args.quick else ())
  keys = args.only.split(",")
  if args.exact:  # in --only's order: the most wanted row first, should the budget cut in
    chosen = {n: rows_in[n] for n in keys if n in rows_in}
  else:
    chosen = {n: o for n, o in rows_in.items() if any(k in n for k in keys)}
  if not chosen:
    raise SystemExit(f"--only {args.only!r} matches none of {list(rows_in)}")
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench_train_") as work:
    for n, o in chosen.items():  # the tables after every row: a run cut short keeps its rows
      rows.append(run_row(n, o, args.steps, args.every, work, extra, args.keep))
      table = write_tables(rows, args.out)
  print(table)


def write_tables(rows: list[dict], out: str) -> str:
  """<out> (.md: the table, then each row's profile summary) and its .csv; the table."""
  table = write_table([{k: v for k, v in r.items() if k != "profile"} for r in rows], COLUMNS,
                      out)
  with open(out, "a", encoding="utf-8") as f:
    f.write("\nShares are % of the traced span (2 steps); kernel time on overlapping streams "
            "counts once per stream.\n")
    for r in rows:
      if r["status"] == "ok":
        pred = ", ".join(f"{k} {r[f'predicted_ms_{k}']:.1f}" for k in PREDICTED if
                         f"predicted_ms_{k}" in r)
        pred = f"\njscale.predict, the same program, ms per step: {pred}\n" if pred else ""
        f.write(f"\n### {r['name']}\n\n```\n{r['profile']}\n```\n{pred}")
  return table


if __name__ == "__main__":
  main()
