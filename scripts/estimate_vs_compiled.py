"""The planner's estimate against the compiled program (issue 49): for each case (model, GPUs,
tokens per step), layouts the planner offers that fit, compiled by the real XLA:GPU compiler for
the target (no GPU: `jscale.analysis.gpu_target`) and timed by `jscale.predict`; the estimate
(`jscale.plan.cost`) recomputed beside it. Reports Spearman's rank correlation of the two step
times per case and over all, and how far the estimate's #1 is from the compiled best.

    python scripts/estimate_vs_compiled.py compile [--cases 1b8,8b8,70b64] [--shard 0/2] \
        [--also results/estimate_vs_compiled.jsonl]   # + the layouts of a stored sweep
    python scripts/estimate_vs_compiled.py fit      # the estimate's fitted constants, refitted
    python scripts/estimate_vs_compiled.py report   # -> results/estimate_vs_compiled.{md,csv}

`compile` appends one JSON line per layout to results/estimate_vs_compiled.jsonl (skipping
layouts already there: a cut-off run resumes); `--shard i/n` takes every n-th layout, for n
processes side by side. `report` needs no compiler: it re-estimates every stored layout with
the planner as it is now, so a change to `jscale/plan/cost.py` is scored in seconds, and scores
each case also with the constants fitted on the other cases alone (held out). `fit` prints
`busy.Fit` and `cost.Exposure` fitted on every stored row, to paste into the code. Every
compiled figure is a prediction (`jscale.predict`), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for GPUs from their descriptions

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
from scipy.optimize import nnls  # noqa: E402

from jscale import hardware  # noqa: E402
from jscale.analysis import gpu_target  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.plan import busy, cost, memory  # noqa: E402
from jscale.plan.__main__ import COMPILED_TOP  # noqa: E402
from jscale.plan.layout import Layout  # noqa: E402
from jscale.plan.rank import evaluate, rank  # noqa: E402
from jscale.plan.verify import compare  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE = os.path.join(ROOT, "results", "estimate_vs_compiled.jsonl")
HEAD = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                      text=True, check=False).stdout.strip()
SEQ = 4096
# name -> (preset, GPUs, global batch tokens, layouts: the estimate's top T + S drawn at random
# from the fitting rest, seeded: a sample that does not depend on the estimate being scored)
CASES = {
    "1b8": ("llama3_1b", 8, 2**20, 12, 10),
    "8b8": ("llama3_8b", 8, 2**20, 12, 10),
    "70b64": ("llama3_70b", 64, 4 * 2**20, 12, 10),
    "1b64": ("llama3_1b", 64, 4 * 2**20, 8, 6),
}


def model_of(preset: str):
  return load_config(None, [f"model.preset={preset}"]).model


def pick(case: str) -> list[Layout]:
  """The estimate's top layouts that fit, and a seeded random sample of the fitting rest."""
  preset, gpus, tokens, top, sample = CASES[case]
  gpu = hardware.GPUS["h100"]
  rows = [r for r in rank(model_of(preset), gpus, SEQ, tokens, gpu) if r.fits]
  rest = sorted((r.layout for r in rows[top:]), key=lambda lay: lay.describe())
  drawn = np.random.default_rng(0).choice(len(rest), min(sample, len(rest)), replace=False)
  return [r.layout for r in rows[:top]] + [rest[i] for i in sorted(drawn)]


def load() -> list[dict]:
  """Every stored row, one per compiled layout (the last, where shards compiled one twice)."""
  if not os.path.exists(STORE):
    return []
  with open(STORE, encoding="utf-8") as f:
    rows = {(r := json.loads(x))["key"]: r for x in f if x.strip()}
  return list(rows.values())


def done_keys() -> set[str]:
  return {r["key"] for r in load()}


def _key(case: str, lay: Layout) -> str:
  """A stored row's key: the case and the layout's fields (the defaults of fields added since
  the first rows were stored left out, so their keys still match)."""
  fields = dataclasses.asdict(lay)
  for name, default in (("moments", "float32"), ("collectives", "xla"), ("overlap", False)):
    if fields[name] == default:
      del fields[name]
  return f"{case} {json.dumps(fields, sort_keys=True)}"


