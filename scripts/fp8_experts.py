"""FP8 experts (`fp8.targets: [experts]`, issue 50): the tiny DeepSeek-V3 trained in bf16 and
with its routed experts in FP8, and the predicted speed of one MoE layer of the 16B proxy.

    python scripts/fp8_experts.py [--seeds 8] [--only loss|speed] [--runs bf16,control,fp8,...]
                                  [--lr 1e-3]
    # -> results/fp8_experts_loss.md (+ .csv, one row per run), results/fp8_experts_speed.md

loss: `configs/deepseek_v3_tiny.yaml` in bf16, 200 steps, each seed four times: bf16 experts;
a control, bf16 with each batch in two micro-batches (`train.microbatches=2`: the same
gradient summed in another order, a perturbation at bf16's rounding, which shows how far two
runs that differ only by rounding drift apart); FP8 experts scaled per expert; and scaled per
row (`fp8.experts_scaling=row`, all e4m3). Measured on this CPU (XLA:CPU computes the FP8
products exactly as dequantised fp32). `--lr` sets the peak learning rate (default: the
config's 3e-3): at 3e-3 two runs that differ only in rounding end ~3% apart, at 1e-3 far less,
so the same seeds tell FP8's own effect apart in fewer runs. Runs already in the .csv for this
commit and learning rate are not run again, so a larger --seeds adds seeds; each learning
rate's table takes each run's seeds from the newest commit that ran them all.
speed: the DeepSeek-V3 16B proxy (3 layers + MTP, seq 4096, 2 sequences, selective remat, bf16
moments; the Hopper kernel's rows again at 6 sequences) on one H100, compiled by XLA:GPU on this machine with its Triton gemms (what keeps the
batched FP8 products FP8: XLA's cuBLAS path upcasts them to f16) and timed by `jscale.predict`:
a prediction, with the FP8 gemms at the FP8 peak times the gemm efficiency bf16's have (no
grouped FP8 gemm rate was measured; the Hopper kernel's FP8 products likewise, at its measured
bf16 rate times the FP8:bf16 peak).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPUs are descriptions

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from jscale import predict  # noqa: E402
from jscale import train as train_lib  # noqa: E402
from jscale.analysis import gpu_target, introspect  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

OUT = os.path.join(ROOT, "results", "fp8_experts_{}.md")
FP8 = ("fp8.enabled=true", "fp8.targets=[experts]")
TINY = ("model.dtype=bfloat16", "checkpoint.every=0", "logging.plot=false",
        "logging.tensorboard=false", "logging.progress=false")
PROXY = ("model.preset=deepseek_v3_16b", "model.n_layers=3", "train.seq_len=4096",
         "train.batch_size=2", "train.remat=selective", "train.moments_dtype=bfloat16",
         "checkpoint.every=0", "mesh.data=1", "model.dtype=bfloat16")
VARIANTS = {"tiled, bf16": ("model.moe.gemm=tiled",),
            "tiled, FP8 (per-expert current scaling)": ("model.moe.gemm=tiled", *FP8),
            "tiled, FP8 (per-row scaling, all e4m3)": ("model.moe.gemm=tiled", *FP8,
                                                       "fp8.experts_scaling=row"),
            "Pallas Hopper kernel, bf16 (auto's pick)": ("model.moe.gemm=pallas",),
            "Pallas Hopper kernel, FP8 forward and dx (per-row scaling; auto's pick)": (
                "model.moe.gemm=pallas", *FP8, "fp8.experts_scaling=row")}


@dataclasses.dataclass(frozen=True)
class Study:
  """Loss runs of the tiny DeepSeek, each seed's validation loss set against `base`'s:
  `runs` {run: overrides}, `names` {run: its row's name} for the runs compared, in order."""
  csv: str
  runs: dict[str, tuple[str, ...]]
  names: dict[str, str]
  base: str = "bf16"
  base_name: str = "bf16"
  column: str = "experts"

  def rows(self) -> list[dict]:
    if not os.path.exists(self.csv):
      return []
    with open(self.csv, encoding="utf-8") as f:
      return list(csv.DictReader(f))


EXPERTS = Study(
    os.path.join(ROOT, "results", "fp8_experts_loss.csv"),
    {"bf16": (), "control": ("train.microbatches=2",), "fp8": FP8,
     "fp8_rows": (*FP8, "fp8.experts_scaling=row")},
    {"control": "bf16, 2 micro-batches (control)", "fp8": "FP8, a scale per expert",
     "fp8_rows": "FP8, a scale per row (all e4m3)"})


CONFIG = os.path.join(ROOT, "configs", "deepseek_v3_tiny.yaml")


def final_losses(tmp: str, seed: int, lr: float,
                 overrides: tuple[str, ...]) -> tuple[float, float]:
  cfg = load_config(CONFIG, [*TINY, f"train.seed={seed}", f"train.output_dir={tmp}/{seed}",
                             f"train.lr={lr}", *overrides])
  out = train_lib.run(cfg)
  last = sorted(out["losses"])[-5:]  # the last 50 steps' logged losses (logging.every=10)
  return float(np.mean([out["losses"][s] for s in last])), out["val_loss"]


def run_missing(study: Study, seeds: int, head: str, runs: list[str], lr: float) -> None:
  """Runs each of `runs` at peak learning rate `lr` for every seed this commit has no row of,
  appending to the study's .csv."""
  done = {(r["run"], int(r["seed"])) for r in study.rows()
          if r["commit"] == head and float(r["lr"]) == lr}
  for seed in range(seeds):
    for run in runs:
      if (run, seed) in done:
        continue
      with tempfile.TemporaryDirectory() as tmp:
        train, val = final_losses(tmp, seed, lr, study.runs[run])
      new = not os.path.exists(study.csv)
      with open(study.csv, "a", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        if new:
          w.writerow(["commit", "run", "seed", "lr", "train", "val"])
        w.writerow([head, run, seed, lr, train, val])


def learning_rates(study: Study) -> list[float]:
  """The peak learning rates the .csv has runs at, largest first."""
  return sorted({float(r["lr"]) for r in study.rows()}, reverse=True)


def loss_table(study: Study, seeds: int, lr: float) -> dict[str, tuple[str, np.ndarray]]:
  """{run: (commit, [seeds, 2] train and validation losses)} at peak learning rate `lr`, from
  the newest commit with all `seeds` of that run."""
  by = {}
  for r in study.rows():
    if float(r["lr"]) != lr:
      continue
    val = float(r["val"]) if r["val"] else float("nan")  # a run stopped early: no eval
    by.setdefault((r["run"], r["commit"]), {})[int(r["seed"])] = (float(r["train"]), val)
  out = {}
  for (run, commit), got in by.items():  # in the .csv's order: the newest last
    if all(s in got for s in range(seeds)):
      out[run] = (commit, np.array([got[s] for s in range(seeds)]))
  return out


def loss_rows(study: Study, seeds: int, lr: float) -> list[str]:
  """The table at peak learning rate `lr`, and each seed's difference from its base run."""
  runs = loss_table(study, seeds, lr)
  if study.base not in runs:
    return [f"(no {study.base} run of all {seeds} seeds at lr {lr:g} yet)"]
  commit, base = runs[study.base]
  mean0 = base.mean(0)
  out = [f"| {study.column} | commit | train loss, last 50 steps | validation loss at step 200 "
         f"| each seed's validation loss against its {study.base_name} run: mean ± standard "
         "error (std) |", "|---|---|---|---|---|",
         f"| {study.base_name} | {commit} | {mean0[0]:.4f} | {mean0[1]:.4f} | |"]
  per_seed = []
  for run, name in study.names.items():
    if run not in runs:
      continue
    commit, losses = runs[run]
    mean, pairs = losses.mean(0), losses[:, 1] / base[:, 1] - 1
    out.append(f"| {name} | {commit} | {mean[0]:.4f} ({mean[0] / mean0[0] - 1:+.2%}) | "
               f"{mean[1]:.4f} ({mean[1] / mean0[1] - 1:+.2%}) | {pairs.mean():+.2%} ± "
               f"{pairs.std(ddof=1) / np.sqrt(seeds):.2%} ({pairs.std(ddof=1):.2%}) |")
    per_seed.append(f"- {name}: " + ", ".join(f"{p:+.2%}" for p in pairs))
  return out + ["", f"Each seed's validation loss against its {study.base_name} run:",
                *per_seed]


def loss_tables(study: Study, seeds: int) -> list[str]:
  """`loss_rows` at each learning rate the .csv has, under a heading each."""
  return [line for lr in learning_rates(study)
          for line in (f"## Peak learning rate {lr:g}", "", *loss_rows(study, seeds, lr), "")]


def experts_ms(sched) -> float:
  """The predicted time of the routed experts' products (the tiled scope's kernels, or the
  Pallas grouped-matmul kernels) per step."""
  return sum(t.seconds * t.runs for t in sched.timed
             if "grouped_tiles" in (t.launch.op_name or "") or
             "grouped_matmul" in (t.launch.label or "")) * 1e3


def speed_rows(variants: dict[str, tuple[str, ...]], extra: tuple[str, ...] = ()) -> list[str]:
  """One row per variant of the proxy (with `extra` overrides): the experts' kernels, the step
  and its MFU, predicted on one H100."""
  devices = gpu_target.devices("h100x1")
  out = ["| routed experts | their kernels (ms per step) | predicted step (ms) | MFU |",
         "|---|---|---|---|"]
  for name, overrides in variants.items():
    cfg = load_config(None, [*PROXY, *overrides, *extra])
    compiled, _ = introspect.compile_train_step(cfg, devices)  # Triton gemms: FP8 stays FP8
    text = compiled.as_text()
    r = predict.predict_config(cfg, "h100x1", text, top=0)
    sched = predict.predict(text, "h100", routed_rows=predict.routed_rows(cfg, 1))
    out.append(f"| {name} | {experts_ms(sched):.1f} | {r.step_s * 1e3:.1f} | {r.mfu:.1%} |")
    print(out[-1], flush=True)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", type=int, default=8)
  ap.add_argument("--only", choices=("loss", "speed"), default=None)
  ap.add_argument("--runs", default=",".join(EXPERTS.runs),
                  help="loss runs to make where missing")
  ap.add_argument("--lr", type=float, default=load_config(CONFIG, []).train.lr,
                  help="the runs' peak learning rate (default: the config's)")
  args = ap.parse_args()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip()
  title = f"# FP8 experts (`fp8.targets: [experts]`), at {head}"
  if args.only in (None, "loss"):
    run_missing(EXPERTS, args.seeds, head, [r for r in args.runs.split(",") if r], args.lr)
    tables = loss_tables(EXPERTS, args.seeds)
    _write("loss", [title, "", f"The tiny DeepSeek-V3 (`configs/deepseek_v3_tiny.yaml`, bf16), "
                    f"200 steps, mean over {args.seeds} seeds; measured on a CPU. The control "
                    "(each batch in two micro-batches: the same gradient, rounded otherwise) "
                    "shows how far two runs that differ only in rounding end apart at each "
                    "peak learning rate:", "", *tables])
  if args.only in (None, "speed"):
    kernels = {k: v for k, v in VARIANTS.items() if k.startswith("Pallas")}
    _write("speed", [title, "", "The DeepSeek-V3 16B proxy on one H100, **predicted** "
                     "(compiled by XLA:GPU on a CPU machine with its Triton gemms, timed by "
                     "`jscale.predict`; FP8 gemms at the FP8 peak, no measured rate):", "",
                     *speed_rows(VARIANTS), "", "The kernels at 6 sequences a step (the "
                     "weights' quantisation passes cost the same; the rows' products triple):",
                     "", *speed_rows(kernels, ("train.batch_size=6",))])


def _write(part: str, lines: list[str]) -> None:
  with open(OUT.format(part), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
