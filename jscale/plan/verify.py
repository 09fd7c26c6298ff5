"""The planner's estimate beside the compiled program: AOT-compile a layout's real train step on
abstract inputs (nothing is allocated) and read XLA's memory analysis and collectives.

Two compilers (`python -m jscale.plan --verify N [--target h100xN]`):
- XLA:GPU for a topology of GPUs (`jscale.analysis.gpu_target`: JAX's CUDA plugin, no GPU
  needed): the buffers and collectives a GPU run would have. The model state is exact, the
  rest (gradients, activations, transients) within ~15% on llama3_1b layouts (README), the
  collectives as XLA:GPU emits them.
- XLA:CPU on simulated devices: the model state exactly and manual mode's hand-written
  collectives as written, but bf16 collectives run in fp32, there is no reduce-scatter or
  ragged all-to-all, and its temporaries are unfused (attention scores materialised).
Collectives inside a `conditional` count every branch (an upper bound): the pipeline's tick
branches under tensor parallelism overcount (`jscale.analysis.hlo`). For a GPU target the
compiled program's step time and MFU (`jscale.predict`) stand beside the planner's estimate.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax

from jscale import hardware, predict
from jscale.analysis import compiler_log, hlo, introspect, volume
from jscale.config_load import load_config
from jscale.plan.rank import Row
from jscale.predict import summary


def _config(model_spec: str, model_overrides: Sequence[str], row: Row, seq: int,
            gpu: hardware.Gpu, collectives: str = "xla", schedule_costs: str = "default",
            scan_layers: bool = True):
  lay = row.layout
  run = [o for o in lay.overrides(seq, gpu.gpus_per_node) if ".dcn_" not in o]
  # One simulated host: each axis gets its full size inside it.
  run = [o for o in run if not o.startswith("mesh.")] + [f"mesh.{a}={lay.size(a)}" for a in
                                                         ("data", "stage", "fsdp", "expert",
                                                          "sequence", "tensor")]
  base = [] if os.path.isfile(model_spec) else [f"model.preset={model_spec}"]
  return load_config(model_spec if os.path.isfile(model_spec) else None,
                     [*base, *model_overrides, f"model.scan_layers={scan_layers}", *run,
                      "checkpoint.every=0",
                      f"parallel.collectives={collectives}",
                      f"parallel.schedule_costs={schedule_costs}"])


def compare(model_spec: str, model_overrides: Sequence[str], row: Row, seq: int,
            gpu: hardware.Gpu, devices: Sequence[jax.Device] | None = None,
            collectives: str = "xla", schedule_costs: str = "default",
            scan_layers: bool = True) -> dict:
  """Estimate vs compiled, per device: model state (params + optimizer: the step's arguments
  less the batch), the rest (gradients, activations, workspace vs XLA's temporaries), and the
  communication volume by collective kind, compiled in `collectives` mode (manual: the
  collectives jscale writes by hand, which XLA:CPU keeps as written), and for GPUs scheduled
  with `schedule_costs` (`parallel.schedule_costs`), its layers in a loop or unrolled
  (`model.scan_layers`)."""
  cfg = _config(model_spec, model_overrides, row, seq, gpu, collectives, schedule_costs,
                scan_layers)
  devices = list(devices or jax.devices())[:row.layout.devices]
  # On GPUs, the gemms as the autotuner picks them (`predict.AUTOTUNED_GEMMS`): the program
  # whose time and memory came closest to the measured ones.
  compiled, info = predict.compile_train_step(cfg, devices)
  mem = introspect.memory(compiled)
  batch = sum(x.size * x.dtype.itemsize for x in introspect.abstract_batch(cfg).values())
  batch //= row.layout.batch_ways  # each device holds its share of the batch
  state = mem["argument"] - batch
  est = row.memory
  text = compiled.as_text()
  measured_volume = volume.hlo_volume(hlo.collectives(text))
  predicted_volume = sum(t.bytes for t in row.cost.transfers)
  timing = {"step_estimate": row.cost.step_s, "mfu_estimate": row.cost.mfu}
  if devices[0].platform == "gpu":  # XLA:GPU's program: its time, kernel by kernel
    remat = compiler_log.of_compile(info)
    p = predict.predict_config(cfg, f"{gpu.name}x{len(devices)}", text,
                               memory_bytes=introspect.device_bytes(mem), remat=remat)
    # a program whose buffers do not fit ranks after every one that does (--rank compiled)
    timing.update(step_compiled=p.step_s, mfu_compiled=p.mfu,
                  exposed_compiled=p.exposed_collectives_s, fits_compiled=bool(p.fits),
                  by_category_compiled=p.by_category,
                  memory_lines=summary.memory_lines(p))
  how = (collectives + ("" if scan_layers else ", unrolled") +
         (", predicted costs" if schedule_costs == "predicted" else ""))
  return {"layout": row.layout.describe() + f" ({how})", **timing,
          "state_estimate": est.params + est.optimizer, "state_compiled": state,
          "rest_estimate": est.grads + est.activations + est.workspace + est.exchange,
          "rest_compiled": mem["temp"] + mem["output"] - mem["alias"],
          "volume_estimate": predicted_volume, "volume_compiled": measured_volume["total"],
          "volume_by_kind": {k: v for k, v in measured_volume.items() if k != "total"},
          "platform": f"{len(devices)} x {devices[0].device_kind}"}


def describe(r: dict) -> str:
  """One verification as lines: estimate, compiled, ratio."""
  line = lambda name, e, c: (f"  {name:<44} estimate {e / 2**20:10.2f} MiB   compiled "
                             f"{c / 2**20:10.2f} MiB   ratio {c / e if e else float('nan'):.3f}")
  step = (f"  {'step time':<44} estimate {r['step_estimate'] * 1e3:10.1f} ms    MFU "
          f"{r['mfu_estimate']:.1%}")
  if "step_compiled" in r:  # `jscale.predict` on the compiled program
    step += (f"   compiled {r['step_compiled'] * 1e3:.1f} ms, MFU {r['mfu_compiled']:.1%} "
             f"(exposed collectives {r['exposed_compiled'] * 1e3:.1f} ms)")
    step += "".join(f"\n  {line}" for line in r["memory_lines"])
  return "\n".join([
      f"verify {r['layout']} (compiled for {r['platform']}):",
      line("model state (params + optimizer)", r["state_estimate"], r["state_compiled"]),
      line("grads + activations + workspace vs temps", r["rest_estimate"], r["rest_compiled"]),
      line("communication volume per step", r["volume_estimate"], r["volume_compiled"]),
      "  compiled collectives: " + ", ".join(f"{k} {v / 2**20:.2f} MiB"
                                             for k, v in r["volume_by_kind"].items()), step])
