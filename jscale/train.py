"""`python -m jscale.train --config configs/tiny.yaml [section.key=value ...]`

Thin CLI over `run(cfg)`: validates the config against this machine before compiling, builds
the data iterator, initialises or restores the train state, and runs the loop with logging,
periodic eval, checkpoints and an optional profiler trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
from flax import nnx

from jscale import checkpoint as ckpt_lib
from jscale.parallel.pipeline import layout
from jscale import distributed
from jscale import init_from
from jscale import metrics as metrics_lib
from jscale import runtime
from jscale import startup
from jscale import train_step as ts
from jscale import validate
from jscale import xla_flags
from jscale import config as config_lib
from jscale.config import Config, ConfigError
from jscale.config_load import load_config
from jscale.data import load_splits, load_tokenizer, make_eval_batches, make_train_iterator
from jscale.infer import evaluate
from jscale.optim import make_optimizer

def write_run_info(cfg: Config, rt: runtime.Runtime, requested_attention: str) -> None:
  """`<output_dir>/run.json` (process 0): what this run resolved and runs on — the attention
  impl chosen (and why), devices, mesh, jax version — and the config it runs (written whole
  via a temporary file, so a reader never sees half of it)."""
  if not distributed.is_main():
    return
  device = rt.mesh.devices.flat[0]
  info = {"attention_impl": cfg.model.attention_impl,
          "attention_impl_requested": requested_attention, "attention_why": rt.attention_why,
          "backend": device.platform, "device_kind": getattr(device, "device_kind", ""),
          "devices": int(rt.mesh.size), "processes": jax.process_count(),
          "mesh": {k: int(v) for k, v in rt.mesh.shape.items()}, "jax": jax.__version__,
          "config": config_lib.to_dict(cfg)}
  if cfg.model.moe is not None:
    info["moe_gemm"], info["moe_gemm_why"] = runtime.moe_gemm(cfg, rt.mesh)
  os.makedirs(cfg.train.output_dir, exist_ok=True)
  path = os.path.join(cfg.train.output_dir, "run.json")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  os.replace(path + ".tmp", path)


def _initial_state(rt: runtime.Runtime, ckptr: ckpt_lib.Checkpointer,
                   train_iter) -> tuple[Any, int]:
  """Resumes from the latest checkpoint, else starts from init_from params or random init."""
  cfg = rt.cfg
  latest = ckptr.latest_step() if cfg.checkpoint.resume else None
  if latest is not None:
    return ckptr.restore(latest, rt.abstract_state(), train_iter), latest
  state = rt.init_state()
  if cfg.checkpoint.init_from:
    model = ts.merge(rt.graphdef, state["params"], state.get("dot_state"))
    init_from.load_into(cfg, model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # init_from params are in model layer order; interleaved pipelines store chunk order.
    params = layout.params_to_storage(params, cfg.model.n_layers, rt.mesh.shape["stage"],
                                      cfg.pipeline.virtual_stages)
    optimizer = make_optimizer(cfg.train)
    state = jax.jit(lambda p, d: ts.state_from_params(p, optimizer, cfg.train.seed, d),
                    out_shardings=rt.state_shardings)(params, state.get("dot_state"))
  return state, 0


def run(cfg: Config, *, stop_after: int | None = None) -> dict[str, Any]:
  """Trains per `cfg`; returns a summary. `stop_after=k` exits after k steps of this call, with
  a checkpoint, as if the job were interrupted (a later call resumes)."""
  validate.check_runtime(cfg)
  t = cfg.train
  pi, pc = jax.process_index(), jax.process_count()
  requested = cfg.model.attention_impl
  rt = runtime.build(cfg)
  cfg = rt.cfg  # model.attention_impl=auto resolved for these devices
  write_run_info(cfg, rt, requested)
  reorder = rt.reorder()  # context parallelism's token order, applied once at load
  train_iter = make_train_iterator(cfg.data, t.seq_len, t.batch_size, pi, pc, reorder)
  eval_batches = (make_eval_batches(cfg.data, t.seq_len, t.batch_size, t.eval_batches, pi, pc,
                                    reorder) if cfg.data.val_fraction > 0 else [])
  ckptr = ckpt_lib.Checkpointer(cfg)
  state, start = _initial_state(rt, ckptr, train_iter)
  if distributed.is_main():
    splits = load_splits(cfg.data)
    print(startup.summary(cfg, rt.mesh, start, ckptr.directory, (len(splits.train),
                                                                 len(splits.val)),
                          load_tokenizer(cfg.data).vocab_size,
                          startup.kernel_lines(rt, requested)), flush=True)
  train_step, eval_step = rt.train_step(), rt.eval_step()
  batch_sharding = rt.layouts.batch()

  writer = metrics_lib.MetricsWriter(t.output_dir, t.steps, start,
                                     tensorboard=cfg.logging.tensorboard,
                                     progress=cfg.logging.progress)
  tokens_per_step = t.batch_size * t.seq_len
  flops_per_step = metrics_lib.flops_per_token(cfg.model, t.seq_len) * tokens_per_step
  peak = t.peak_flops or metrics_lib.device_peak_flops()
  n_devices = rt.mesh.size
  end = t.steps if stop_after is None else min(t.steps, start + stop_after)
  losses: dict[int, float] = {}
  val_loss = None
  last_time, last_step, tracing = None, start, False
  for step in range(start, end):
    if t.profile_steps and step == t.profile_steps[0]:
      jax.profiler.start_trace(os.path.join(t.output_dir, "profile"))
      tracing = True
    state, m = train_step(state, evaluate.to_global(next(train_iter), batch_sharding))
    done = step + 1
    if last_time is None:  # the first step includes compilation: time from its end
      jax.block_until_ready(m)
      last_time, last_step = time.perf_counter(), done
    if tracing and step == t.profile_steps[1]:
      jax.block_until_ready(m)
      jax.profiler.stop_trace()
      tracing = False
    if done % cfg.logging.every == 0 or done == end:
      m = jax.device_get(m)  # the only host sync: once per logging interval
      now = time.perf_counter()
      step_time = (now - last_time) / max(done - last_step, 1) if done > last_step else None
      last_time, last_step = now, done
      row = {k: (v.tolist() if getattr(v, "ndim", 0) else float(v))
             for k, v in m.items() if k != "tokens"}
      losses[done] = row["loss"]
      if step_time:
        row.update(step_time_s=step_time, tokens_per_sec=tokens_per_step / step_time,
                   mfu=metrics_lib.mfu(flops_per_step, step_time, n_devices, peak))
      row["peak_memory_bytes"] = metrics_lib.peak_memory_bytes()
      writer.write(done, row)
    if eval_batches and t.eval_every and (done % t.eval_every == 0 or done == t.steps):
      val_loss = evaluate.mean_loss(eval_step, state["params"], eval_batches, batch_sharding,
                                    state.get("dot_state")).loss
      writer.write(done, {"val_loss": val_loss})
    ckptr.save(done, state, train_iter, force=(done == end and cfg.checkpoint.every > 0))
    writer.advance()
  if tracing:
    jax.profiler.stop_trace()
  ckptr.close()
  writer.close()
  if cfg.logging.plot and distributed.is_main():
    from jscale.analysis import plots  # pylint: disable=import-outside-toplevel
    plots.plot_run_end(t.output_dir)
  return {"losses": losses, "val_loss": val_loss, "final_step": end, "state": state}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jscale.train", description="Train a Llama-family model with jscale.")
  parser.add_argument("--config", required=True, help="YAML file, e.g. configs/tiny.yaml")
  parser.add_argument("overrides", nargs="*", help="dotted overrides: train.steps=100 ...")
  args = parser.parse_args(argv)
  try:
    cfg = load_config(args.config, args.overrides)
    xla_flags.apply()  # GPU compute/communication overlap; before any JAX backend starts
    distributed.initialize(cfg.distributed)  # before anything starts a JAX backend
    summary = run(cfg)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  if distributed.is_main():
    last = max(summary["losses"]) if summary["losses"] else None
    msg = f"done: step {summary['final_step']}"
    if last is not None:
      msg += f", loss {summary['losses'][last]:.4f}"
    if summary["val_loss"] is not None:
      msg += f", val_loss {summary['val_loss']:.4f}"
    print(msg + f"; metrics in {os.path.join(cfg.train.output_dir, 'metrics.jsonl')}")
    if cfg.checkpoint.every > 0:
      out = cfg.train.output_dir
      prompt = "def " if cfg.data.source == "stdlib" else "your text"
      print(f"next: python -m jscale.generate --model {out} --prompt '{prompt}'   |   "
            f"python -m jscale.eval --model {out}   |   "
            f"python -m jscale.convert jscale-to-hf --ckpt {out} --out {out}-hf")
  return 0


if __name__ == "__main__":
  sys.exit(main())
