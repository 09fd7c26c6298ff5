"""Shared by the parity tests: a few training steps of a layout on fixed batches."""

import dataclasses
import functools

import jax
import numpy as np

from conftest import small_config
from jscale import runtime
from jscale.config import Config, MeshConfig, ParallelConfig, PipelineConfig

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


def doc_starts(rng, b: int, l: int, docs: int = 4) -> np.ndarray:
  """int32 [b, l]: each row cut into `docs` documents of random lengths (`data.document_mask`'s
  "doc_starts": the index of each token's document's first token)."""
  out = np.zeros((b, l), np.int32)
  for row in out:
    for cut in np.sort(rng.choice(np.arange(1, l), docs - 1, replace=False)):
      row[cut:] = cut
  return out


def batches(cfg, reorder=None, steps: int = STEPS):
  rng = np.random.default_rng(0)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  out = []
  for _ in range(steps):
    t = rng.integers(0, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
    mask = np.ones((b, l), np.float32)
    mask[0, l // 2:] = 0.0
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}
    if cfg.data.document_mask:
      batch["doc_starts"] = doc_starts(rng, b, l)
    out.append(reorder(batch) if reorder else batch)
  return out


def losses(overrides, devices=None, steps: int = STEPS) -> np.ndarray:
  """[steps, 2]: loss and gradient norm of each step, from one device's initial state placed
  in the layout (`initial_state`)."""
  return run(overrides, devices, steps)[0]


def run(overrides, devices=None, steps: int = STEPS
        ) -> tuple[np.ndarray, jax.stages.Lowered, jax.stages.Compiled]:
  """(`losses`, the step lowered, the step compiled): the tests that check a program's HLO and
  its numbers share its one compile."""
  cfg = small_config(None, *BASE, *overrides)
  rt = runtime.build(cfg, devices)
  state = initial_state(rt)
  placed = [jax.device_put(b, rt.layouts.batch()) for b in batches(cfg, rt.reorder(), steps)]
  lowered = rt.train_step().lower(state, placed[0])
  step = lowered.compile()
  out = []
  for b in placed:
    state, m = step(state, b)
    out.append((float(m["loss"]), float(m["grad_norm"])))
  return np.array(out), lowered, step


@functools.lru_cache(maxsize=None)
def reference(*numerics) -> np.ndarray:
  """The single-device run with the same numerics (micro-batches, remat); computed once per
  process for each (the tests of a file share it: they run in one worker)."""
  return losses(("mesh.data=1", *numerics), jax.devices()[:1])


def one_device(cfg: Config) -> Config:
  """`cfg` on one device: the mesh, parallelism and pipeline at their defaults (what the
  initial state's values do not depend on)."""
  return dataclasses.replace(cfg, mesh=MeshConfig(data=1), parallel=ParallelConfig(),
                             pipeline=PipelineConfig())


_HOST_INITS: dict[str, dict] = {}  # one device's initial state (numpy) by its config's repr


def _host_init(cfg: Config) -> dict:
  key = repr(cfg)  # (Config is not hashable)
  if key not in _HOST_INITS:
    state = runtime.build(cfg, jax.devices()[:1]).init_state()
    _HOST_INITS[key] = jax.tree.map(np.array, jax.device_get(state))
  return _HOST_INITS[key]


def initial_state(rt: runtime.Runtime):
  """`rt.init_state()`'s values without compiling `rt`'s init: one device's initial state (an
  init compiled once per model, numerics and seed) in `rt`'s layer order and shardings.
  Every layout's init equals one device's (`tests/parallel/test_parallel_xla.py` checks it); compiles
  dominate the parity tests, and the sharded init was a third of each."""
  host = _host_init(one_device(rt.cfg))
  placed = {**host, "params": rt.params_to_storage(host["params"])}
  if "dot_state" in host:
    placed["dot_state"] = rt.params_to_storage(host["dot_state"])
  want = jax.tree.map(lambda x: (x.shape, x.dtype), rt.state_shapes)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), placed) == want, "state layouts differ"
  return jax.tree.map(jax.device_put, placed, rt.state_shardings)
