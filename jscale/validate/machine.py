"""`check_runtime`: what a config needs of this machine (its backend, the tokenizer, the
checkpoint to initialise from); the trainer runs it before building anything."""

from __future__ import annotations

import jax

from jscale.ckpt import init_from
from jscale.config import Config, ConfigError
from jscale.data import tokenizer_vocab_size
from jscale.validate.kernels import check_backend


def check_runtime(cfg: Config) -> None:
  """Checks that need this machine (backend, files); raises ConfigError before any compile."""
  check_backend(cfg, jax.default_backend())
  if cfg.checkpoint.init_from:  # first: its tokenizer rule names the right fix there
    init_from.check(cfg)  # shape keys, stored parameter shapes, the tokenizer rule
  vocab = tokenizer_vocab_size(cfg.data)
  if vocab > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                      f"vocabulary ({vocab}, data.tokenizer={cfg.data.tokenizer}): raise it")
