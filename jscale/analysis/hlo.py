"""The collectives a compiled XLA program runs, by kind, with their bytes per step.

Parses the optimized HLO text of `jax.jit(f).lower(...).compile().as_text()`; it reports what XLA
actually emits after its passes, which is not always what the JAX program asked for. On XLA:CPU
(jax 0.10.2), found by compiling small programs on 8 host devices:
  * psum / all_gather / psum_scatter / ppermute stay all-reduce / all-gather / reduce-scatter /
    collective-permute; all_to_all becomes one all-to-all with a tuple result (one slice per peer).
  * Collectives on bf16 are promoted: the op runs in f32 (twice the bytes) between converts.
  * Several independent psums are combined into one tuple-shaped all-reduce (bytes: the sum).
  * XLA-sharded (GSPMD/Shardy) programs may do a gradient reduce-scatter as all-reduce +
    dynamic-slice, and a reshard as all-to-all + collective-permute.
  * ragged-all-to-all does not compile on CPU at all; it is parsed for GPU/TPU text.
GPU async pairs (`all-gather-start`/`-done`, `async-start`/`async-done`...) count once, at the
start, with the size of the real result (the -done op's shape), not the start's tuple.

A collective inside a `while` body (a `lax.scan` over layers) runs once per iteration. XLA
annotates loops whose trip count it knows as `backend_config={..."known_trip_count":{"n":"4"}}`
on the while op; `executions` multiplies those counts (nested loops multiply). Where a count is
unknown the loop counts once and `executions_known` is False. Both branches of a `conditional`
count (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
         "ragged-all-to-all")
_CALL_KEYS = r"body|condition|to_apply|calls|true_computation|false_computation|branch_computations"
_SEP, _LEAF = re.compile(r"[ ,]*"), re.compile(r"([a-z]\w*)\[([^\]]*)\](\{[^}]*\})?")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the optimized HLO (per device: shapes are shard shapes)."""
  kind: str                      # one of KINDS (an async -start counts as its kind)
  name: str                      # instruction name, e.g. "all-reduce.3"
  computation: str               # the HLO computation it lives in
  shapes: tuple[str, ...]        # result shapes, e.g. ("f32[1024]",); several if tuple-shaped
  dtypes: tuple[str, ...]
  bytes: int                     # size of the result, summed over tuple elements
  replica_groups: str            # raw text (source_target_pairs for collective-permute)
  groups: tuple[tuple[int, ...], ...] | None  # device groups; (source, target) pairs for permute
  group_size: int | None         # devices per group (None for collective-permute)
  op_name: str | None            # metadata op_name: the JAX source op, e.g. "jit(f)/.../psum"
  in_while: bool = False         # inside a while body (any depth)
  executions: int = 1            # runs per program execution: product of enclosing trip counts
  executions_known: bool = True  # False if some enclosing loop's trip count is unknown

  @property
  def bytes_per_step(self) -> int:
    """Bytes moved per program execution: `bytes * executions`."""
    return self.bytes * self.executions


def split_shape(s: str, i: int = 0) -> tuple[Any, int]:
  """Parses one shape at s[i:]: a (dtype, dims) leaf, or a list of shapes for a tuple."""
  i = _SEP.match(s, i).end()
  if s[i] != "(":
    m = _LEAF.match(s, i)
    dims = tuple(int(d.lstrip("<=")) if d.lstrip("<=").isdigit() else 0
                 for d in m.group(2).split(",") if d)   # "<=8": a dynamic dim's bound
    return (m.group(1), dims), m.end()
  items, i = [], i + 1
  while s[i] != ")":
    item, i = split_shape(s, i)
    items.append(item)
    i = _SEP.match(s, i).end()
  return items, i + 1


def leaves(shape: Any) -> list[tuple[str, tuple[int, ...]]]:
  return [shape] if isinstance(shape, tuple) else [x for s in shape for x in leaves(s)]


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
  bits = 8 if dtype == "pred" else int((re.match(r"[a-z]+(\d+)", dtype) or [0, 0])[1])
  return (math.prod(dims) * bits + 7) // 8


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  return np.arange(math.prod(dims)).reshape(dims).transpose(perm or range(len(dims)))


