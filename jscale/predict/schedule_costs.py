"""XLA's latency-hiding scheduler told what each kernel of the step costs
(`parallel.schedule_costs: predicted`): the predictor's times as the profile XLA:GPU's
profile-guided latency estimator reads (`xla_gpu_pgle_profile_file_or_directory_path`).

Without a profile, XLA:GPU schedules with an approximate cost model in which every collective
takes the same long latency, and at most one is in flight. Each ZeRO-3 gather then starts at
the previous one's done, which the scheduler puts just before that gather's first use: the
link idles while the compute catches up, and the layer's gradient reduce-scatter, queued
behind, is waited for before the iteration ends. In Llama 3 70B's data2 × fsdp64 program for
128 H100s that waiting is 1.6 s of a 15.3 s step (predicted). Told the kernels' times, the
scheduler ends each collective where it finishes and starts the next there (predicted: 13.9 s,
0.2 s exposed). It can also be worse: the 7B fsdp8 pick on 8 H100s gains nothing and holds
more memory, so it is a choice, made per layout by the compiled prediction
(`scripts/peers_h100.py`).

The profile comes from the step compiled once without it; the step is then compiled again
with it. The costs are a function of the program text, so every process of a multi-host run
derives the same profile and the same schedule, which SPMD needs (every device must issue its
collectives in one order). JAX's auto-PGLE (`jax_enable_pgle`) is the measured counterpart: the
same profile from the first steps' GPU trace.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Callable, Sequence, TypeVar

from jscale import hardware
from jscale.predict import launches, rates, timing

# The XLA:GPU option naming the profile: a ProfiledInstructionsProto, here in text form.
OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# A launch the predictor times at zero still gets a cost: XLA falls back to its own estimate for
# instructions the profile lacks, in other units.
_FLOOR_US = 1e-3

T = TypeVar("T")


def _costs(items, chip: rates.Chip, out: dict[str, float]) -> None:
  for it in items:
    if isinstance(it, launches.Loop):
      _costs(it.body, chip, out)
    elif isinstance(it, launches.Branches):
      for branch in it.branches:
        _costs(branch, chip, out)
    elif it.kind != "done":  # an async pair's cost is its start's (XLA reads it so)
      out[it.name] = max(timing.time_launch(it, chip).seconds * 1e6, _FLOOR_US)


def costs_us(hlo_text: str, gpu: str, fit: rates.Fit = rates.FIT,
             routed_rows: int | None = None, devices: Sequence[int] | None = None,
             node_rows: tuple[int, int] | None = None) -> dict[str, float]:
  """Every launch of `hlo_text` (`compiled.as_text()`) by name -> its predicted microseconds
  on `gpu` (one run; an async collective under its -start's name); `routed_rows`, `devices`
  and `node_rows` as `launches.Program` takes them."""
  out: dict[str, float] = {}
  program = launches.Program(hlo_text, routed_rows, devices, node_rows)
  _costs(program.items(), rates.chip(gpu, fit), out)
  # Loops' conditions (a compare of the counter) are no launches the predictor times; named,
  # they keep XLA from warning that the profile lacks them.
  for cond in set(re.findall(r"\bcondition=%?([\w.\-]+)", hlo_text)):
    for name, *_ in program.comps.get(cond, ()):
      out.setdefault(name, _FLOOR_US)
  return out


def profile_text(costs: dict[str, float]) -> str:
  """`costs` as a ProfiledInstructionsProto in protobuf text format."""
  return "".join(f'costs {{ name: "{name}" cost_us: {us:.4f} }}\n'
                 for name, us in sorted(costs.items()))


def gpu_of(device) -> str:
  """The predictor's name for `device`'s GPU ("h100"); ValueError for a device it has no rates
  for (the trainer refuses such a run first: `validate.machine.check_schedule_costs`)."""
  gpu = hardware.predictable_device(device)
  if gpu is None:
    raise ValueError(f"parallel.schedule_costs=predicted schedules for an H100 or H200, not "
                     f"{getattr(device, 'device_kind', device.platform)!r}")
  return gpu


def compile_guided(compile_with: Callable[[dict], T], text_of: Callable[[T], str], gpu: str,
                   routed_rows: int | None = None, devices: Sequence[int] | None = None,
                   node_rows: tuple[int, int] | None = None) -> T:
  """The program `compile_with(options)` makes when XLA's scheduler is given the predicted
  costs (on `gpu`; `routed_rows`, `devices` and `node_rows` as `costs_us`) of the program
  `compile_with({})` makes; `text_of` reads a program's optimised HLO. The profile lives in a
  temporary file for the second compile."""
  first = compile_with({})
  text = profile_text(costs_us(text_of(first), gpu, routed_rows=routed_rows, devices=devices,
                               node_rows=node_rows))
  fd, path = tempfile.mkstemp(prefix="jscale_schedule_costs_", suffix=".pbtxt")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    return compile_with({OPTION: path})
  finally:
    os.remove(path)
