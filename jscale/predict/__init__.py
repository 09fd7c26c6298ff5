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
from jscale.predict import cost, program, rates, report


def predict(hlo_text: str, gpu: str, fit: rates.Fit = rates.FIT) -> cost.Schedule:
  """The predicted schedule of one step of `hlo_text` (`compiled.as_text()`) on `gpu`."""
  return cost.schedule(program.Program(hlo_text).items(), rates.chip(gpu, fit))


def model_flops_per_device(cfg: Config, n_devices: int) -> float:
  """The trainer's model FLOPs of one step (`metrics.flops_per_token`), per device."""
  t = cfg.train
  return metrics.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len / n_devices


def predict_config(cfg: Config, target: str, hlo_text: str | None = None, top: int = 20,
                   fit: rates.Fit = rates.FIT) -> report.Summary:
  """`cfg`'s train step compiled for `target` ("h100x8") — or `hlo_text`, that step compiled
  already — predicted and summarised."""
  gpu, n = gpu_target.parse(target)
  if hlo_text is None:
    compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices(target))
    hlo_text = compiled.as_text()
  return report.summarize(predict(hlo_text, gpu, fit), rates.chip(gpu, fit),
                          model_flops_per_device(cfg, n),
                          cfg.train.batch_size * cfg.train.seq_len, top)
