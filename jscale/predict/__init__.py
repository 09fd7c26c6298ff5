"""Step time of a compiled XLA:GPU train step, predicted on any machine, kernel by kernel.

`predict(hlo_text, "h100")` walks the optimised program (`program`), times each launch
(`cost`, with the measured rates and fitted constants of `rates`) and runs the schedule;
`predict_config(cfg, "h100x8")` compiles a config's step as `python -m jscale.train` launches
it and summarises the prediction (`report`); `python -m jscale.predict` prints it. Checked
against every measured GPU row: results/predict_vs_measured.md.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jscale import mesh, metrics
from jscale.analysis import compiler_log, gpu_target, introspect
from jscale.config import Config
from jscale.parallel import expert_exchange
from jscale.predict import launches, loops, rates, schedule_costs, summary, timing
from jscale.step import pipelined


def predict(hlo_text: str, gpu: str, fit: rates.Fit = rates.FIT,
            routed_rows: int | None = None, ticks: np.ndarray | None = None,
            devices: Sequence[int] | None = None,
            node_rows: tuple[int, int] | None = None) -> timing.Schedule:
  """The predicted schedule of one step of `hlo_text` (`compiled.as_text()`) on `gpu`;
  `routed_rows`: the rows each grouped matmul computes (`launches.Program`); `ticks`: a
  pipelined step's executed ticks (`pipeline_ticks`); `devices`: the device each partition
  runs on (`partition_devices`; None: partition i on device i); `node_rows`: the
  node-limited exchange's first hop (`node_rows`)."""
  items = launches.Program(hlo_text, routed_rows, devices, node_rows).items()
  chip = rates.chip(gpu, fit)
  s = timing.schedule(items, chip, ticks)
  s.loops, s.loop_ceiling_s = loops.loop_times(s, items, chip), loops.ceiling_s(items, s, chip)
  return s


def pipeline_ticks(cfg: Config, n_devices: int) -> np.ndarray | None:
  """The switch branch each stage runs per executed tick of `cfg`'s pipeline
  (`pipeline.program.Program.code`, [T, p]); None when the layers are not pipelined."""
  ici, dcn = mesh.axis_sizes(cfg.mesh, n_devices)["stage"]
  if ici * dcn == 1:
    return None
  return pipelined.program_for(cfg.pipeline, ici * dcn).code


def partition_devices(cfg: Config, devices: Sequence[jax.Device]) -> tuple[int, ...]:
  """The device each partition of `cfg`'s step on `devices` runs on: its mesh's device
  assignment (`mesh.partition_devices`), which tells the nodes a collective's group spans."""
  return mesh.partition_devices(mesh.make_mesh(cfg.mesh, devices))


def routed_rows(cfg: Config, n_devices: int) -> int | None:
  """The expert rows one device's grouped matmuls compute per call with balanced routing: its
  routed tokens per exchange slice times top_k (None without MoE)."""
  moe = cfg.model.moe
  if moe is None:
    return None
  return _tokens_per_exchange(cfg, n_devices) * moe.top_k


def _tokens_per_exchange(cfg: Config, n_devices: int) -> int:
  """The tokens one device routes per exchange call: its routed tokens per exchange slice."""
  sizes = {a: ici * dcn for a, (ici, dcn) in mesh.axis_sizes(cfg.mesh, n_devices).items()}
  return metrics.routed_tokens(cfg, sizes) // cfg.parallel.expert_chunks


def node_rows(cfg: Config, n_devices: int) -> tuple[int, int] | None:
  """(the rows of the node-limited exchange's first-hop blocks, the rows that hop carries per
  call with balanced routing: a copy per routed token and chosen group), as `launches.Program`
  tells that hop's all-to-alls apart; None without it (`model.moe.exchange`)."""
  moe = cfg.model.moe
  if moe is None or moe.exchange != "node_limited":
    return None
  t = _tokens_per_exchange(cfg, n_devices)
  blocks = moe.n_group * expert_exchange.node_rows(t, moe.topk_group, moe.n_group,
                                                   moe.receive_factor)
  return blocks, t * moe.topk_group


def model_flops_per_device(cfg: Config, n_devices: int) -> float:
  """The trainer's model FLOPs of one step (`metrics.flops_per_token`), per device."""
  t = cfg.train
  return metrics.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len / n_devices


# On a GPU the autotuner picks cuBLAS for most gemms (the measured profiles' kernels are
# nvjet / xmma); compiled without one, XLA keeps its own Triton gemm fusions, whose untuned
# tiles and fused converts change the program around the gemms. Predicted against every
# measured row, the cuBLAS program is the closer (results/predict_vs_measured.md).
AUTOTUNED_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def compile_train_step(cfg: Config, devices: Sequence[jax.Device]
                       ) -> tuple[jax.stages.Compiled, dict[str, float]]:
  """`introspect.compile_train_step` of `cfg` on `devices` with, for GPUs, the gemms their
  autotuner would mostly pick; under parallel.schedule_costs=predicted, compiled again with
  the first program's predicted kernel costs (`schedule_costs`), as the trainer does."""

  def compile_with(options):
    return introspect.compile_train_step(cfg, devices, {**AUTOTUNED_GEMMS, **options})

  if cfg.parallel.schedule_costs == "default":
    return compile_with({})
  return schedule_costs.compile_guided(
      compile_with, lambda c: c[0].as_text(), schedule_costs.gpu_of(devices[0]),
      routed_rows(cfg, len(devices)), partition_devices(cfg, devices),
      node_rows(cfg, len(devices)))


def compile_for(cfg: Config, target: str
                ) -> tuple[str, int, compiler_log.RematShortfall | None]:
  """(optimised HLO text, per-device bytes, the remat pass's shortfall if it warned) of `cfg`'s
  train step compiled for `target` ("h100x8") as `python -m jscale.train` launches it
  (`compile_train_step`)."""
  compiled, info = compile_train_step(cfg, gpu_target.devices(target))
  text = compiled.as_text()
  if text is None:
    raise RuntimeError(f"XLA gave no HLO text for the step compiled for {target}")
  remat = compiler_log.of_compile(info)
  return text, introspect.device_bytes(introspect.memory(compiled)), remat


def compile_step(cfg: Config, target: str) -> str:
  """The optimised HLO text of `compile_for`."""
  return compile_for(cfg, target)[0]


def predict_config(cfg: Config, target: str, hlo_text: str | None = None, top: int = 20,
                   fit: rates.Fit = rates.FIT, memory_bytes: int | None = None,
                   remat: compiler_log.RematShortfall | None = None) -> summary.Summary:
  """`cfg`'s train step compiled for `target` ("h100x8", `compile_for`) — or `hlo_text`, that
  step compiled already, holding `memory_bytes` per device and drawing the remat warning
  `remat` if known — predicted and summarised, with whether it fits the target's memory."""
  gpu, n = gpu_target.parse(target)
  if hlo_text is None:
    hlo_text, memory_bytes, remat = compile_for(cfg, target)
  r = summary.summarize(predict(hlo_text, gpu, fit, routed_rows(cfg, n), pipeline_ticks(cfg, n),
                                partition_devices(cfg, gpu_target.devices(target)),
                                node_rows(cfg, n)),
                        rates.chip(gpu, fit),
                        model_flops_per_device(cfg, n),
                        cfg.train.batch_size * cfg.train.seq_len, top)
  r.memory_bytes = memory_bytes
  r.memory_limit = introspect.launched_limit(gpu_target.devices(f"{gpu}x1")[0])
  if remat is not None:
    r.remat_limit_bytes, r.remat_reached_bytes = remat.limit_bytes, remat.reached_bytes
  return r