def compile_case(case: str, shard: tuple[int, int], extra: list[dict]) -> None:
  """Compiles `case`'s layouts (and the `extra` rows' layouts of it) for its GPUs, this
  shard's share, and appends their rows."""
  preset, gpus, *_ = CASES[case]
  gpu = hardware.GPUS["h100"]
  devices = gpu_target.devices(f"h100x{gpus}")
  have = done_keys()
  lays = pick(case) + [Layout(**r["layout"]) for r in extra if r["case"] == case]
  for i, lay in enumerate(lays):
    key = _key(case, lay)
    if i % shard[1] != shard[0] or key in have:
      continue
    have.add(key)
    start = time.monotonic()
    row = evaluate(model_of(preset), lay, SEQ, gpu)
    try:
      r = compare(preset, [], row, SEQ, gpu, devices)
      out = {k: r[k] for k in ("step_compiled", "mfu_compiled", "exposed_compiled",
                               "fits_compiled", "by_category_compiled")}
    except Exception as e:  # noqa: BLE001  a layout that does not compile is a finding: record it
      out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out.update(key=key, case=case, layout=dataclasses.asdict(lay), commit=HEAD,
               compile_s=round(time.monotonic() - start, 1))
    with open(STORE, "a", encoding="utf-8") as f:
      f.write(json.dumps(out) + "\n")
    print(f"[{case} {i + 1}/{len(lays)}] {lay.describe()}: "
          f"{out.get('step_compiled', out.get('error'))} ({out['compile_s']} s)", flush=True)


def spearman(a, b) -> float:
  ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
  return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def fitting(rows: list[dict]) -> list[tuple[dict, object, Layout]]:
  """(row, model, layout) of every stored layout that compiled and fits."""
  models = {case: model_of(preset) for case, (preset, *_) in CASES.items()}
  return [(r, models[r["case"]], Layout(**r["layout"])) for r in rows
          if r["case"] in models and "step_compiled" in r and r["fits_compiled"]]


def _relative_nnls(features: np.ndarray, fixed: np.ndarray, target: np.ndarray,
                   scale: np.ndarray) -> np.ndarray:
  """Non-negative c minimising Σ ((fixed + features·c - target) / scale)²."""
  return nnls(features / scale[:, None], (target - fixed) / scale)[0]


# `cost.Exposure`'s prefetch window and the memory share past which XLA re-gathers, searched on
# a grid (the shares are linear given them)
WINDOWS = np.round(np.arange(0.0, 0.76, 0.01), 2)
REGATHER_FROM = np.round(np.arange(0.5, 0.96, 0.05), 2)
# fitted on a grid or outside the sweep (`cost.Exposure`)
NOT_SHARES = ("zero3_window", "regather_from", "host_offload", "pipeline_pace",
              "split_backward", "paired")


def _fit_shares(flat: list, passes: busy.Fit, window: float, regather_from: float
                ) -> tuple[cost.Exposure, float]:
  """(`cost.Exposure`'s shares fitted on the pipeline-free rows `flat` — (row, layout,
  transfers, busy seconds, memory share) — with the prefetched gathers hiding behind `window`
  of the busy time and gathered again past `regather_from` of the memory, the fit's relative
  residual)."""
  shares = [f.name for f in dataclasses.fields(cost.Exposure) if f.name not in NOT_SHARES]
  grid = dict(zero3_window=window, regather_from=regather_from)
  none = cost.Exposure(**dict.fromkeys(shares, 0.0), **grid)
  feats, fixed = [], []
  for _, lay, ts, busy_s, share in flat:
    inside = cost.prefetch_inside(ts, window * busy_s)
    feats.append([cost.regathered(ts, share, regather_from) if n == "zero3_regather" else
                  sum(t.seconds() * (inside if t.overlap == "prefetch" else 1.0)
                      for t in ts if t.share == n) for n in shares])
    fixed.append(cost.exposed(ts, busy_s, lay.accum, none, share))
  step = np.array([r["step_compiled"] for r, *_ in flat])
  exposed = np.array([r["exposed_compiled"] for r, *_ in flat])
  feats, fixed = np.array(feats), np.array(fixed)
  share = _relative_nnls(feats, fixed, exposed, step)
  residual = float(np.sum(((fixed + feats @ share - exposed) / step) ** 2))
  return (cost.Exposure(**dict(zip(shares, share)), **grid, pipeline_pace=1.0,
                        split_backward=0.0), residual)


