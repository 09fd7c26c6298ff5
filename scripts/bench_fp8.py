"""FP8 against bf16 on one GPU (issue 18): gemm TFLOP/s, training throughput, loss curves.

On the H100, three commands (each under 10 minutes; together they fill one table):
  python scripts/bench_fp8.py --only gemm,1b   # gemms + llama3_1b rows -> results/bench_fp8.*
  python scripts/bench_fp8.py --only 8b        # + the 8b-8L rows
  python scripts/bench_fp8.py --curves         # + loss curves, results/bench_fp8_loss.png
Without --only: the gemms and every train row at once (6-11 minutes). `--steps 30 --
train.seq_len=8192`: steps and extra overrides for every train row. `--quick`: a CPU smoke run
of all three parts at tiny shapes, to $TMPDIR/bench_fp8_quick.* unless --out says otherwise.

1. gemm: M = N = K = 4096, 8192, 16384, bf16 operands: `a @ b` in bf16 against
   `jscale.fp8.dot.fp8_dot_general` with current scaling (amaxes, quantisation and the scaled
   e4m3 gemm all timed), forward and forward + backward (a vjp: 3 gemms). Each jitted function
   runs --calls times back to back per host sync (dispatch is async, so the GPU runs them end to
   end); the median of --reps such blocks. The compiled FP8 HLO is searched for XLA's cuBLASLt
   FP8 gemm custom call (`__cublas$lt$matmul$f8`): yes / no, and its count fwd / fwd+bwd.
2. end to end: `python -m jscale.train` processes via `bench_train.run_row` (configs/tiny.yaml's
   stdlib data, bf16 compute, no checkpoints, no eval; steps 2..N timed, two steps profiled):
   llama3_1b (seq 4096, batch 4, selective remat) bf16 / fp8 delayed / fp8 current, and
   llama3_8b cut to 8 layers (batch 2, selective) bf16 / fp8 delayed. MFU is the trainer's:
   against the bf16 peak for every row, FP8 included. Speedup: tokens/s over the model's bf16 row.
3. --curves: llama3_1b, 200 steps, bf16 vs fp8 delayed at lr 3e-4 (configs/llama3_1b.yaml's),
   loss logged every 10 steps; final loss = mean of the losses logged in the last 50 steps, its
   difference in %, and the curves plotted side by side (if matplotlib imports).

Writes <out>.md (a table per part), <out>.csv (every raw field; `section` says the part) and,
with --curves, <out stem>_loss.png; --out defaults to results/bench_fp8.md. Rows an earlier run
left in <out>.csv that this one does not redo are kept (delete the files to start afresh). This
process never starts JAX (the gemms run in a child): JAX takes 75% of the GPU's memory when it
starts, and the training subprocesses need it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # noqa: E402  (also puts the repo root on sys.path)
from jscale import hardware  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402

SIZES, QUICK_SIZES = (4096, 8192, 16384), (256, 512)
_H100 = hardware.GPUS["h100"].peak_flops  # dense TFLOP/s, H100 SXM (an H200's too)
PEAK_BF16, PEAK_FP8 = _H100["bf16"] / 1e12, _H100["fp8"] / 1e12
CUBLAS_F8 = "cublas$lt$matmul$f8"  # XLA's custom-call target: __cublas$lt$matmul$f8
RECIPES = {"bf16": (), "fp8 delayed": ("fp8.enabled=true", "fp8.recipe=delayed"),
           "fp8 current": ("fp8.enabled=true", "fp8.recipe=current")}
# model -> overrides on top of bench_train.COMMON (seq 4096, bf16); rows: (model, recipe)
MODELS = {"1b": ("model.preset=llama3_1b", "train.batch_size=4", "train.remat=selective"),
          "8b-8L": ("model.preset=llama3_8b", "model.n_layers=8", "train.batch_size=2",
                    "train.remat=selective")}  # 8 of 8B's 32 layers: fits one GPU
ROWS = (("1b", "bf16"), ("1b", "fp8 delayed"), ("1b", "fp8 current"), ("8b-8L", "bf16"),
        ("8b-8L", "fp8 delayed"))
# CPU: plumbing, not a measurement (fp8 delayed runs in the quick curves)
QUICK_MODELS = {"tiny": ("model.n_layers=2", "train.batch_size=8")}
QUICK_ROWS = (("tiny", "bf16"), ("tiny", "fp8 current"))
# Curves at a 1B-sized learning rate (tiny.yaml's 3e-3 is for a 3M model), 10% warmup.
CURVE_LR = ("train.lr=3e-4", "train.warmup_steps=20")


def _seconds(fn, args, calls: int, reps: int) -> tuple[float, str]:
  """Median seconds per call of jitted `fn(*args)` (`calls` calls per sync) and its HLO text."""
  import jax  # pylint: disable=import-outside-toplevel
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(calls):
      out = compiled(*args)
    jax.block_until_ready(out)  # one stream: the last call done means all are
    times.append((time.perf_counter() - t) / calls)
  return statistics.median(times), compiled.as_text()


def bench_gemm(sizes, calls: int, reps: int) -> list[dict]:
  """One row per size: TFLOP/s of bf16 and FP8 (current scaling) products, forward and
  forward + backward, and the cuBLASLt FP8 custom calls in the compiled FP8 programs."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jscale.fp8.dot import Recipe, fp8_dot_general  # pylint: disable=import-outside-toplevel
  dims = (((1,), (0,)), ((), ()))
  dots = {"bf16": lambda a, b: jax.lax.dot_general(a, b, dims),
          "fp8": lambda a, b: fp8_dot_general(a, b, dims, Recipe(delayed=False))}

  def fwd_bwd(dot):
    def f(a, b, g):
      y, vjp = jax.vjp(dot, a, b)
      return (y, *vjp(g))  # y too, or the bf16 forward gemm would be dead code
    return f

  rows = []
  for n in sizes:
    ka, kb, kg = jax.random.split(jax.random.key(n), 3)
    a, g = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in (ka, kg))
    b = (jax.random.normal(kb, (n, n), jnp.float32) * n**-0.5).astype(jnp.bfloat16)
    row = {"name": f"gemm {n}", "section": "gemm", "device": jax.devices()[0].device_kind,
           "size": n, "status": "ok"}
    for kind, dot in dots.items():
      for mode, fn, args, flops in (("fwd", dot, (a, b), 2 * n**3),
                                    ("fwd_bwd", fwd_bwd(dot), (a, b, g), 6 * n**3)):
        try:
          s, hlo = _seconds(fn, args, calls, reps)
        except Exception as e:  # pylint: disable=broad-except  (one cell, not the run)
          first = str(e).split("\n")[0][:100]
          row["status"] = f"{kind} {mode}: {type(e).__name__}: {first}"
          print(row["status"], file=sys.stderr)
          continue
        row[f"{kind}_{mode}_tflops"] = flops / s / 1e12
        if kind == "fp8":
          row[f"cublaslt_f8_{mode}"] = hlo.count(CUBLAS_F8)
          print(f"gemm {n}: FP8 {mode} compiled HLO has {hlo.count(CUBLAS_F8)} "
                f"__{CUBLAS_F8} custom call(s)", flush=True)
    rows.append(row)
  return rows