def _ints(s: str | None) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", s or "")]


def _mesh_groups(text: str) -> np.ndarray:
  """Expands Shardy's `mesh['a'=2,'b'=4], device_ids=(...) {'a','b':(1)2}` replica groups."""
  names, sizes = zip(*[(n, int(v)) for n, v in re.findall(
      r"'?(\w+)'?=(\d+)", re.search(r"mesh[\[<]([^\]>]*)", text).group(1))])
  dev = re.search(r"\((?:devices=)?([^()]*(?:T\([\d,]*\))?)\)", text.split("{")[0])
  devices = np.arange(math.prod(sizes))
  if dev:
    spec = dev.group(1).split("<=")[-1]
    m = re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", spec)
    devices = (_iota(_ints(m.group(1)), _ints(m.group(2))) if m
               else np.array(_ints(re.sub(r"^\[[\d,]*\]", "", spec))))
  axes = [(names.index(n), int(p) if p else 1, int(z) if z else sizes[names.index(n)])
          for n, p, z in re.findall(r"'?(\w+)'?(?::\((\d+)\)(\d+))?", text.split("{")[-1])]
  points = [sorted({1, n} | {q for a, p, z in axes if a == i for q in (p, p * z)})
            for i, n in enumerate(sizes)]
  dims, index = [], {}
  for i, pts in enumerate(points):
    for lo, hi in zip(pts, pts[1:]):
      index[(i, lo)] = len(dims)
      dims.append(hi // lo)
  picked = [index[(a, q)] for a, p, z in axes for q in points[a] if p <= q < p * z]
  rest = [d for d in range(len(dims)) if d not in picked]
  size = math.prod(dims[d] for d in picked)
  return devices.reshape(dims).transpose(rest + picked).reshape(-1, size)


def _groups(attrs: str, n_devices: int, key: str) -> tuple[str, Any, int | None]:
  """(raw text, parsed groups, group size) of an instruction's replica_groups (or `key`)."""
  m = re.search(key + r"=(\{(?:\{[\d,\s]*\},?\s*)*\}|\[[\d,]*\]<=\[[\d,]*\]"
                r"(?:T\([\d,]*\))?|@?mesh[^{]*\{[^}]*\})", attrs)
  if not m:
    return "", None, None
  raw = m.group(1)
  try:
    if raw.startswith("{"):
      groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])]
    elif raw.startswith("["):
      g, r, p = re.match(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", raw).groups()
      groups = _iota(_ints(r), _ints(p)).reshape(_ints(g))
    else:
      groups = _mesh_groups(raw)
  except (AttributeError, IndexError, KeyError, ValueError):
    return raw, None, None  # a format this parser does not know: the raw text is still there
  if len(groups) == 0:  # `{}`: one group of every device
    return raw, None, n_devices
  out = tuple(tuple(int(d) for d in g) for g in groups)
  return raw, out, len(out[0])


def instruction(line: str) -> list | None:
  """[name, result shape, opcode, text after "opcode("] of an instruction line, else None."""
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
  try:
    shape, i = split_shape(m.group(2))
    op = re.compile(r"\s*([\w\-]+)\(").match(m.group(2), i)
    return [m.group(1), shape, op.group(1), m.group(2)[op.end():]]
  except (AttributeError, IndexError):
    return None  # not an instruction: e.g. `  source_target_pairs={...}` continuing the last one


# An operand: `%name`, or `%name#i` for element i of a tuple-shaped instruction (XLA as shipped
# with jaxlib 0.11 writes these in place of get-tuple-element instructions).
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")


def operands(attrs: str) -> list[str]:
  """Operand names of an instruction, from the text after `opcode(` up to its closing
  parenthesis; a tuple element stays `name#i` (`shapes` resolves it)."""
  depth, end = 1, 0
  for end, ch in enumerate(attrs):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      break
  return _OPERAND.findall(attrs[:end])


def shapes(insts: list[list]) -> dict[str, Any]:
  """{name: result shape} of one computation's instructions, and `name#i` for each element of
  a tuple-shaped one, so that every operand name `operands` returns looks up its own shape."""
  out: dict[str, Any] = {}
  for name, shape, _, _ in insts:
    out[name] = shape
    if isinstance(shape, list):
      out.update((f"{name}#{i}", s) for i, s in enumerate(shape))
  return out


def parse(text: str) -> tuple[dict[str, list[list]], str | None, int]:
  """{computation: [[name, shape, opcode, attrs]]}, the entry name, and the device count."""
  comps, entry, cur = {}, None, None
  n_devices = math.prod(int(m.group(1)) for key in ("replica_count", "num_partitions")
                        if (m := re.search(key + r"=(\d+)", text)))
  for line in re.sub(r"/\*.*?\*/", "", text).splitlines():
    h = re.match(r"\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$", line)
    if h and " = " not in line:
      cur, entry = h.group(2), h.group(2) if h.group(1) else entry
      comps[cur] = []
    elif line.strip() == "}":
      cur = None
    elif cur is not None and (inst := instruction(line)):
      comps[cur].append(inst)
    elif cur is not None and comps[cur] and line.strip():
      comps[cur][-1][3] += " " + line.strip()   # an instruction continued on the next line
  return comps, entry, n_devices


def _scalar(insts: list[list], name: str, depth: int = 8) -> int | None:
  """The integer instruction `name` of one computation's `insts` holds where it is a constant,
  through copies, bitcasts and converts (None otherwise)."""
  by_name = {n: (o, a) for n, _, o, a in insts}
  while depth and name in by_name:
    op, attrs = by_name[name]
    if op == "constant":
      m = re.match(r"\s*(-?\d+)\)", attrs)
      return int(m.group(1)) if m else None
    if op not in ("copy", "bitcast", "convert") or not operands(attrs):
      return None
    name, depth = operands(attrs)[0].split("#")[0], depth - 1
  return None


def trip_count(comps: dict, comp: str, attrs: str) -> int | None:
  """A while loop's trip count: XLA's `known_trip_count`, else read from its condition (the
  counter, element 0 of the carry, compared LT / LE / GT / GE with a constant, perhaps inside a
  fusion) and the counter's initial value in the init tuple (a constant). None if unreadable:
  XLA:GPU leaves the count off some loops (a micro-batch scan whose first step it peeled)."""
  n = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', attrs)
  if n:
    return int(n.group(1))
  cond = re.search(r"\bcondition=%?([\w.\-]+)", attrs)
  init = operands(attrs)
  if not cond or cond.group(1) not in comps or not init:
    return None
  body = comps[cond.group(1)]
  root = body[-1]
  if root[2] == "fusion":
    body = comps.get((re.search(r"calls=%?([\w.\-]+)", root[3]) or [None, ""])[1], [])
    root = body[-1] if body else root
  direction = re.search(r"direction=(\w+)", root[3])
  if root[2] != "compare" or not direction:
    return None
  limit = next((v for o in operands(root[3])
                if (v := _scalar(body, o)) is not None), None)
  start = None
  tup = {n: a for n, _, o, a in comps.get(comp, []) if o == "tuple"}.get(init[0].split("#")[0])
  if tup is not None and operands(tup):
    start = _scalar(comps.get(comp, []), operands(tup)[0].split("#")[0])
  if limit is None or start is None:
    return None
  trips = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit,
           "GE": start - limit + 1}.get(direction.group(1))
  return trips if trips is not None and trips >= 0 else None