def fit(rows: list[dict]) -> tuple[busy.Fit, cost.Exposure]:
  """`busy.Fit` and `cost.Exposure` fitted on `rows` (non-negative least squares, relative):
  the passes on the pipeline-free layouts' busy time (the compiled step less its exposed
  collectives), the exposed shares on their exposed time (relative to the step) at the grid's
  window and memory threshold that fit it best, the pace on the pipelined layouts' steps."""
  gpu = hardware.GPUS["h100"]
  names = [f.name for f in dataclasses.fields(busy.Fit)]
  flat, piped = [], []
  for r, model, lay in fitting(rows):
    (piped if lay.stage > 1 else flat).append((r, model, lay, busy.terms(model, lay, SEQ, gpu)))
  held = np.array([r["step_compiled"] - r["exposed_compiled"] for r, *_ in flat])
  coef = _relative_nnls(np.array([[p[n] for n in names] for *_, p in flat]),
                        np.array([sum(p[k] for k in busy.FIXED) for *_, p in flat]), held, held)
  passes = busy.Fit(*coef)

  def prepared(r, model, lay, p):
    share = memory.estimate(model, lay, SEQ).total / memory.usable_bytes(gpu)
    ts = cost.transfers(model, lay, SEQ, gpu.gpus_per_node)
    return r, lay, ts, busy.seconds(p, passes), share

  # The shares on the layouts without a ring: its hops are priced by a rule, not a share, and
  # its misfit at 8-64-way splits would bias the shares of the transfers it runs beside.
  unringed = [prepared(*x) for x in flat if x[2].sequence == 1 or x[2].ulysses]
  exposure = min((_fit_shares(unringed, passes, w, m) for w in WINDOWS for m in REGATHER_FROM),
                 key=lambda x: x[1])[0]
  # The pace and the split backward's extra, by relative least squares on the pipelined steps:
  # step - exposed = busy · pace-per-unit-tick · (1 + split · W-alone share).
  a, e, y = [], [], []
  for r, model, lay, p in piped:
    *_, ts, busy_s, share = prepared(r, model, lay, p)
    unit = busy_s * cost.pipeline_pace(model, lay, SEQ, exposure)  # pace 1, no split extra
    alone = memory.executed(lay.schedule, lay.stage, lay.accum, lay.virtual_stages).w_alone
    a.append((unit, unit * alone))
    e.append(cost.exposed(ts, busy_s, lay.accum, exposure, share))
    y.append(r["step_compiled"])
  if not y:
    return passes, exposure
  a, e, y = np.array(a), np.array(e), np.array(y)
  (pace, extra), *_ = np.linalg.lstsq(a / y[:, None], 1 - e / y, rcond=None)
  return passes, dataclasses.replace(exposure, pipeline_pace=float(pace),
                                     split_backward=float(extra / pace))


CASE_COLUMNS = [("case", lambda r: r["case"]), ("model", lambda r: r["model"]),
                ("GPUs", lambda r: str(r["gpus"])), ("tokens / step", lambda r: f"{r['tokens']:,}"),
                ("layouts", lambda r: str(r["layouts"])),
                ("Spearman (step)", lambda r: f"{r['spearman']:.3f}"),
                ("estimate's #1 over the compiled best", lambda r: f"{r['first_over_best']:+.1%}"),
                (f"--rank compiled's pick (of the top {COMPILED_TOP}) over best",
                 lambda r: f"{r['top10_over_best']:+.1%}"),
                ("held out: Spearman", lambda r: f"{r['held_spearman']:.3f}"),
                ("held out: #1 over best", lambda r: f"{r['held_first_over_best']:+.1%}"),
                ("its #1", lambda r: r["first"]), ("compiled best", lambda r: r["best"])]
ROW_COLUMNS = [("case", lambda r: r["case"]), ("layout", lambda r: r["layout"]),
               ("MFU estimate", lambda r: f"{r['mfu_estimate']:.1%}"),
               ("MFU compiled (predicted)", lambda r: f"{r['mfu_compiled']:.1%}"),
               ("step estimate (ms)", lambda r: f"{1e3 * r['step_estimate']:.0f}"),
               ("step compiled (ms)", lambda r: f"{1e3 * r['step_compiled']:.0f}"),
               ("exposed collectives compiled (ms)", lambda r: f"{1e3 * r['exposed']:.0f}")]


def score_case(mine: list[tuple[dict, object, Layout]], passes: busy.Fit,
               exposure: cost.Exposure) -> tuple[list, float, float, int, int]:
  """(estimates, Spearman of the steps, the estimate's #1 over the compiled best, #1, best)."""
  gpu = hardware.GPUS["h100"]
  est = [cost.estimate(model, lay, SEQ, gpu, passes, exposure) for _, model, lay in mine]
  comp = [r["step_compiled"] for r, *_ in mine]
  first, best = int(np.argmin([c.step_s for c in est])), int(np.argmin(comp))
  return (est, spearman([c.step_s for c in est], comp), comp[first] / comp[best] - 1,
          first, best)


