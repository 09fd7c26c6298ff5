"""Shared by the parity tests: a few training steps of a layout on fixed batches."""

import functools

import jax
import numpy as np

from conftest import small_config
from jscale import runtime

STEPS = 5
# kv_heads=4 so tensor=4 divides it; batch 16 = data x fsdp x microbatches for every case.
BASE = ("model.n_kv_heads=4", "train.batch_size=16", "train.warmup_steps=0")

# The layouts of the XLA-sharded issue, each run in both collective modes.
LAYOUTS = [
    ("mesh.data=8",),
    ("mesh.fsdp=8", "mesh.data=1", "parallel.zero_stage=1"),
    ("mesh.fsdp=8", "mesh.data=1", "parallel.zero_stage=2"),
    ("mesh.fsdp=8", "mesh.data=1", "parallel.zero_stage=3"),
    ("mesh.tensor=4", "mesh.data=2"),
    ("mesh.tensor=4", "mesh.data=2", "parallel.sequence_parallel=true"),
    ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
     "parallel.zero_stage=3"),
]
ACCUMULATE = [("train.microbatches=2", "train.remat=full"),
              ("train.microbatches=2", "train.remat=selective")]


def batches(cfg, reorder=None, steps: int = STEPS):
  rng = np.random.default_rng(0)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  out = []
  for _ in range(steps):
    t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
    mask = np.ones((b, l), np.float32)
    mask[0, l // 2:] = 0.0
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}
    out.append(reorder(batch) if reorder else batch)
  return out


def losses(overrides, devices=None, steps: int = STEPS) -> np.ndarray:
  """[steps, 2]: loss and gradient norm of each step."""
  cfg = small_config(None, *BASE, *overrides)
  rt = runtime.build(cfg, devices)
  state, step = rt.init_state(), rt.train_step()
  out = []
  for b in batches(cfg, rt.reorder(), steps):
    state, m = step(state, jax.device_put(b, rt.layouts.batch()))
    out.append((float(m["loss"]), float(m["grad_norm"])))
  return np.array(out)


@functools.lru_cache(maxsize=None)
def reference(*numerics) -> np.ndarray:
  """The single-device run with the same numerics (micro-batches, remat)."""
  return losses(("mesh.data=1", *numerics), jax.devices()[:1])
