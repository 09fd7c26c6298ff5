"""The kernels an optimised XLA:GPU program launches, in the order it runs them.

Reads `compiled.as_text()` (a scheduled module: each computation's instructions are printed in
the order the GPU stream runs them) and turns every instruction that launches work into a
`Launch`: what it is (gemm, attention, kernel, memory, collective start / done), its FLOPs and
operand types where it multiplies, and the HBM bytes it reads and writes. Control flow stays
structure: a `while` is a `Loop` over its body's launches with XLA's known trip count, a
`conditional` a `Branches` of its branches, a `call` is inlined. `jscale.predict.timing` times
the launches and walks the structure.

Bytes are what a fused kernel must move: each operand once (a parameter read only through
slices and gathers, or views and conversions of it, counts what they take; the buffer a
dynamic-update-slice updates in place counts nothing, and the write is the update alone) plus
the result.

XLA:GPU's dynamic-slice fusion (`--xla_gpu_enable_dynamic_slice_fusion`, on by default in the
XLA of jax 0.11; off in 0.10's, which fails to compile a train step with it) wraps one kernel,
its hero (a custom call: a Pallas kernel, cuBLAS, cuDNN), with the slices it reads and the
dynamic-update-slice its result goes into: the kernel runs on those addresses, with no copy in
or out. Such a fusion is its hero's launch on the slices (`_sliced_hero`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Union

from jscale.analysis import hlo
from jscale.fp8 import dot as fp8_dot

# Instructions that launch nothing: views, tuples, scalars, control markers.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "iota",
         "broadcast", "reshape"}
_F8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e5m2fnuz", "f8e4m3fnuz")
# What a dynamic-slice fusion may wrap (its hero); the rest of its body is slicing.
_HEROES = ("custom-call", "fusion", "dot", "convolution")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass
class Launch:
  """One kernel (or a collective's start / done) of the executed sequence."""
  name: str                 # instruction name: XLA names the GPU kernel after it
  op: str                   # HLO opcode
  kind: str                 # gemm | attention | kernel | memory | collective | done
  label: str                # what runs: fusion kind, custom-call target, Pallas kernel name
  op_name: str              # JAX source op (metadata), e.g. ".../layers/while/body/..."
  bytes: float = 0.0        # HBM bytes read + written
  flops: float = 0.0        # gemm / attention FLOPs
  dtype: str = ""           # gemm operand type: bf16, f32, f8 (the slower operand)
  highest: bool = False     # an f32 gemm at HIGHEST precision (no TF32)
  mnk: tuple[int, int, int, int] = (0, 0, 0, 0)  # gemm (batch, m, n, k)
  attention: dict | None = None  # cuDNN / flash: {"pass", "seq", "head_dim", "causal", ...}
  collective: hlo.Collective | None = None
  done_of: str = ""         # for kind "done": the start it waits for
  online: int = 0           # elements an online softmax reduction combines (`_online_elements`)

  @property
  def kernel_name(self) -> str:
    """The name a GPU profile shows for XLA's own kernels (fusion names, dots -> _)."""
    return self.name.replace(".", "_")


@dataclasses.dataclass
class Loop:
  """A while loop: `body` runs `trips` times (None: XLA did not know the count)."""
  name: str
  trips: int | None
  body: list["Item"]
  op_name: str = ""


@dataclasses.dataclass
class Branches:
  """A conditional: one of `branches` runs (which one is data-dependent)."""
  name: str
  branches: list[list["Item"]]
  op_name: str = ""


Item = Union[Launch, Loop, Branches]


def _attr(attrs: str, key: str) -> str:
  m = re.search(key + r'="((?:[^"\\]|\\.)*)"', attrs)
  return m.group(1) if m else ""


def _size(shape) -> int:
  return sum(hlo.nbytes(d, s) for d, s in hlo.leaves(shape))


def _callees(attrs: str, comps: dict) -> list[str]:
  return [c for _, val in _CALLS.findall(attrs) for c in re.findall(r"%?([\w.\-]+)", val)
          if c in comps]


def _on_devices(c: hlo.Collective, devices: Sequence[int] | None) -> hlo.Collective:
  """`c` with its groups (or a permute's source-target pairs) as the devices its partitions
  run on."""
  if devices is None or c.groups is None:
    return c
  return dataclasses.replace(c, groups=tuple(tuple(devices[p] for p in g) for g in c.groups))


class Program:
  """A parsed optimised module: `items()` is its entry computation as `Item`s."""

  def __init__(self, text: str, routed_rows: int | None = None,
               devices: Sequence[int] | None = None, node_rows: tuple[int, int] | None = None):
    """`routed_rows`: the expert rows a grouped matmul computes per call with balanced routing
    (None: all its rows). Its lhs may hold more: an expert-parallel exchange's receive buffer
    keeps room for the most a device can be sent, and the kernel skips the rows past its
    groups' sizes (pallas_kernels/grouped_matmul), so only the routed rows cost FLOPs.
    `devices`: the device each partition runs on, the program's device assignment (a hybrid
    mesh's is a permutation: `mesh.make_mesh`); the collectives' groups, which name
    partitions, are read as those devices (None: partition i runs on device i).
    `node_rows`: (the rows of the node-limited exchange's first-hop blocks, the rows that hop
    carries per call with balanced routing: a copy per token and chosen group), or None."""
    self.routed_rows = routed_rows
    self.node_rows = node_rows
    self.comps, self.entry, self.n_devices = hlo.parse(text)
    # Instructions with a host-memory (memory space S(5)) buffer in their shape.
    self._on_host = set(re.findall(r"%([\w.\-]+) = [^\n]*:S\(5\)", text))
    self.colls = {(c.computation, c.name): _on_devices(c, devices)
                  for c in hlo.collectives(text)}
    self._shapes = {c: hlo.shapes(insts) for c, insts in self.comps.items()}

  def _routed(self, c: hlo.Collective) -> hlo.Collective:
    """A ragged all-to-all moves the routed rows, not its buffer (room for the most a device
    can be sent or send): its bytes for the rows its exchange carries with balanced routing
    where that is fewer (`routed_rows`; the node-limited exchange's first hop, told by its
    blocks' rows, `node_rows`), and never more rows than its input holds (a transpose's output
    is the sender's whole row array: the first hop sends back at most its bounded blocks)."""
    if c.kind != "ragged-all-to-all" or self.routed_rows is None:
      return c
    rows, sent = hlo.split_shape(c.shapes[0])[0][1][0], self._input_rows(c)
    # One side of every exchange's all-to-all is its [N·cap] blocks, the larger one.
    carried = (self.node_rows[1] if self.node_rows and self.node_rows[0] == max(rows, sent)
               else self.routed_rows)
    return dataclasses.replace(c, bytes=c.bytes * min(rows, carried, sent) // rows)

  def _input_rows(self, c: hlo.Collective) -> int:
    """Rows of a ragged all-to-all's input operand (what it can send at most)."""
    attrs = next(a for n, _, op, a in self.comps[c.computation] if n == c.name)
    shape = self._shapes[c.computation][hlo.operands(attrs)[0]]
    return hlo.leaves(shape)[0][1][0]

  def items(self, comp: str | None = None) -> list[Item]:
    """The launches and control flow of `comp` (default: the entry) in schedule order."""
    comp = comp or self.entry
    out: list[Item] = []
    for name, shape, op, attrs in self.comps[comp]:
      if op in _FREE:
        continue
      callees = _callees(attrs, self.comps)
      op_name = _attr(attrs, "op_name")
      if op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", attrs).group(1)
        out.append(Loop(name, hlo.trip_count(self.comps, comp, attrs), self.items(body),
                        op_name))
      elif op == "conditional":
        out.append(Branches(name, [self.items(c) for c in callees], op_name))
      elif op == "call":
        out += [x for c in callees for x in self.items(c)]
      else:
        launch = self._launch(comp, name, shape, op, attrs, callees, op_name)
        if launch is not None:
          out.append(launch)
    return out

  # ---------------------------------------------------------------------------- one launch
  def _launch(self, comp, name, shape, op, attrs, callees, op_name) -> Launch | None:
    base = op.removesuffix("-start").removesuffix("-done")
    if op.endswith("-done"):
      ops = hlo.operands(attrs)
      return Launch(name, op, "done", base, op_name, done_of=ops[0].split("#")[0] if ops else "")
    if op.endswith("-start") and base in hlo.KINDS or op == "async-start":
      coll = self.colls.get((comp, name)) or next(
          (self.colls[(c, n)] for c in callees for n, *_ in self.comps[c]
           if (c, n) in self.colls), None)
      if coll is not None:
        return Launch(name, op, "collective", coll.kind, op_name, collective=self._routed(coll))
    if op in hlo.KINDS:  # a synchronous collective
      coll = self.colls.get((comp, name))
      return Launch(name, op, "collective", op, op_name,
                    collective=coll and self._routed(coll))
    if op == "fusion-start" and name in self._on_host and (
        moved := self._host_slice_bytes(callees)):
      # XLA:GPU's host offload (`remat: offload`): an async fusion that writes a slice into a
      # host-memory (S(5)) buffer or reads one back, beside the compute
      return Launch(name, op, "transfer", "host offload", op_name, bytes=moved)
    if op.endswith("-start") or op in ("async-update", "async-done"):
      return None  # copy-start / send / recv: not on a train step's path
    if op == "custom-call" and _attr(attrs, "custom_call_target") == "AllocateBuffer":
      return None  # an allocation, no kernel (XLA:GPU's zero-init elimination, `xla_flags`)
    if op == "fusion" and (hero := self._sliced_hero(name, attrs, callees)) is not None:
      return hero
    launch = Launch(name, op, "memory", op, op_name, bytes=self._bytes(comp, shape, attrs))
    if op == "fusion":
      kind = re.search(r"kind=(\w+)", attrs).group(1)
      backend = re.search(r'"fusion_backend_config"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"', attrs)
      launch.label = backend.group(1) if backend else kind
      if backend and "gemm" in backend.group(1) or self._root_dot(callees):
        self._gemm(launch, callees, attrs)
      elif callees:
        launch.bytes = self._fusion_bytes(comp, shape, attrs, callees[0])
        launch.online = self._online_elements(callees[0])
    elif op == "custom-call":
      self._custom_call(launch, comp, shape, attrs)
    elif op == "dot":
      self._gemm(launch, [], attrs, comp)
    if launch.kind == "gemm" and fp8_dot.GEMM_SCOPE in op_name:
      launch.dtype = "f8"  # an FP8 product, upcast here: on a GPU cuBLASLt's FP8 gemm
    return launch

  def _sliced_hero(self, name: str, attrs: str, callees: list[str]) -> Launch | None:
    """A dynamic-slice fusion's launch: its hero's, with the operands and result as the hero
    sees them (the slices it reads, the update it writes in place), under the fusion's name
    (what XLA schedules). None: not a dynamic-slice fusion, or none with a hero."""
    config = _json_after(attrs, "custom_fusion_config") or {}
    if config.get("name") != "dynamic_slice_fusion" or not callees:
      return None
    fused = callees[0]
    for hero, shape, op, hero_attrs in self.comps[fused]:
      if op in _HEROES:
        launch = self._launch(fused, hero, shape, op, hero_attrs,
                              _callees(hero_attrs, self.comps), _attr(hero_attrs, "op_name"))
        return launch and dataclasses.replace(launch, name=name)
    return None

  def _host_slice_bytes(self, callees: list[str]) -> int | None:
    """Bytes an async fusion on a host-memory buffer moves over the host link: the slice its
    dynamic-update-slice writes, or its dynamic-slice reads (None: neither)."""
    for fused in callees:
      for _, shape, op, attrs in self.comps[fused]:
        if op == "dynamic-update-slice":
          return _size(self._shapes[fused][hlo.operands(attrs)[1]])
        if op == "dynamic-slice":
          return _size(shape)
    return None

  def _bytes(self, comp: str, shape, attrs: str) -> float:
    shapes = self._shapes[comp]
    return _size(shape) + sum(_size(shapes[o]) for o in hlo.operands(attrs) if o in shapes)

  def _fusion_bytes(self, comp: str, shape, attrs: str, fused: str) -> float:
    """Operands and result of a fusion, with slices and in-place updates counted as moved."""
    insts = self.comps[fused]
    params = {n: int(re.match(r"\s*(\d+)", a).group(1)) for n, _, o, a in insts
              if o == "parameter"}
    users: dict[str, list[tuple[str, object, int, str]]] = {}
    for n, s, o, a in insts:
      for pos, src in enumerate(hlo.operands(a)):
        users.setdefault(src, []).append((o, s, pos, n))
    root = insts[-1]  # a fused computation's ROOT is printed last
    views = {n: hlo.operands(a)[0] for n, _, o, a in insts if o == "bitcast"}
    in_place = {}
    for n, s, o, a in insts:
      if o in ("dynamic-update-slice", "scatter"):
        ops = hlo.operands(a)
        buffer = ops[0]
        while buffer in views:  # the buffer may be a bitcast view of the parameter
          buffer = views[buffer]
        if o == "dynamic-update-slice":
          in_place[buffer] = _size(self._shapes[fused].get(ops[1], s))
        else:  # the rows it updates, read and written (the embedding's gradient: 0.11 ms a
          # step traced on an H200 over a 0.84 GB buffer, 2026-11-30)
          in_place[buffer] = 2 * _size(self._shapes[fused].get(ops[2], s))
    outer = self._shapes[comp]
    operands = hlo.operands(attrs)
    total = 0.0
    for pname, index in params.items():
      outside = outer.get(operands[index]) if index < len(operands) else None
      full = _size(outside) if outside is not None else 0
      if pname in in_place:
        continue  # updated in place: only the update is written (counted below)
      picked = _picked(users, pname) if outside is not None else None
      if picked is not None:  # elements taken out of it, at its own width
        total += min(full, picked * full / max(1, _elements(outside)))
      else:
        total += full
    written = _size(shape)
    if in_place and root[2] in ("dynamic-update-slice", "scatter", "tuple", "bitcast"):
      written = min(written, sum(in_place.values()))  # only the updated slices are written
    return total + written

  def _online_elements(self, fused: str) -> int:
    """Elements the fused computation's variadic reductions with an exp in their combiner take
    (the loss's (max, sum-exp) pairs, `jscale.step.loss.max_sum_exp`): XLA:GPU runs them at a
    measured rate far under the HBM's (`rates.ONLINE_SOFTMAX`); 0 where it has none."""
    total = 0
    for _, shape, op, attrs in self.comps[fused]:
      if op != "reduce" or not isinstance(shape, list):  # a tuple result: variadic
        continue
      combiner = _callees(attrs, self.comps)
      if any(o == "exponential" for c in combiner for _, _, o, _ in self.comps[c]):
        total += _elements(self._shapes[fused][hlo.operands(attrs)[0]])
    return total

  def _root_dot(self, callees: list[str]) -> bool:
    return bool(callees) and any(o in ("dot", "convolution") for _, _, o, _ in
                                 self.comps[callees[0]])

  def _find_dot(self, comp: str, seen: set[str]):
    """The dot inside a (nested) gemm fusion: (instruction, its computation)."""
    seen.add(comp)
    for inst in self.comps[comp]:
      if inst[2] == "dot":
        return inst, comp
    for *_, attrs in self.comps[comp]:
      for c in _callees(attrs, self.comps):
        if c not in seen and (found := self._find_dot(c, seen)):
          return found
    return None

  def _gemm(self, launch: Launch, callees: list[str], attrs: str, comp: str = "") -> None:
    found = (([i for i in self.comps[comp] if i[0] == launch.name][0], comp) if not callees
             else self._find_dot(callees[0], set()))
    if found is None:
      return
    (_, _, _, dot_attrs), dot_comp = found
    ops = hlo.operands(dot_attrs)
    shapes = self._shapes[dot_comp]
    (lt, ls), (rt, rs) = hlo.leaves(shapes[ops[0]])[0], hlo.leaves(shapes[ops[1]])[0]
    dims = lambda key: [int(x) for x in re.findall(r"\d+", re.search(
        key + r"=\{([\d,]*)\}", dot_attrs).group(1))] if re.search(key, dot_attrs) else []
    _set_gemm(launch, (lt, ls), (rt, rs), *(dims(f"{side}_{what}_dims") for side in ("lhs", "rhs")
                                             for what in ("contracting", "batch")))
    precision = re.search(r"operand_precision=\{([^}]*)\}", dot_attrs)
    launch.highest = precision is not None and "highest" in precision.group(1)

  # -------------------------------------------------------------------------- custom calls
  def _custom_call(self, launch: Launch, comp: str, shape, attrs: str) -> None:
    target = _attr(attrs, "custom_call_target")
    launch.label = target
    shapes = self._shapes[comp]
    operands = [hlo.leaves(shapes[o])[0] for o in hlo.operands(attrs) if o in shapes]
    if target.startswith("__cublas"):
      self._cublas(launch, attrs, operands)
    elif target.startswith("__cudnn$fmha"):
      fmha = _json_after(attrs, "cudnn_fmha_backend_config") or {}
      b, h, l, s = (int(x) for x in fmha["intermediate_tensor_shape"]["dimensions"])
      k, kv = operands[0][1][-1], operands[2][1][-1]  # Q's head size, V's (MLA's apart)
      causal = fmha.get("mask_type", "") == "CAUSAL"
      backward = "Backward" in target
      launch.kind = "attention"
      launch.attention = {"pass": "bwd" if backward else "fwd", "seq": s, "head_dim": k,
                          "causal": causal, "impl": "cudnn", "v_head_dim": kv}
      launch.flops = _attention_flops(b, h, l, s, k, causal, backward, kv)
    elif target in ("mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton"):
      kernel = _pallas_name(launch.op_name) or _attr(attrs, "name")
      launch.kind, launch.label = "kernel", kernel
      if "flash_attention" in kernel:
        self._flash(launch, kernel, operands)
      elif "grouped_matmul" in kernel:  # lhs [M, K] (after the group sizes); out [..., N]
        rows_inputs = [o for o in operands if len(o[1]) == 2]  # lhs (and dW's dout [M, N])
        m, k = rows_inputs[0][1]
        launch.dtype = _gemm_type(rows_inputs[0][0], operands[-1][0])  # f8: FP8 experts
        rows = m if self.routed_rows is None else min(m, self.routed_rows)
        # The kernel reads no row past its groups' sizes (it writes them as zeros).
        launch.bytes -= sum(hlo.nbytes(d, (m - rows, s[1])) for d, s in rows_inputs if s[0] == m)
        n = hlo.leaves(shape)[0][1][-1]
        # A launch on some of rhs's output columns (`hopper_config.column_parts`) reads those.
        launch.bytes -= sum(hlo.nbytes(d, s) * max(0.0, 1 - s[0] * k * n / math.prod(s))
                            for d, s in operands if len(s) == 3)
        launch.mnk = (1, rows, n, k)

  def _cublas(self, launch: Launch, attrs: str, operands) -> None:
    gemm = _json_after(attrs, "gemm_backend_config") or {}
    dn = gemm.get("dot_dimension_numbers", {})
    ints = lambda key: [int(x) for x in dn.get(key, [])]
    _set_gemm(launch, operands[0], operands[1],
              *(ints(f"{side}_{what}_dimensions") for side in ("lhs", "rhs")
                for what in ("contracting", "batch")))
    precision = gemm.get("precision_config", {}).get("operand_precision", [])
    launch.highest = "HIGHEST" in precision

  def _flash(self, launch: Launch, kernel: str, operands) -> None:
    """A Pallas flash kernel: q [B, L, H, K], k [B, S, G, K]; jscale trains causally."""
    (_, q), (_, kv) = operands[0], operands[1]
    if len(q) != 4 or len(kv) != 4:
      return
    b, l, h, k = q
    s = kv[1]
    backward = "dq" in kernel or "dkv" in kernel or "bwd" in kernel
    launch.kind = "attention"
    part = 0.4 if "dq" in kernel else 0.6 if "dkv" in kernel else 1.0  # of the backward
    launch.attention = {"pass": "bwd" if backward else "fwd", "seq": s, "head_dim": k,
                        "causal": True, "impl": "hopper" if "hopper" in kernel else "pallas",
                        "part": part}
    launch.flops = _attention_flops(b, h, l, s, k, True, backward) * (part if backward else 1)


def _elements(shape) -> int:
  return sum(math.prod(dims) for _, dims in hlo.leaves(shape))


def _picked(users: dict, name: str) -> int | None:
  """Elements of the fused value `name` that its kernel reads where only slices and gathers
  (operand 0) take from it, directly or through views and conversions (XLA fuses the logits'
  fp32 convert before the label's gather: one element a row read, not the row); None where
  anything reads it whole."""
  uses = users.get(name, [])
  total = 0
  for op, shape, pos, user in uses:
    if op in ("bitcast", "convert", "reshape"):
      inner = _picked(users, user)
      if inner is None:
        return None
      total += inner
    elif op in ("dynamic-slice", "slice", "gather") and pos == 0:
      total += _elements(shape)
    else:
      return None
  return total if uses else None


def _set_gemm(launch: Launch, lhs, rhs, lc, lb, rc, rb) -> None:
  """Makes `launch` a gemm of (dtype, dims) operands with these contracting / batch dims."""
  (lt, ls), (rt, rs) = lhs, rhs
  batch, k = math.prod(ls[i] for i in lb), math.prod(ls[i] for i in lc)
  m = math.prod(d for i, d in enumerate(ls) if i not in lc and i not in lb)
  n = math.prod(d for i, d in enumerate(rs) if i not in rc and i not in rb)
  launch.kind, launch.mnk, launch.flops = "gemm", (batch, m, n, k), 2.0 * batch * m * n * k
  launch.dtype = _gemm_type(lt, rt)


def _gemm_type(lt: str, rt: str) -> str:
  """The type a gemm runs in: f8 when both operands are, bf16 / f16 likewise, else f32."""
  types = {lt, rt}
  if types <= set(_F8):
    return "f8"
  if types <= {"bf16", "f16"}:
    return "bf16"
  return "f32"


def _attention_flops(b, h, l, s, k, causal: bool, backward: bool, kv: int | None = None
                     ) -> float:
  """QKᵀ over Q's head size K and PV over V's Kv (K unless given: MLA's differ), 2·B·H·L·S
  each, halved by a causal mask; the backward QKᵀ recomputed, dQ and dK over K, dP and dV over
  Kv (FlashAttention-2's count: 2.5x the forward where Kv = K)."""
  kv = k if kv is None else kv
  per = 2.0 * b * h * l * s * (0.5 if causal else 1.0)
  return per * (3 * k + 2 * kv) if backward else per * (k + kv)


def _pallas_name(op_name: str) -> str:
  """The Pallas kernel's name from its op_name (".../flash_attention_fwd_hopper/mpmd_map")."""
  parts = [p for p in op_name.split("/") if p not in ("mpmd_map", "pallas_call")]
  return parts[-1] if parts else ""


def _json_after(attrs: str, key: str) -> dict | None:
  """The JSON object that follows `"key":` in a backend_config."""
  i = attrs.find(f'"{key}"')
  if i < 0:
    return None
  start = attrs.index("{", i)
  depth = 0
  for j in range(start, len(attrs)):
    depth += {"{": 1, "}": -1}.get(attrs[j], 0)
    if depth == 0:
      return json.loads(attrs[start:j + 1])
  return None
