"""What XLA:GPU scheduled under each asynchronous collective: the instructions between its
-start and its -done, in the compiled program's schedule order (a scheduled module lists each
computation's instructions in the order they run).

A collective hides behind the kernels its window holds: the compute stream runs them while the
communication stream moves the bytes (`jscale.predict.timing` times it so). This reads the
windows from the text, to assert on CPU that a program was scheduled to overlap, e.g. one
slice's expert all-to-alls around another slice's grouped matmuls (`parallel.expert_chunks`).
"""

from __future__ import annotations

import dataclasses
import re

from jscale.analysis import hlo


@dataclasses.dataclass(frozen=True)
class Window:
  """One async collective's start ... done in one computation."""
  computation: str
  start: str  # the -start instruction's name
  kind: str  # e.g. "ragged-all-to-all"
  between: tuple[tuple[str, str], ...]  # (opcode, attributes) of each instruction inside

  def count(self, pattern: str) -> int:
    """Instructions inside whose opcode and attributes match the regular expression."""
    return sum(bool(re.search(pattern, f"{op} {attrs}")) for op, attrs in self.between)


def windows(text: str, kind: str) -> list[Window]:
  """Every `kind`-start ... `kind`-done pair of the optimised HLO `text` (e.g. kind
  "ragged-all-to-all", "all-gather"), with what was scheduled between them."""
  comps, _, _ = hlo.parse(text)
  out = []
  for comp, insts in comps.items():
    open_at: dict[str, int] = {}
    for i, (name, _, op, attrs) in enumerate(insts):
      if op == f"{kind}-start":
        open_at[name] = i
      elif op == f"{kind}-done":
        start = hlo.operands(attrs)[0].split("#")[0]
        if start in open_at:
          j = open_at.pop(start)
          inside = tuple((o, a) for _, _, o, a in insts[j + 1:i])
          out.append(Window(comp, start, kind, inside))
  return out
