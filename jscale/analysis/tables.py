"""Result tables for benchmark scripts: one markdown table plus a CSV beside it."""

from __future__ import annotations

import csv
import os
from typing import Callable, Sequence

Column = tuple[str, Callable[[dict], str]]  # (header, row -> cell text)


def write_table(rows: Sequence[dict], columns: Sequence[Column], out_md: str) -> str:
  """Writes `rows` as a markdown table to `out_md` and every raw field to `<out>.csv`."""
  os.makedirs(os.path.dirname(out_md) or ".", exist_ok=True)
  lines = ["| " + " | ".join(h for h, _ in columns) + " |",
           "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
  text = "\n".join(lines) + "\n"
  with open(out_md, "w", encoding="utf-8") as f:
    f.write(text)
  with open(os.path.splitext(out_md)[0] + ".csv", "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  return text
