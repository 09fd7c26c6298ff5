"""Pictures of an action table: an ASCII timeline and a PNG (matplotlib, imported on use).
A forward + backward pair (DualPipeV) shows as one op: its backward's cells marked "&" in the
ASCII timeline, one black frame round its cells in the PNG."""

from __future__ import annotations

import numpy as np

from jscale.parallel.pipeline import placement
from jscale.parallel.pipeline.schedules import (
  IDLE,
  NAMES,
  SCHEDULES,
  Table,
  theory_bubble,
  theory_in_flight,
)


def _local(table: Table, t: int, s: int) -> int:
  return placement.local_of(int(table.chunk[t, s]), table.p, table.placement)


def _cell(table: Table, t: int, s: int, in_pair: np.ndarray) -> str:
  k = int(table.kind[t, s])
  if k == IDLE:
    return "."
  text = ("&" if in_pair[t, s] else "") + f"{NAMES[k]}{table.mb[t, s]}"
  if table.v > 1:  # which of the stage's chunks: a, b, c, ...
    text += "abcdefgh"[_local(table, t, s)]
  return text


def _pair_cells(table: Table) -> np.ndarray:
  """[T, p] bool: the cells after a pair's F, inside its op."""
  starts = table.starts()
  return np.take_along_axis(table.paired(), starts, axis=0) & (
      starts != np.arange(table.ticks)[:, None])


def ascii_timeline(table: Table) -> str:
  """One row per stage, one column per tick: F3 = forward of micro-batch 3 (F3b: of the stage's
  second chunk), B = input gradient, W = weight gradient, . = idle."""
  in_pair = _pair_cells(table)
  cells = [[_cell(table, t, s, in_pair) for t in range(table.ticks)] for s in range(table.p)]
  width = max(len(c) for row in cells for c in row)
  theory = theory_bubble(table.name, table.p, table.m, table.v)
  lines = [f"{table.name}: p={table.p} m={table.m} v={table.v}, {table.ticks} ticks, bubble "
           f"{table.bubble():.3f} (theory {theory:.3f})"]
  if table.name in SCHEDULES:
    lines[0] += (f", residual sets {table.live().max()} (theory "
                 f"{theory_in_flight(table.name, table.p, table.m, table.v)})")
  for s, row in enumerate(cells):
    lines.append(f"stage {s} |" + " ".join(c.rjust(width) for c in row))
  return "\n".join(lines)


_COLORS = {1: (0.30, 0.55, 0.85), 2: (0.90, 0.55, 0.25), 3: (0.45, 0.70, 0.40)}


def render_png(table: Table, path: str) -> None:
  """Draws the table as coloured boxes (F blue, B orange, W green; later chunks lighter)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Rectangle

  fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * table.ticks), 0.45 * table.p + 0.9))
  for t in range(table.ticks):
    for s in range(table.p):
      k = int(table.kind[t, s])
      if k == IDLE:
        continue
      fade = _local(table, t, s) / max(1, table.v)
      color = tuple(c + (1 - c) * 0.55 * fade for c in _COLORS[k])
      ax.add_patch(Rectangle((t, s), 1, 1, facecolor=color, edgecolor="white", lw=0.8))
      ax.text(t + 0.5, s + 0.5, str(table.mb[t, s]), ha="center", va="center", fontsize=7)
  for t, s in zip(*np.nonzero(table.paired())):  # a pair: one op, one frame
    n = table.ends()[t, s] - t + 1
    ax.add_patch(Rectangle((t, s), n, 1, fill=False, edgecolor="black", lw=1.2))
  ax.set_xlim(0, table.ticks)
  ax.set_ylim(table.p, 0)
  ax.set_yticks(np.arange(table.p) + 0.5, [f"stage {s}" for s in range(table.p)])
  ax.set_xlabel("tick (F = B = W = 1 unit)")
  ax.set_title(f"{table.name}  p={table.p} m={table.m} v={table.v}  bubble {table.bubble():.3f}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
