"""The matmuls of a lowered program: every `stablehlo.dot_general` with its operand and result
dtypes and the source location's name (JAX's name stack: named scopes, `transpose(jvp(...))`
for backward products).

Reads `jax.jit(f).lower(...).as_text(debug_info=True)`: the StableHLO JAX emits, before XLA's
passes, so it shows what the program asks the compiler to multiply in which precision (what
decides TF32 vs bf16 gemms on a GPU), on any backend, without compiling.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jscale.analysis import hlo

# dot_general, and ragged_dot where a backend keeps it whole (its third operand: group sizes).
_DOT = re.compile(r"(?:stablehlo\.dot_general|chlo\.ragged_dot)\b.*?:\s*\(tensor<([^>]*)>,\s*"
                  r"tensor<([^>]*)>(?:,\s*tensor<[^>]*>)?\)\s*->\s*tensor<([^>]*)>.*?"
                  r"loc\((#loc\d*|\"[^\"]*\")")
_LOC_DEF = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$", re.M)


@dataclasses.dataclass(frozen=True)
class Dot:
  """One dot_general of the lowered program (each textual occurrence once: a loop body's
  matmul counts once however many times the loop runs)."""
  lhs: str       # element types: "bf16", "f32", ...
  rhs: str
  out: str
  lhs_shape: str  # e.g. "8x256x256"
  rhs_shape: str
  location: str  # the names along the op's location, joined by " / "
  flops: int = 0  # 2 * output elements * contracted size (compiled dots; cuBLAS calls: 0)

  @property
  def operands(self) -> tuple[str, str]:
    return self.lhs, self.rhs


def _split(tensor_type: str) -> tuple[str, str]:
  parts = tensor_type.split("x")
  return "x".join(parts[:-1]), parts[-1]


def _names(ref: str, defs: dict[str, str], seen: set[str]) -> list[str]:
  """Quoted names reachable from a location (a `#locN` alias or an inline `"name"`)."""
  if not ref.startswith("#"):
    return [ref.strip('"')]
  if ref in seen or ref not in defs:
    return []
  seen.add(ref)
  body = defs[ref]
  out = [n for n in re.findall(r'"([^"]*)"', body) if not re.search(r"\.py$|^/", n)]
  for sub in re.findall(r"#loc\d*", body):
    out += _names(sub, defs, seen)
  return out


def dot_generals(lowered: Any) -> list[Dot]:
  """Every dot_general in a `Lowered` (or its `as_text(debug_info=True)` text)."""
  text = lowered if isinstance(lowered, str) else lowered.as_text(debug_info=True)
  defs = dict(_LOC_DEF.findall(text))
  out = []
  for line in text.splitlines():
    m = _DOT.search(line)
    if not m:
      continue
    (ls, lt), (rs, rt), (_, ot) = _split(m.group(1)), _split(m.group(2)), _split(m.group(3))
    names = _names(m.group(4), defs, set())
    out.append(Dot(lt, rt, ot, ls, rs, " / ".join(dict.fromkeys(names))))
  return out


def not_in(dots: list[Dot], dtype: str, allowed_scopes: tuple[str, ...] = ()) -> list[Dot]:
  """The dots with an operand not of `dtype` ("bf16") whose location is under none of the
  `allowed_scopes` (named scopes such as "fp32_router")."""
  return [d for d in dots if set(d.operands) != {dtype}
          and not any(s in d.location for s in allowed_scopes)]


def compiled_dots(compiled: Any) -> list[Dot]:
  """Every matmul of a compiled program (a `Compiled` or its `as_text()`), as the backend runs
  it: `dot` instructions (on XLA:GPU inside gemm fusions) with the element types of their
  operands there (so an operand converted to fp32 inside a fusion shows as f32), and cuBLAS
  custom calls (`__cublas$...`: FP8 gemms among them). `location` is the op_name."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, _, _ = hlo.parse(text)
  out = []
  for insts in comps.values():
    types = {name: hlo.leaves(shape) for name, shape in hlo.shapes(insts).items()}
    for _, shape, opcode, attrs in insts:
      cublas = opcode == "custom-call" and '"__cublas$' in attrs
      if opcode != "dot" and not cublas:
        continue
      ops = hlo.operands(attrs)[:2]
      if len(ops) < 2 or any(o not in types for o in ops):
        continue
      (lt, ls), (rt, rs) = types[ops[0]][0], types[ops[1]][0]
      op_name = re.search(r'op_name="([^"]*)"', attrs)
      ot, os_ = hlo.leaves(shape)[0]
      contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
      k = math.prod(ls[int(i)] for i in contract.group(1).split(",") if i) if contract else 0
      out.append(Dot(lt, rt, ot, "x".join(map(str, ls)), "x".join(map(str, rs)),
                     op_name.group(1) if op_name else "", 2 * math.prod(os_) * k))
  return out