def _backend() -> str:
  import jax  # pylint: disable=import-outside-toplevel
  return jax.default_backend()


def _in_child(fn, *args):
  """fn(*args) in a fresh process, so that this one never holds GPU memory."""
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
    return ex.submit(fn, *args).result()


def run_train(model: str, overrides, recipe: str, steps: int, every: int, work: str,
              extra, prefix: str = "") -> tuple[dict, list[tuple[int, float]]]:
  """One training row (bench_train.run_row) and its logged (step, loss) pairs."""
  name = f"{prefix}{model} {recipe}"
  row = bench_train.run_row(name, (*overrides, *RECIPES[recipe]), steps, every, work, extra)
  row.pop("profile", None)  # long text; the shares and top kernels stay in the table
  row.update(model=model, recipe=recipe)
  losses = []
  if row["status"] == "ok":  # run_row's output directory
    with open(os.path.join(work, name.replace(" ", "_"), "metrics.jsonl"), encoding="utf-8") as f:
      losses = [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]
  return row, losses


def plot_curves(curves: dict[str, list[tuple[int, float]]], model: str, path: str) -> None:
  """Loss against step for each recipe (left) and FP8's relative difference to bf16 (right)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("matplotlib not installed: no loss plot")
    return
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  base = dict(curves["bf16"])
  for recipe, pts in curves.items():
    left.plot(*zip(*pts), label=recipe)
    if recipe != "bf16":
      right.plot(*zip(*[(s, 100 * (v - base[s]) / base[s]) for s, v in pts if s in base]),
                 label=f"{recipe} vs bf16")
  left.set(xlabel="step", ylabel="training loss", title=f"{model}: training loss")
  right.set(xlabel="step", ylabel="loss difference (%)", title="(FP8 - bf16) / bf16")
  right.axhline(0, color="gray", lw=0.5)
  left.legend()
  right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def _num(v: str):
  """A CSV cell back as None, a number or the string."""
  try:
    return float(v) if v else None
  except ValueError:
    return v


def _fmt(v, spec):
  return "—" if v in (None, "") else format(v, spec)


def _rate(r, kind, mode, peak):
  v = r.get(f"{kind}_{mode}_tflops")
  return "—" if v is None else f"{v:,.0f} ({v / peak:.0%})" if v >= 10 else f"{v:.2g}"


def _ratio(r, mode):
  f8, bf = r.get(f"fp8_{mode}_tflops"), r.get(f"bf16_{mode}_tflops")
  return f"{f8 / bf:.2f}x" if f8 and bf else "—"


def _cublas(r):
  f, b = r.get("cublaslt_f8_fwd"), r.get("cublaslt_f8_fwd_bwd")
  return "—" if f is None else f"{'yes' if f else 'no'} ({f:.0f} / {_fmt(b, '.0f')})"


_BT = dict(bench_train.COLUMNS)  # bench_train's cells, by header
# section -> (heading and note, columns)
TABLES = {
    "gemm": (f"## GEMM: bf16 vs FP8 (current scaling, quantisation timed)\n\nSquare bf16 "
             f"operands. Theoretical dense peaks, H100 SXM: bf16 {PEAK_BF16:g} TFLOP/s, fp8 "
             f"{PEAK_FP8:g} TFLOP/s. fwd+bwd: 3 gemms.", [
        ("M=N=K", lambda r: _fmt(r["size"], ".0f")),
        (f"bf16 fwd TFLOP/s (% of {PEAK_BF16:g})", lambda r: _rate(r, "bf16", "fwd", PEAK_BF16)),
        (f"fp8 fwd (% of {PEAK_FP8:g})", lambda r: _rate(r, "fp8", "fwd", PEAK_FP8)),
        ("fp8 / bf16 fwd", lambda r: _ratio(r, "fwd")),
        (f"bf16 fwd+bwd (% of {PEAK_BF16:g})", lambda r: _rate(r, "bf16", "fwd_bwd", PEAK_BF16)),
        (f"fp8 fwd+bwd (% of {PEAK_FP8:g})", lambda r: _rate(r, "fp8", "fwd_bwd", PEAK_FP8)),
        ("fp8 / bf16 fwd+bwd", lambda r: _ratio(r, "fwd_bwd")),
        ("cuBLASLt fp8 gemm (calls fwd / fwd+bwd)", _cublas),
        ("status", lambda r: r["status"])]),
    "train": ("## End to end (`python -m jscale.train`; overrides in the CSV)\n\nMFU counts "
              "model FLOPs against the bf16 peak for every row, FP8 rows included. Speedup: "
              "tokens/s over the bf16 row of the same model.", [
        ("setting", _BT["setting"]), ("tokens/s", _BT["tokens/s"]),
        ("MFU (of bf16 peak)", _BT["MFU"]),
        ("speedup vs bf16", lambda r: _fmt(r.get("speedup"), ".2f")),
        ("step (ms)", _BT["step (ms)"]), ("peak (GiB)", _BT["peak (GiB)"]),
        ("gemm / attn / coll / elem / copy / idle", _BT["gemm / attn / coll / elem / copy / idle"]),
        ("top kernels", lambda r: r.get("top_kernels") or "—")]),
    "curves": ("## Loss curves: bf16 vs fp8 delayed (lr 3e-4)\n\nFinal loss: mean of the "
               "losses logged in the last quarter of the steps (every 10, last 50 of 200).",
               [("setting", lambda r: r["name"]), ("status", lambda r: r["status"]),
                ("final loss", lambda r: _fmt(r.get("final_loss"), ".4f")),
                ("vs bf16 (%)", lambda r: _fmt(r.get("loss_diff_pct"), "+.2f")),
                ("tokens/s", _BT["tokens/s"])]),
}


def merge(rows: list[dict], out: str, names: list[str]) -> list[dict]:
  """`rows` after the rows of <out>.csv that this run did not redo, in table order, with each
  train row's speedup over the bf16 row of its model."""
  path = os.path.splitext(out)[0] + ".csv"
  if os.path.exists(path):
    done = {r["name"] for r in rows}
    with open(path, encoding="utf-8") as f:
      rows = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)
              if r["name"] not in done and r.get("section") in TABLES] + rows
  order = {n: i for i, n in enumerate(names)}
  rows.sort(key=lambda r: (list(TABLES).index(r["section"]), order.get(r["name"], len(order))))
  bf16 = {r["model"]: r["tokens_per_sec"] for r in rows
          if r["section"] == "train" and r["recipe"] == "bf16" and r.get("tokens_per_sec")}
  for r in rows:
    if r["section"] == "train":
      r["speedup"] = (r["tokens_per_sec"] / bf16[r["model"]]
                      if r.get("tokens_per_sec") and r["model"] in bf16 else None)
  return rows


