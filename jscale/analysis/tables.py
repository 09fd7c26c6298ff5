"""Result tables for benchmark scripts: one markdown table plus a CSV beside it."""

from __future__ import annotations

import csv
import os
import subprocess
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


def head_commit() -> str:
  """The short commit the results are written at."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                        capture_output=True, check=False).stdout.strip()


def write_markdown(lines: Sequence[str], out_md: str) -> str:
  """`lines` as a markdown file at `out_md` (printed too); returns its text."""
  text = "\n".join(lines) + "\n"
  os.makedirs(os.path.dirname(out_md) or ".", exist_ok=True)
  with open(out_md, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return text


def write_predicted_table(rows: Sequence[dict], columns: Sequence[Column], out_md: str,
                          what: str, script: str) -> str:
  """`write_table`, headed by a line saying what it shows, that its figures are `jscale.predict`'s
  (XLA:GPU compiled on a CPU machine: predictions, not measurements), the commit that predicted
  them and the `script` that writes it again."""
  text = (f"{what}, **predicted** at {head_commit()} (`python {script}`: XLA:GPU compiled on a CPU "
          "machine, timed by `jscale.predict`; not measured).\n\n"
          + write_table(rows, columns, out_md))
  with open(out_md, "w", encoding="utf-8") as f:
    f.write(text)
  return text
