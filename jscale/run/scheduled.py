"""The train step as the trainer runs it: jitted, scheduled by XLA's own cost model; or, under
`parallel.schedule_costs: predicted`, compiled before the first step with the predicted
kernel times given to XLA:GPU's latency-hiding scheduler (`jscale.predict.schedule_costs`)."""

from __future__ import annotations

from typing import Callable

from jscale import mesh, predict, runtime
from jscale.analysis import introspect
from jscale.config import Config
from jscale.predict import schedule_costs


def train_step(cfg: Config, rt: runtime.Runtime, gpu: str | None = None) -> Callable:
  """`rt`'s train step as `parallel.schedule_costs` asks; `gpu`: whose predicted kernel times
  guide the schedule (default: the devices', `validate.machine.check_schedule_costs`)."""
  step = rt.train_step()
  if cfg.parallel.schedule_costs == "default":
    return step
  gpu = gpu or schedule_costs.gpu_of(rt.mesh.devices.flat[0])
  lowered = step.lower(rt.abstract_state(), introspect.abstract_batch(cfg))
  return schedule_costs.compile_guided(lambda options: lowered.compile(compiler_options=options),
                                       lambda compiled: compiled.as_text(), gpu,
                                       predict.routed_rows(cfg, rt.mesh.size),
                                       mesh.partition_devices(rt.mesh),
                                       predict.node_rows(cfg, rt.mesh.size))
