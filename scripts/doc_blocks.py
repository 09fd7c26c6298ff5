"""Figures a script produces, kept true in README.md and docs/: each sits between
`<!-- NAME:begin -->` and `<!-- NAME:end -->` and is written from the script's stored results,
never typed.

- NAME a results file (`results/zero_memory.md`): the block is that file, as the script wrote it.
- NAME in `RENDERED`: the block is a script's rendering of its stored results (the README's
  short tables and the quick-start sentence).

    python scripts/doc_blocks.py          # rewrite every block from the stored results

The scripts that produce these figures call `sync()` after writing their results;
tests/house/test_docs.py checks that no block differs from what `expected` gives.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# block name -> (script module in scripts/, its function returning the block's text)
RENDERED = {
    "quickstart": ("quickstart_figures", "block"),
    "zero_memory_summary": ("zero_memory", "summary"),
    "collectives_h100x8_summary": ("compare_collectives", "summary"),
}
BLOCK = re.compile(r"<!-- (\S+):begin -->\n(.*?)<!-- \1:end -->", re.S)


def expected(name: str) -> str:
  """What block `name` must hold, from the stored results."""
  if name.startswith("results/"):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      return f.read().strip()
  if name not in RENDERED:
    raise KeyError(f"block {name!r}: neither a results file nor one of {sorted(RENDERED)}")
  module, fn = RENDERED[name]
  if os.path.join(ROOT, "scripts") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
  return getattr(importlib.import_module(module), fn)().strip()


def blocks(doc: str) -> dict[str, str]:
  """The blocks of `doc` (a path under ROOT): name -> text, stripped."""
  with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
    return {m.group(1): m.group(2).strip() for m in BLOCK.finditer(f.read())}


def stale(docs: list[str] = DOCS) -> list[str]:
  """`doc: NAME` for each block that differs from what its results give."""
  return [f"{doc}: {name}" for doc in docs for name, text in blocks(doc).items()
          if text != expected(name)]


def sync(docs: list[str] = DOCS) -> list[str]:
  """Rewrites every block from the stored results; returns the docs that changed."""
  changed = []
  for doc in docs:
    path = os.path.join(ROOT, doc)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = BLOCK.sub(lambda m: f"<!-- {m.group(1)}:begin -->\n{expected(m.group(1))}\n"
                              f"<!-- {m.group(1)}:end -->", text)
    if new != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      changed.append(doc)
  return changed


if __name__ == "__main__":
  print("\n".join(f"rewrote {d}" for d in sync()) or "every block is up to date")
