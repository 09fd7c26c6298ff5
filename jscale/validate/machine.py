"""`check_runtime`: what a config needs of this machine (its backend, the tokenizer, the
checkpoint to initialise from); the trainer runs it before building anything."""

from __future__ import annotations

import jax

from jscale import hardware
from jscale.ckpt import init_from
from jscale.config import Config, ConfigError
from jscale.data import tokenizer_vocab_size
from jscale.validate.kernels import check_backend


def check_runtime(cfg: Config) -> None:
  """Checks that need this machine (backend, files); raises ConfigError before any compile."""
  check_backend(cfg, jax.default_backend())
  check_schedule_costs(cfg, jax.devices()[0])
  if cfg.checkpoint.init_from:  # first: its tokenizer rule names the right fix there
    init_from.check(cfg)  # shape keys, stored parameter shapes, the tokenizer rule
  vocab = tokenizer_vocab_size(cfg.data)
  if vocab > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                      f"vocabulary ({vocab}, data.tokenizer={cfg.data.tokenizer}): raise it")


def check_schedule_costs(cfg: Config, device) -> None:
  """parallel.schedule_costs=predicted: GPUs the predictor has rates for (it tells XLA:GPU's
  latency-hiding scheduler what each kernel costs there)."""
  if cfg.parallel.schedule_costs == "default":
    return
  kind = getattr(device, "device_kind", device.platform)
  if hardware.predictable_device(device) is None:
    raise ConfigError(f"parallel.schedule_costs={cfg.parallel.schedule_costs} tells XLA:GPU's "
                      f"scheduler the predicted kernel times of an H100 or H200; this device is "
                      f"{kind!r}: set parallel.schedule_costs=default")
