"""Compile a train step without running it: compiled memory and HLO for tests and scripts."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jscale import runtime, xla_flags
from jscale.analysis import compiler_log, gpu_target
from jscale.config import Config
from jscale.config_load import load_config
from jscale.metrics import param_counts


def abstract_batch(cfg: Config) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes of one global batch (with `positions` under context parallelism, `doc_starts`
  with `data.document_mask`)."""
  b, l = cfg.train.batch_size, cfg.train.seq_len
  out = {"tokens": jax.ShapeDtypeStruct((b, l), jnp.int32),
         "labels": jax.ShapeDtypeStruct((b, l), jnp.int32),
         "loss_mask": jax.ShapeDtypeStruct((b, l), jnp.float32)}
  if cfg.mesh.sequence * cfg.mesh.dcn_sequence != 1:  # the context split, across nodes too
    out["positions"] = jax.ShapeDtypeStruct((b, l), jnp.int32)
  if cfg.data.document_mask:
    out["doc_starts"] = jax.ShapeDtypeStruct((b, l), jnp.int32)
  return out


def compile_train_step(cfg: Config, devices: Sequence[jax.Device] | None = None,
                       gpu_options: dict[str, bool | int | str] | None = None
                       ) -> tuple[jax.stages.Compiled, dict[str, float]]:
  """Lowers and compiles one train step of `cfg`'s layout on `devices` (default: all), on
  abstract inputs (nothing is allocated or run); returns it with what the compile took (s:
  `lower_s`, `compile_s`) and, where XLA's remat pass warned that it could not get the step
  under the device memory, its figures (`remat_limit_bytes`, `remat_reached_bytes`:
  `compiler_log`). `gpu_options`: XLA options added to the launcher's for a GPU compile."""
  rt = runtime.build(cfg, devices)
  step = rt.train_step()
  t0 = time.perf_counter()
  with gpu_target.tracing_for(rt.mesh.devices.flat[0]):
    lowered = step.lower(rt.abstract_state(), abstract_batch(cfg))
  t1 = time.perf_counter()
  with compiler_log.remat_shortfalls() as short:
    compiled = compile_as_launched(lowered, rt, gpu_options)
  t2 = time.perf_counter()
  info: dict[str, float] = {"lower_s": t1 - t0, "compile_s": t2 - t1}
  if short:
    info.update(remat_limit_bytes=short[-1].limit_bytes,
                remat_reached_bytes=short[-1].reached_bytes)
  return compiled, info


def compile_as_launched(lowered: jax.stages.Lowered, rt: runtime.Runtime,
                        gpu_options: dict[str, bool | int | str] | None = None
                        ) -> jax.stages.Compiled:
  """Compiles `rt`'s lowered step as `python -m jscale.train` would: for GPUs with the overlap
  flags it runs with (they change the program's schedule and buffers), whatever this process's
  XLA_FLAGS, and the device memory its allocator gives XLA to plan for (which decides what
  XLA rematerialises); plus `gpu_options` there."""
  device = rt.mesh.devices.flat[0]
  if device.platform != "gpu":
    return lowered.compile()
  with gpu_target.launched_memory(launched_limit(device)):
    return lowered.compile(compiler_options={**xla_flags.compiler_options(rt.cfg),
                                             **(gpu_options or {})})


def time_steps(step: Callable, state: Any, batch: Any, steps: int) -> tuple[float, float]:
  """(median seconds per step, loss of the first step) over `steps` runs after one warm-up
  run; the state is threaded through (donated buffers stay valid)."""
  times, first_loss = [], 0.0
  for i in range(steps + 1):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    if i == 0:  # the warm-up run: its loss, not its time (a single host read)
      first_loss = float(m["loss"])
    else:
      times.append(time.perf_counter() - t0)
  return statistics.median(times), first_loss


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes from XLA's memory analysis."""
  m = compiled.memory_analysis()
  return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
          "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}


def device_bytes(mem: dict[str, int]) -> int:
  """What one device holds for the step (`memory`'s figures): its arguments, temporaries and
  outputs, less the outputs that reuse donated arguments."""
  return mem["argument"] + mem["temp"] + mem["output"] - mem["alias"]


def launched_limit(device: jax.Device) -> int | None:
  """The bytes XLA may plan for on a GPU of `gpu_target` as `python -m jscale.train` launches
  it (its allocator's share, `xla_flags.MEM_FRACTION`); None for other devices. A step that
  needs more did not fit: XLA's remat pass warned that it could not get under this."""
  total = gpu_target.memory_bytes(device)
  return int(total * float(xla_flags.MEM_FRACTION)) if total else None


def zero_formula_bytes(n_params: int, zero_stage: int, n_shards: int, param_bytes: int = 4,
                       grad_bytes: int = 4, opt_bytes: int = 8) -> dict[str, float]:
  """Per-device model-state bytes by the playbook's ZeRO formulas (activations excluded).

  Stage 1 divides the optimizer state by the fsdp degree, 2 also the gradients, 3 also the
  parameters. The defaults are jscale's layout: fp32 master weights used directly (no separate
  bf16 copy), fp32 gradients, Adam's two fp32 moments (k = 8; the playbook's mixed-precision
  2Ψ + 2Ψ + 12Ψ has the same stage-0 total).
  """
  div = lambda on: n_shards if on else 1
  parts = {"params": n_params * param_bytes / div(zero_stage >= 3),
           "grads": n_params * grad_bytes / div(zero_stage >= 2),
           "optimizer": n_params * opt_bytes / div(zero_stage >= 1)}
  return {**parts, "total": sum(parts.values())}


# Deep and narrow with full remat: model state dominates activations, and one layer is a small
# part of the model (ZeRO-3 holds one gathered layer, ZeRO-1/2 gather updates a layer at a time).
ZERO_SHAPE = ("model.preset=tiny", "model.d_model=128", "model.n_layers=64", "model.n_heads=4",
              "model.n_kv_heads=4", "model.d_ff=1024", "model.dtype=float32", "train.remat=full",
              "train.batch_size=8", "train.seq_len=8", "mesh.data=1")


def zero_memory_rows(fsdp: int, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
  """Per ZeRO stage 0-3 at `fsdp` devices: formula parts (f_*), compiled memory, measured
  per-device bytes (arguments + temps + non-aliased outputs) and measured / formula."""
  rows = []
  for stage in range(4):
    cfg = load_config(None, [*ZERO_SHAPE, *overrides, f"mesh.fsdp={fsdp}",
                             f"parallel.zero_stage={stage}"])
    compiled, _ = compile_train_step(cfg, jax.devices()[:fsdp])
    mem = memory(compiled)
    formula = zero_formula_bytes(param_counts(cfg.model)["total"], stage, fsdp)
    measured = device_bytes(mem)
    rows.append({"stage": stage, **{f"f_{k}": v for k, v in formula.items()}, **mem,
                 "measured": measured, "ratio": measured / formula["total"]})
  return rows
