"""FP8 experts (`fp8.targets: [experts]`, issue 50): the tiny DeepSeek-V3 trained in bf16 and
with its routed experts in FP8, and the predicted speed of one MoE layer of the 16B proxy.

    python scripts/fp8_experts.py [--seeds 8] [--only loss|speed]
    # -> results/fp8_experts_loss.md (+ .csv, one row per run), results/fp8_experts_speed.md

loss: `configs/deepseek_v3_tiny.yaml` in bf16, 200 steps, each seed three times: bf16 experts,
FP8 experts, and a control, bf16 with each batch in two micro-batches (`train.microbatches=2`:
the same gradient summed in another order, a perturbation at bf16's rounding, which shows how
far two runs that differ only by rounding drift apart). Measured on this CPU (XLA:CPU computes the FP8 products exactly
as dequantised fp32). Runs already in the .csv for this commit are not run again, so a larger
--seeds adds seeds.
speed: the DeepSeek-V3 16B proxy (3 layers + MTP, seq 4096, 2 sequences, selective remat, bf16
moments) on one H100, compiled by XLA:GPU on this machine with its Triton gemms (what keeps the
batched FP8 products FP8: XLA's cuBLAS path upcasts them to f16) and timed by `jscale.predict`:
a prediction, with the FP8 gemms at the FP8 peak times the gemm efficiency bf16's have (no
grouped FP8 gemm rate was measured).
"""

from __future__ import annotations

import argparse
import csv
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
            "Pallas Hopper kernel, bf16 (auto's pick)": ("model.moe.gemm=pallas",)}


LOSS_RUNS = {"bf16": (), "control": ("train.microbatches=2",), "fp8": FP8}
CSV = os.path.join(ROOT, "results", "fp8_experts_loss.csv")


def final_losses(tmp: str, seed: int, overrides: tuple[str, ...]) -> tuple[float, float]:
  cfg = load_config(os.path.join(ROOT, "configs", "deepseek_v3_tiny.yaml"),
                    [*TINY, f"train.seed={seed}", f"train.output_dir={tmp}/{seed}",
                     *overrides])
  out = train_lib.run(cfg)
  last = sorted(out["losses"])[-5:]  # the last 50 steps' logged losses (logging.every=10)
  return float(np.mean([out["losses"][s] for s in last])), out["val_loss"]


def loss_runs(seeds: int, head: str) -> dict[str, np.ndarray]:
  """{run: [seeds, 2] (train, validation)}: this commit's rows of the .csv, the missing run."""
  done = {}
  if os.path.exists(CSV):
    with open(CSV, encoding="utf-8") as f:
      done = {(r["run"], int(r["seed"])): (float(r["train"]), float(r["val"]))
              for r in csv.DictReader(f) if r["commit"] == head}
  for seed in range(seeds):
    for run, overrides in LOSS_RUNS.items():
      if (run, seed) in done:
        continue
      with tempfile.TemporaryDirectory() as tmp:
        done[run, seed] = final_losses(tmp, seed, overrides)
      new = not os.path.exists(CSV)
      with open(CSV, "a", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        if new:
          w.writerow(["commit", "run", "seed", "train", "val"])
        w.writerow([head, run, seed, *done[run, seed]])
  return {run: np.array([done[run, s] for s in range(seeds)]) for run in LOSS_RUNS}


def loss_rows(seeds: int, head: str) -> list[str]:
  runs = loss_runs(seeds, head)
  bf16 = runs["bf16"].mean(0)
  out = ["| experts | train loss, last 50 steps | validation loss at step 200 | each seed's "
         "validation loss against its bf16 run: mean ± standard error (std) |",
         "|---|---|---|---|", f"| bf16 | {bf16[0]:.4f} | {bf16[1]:.4f} | |"]
  for run, name in (("control", "bf16, 2 micro-batches (control)"), ("fp8", "FP8")):
    mean = runs[run].mean(0)
    pairs = runs[run][:, 1] / runs["bf16"][:, 1] - 1
    out.append(f"| {name} | {mean[0]:.4f} ({mean[0] / bf16[0] - 1:+.2%}) | {mean[1]:.4f} "
               f"({mean[1] / bf16[1] - 1:+.2%}) | {pairs.mean():+.2%} ± "
               f"{pairs.std(ddof=1) / np.sqrt(seeds):.2%} ({pairs.std(ddof=1):.2%}) |")
  fp8 = runs["fp8"][:, 1] / runs["bf16"][:, 1] - 1
  control = runs["control"][:, 1] / runs["bf16"][:, 1] - 1
  return out + ["", "Per seed, FP8 against bf16: " + ", ".join(f"{p:+.2%}" for p in fp8) +
                "; the control against bf16: " + ", ".join(f"{p:+.2%}" for p in control) + "."]


def experts_ms(sched) -> float:
  """The predicted time of the routed experts' products (the tiled scope's kernels, or the
  Pallas grouped-matmul kernels) per step."""
  return sum(t.seconds * t.runs for t in sched.timed
             if "grouped_tiles" in (t.launch.op_name or "") or
             "grouped_matmul" in (t.launch.label or "")) * 1e3


def speed_rows() -> list[str]:
  devices = gpu_target.devices("h100x1")
  out = ["| routed experts | their kernels (ms per step) | predicted step (ms) | MFU |",
         "|---|---|---|---|"]
  for name, overrides in VARIANTS.items():
    cfg = load_config(None, [*PROXY, *overrides])
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
  args = ap.parse_args()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip()
  title = f"# FP8 experts (`fp8.targets: [experts]`), at {head}"
  if args.only in (None, "loss"):
    _write("loss", [title, "", f"The tiny DeepSeek-V3 (`configs/deepseek_v3_tiny.yaml`, bf16), "
                    f"200 steps, mean over {args.seeds} seeds; measured on a CPU:", "",
                    *loss_rows(args.seeds, head)])
  if args.only in (None, "speed"):
    _write("speed", [title, "", "The DeepSeek-V3 16B proxy on one H100, **predicted** "
                     "(compiled by XLA:GPU on a CPU machine with its Triton gemms, timed by "
                     "`jscale.predict`; FP8 gemms at the FP8 peak, no measured rate):", "",
                     *speed_rows()])


def _write(part: str, lines: list[str]) -> None:
  with open(OUT.format(part), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
