"""Pictures of an action table: an ASCII timeline and a PNG (matplotlib, imported on use)."""

from __future__ import annotations

import numpy as np

from jscale.parallel.pipeline.schedules import IDLE, NAMES, Table, theory_bubble


def _cell(table: Table, t: int, s: int) -> str:
  k = int(table.kind[t, s])
  if k == IDLE:
    return "."
  text = f"{NAMES[k]}{table.mb[t, s]}"
  if table.v > 1:  # which of the stage's chunks: a, b, c, ...
    text += "abcdefgh"[table.chunk[t, s] // table.p]
  return text


def ascii_timeline(table: Table) -> str:
  """One row per stage, one column per tick: F3 = forward of micro-batch 3 (F3b: of the stage's
  second chunk), B = input gradient, W = weight gradient, . = idle."""
  cells = [[_cell(table, t, s) for t in range(table.ticks)] for s in range(table.p)]
  width = max(len(c) for row in cells for c in row)
  lines = [f"{table.name}: p={table.p} m={table.m} v={table.v}, {table.ticks} ticks, bubble "
           f"{table.bubble():.3f} (theory {theory_bubble(table.name, table.p, table.m, table.v):.3f})"]
  for s, row in enumerate(cells):
    lines.append(f"stage {s} |" + " ".join(c.rjust(width) for c in row))
  return "\n".join(lines)


_COLORS = {1: (0.30, 0.55, 0.85), 2: (0.90, 0.55, 0.25), 3: (0.45, 0.70, 0.40)}


def render_png(table: Table, path: str) -> None:
  """Draws the table as coloured boxes (F blue, B orange, W green; later chunks lighter)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * table.ticks), 0.45 * table.p + 0.9))
  for t in range(table.ticks):
    for s in range(table.p):
      k = int(table.kind[t, s])
      if k == IDLE:
        continue
      fade = (table.chunk[t, s] // table.p) / max(1, table.v)
      color = tuple(c + (1 - c) * 0.55 * fade for c in _COLORS[k])
      ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=color, edgecolor="white", lw=0.8))
      ax.text(t + 0.5, s + 0.5, str(table.mb[t, s]), ha="center", va="center", fontsize=7)
  ax.set_xlim(0, table.ticks)
  ax.set_ylim(table.p, 0)
  ax.set_yticks(np.arange(table.p) + 0.5, [f"stage {s}" for s in range(table.p)])
  ax.set_xlabel("tick (F = B = W = 1 unit)")
  ax.set_title(f"{table.name}  p={table.p} m={table.m} v={table.v}  bubble {table.bubble():.3f}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
