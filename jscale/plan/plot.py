"""The planner's picture: per-device memory stacked by term (the playbook's memory widget) and
each layout's step time split into compute, bubble and exposed communication."""

from __future__ import annotations

from jscale.analysis.plots import save
from jscale.plan.memory import GiB
from jscale.plan.rank import Row


def plot(rows: list[Row], limit_bytes: float, out_path: str) -> str:
  """Draws `rows` (ranked) into a two-panel PNG at `out_path` (written whole); returns it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = [f"#{i} {r.layout.describe()}" for i, r in enumerate(rows, 1)]
  ys = range(len(rows))
  fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(15, 0.45 * len(rows) + 1.6), sharey=True)
  left = [0.0] * len(rows)
  for i, term in enumerate(rows[0].memory.terms()):
    widths = [r.memory.terms()[term] / GiB for r in rows]
    mem_ax.barh(ys, widths, left=left, color=f"C{i}", label=term)
    left = [a + b for a, b in zip(left, widths)]
  mem_ax.axvline(limit_bytes / GiB, color="k", ls="--", lw=1, label="usable")
  mem_ax.set_title("memory per device (GiB)")
  left = [0.0] * len(rows)
  parts = (("busy", lambda r: r.cost.compute_s),
           ("pipeline schedule", lambda r: r.cost.step_s - r.cost.exposed_s - r.cost.compute_s),
           ("exposed communication", lambda r: r.cost.exposed_s))
  for i, (name, get) in enumerate(parts):
    widths = [get(r) for r in rows]
    time_ax.barh(ys, widths, left=left, color=f"C{i + 5}", label=name)
    left = [a + b for a, b in zip(left, widths)]
  for y, r in zip(ys, rows):
    time_ax.text(left[y], y, f" {100 * r.cost.mfu:.1f}% MFU", va="center", fontsize=8)
  time_ax.set_title("estimated step time (s)")
  mem_ax.set_yticks(list(ys), labels, fontsize=8)
  mem_ax.invert_yaxis()
  for ax in (mem_ax, time_ax):
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.6 / (len(rows) + 2)),
              ncol=6)
    ax.grid(alpha=0.3, axis="x")
  save(fig, out_path)
  return out_path