def score(rows: list[dict]) -> tuple[list[dict], list[dict], float]:
  """(per case, per layout, pooled Spearman of MFU) with the planner's estimate as it is now,
  and per case with the constants fitted on the other cases (held out)."""
  cases, table, pooled = [], [], ([], [])
  every = fitting(rows)
  for case, (preset, gpus, tokens, *_) in CASES.items():
    mine = [x for x in every if x[0]["case"] == case]
    if len(mine) < 3:
      continue
    est, rho, over, first, best = score_case(mine, busy.FIT, cost.EXPOSURE)
    others = [r for r in rows if r["case"] != case]
    _, held_rho, held_over, *_ = score_case(mine, *fit(others))
    lays = [lay for *_, lay in mine]
    comp = [r["step_compiled"] for r, *_ in mine]
    top = sorted(range(len(mine)), key=lambda i: est[i].step_s)[:COMPILED_TOP]
    cases.append({"case": case, "model": preset, "gpus": gpus, "tokens": tokens,
                  "layouts": len(mine), "spearman": rho, "first_over_best": over,
                  "top10_over_best": min(comp[i] for i in top) / min(comp) - 1,
                  "held_spearman": held_rho, "held_first_over_best": held_over,
                  "first": lays[first].describe(), "best": lays[best].describe()})
    pooled[0].extend(c.mfu for c in est)
    pooled[1].extend(r["mfu_compiled"] for r, *_ in mine)
    table += [{"case": case, "layout": lay.describe(), "mfu_estimate": c.mfu,
               "mfu_compiled": r["mfu_compiled"], "step_estimate": c.step_s,
               "step_compiled": r["step_compiled"], "exposed": r["exposed_compiled"]}
              for (r, _, lay), c in sorted(zip(mine, est), key=lambda x: x[0][0]["step_compiled"])]
  return cases, table, spearman(*pooled) if pooled[0] else float("nan")


def report(out: str) -> str:
  """Re-estimates every stored layout and scores the estimate against the compiled step."""
  rows = load()
  cases, table, rho = score(rows)
  failed = [r for r in rows if "error" in r]
  no_fit = [r for r in rows if "step_compiled" in r and not r["fits_compiled"]]
  stem = os.path.splitext(out)[0]
  text = ("# The planner's estimate against the compiled program (predicted)\n\n"
          "`python scripts/estimate_vs_compiled.py report`: layouts the planner offers that fit, "
          "compiled for H100s by XLA:GPU on a CPU machine and timed by `jscale.predict` "
          "(predictions, not measurements; compiled at "
          f"{', '.join(sorted({r.get('commit', '?') for r in rows}))}), beside `jscale.plan`'s "
          f"estimate at {HEAD}. Spearman over all "
          f"{len(table)} fitting layouts' MFU: **{rho:.3f}**; {len(no_fit)} compiled over the "
          f"device's memory (left out), {len(failed)} failed to compile.\n\n")
  text += write_table(cases, CASE_COLUMNS, stem + "_cases.md") + "\n"
  text += write_table(table, ROW_COLUMNS, stem + "_rows.md")
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return text


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("verb", choices=("compile", "fit", "report", "list"))
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--shard", default="0/1", help="i/n: every n-th layout from the i-th")
  p.add_argument("--also", default=None, help="a .jsonl of an earlier sweep: its layouts too")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "estimate_vs_compiled.md"))
  args = p.parse_args()
  if args.verb == "report":
    print(report(args.out))
    return
  if args.verb == "fit":
    for constants in fit(load()):
      print(f"{type(constants).__name__}(" + ", ".join(
          f"{f.name}={getattr(constants, f.name):.4g}" for f in dataclasses.fields(constants))
            + ")")
    return
  for case in args.cases.split(","):
    if args.verb == "list":
      for lay in pick(case):
        print(case, lay.describe())
      continue
    i, n = (int(x) for x in args.shard.split("/"))
    extra = []
    if args.also:
      with open(args.also, encoding="utf-8") as f:
        extra = [json.loads(x) for x in f if x.strip()]
    compile_case(case, (i, n), extra)


if __name__ == "__main__":
  sys.exit(main())
