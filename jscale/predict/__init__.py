"""Step time of a compiled XLA:GPU train step, predicted on any machine, kernel by kernel.

`predict(hlo_text, "h100")` walks the optimised program (`program`), times each launch
(`cost`, with the measured rates and fitted constants of `rates`) and runs the schedule;
`predict_config(cfg, "h100x8")` compiles a config's step as `python -m jscale.train` launches
it and summarises the prediction (`report`); `python -m jscale.predict` prints it. Checked
against every measured GPU row: results/predict_vs_measured.md.
"""

from __future__ import annotations

from jscale import metrics
from jscale.analysis import gpu_target, introspect
from jscale.config import Config
from jscale.predict import launches, rates, summary, timing


def predict(hlo_text: str, gpu: str, fit: rates.Fit = rates.FIT) -> timing.Schedule:
  """The predicted schedule of one step of `hlo_text` (`compiled.as_text()`) on `gpu`."""
  return timing.schedule(launches.Program(hlo_text).items(), rates.chip(gpu, fit))


def model_flops_per_device(cfg: Config, n_devices: int) -> float:
  """The trainer's model FLOPs of one step (`metrics.flops_per_token`), per device."""
  t = cfg.train
  return metrics.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len / n_devices


# On a GPU the autotuner picks cuBLAS for most gemms (the measured profiles' kernels are
# nvjet / xmma); compiled without one, XLA keeps its own Triton gemm fusions, whose untuned
# tiles and fused converts change the program around the gemms. Predicted against every
# measured row, the cuBLAS program is the closer (results/predict_vs_measured.md).
AUTOTUNED_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def compile_step(cfg: Config, target: str) -> str:
  """The optimised HLO text of `cfg`'s train step compiled for `target` ("h100x8") as
  `python -m jscale.train` launches it, with the gemms the GPU's autotuner would mostly pick."""
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices(target), AUTOTUNED_GEMMS)
  text = compiled.as_text()
  if text is None:
    raise RuntimeError(f"XLA gave no HLO text for the step compiled for {target}")
  return text


def predict_config(cfg: Config, target: str, hlo_text: str | None = None, top: int = 20,
                   fit: rates.Fit = rates.FIT) -> summary.Summary:
  """`cfg`'s train step compiled for `target` ("h100x8", `compile_step`) — or `hlo_text`, that
  step compiled already — predicted and summarised."""
  gpu, n = gpu_target.parse(target)
  hlo_text = hlo_text if hlo_text is not None else compile_step(cfg, target)
  return summary.summarize(predict(hlo_text, gpu, fit), rates.chip(gpu, fit),
                          model_flops_per_device(cfg, n),
                          cfg.train.batch_size * cfg.train.seq_len, top)
