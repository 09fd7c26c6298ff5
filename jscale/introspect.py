"""Compile a train step without running it: compiled memory and HLO for tests and scripts."""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp

from jscale import runtime
from jscale.config import Config


def abstract_batch(cfg: Config) -> dict[str, jax.ShapeDtypeStruct]:
  b, l = cfg.train.batch_size, cfg.train.seq_len
  return {"tokens": jax.ShapeDtypeStruct((b, l), jnp.int32),
          "labels": jax.ShapeDtypeStruct((b, l), jnp.int32),
          "loss_mask": jax.ShapeDtypeStruct((b, l), jnp.float32)}


def compile_train_step(cfg: Config, devices: Sequence[jax.Device] | None = None
                       ) -> tuple[jax.stages.Compiled, dict[str, float]]:
  """Lowers and compiles one train step of `cfg`'s layout on `devices` (default: all), on
  abstract inputs (nothing is allocated or run); returns it with timings (s)."""
  rt = runtime.build(cfg, devices)
  step = rt.train_step()
  t0 = time.perf_counter()
  lowered = step.lower(rt.abstract_state(), abstract_batch(cfg))
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return compiled, {"lower_s": t1 - t0, "compile_s": t2 - t1}


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes from XLA's memory analysis."""
  m = compiled.memory_analysis()
  return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
          "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