def write(rows: list[dict], out: str) -> str:
  """<out>.md: a table per section present; <out>.csv: every row, every field."""
  keys = list(dict.fromkeys(k for r in rows for k in r))
  rows = [{k: r.get(k) for k in keys} for r in rows]
  devices = sorted({r["device"] for r in rows if r.get("device")})
  text = f"# FP8 vs bf16 on {', '.join(devices) or 'unknown device'}\n"
  with tempfile.TemporaryDirectory() as tmp:  # rendered first: a failure leaves <out> as it was
    for section, (note, cols) in TABLES.items():
      part = [r for r in rows if r["section"] == section]
      if part:
        text += f"\n{note}\n\n" + write_table(part, cols, os.path.join(tmp, "part.md"))
  write_table(rows, [], out)  # for its CSV of every row and field; the .md is replaced below
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return text


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="comma-separated: the gemm / train rows whose "
                 "name contains one of these (gemm 4096, .., 1b bf16, .., 8b-8L fp8 delayed)")
  p.add_argument("--curves", action="store_true", help="run the loss curves (only)")
  p.add_argument("--steps", type=int, default=20, help="train steps per end-to-end row")
  p.add_argument("--every", type=int, default=5, help="logging interval (timed blocks)")
  p.add_argument("--quick", action="store_true", help="CPU smoke run of every part: tiny shapes")
  p.add_argument("--out", default=None, help="markdown path (default results/bench_fp8.md)")
  p.add_argument("extra", nargs="*", help="overrides added to every train row")
  a = p.parse_args()
  out = a.out or (os.path.join(tempfile.gettempdir(), "bench_fp8_quick.md") if a.quick
                  else "results/bench_fp8.md")
  backend = _in_child(_backend)
  if backend != "gpu" and not a.quick:
    raise SystemExit(f"no GPU here (backend {backend}): `--quick` runs the script on CPU")
  models, train, sizes = ((QUICK_MODELS, QUICK_ROWS, QUICK_SIZES) if a.quick
                          else (MODELS, ROWS, SIZES))
  # quick: every part, few steps (a training process is ~30 s of start and compile on CPU)
  steps, every, calls, reps = (6, 2, 3, 2) if a.quick else (a.steps, a.every, 20, 5)
  curve_steps, curve_every = (12, 2) if a.quick else (200, 10)
  extra = tuple(a.extra) + (("train.seq_len=64",) if a.quick else ())
  names = [f"gemm {n}" for n in sizes] + [f"{m} {r}" for m, r in train]
  pick = lambda name: any(k in name for k in a.only.split(","))
  if not any(map(pick, names)):
    raise SystemExit(f"--only {a.only!r} matches none of {names}")
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench_fp8_") as work:
    if not a.curves or a.quick:
      if any(pick(f"gemm {n}") for n in sizes):
        rows += _in_child(bench_gemm, [n for n in sizes if pick(f"gemm {n}")], calls, reps)
      for m, r in (t for t in train if pick(f"{t[0]} {t[1]}")):
        rows.append({**run_train(m, models[m], r, steps, every, work, extra)[0],
                     "section": "train"})
    if a.curves or a.quick:
      model, curves = next(iter(models)), {}
      for r in ("bf16", "fp8 delayed"):
        row, curves[r] = run_train(model, models[model] + CURVE_LR, r, curve_steps,
                                   curve_every, work, extra, prefix="curve ")
        last = [v for s, v in curves[r] if s > curve_steps * 3 // 4]
        rows.append({**row, "section": "curves",
                     "final_loss": statistics.mean(last) if last else None})
      base, fp8 = rows[-2]["final_loss"], rows[-1]["final_loss"]
      rows[-1]["loss_diff_pct"] = 100 * (fp8 - base) / base if base and fp8 else None
      if all(curves.values()):
        plot_curves(curves, model, os.path.splitext(out)[0] + "_loss.png")
  print(write(merge(rows, out, names), out))
  print(f"wrote {out} and {os.path.splitext(out)[0]}.csv")


if __name__ == "__main__":
  main()