def executions(comps: dict[str, list], entry: str | None) -> dict[str, tuple[int, bool, bool]]:
  """{computation: (executions per program run, all trip counts known, inside a while body)}."""
  callers: dict[str, list[tuple]] = {c: [] for c in comps}
  for comp, insts in comps.items():
    for _, _, opcode, attrs in insts:
      if opcode in ("async-done", "async-update"):
        continue  # the same wrapped computation as its async-start: count it once
      n = trip_count(comps, comp, attrs) if opcode == "while" else None
      for key, val in re.findall(rf"\b({_CALL_KEYS})=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs):
        loop = opcode == "while" and key in ("body", "condition")
        trips = n + (key == "condition") if loop and n is not None else 1
        for callee in re.findall(r"%?([\w.\-]+)", val):
          if callee in callers:
            callers[callee].append((comp, trips, not loop or n is not None, loop))
  memo: dict[str, tuple[int, bool, bool]] = {}

  def visit(c: str) -> tuple[int, bool, bool]:
    if c not in memo:  # roots: the entry (or, in a fragment without one, every root) runs once
      runs = [(visit(p), t, k, w) for p, t, k, w in callers[c]]
      memo[c] = ((sum(r[0] * t for r, t, _, _ in runs), all(r[1] and k for r, _, k, _ in runs),
                  any(r[2] or w for r, _, _, w in runs)) if runs
                 else (int(entry is None or c == entry), True, False))
    return memo[c]

  return {c: visit(c) for c in comps}


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in optimized HLO text (or a `Compiled`), in program text order."""
  if not isinstance(hlo_text, str):
    hlo_text = hlo_text.as_text()
  comps, entry, n_devices = parse(hlo_text)
  runs = executions(comps, entry)
  done_shape = {m.group(1): shape for insts in comps.values() for _, shape, opcode, attrs in insts
                if opcode.endswith("-done") and (m := re.search(r"%?([\w.\-]+)(?:#\d+)?\)", attrs))}
  out = []
  for comp, insts in comps.items():
    for name, shape, opcode, attrs in insts:
      kind = opcode.removesuffix("-start")
      if kind not in KINDS:
        continue
      if opcode.endswith("-start"):  # the real result: the -done's shape, else the start's [1]
        shape = done_shape.get(name, shape if kind == "all-reduce" or
                               isinstance(shape, tuple) else shape[1])
      parts = leaves(shape)
      permute = kind == "collective-permute"
      raw, groups, size = _groups(attrs, n_devices, "source_target_pairs" if permute
                                  else "replica_groups")
      op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
      n, known, in_while = runs[comp]
      out.append(Collective(
          kind, name, comp, tuple(f"{d}[{','.join(map(str, s))}]" for d, s in parts),
          tuple(d for d, _ in parts), sum(nbytes(d, s) for d, s in parts), raw, groups,
          None if permute else size,
          op_name and op_name.group(1), in_while, n, known))
  return out


def bytes_across_nodes(c: Collective, per_node: int) -> int:
  """Bytes an all-to-all (or ragged one: its buffer, an upper bound) sends per device per
  execution to devices of other nodes (`per_node` consecutive devices each): one
  bytes / group-size slice per group member outside the sender's node (the most of any device)."""
  if c.kind not in ("all-to-all", "ragged-all-to-all"):
    raise ValueError(f"{c.name}: bytes_across_nodes counts all-to-alls, not {c.kind}")
  if c.groups is None:
    raise ValueError(f"{c.name}: no replica groups parsed ({c.replica_groups!r})")
  return max(c.bytes // len(g) * sum(j // per_node != i // per_node for j in g)
             for g in c.groups for i in g)


def summary(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {"count": runs per step, "bytes": bytes per step}}, loop trip counts multiplied."""
  out: dict[str, dict[str, int]] = {}
  for c in collectives(hlo_text):
    if not c.executions_known:
      warnings.warn(f"{c.name} is in a loop of unknown trip count: counted once per step")
    s = out.setdefault(c.kind, {"count": 0, "bytes": 0})
    s["count"] += c.executions
    s["bytes"] += c.bytes_per_step
  return out


def compiled_collectives(fn: Any, *args: Any, **kwargs: Any) -> dict[str, dict[str, int]]:
  """`summary` of `fn` (jitted, or jitted here) compiled for args (arrays or ShapeDtypeStructs)."""
  if not hasattr(fn, "lower"):
    import jax
    fn = jax.jit(fn)
  return summary(fn.lower(*args, **kwargs).compile().as_text())


def largest_array(hlo_text: str) -> tuple[int, str]:
  """(elements, shape) of the largest array any instruction of the program produces or reads:
  e.g. to show that attention never materialises a score matrix beyond a given size."""
  best = (0, "")
  for m in _LEAF.finditer(hlo_text):
    if m.group(1) in ("token", "pred") or not m.group(2):
      continue
    dims = [int(d.lstrip("<=")) for d in m.group(2).split(",") if d.lstrip("<=").isdigit()]
    best = max(best, (math.prod(dims), f"{m.group(1)}[{m.group(2)}]"))
  return best
