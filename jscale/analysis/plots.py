"""Pictures of runs: train / val loss, tokens/s and MFU against steps, runs overlaid.

A run's `metrics.jsonl` (jscale.metrics.MetricsWriter) is read as series per key. A resumed run
appends to the file, so a step can appear twice: the later row wins. A crash can leave a
partial last line: it is skipped. matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import json
import os
import tempfile

Series = dict[str, list[tuple[int, float]]]  # key -> [(step, value)], ascending steps
PANELS = (("loss", "loss"), ("tokens_per_sec", "tokens/s"), ("mfu", "MFU (%)"))


def read_metrics(run_dir: str) -> Series:
  """Every numeric key of `<run_dir>/metrics.jsonl` as a step-sorted series."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{run_dir}: no metrics.jsonl there; give a training run's "
                            "train.output_dir")
  by_key: dict[str, dict[int, float]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # a partial line a crash left
      step = row.get("step")
      if not isinstance(step, int):
        continue
      for key, value in row.items():
        if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(
            value, bool):
          by_key.setdefault(key, {})[step] = float(value)  # later rows win
  return {k: sorted(v.items()) for k, v in by_key.items()}


def figure(runs: dict[str, Series], out_path: str) -> dict[str, list[str]]:
  """Draws `runs` ({label: series}) into a 3-panel PNG at `out_path`, written whole (a temp
  file renamed). Returns {panel title: labels of the runs drawn in it}."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  drawn: dict[str, list[str]] = {title: [] for _, title in PANELS}
  for i, (label, series) in enumerate(runs.items()):
    color = f"C{i % 10}"
    for ax, (key, title) in zip(axes, PANELS):
      points = series.get(key, [])
      scale = 100.0 if key == "mfu" else 1.0
      if points:
        ax.plot(*zip(*[(s, v * scale) for s, v in points]), color=color, label=label, lw=1.2)
        drawn[title].append(label)
      if key == "loss" and series.get("val_loss"):
        ax.plot(*zip(*series["val_loss"]), color=color, ls="--", marker="o", ms=3,
                label=f"{label} (val)")
  for ax, (_, title) in zip(axes, PANELS):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
    else:  # e.g. MFU on CPU, where no peak FLOP/s is known
      why = ("not recorded: no device peak\nFLOP/s known (train.peak_flops)"
             if title.startswith("MFU") else "not recorded")
      ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes)
  save(fig, out_path)
  return drawn


def save(fig, out_path: str) -> None:
  """Writes `fig` to `out_path` atomically (a temporary file renamed) and closes it."""
  import matplotlib.pyplot as plt
  fig.tight_layout()
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".png", dir=out_dir)
  os.close(fd)
  try:
    fig.savefig(tmp, dpi=110)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_path)
  finally:
    plt.close(fig)
    if os.path.exists(tmp):
      os.remove(tmp)


def labels(run_dirs: list[str]) -> list[str]:
  """Short labels: each dir's basename, its parent prepended where basenames collide."""
  names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
  return [os.path.join(os.path.basename(os.path.dirname(os.path.normpath(d))), n)
          if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def plot_runs(run_dirs: list[str], out_path: str | None = None) -> str:
  """Plots the runs in `run_dirs` overlaid; returns the PNG path (default
  `<first run>/metrics.png`)."""
  runs = {label: read_metrics(d) for label, d in zip(labels(run_dirs), run_dirs)}
  out_path = out_path or os.path.join(run_dirs[0], "metrics.png")
  figure(runs, out_path)
  return out_path


def plot_run_end(output_dir: str) -> str | None:
  """`<output_dir>/metrics.png` at the end of a run. A finished run never fails for a picture:
  any trouble is one printed warning and None."""
  try:
    return plot_runs([output_dir])
  except Exception as e:  # a picture is never worth a failed run
    print(f"warning: no metrics.png for {output_dir}: {type(e).__name__}: {e}", flush=True)
    return None
