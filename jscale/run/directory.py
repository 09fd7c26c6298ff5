"""An output directory's lifecycle: start a new run, resume one, or refuse — decided before
anything compiles.

`plan(cfg)` looks at the checkpoints already there and the config saved with the latest one
(`meta/` in each checkpoint, `run.json` for older runs):

- none: `starting a new run in <dir>`;
- some, `checkpoint.resume=true`: `resuming <dir> from step N`, unless the config changes the
  model, the optimizer state's shapes or the data stream (`FIXED`): then a ConfigError lists
  every differing key with both values and the ways out. Other changes (steps, logging, eval,
  the mesh layout, learning-rate settings) are allowed and listed;
- some, `checkpoint.resume=false`: refused unless `checkpoint.overwrite=true`, which moves the
  earlier run aside (`prepare`) to `<output_dir>/replaced-<time>/`; nothing is deleted. An
  earlier run's metrics without checkpoints (checkpoint.every=0) are moved aside the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from importlib import metadata as importlib_metadata
from typing import Any

from jscale import config as config_lib
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.config import Config, ConfigError

# Key prefixes whose change gives another model, optimizer state or data stream than the
# checkpoint holds: resuming with any of them changed is refused.
FIXED = ("model.", "fp8.", "data.", "train.batch_size", "train.seq_len",
         "pipeline.virtual_stages")
# ... except these: how the same model is computed, training-loss weights, bookkeeping.
FREE = ("model.preset", "model.attention_impl", "model.norm_impl", "model.kernel_interpret",
        "model.moe.gemm", "model.moe.dispatch", "model.moe.capacity_factor",
        "model.moe.aux_loss_weight", "model.moe.z_loss_weight", "model.dtype", "model.max_seq_len",
        "data.cache_dir")
# The run's products an overwrite moves aside (beside the checkpoints).
_PRODUCTS = ("metrics.jsonl", "metrics.png", "tensorboard", "run.json", "profile")


@dataclasses.dataclass
class Plan:
  """What this start does: `step` is the checkpoint to resume (None: a new run)."""
  output_dir: str
  step: int | None
  changed: list[tuple[str, Any, Any]]  # allowed differences from the saved config
  replace: bool = False  # move an earlier run aside first (checkpoint.overwrite)

  def line(self) -> str:
    """The first line the run prints."""
    if self.step is None:
      return f"starting a new run in {self.output_dir}"
    return f"resuming {self.output_dir} from step {self.step}"


def metadata(cfg: Config, argv: list[str] | None = None) -> dict[str, Any]:
  """What each checkpoint (and run.json) records of the run: the resolved config, the jscale
  version, the command line."""
  if argv is None:  # as typed: `python -m jscale.train ...`, not the module's file path
    argv = [os.path.basename(sys.executable), *getattr(sys, "orig_argv", sys.argv)[1:]]
  return {"config": config_lib.to_dict(cfg), "jscale": version(),
          "command": " ".join(shlex.quote(a) for a in argv)}


def version() -> str:
  try:
    return importlib_metadata.version("jscale")
  except importlib_metadata.PackageNotFoundError:
    return "unknown (not installed)"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"model": {"moe": {"top_k": 2}}} -> {"model.moe.top_k": 2}; None sections stay one key."""
  out: dict[str, Any] = {}
  for k, v in d.items():
    if isinstance(v, dict) and v and k != "rules":
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def diff(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  """Every dotted key whose value differs: (key, saved value, current value), sorted."""
  a, b = flatten(saved), flatten(now)
  missing = object()
  out = []
  for key in sorted(set(a) | set(b)):
    va, vb = a.get(key, missing), b.get(key, missing)
    if va != vb:
      out.append((key, None if va is missing else va, None if vb is missing else vb))
  return out


def is_fixed(key: str) -> bool:
  """Whether a change of `key` is refused on resume."""
  free = any(key == f or key.startswith(f + ".") for f in FREE)
  return not free and any(key.startswith(p) or key == p for p in FIXED)


def saved_config(cfg: Config, step: int) -> dict[str, Any] | None:
  """The config the checkpoint at `step` was written with (its meta, else run.json)."""
  meta = ckpt_lib.read_meta(ckpt_lib.checkpoint_dir(cfg), step)
  if meta is None:
    try:
      with open(os.path.join(cfg.train.output_dir, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    except (OSError, ValueError):
      return None
  return meta.get("config")


def plan(cfg: Config) -> Plan:
  """Decides new run / resume / refusal for `cfg` (reads files only; no JAX)."""
  out = os.path.abspath(cfg.train.output_dir)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"train.output_dir={cfg.train.output_dir} is a file: give a directory "
                      "(created if missing)")
  directory = ckpt_lib.checkpoint_dir(cfg)
  steps = ckpt_lib.complete_steps(directory)
  if not steps:  # an earlier run without checkpoints left its metrics: keep them, aside
    return Plan(out, None, [], replace=any(os.path.exists(os.path.join(out, name))
                                           for name in _PRODUCTS))
  latest = steps[-1]
  if not cfg.checkpoint.resume:
    if cfg.checkpoint.overwrite:
      return Plan(out, None, [], replace=True)
    raise ConfigError(
        f"checkpoint.resume=false, but {directory} holds an earlier run's checkpoints (up to "
        f"step {latest}). Train it on: drop checkpoint.resume=false; start a separate run: "
        f"train.output_dir=<new dir>; replace it: checkpoint.overwrite=true (it is moved to "
        f"{out}/replaced-<time>/, not deleted)")
  saved = saved_config(cfg, latest)
  if saved is None:
    return Plan(out, latest, [])
  now = config_lib.to_dict(cfg)
  for d in (saved, now):  # where the run lives and how it starts: never compared
    for section, key in (("train", "output_dir"), ("checkpoint", "dir"),
                         ("checkpoint", "resume"), ("checkpoint", "overwrite")):
      d.get(section, {}).pop(key, None)
  known = flatten(saved)  # keys a newer jscale added are not differences
  changes = [c for c in diff(saved, now) if c[0] in known]
  fp8_off = not flatten(saved).get("fp8.enabled", False) and not cfg.fp8.enabled
  fixed = [c for c in changes if (is_fixed(c[0]) and not (fp8_off and c[0].startswith("fp8.")))
           # interleaved pipelines store layers in chunk order, which depends on the stages
           or (c[0] == "mesh.stage" and flatten(saved).get("pipeline.virtual_stages", 1) > 1)]
  if fixed:
    lines = "\n".join(f"  {k}: {_show(a)} in the checkpoint, {_show(b)} now" for k, a, b in fixed)
    raise ConfigError(
        f"{out} holds a run (checkpoint step {latest}) whose model, optimizer state or data "
        f"differ from this config:\n{lines}\nTo train it on, use its values (see "
        f"{out}/run.json). For a new run: train.output_dir=<new dir>, or "
        f"checkpoint.resume=false checkpoint.overwrite=true to move this one to "
        f"{out}/replaced-<time>/.")
  return Plan(out, latest, changes)


def _show(v: Any) -> str:
  return "(absent)" if v is None else json.dumps(v)


def changed_lines(p: Plan) -> list[str]:
  """The allowed changes, one line each, for the start of the log."""
  return [f"  changed since the checkpoint: {k} {_show(a)} -> {_show(b)}" for k, a, b in p.changed]


def prepare(cfg: Config, p: Plan) -> str | None:
  """Process 0, before the run starts: with `p.replace`, moves the earlier run's checkpoints
  and products into `<output_dir>/replaced-<time>/` (renames: atomic, nothing deleted);
  returns that directory."""
  if not p.replace:
    return None
  stamp = time.strftime('%Y%m%d-%H%M%S')
  target = os.path.join(p.output_dir, f"replaced-{stamp}")
  os.makedirs(target)
  directory = ckpt_lib.checkpoint_dir(cfg)
  if os.path.isdir(directory):  # a checkpoint.dir elsewhere is renamed in place (same disk)
    inside = os.path.dirname(directory) == p.output_dir
    os.replace(directory, os.path.join(target, os.path.basename(directory)) if inside
               else f"{directory}.replaced-{stamp}")
  for name in _PRODUCTS:
    path = os.path.join(p.output_dir, name)
    if os.path.exists(path):
      os.replace(path, os.path.join(target, name))
  return target
