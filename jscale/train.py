"""`python -m jscale.train --config configs/tiny.yaml [section.key=value ...]`

Thin CLI over `run(cfg)`: validates the config against this machine and decides new run /
resume / refusal (`jscale.run.directory`) before compiling, builds the data iterator,
initialises or restores the train state, and runs `jscale.run.loop` under SIGTERM / SIGINT
handling (`jscale.run.preemption`). Exit status: 0 done, 2 config error, 3 non-finite loss
(train.on_nan=stop), 74 the last checkpoint did not read back twice, 75 stopped by a signal
after saving (rerun to resume), 130 a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import textwrap
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from jscale import config_cli, distributed, exit_codes, platforms, runtime, validate, xla_flags
from jscale import metrics as metrics_lib
from jscale.analysis import plots
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.ckpt import init_from
from jscale.config import Config, ConfigError
from jscale.config_load import load_config
from jscale.data import components, load_splits, load_tokenizer, make_eval_sets, make_train_iterator
from jscale.infer import sampling
from jscale.optim import make_optimizer
from jscale.run import console as console_lib
from jscale.run import directory as run_dir
from jscale.run import loop, output, preemption, startup
from jscale.step import state as state_lib


def _initial_state(rt: runtime.Runtime, ckptr: ckpt_lib.Checkpointer, train_iter,
                   plan: run_dir.Plan) -> tuple[Any, int]:
  """Resumes from the newest readable checkpoint (per `plan`), else starts from init_from
  params or random init."""
  cfg = rt.cfg
  if plan.step is not None:  # intact: `_start` moved any damaged newer step aside
    abstract = rt.abstract_state()
    saved = ckptr.restore(plan.step, state_lib.as_saved(abstract), train_iter)
    return state_lib.from_saved(_restacked(rt, saved, plan), abstract), plan.step
  state = rt.init_state()
  if cfg.checkpoint.init_from:
    model = state_lib.merge(rt.graphdef, state["params"], state.get("dot_state"))
    init_from.load_into(cfg, model)
    # init_from params are in model layer order; pipelines with v > 1 store chunk order.
    params = rt.params_to_storage(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    optimizer = make_optimizer(cfg.train)
    copies = state_lib.copies_dtype(cfg, rt.mesh.shape["stage"])
    state = jax.jit(lambda p, d: state_lib.state_from_params(p, optimizer, cfg.train.seed, d,
                                                             copies),
                    out_shardings=rt.state_shardings)(params, state.get("dot_state"))
  return state, 0


def _restacked(rt: runtime.Runtime, state: Any, plan: run_dir.Plan) -> Any:
  """A checkpoint of a run whose pipeline.schedule placed the chunks otherwise (interleaved vs
  the V of zbv / dualpipev) stores the layers in that order: put them in this run's."""
  saved = {key: before for key, before, _ in plan.changed}.get("pipeline.schedule")
  if saved is None:
    return state
  cfg = rt.cfg
  restack = lambda s: state_lib.restack(s, cfg.model.stack_layers, rt.mesh.shape["stage"],
                                        dataclasses.replace(cfg.pipeline, schedule=saved),
                                        cfg.pipeline)
  return jax.jit(restack, out_shardings=rt.state_shardings)(state)


def _warn_once(msg: str) -> None:
  """A warning every process meets, said by process 0."""
  if distributed.is_main():
    print(msg, file=sys.stderr, flush=True)


def _start(cfg: Config) -> run_dir.Plan:
  """Decides new run / resume / refusal before anything compiles, and says which. A resume
  starts from the newest checkpoint that reads back (damaged newer ones are moved aside)."""
  if cfg.checkpoint.resume:
    ckpt_lib.newest_intact(ckpt_lib.checkpoint_dir(cfg), cfg.checkpoint.verify, _warn_once)
  plan = run_dir.plan(cfg)
  if jax.process_count() > 1:  # every process reads the run directory before process 0
    # changes it below: one that planned after the change would plan otherwise, and meet
    # the others at a different barrier (a 2-process CI run under load did)
    multihost_utils.sync_global_devices("jscale_planned")
  if distributed.is_main():
    print(plan.line(), flush=True)
    for line in run_dir.changed_lines(plan):
      print(line, flush=True)
    moved = run_dir.prepare(cfg, plan)
    if moved:
      print(f"  the earlier run is moved to {moved}", flush=True)
  if plan.replace and jax.process_count() > 1:
    multihost_utils.sync_global_devices("jscale_prepared")  # the others wait for the move
  return plan


def run(cfg: Config, *, stop_after: int | None = None) -> dict[str, Any]:
  """Trains per `cfg`; returns a summary (`stopped`: None, "preempted" or "nonfinite", with
  `message`). `stop_after=k` exits after k steps of this call, with a checkpoint, as if the job
  were interrupted (a later call resumes)."""
  validate.check_runtime(cfg)
  t = cfg.train
  plan = _start(cfg)
  if plan.step is not None and plan.step >= t.steps and stop_after is None:
    msg = (f"train.steps={t.steps} already reached (checkpoint step {plan.step}): nothing to "
           f"train. To train on: train.steps=<more>; for a new run: train.output_dir=<new dir>")
    return {"losses": {}, "val_loss": None, "final_step": plan.step, "state": None,
            "stopped": None, "message": msg}
  with preemption.StopSignals() as signals:
    pi, pc = jax.process_index(), jax.process_count()
    given = cfg
    rt = runtime.build(cfg)
    cfg = rt.cfg  # model.attention_impl=auto resolved for these devices
    meta = run_dir.metadata(given)  # what a resume compares with: the config as given
    startup.write_run_info(rt, meta)
    reorder = rt.reorder()  # context parallelism's token order, applied once at load
    train_iter = make_train_iterator(cfg.data, t.seq_len, t.batch_size, pi, pc, reorder)
    eval_sets = (make_eval_sets(cfg.data, t.seq_len, t.batch_size, t.eval_batches, pi, pc,
                                reorder) if cfg.data.val_fraction > 0 else {})
    ckptr = ckpt_lib.Checkpointer(cfg, meta)
    state, start = _initial_state(rt, ckptr, train_iter, plan)
    if distributed.is_main():
      for line in validate.no_op_warnings(cfg, rt.mesh):
        print(line, file=sys.stderr, flush=True)
      splits = [load_splits(part.cfg) for part in components(cfg.data)]
      kernels = startup.kernel_lines(rt.kernels, cfg.model.moe is not None)
      long_docs = [s.documents_longer_than(t.seq_len) for s in splits]
      print(startup.summary(cfg, rt.mesh, start, ckptr.directory,
                            (sum(len(s.train) for s in splits), sum(len(s.val) for s in splits)),
                            load_tokenizer(cfg.data).vocab_size, kernels,
                            None if None in long_docs else
                            tuple(map(sum, zip(*long_docs)))), flush=True)
    writer = metrics_lib.MetricsWriter(t.output_dir, start, tensorboard=cfg.logging.tensorboard)
    console = console_lib.Console(t.steps, start, progress=cfg.logging.progress,
                                  active=distributed.is_main())
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    try:
      out = loop.train(cfg, rt, state, start, end, train_iter, eval_sets, ckptr, writer,
                       console, signals)
      if out.stopped is None:
        signals.phase = "reading the last checkpoint back"
        unsaved = ckptr.check_last(state_lib.as_saved(out.state), train_iter, _warn_once)
        if unsaved:
          out.stopped, out.message = "unsaved", unsaved
    finally:
      # A signal from here on lets the save and the plot finish (a second Ctrl-C exits at once).
      signals.phase = "the final checkpoint save"
      console.close()
      ckptr.close()
      writer.close()
    if cfg.logging.plot and distributed.is_main():
      signals.phase = "the plot of the run (metrics.png)"
      plots.plot_run_end(t.output_dir)
  return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jscale.train", description="Train a Llama-family model with jscale.\n\n"
      + textwrap.fill(config_cli.USAGE_NOTE, 100), epilog=config_cli.reference(),
      formatter_class=config_cli.HelpFormatter)
  parser.add_argument("--config", required=True, help="YAML file, e.g. configs/tiny.yaml")
  config_cli.add_print_config(parser)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="config overrides, e.g. train.steps=100 (every key: below)")
  return parser


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (see the module docstring)."""
  parser = _parser()
  args, overrides = config_cli.parse(parser, argv)
  args.overrides += overrides
  if args.print_config:
    try:
      print(config_cli.to_yaml(load_config(args.config, args.overrides)), end="")
    except ConfigError as e:
      print(f"config error: {e}", file=sys.stderr)
      return exit_codes.BAD_INPUT
    return 0
  streams = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = output.ClosableOutput(sys.stdout), output.ClosableOutput(sys.stderr)
  try:
    return _main(args)
  finally:
    sys.stdout, sys.stderr = streams


def _main(args: argparse.Namespace) -> int:
  try:
    cfg = load_config(args.config, args.overrides)
    platforms.settle()  # the CPU alone where a CUDA plugin has no GPU; before any JAX backend
    xla_flags.apply(cfg)  # GPU compute/communication overlap; before any JAX backend starts
    distributed.initialize(cfg.distributed)  # before anything starts a JAX backend
    with contextlib.ExitStack() as stack:
      if jax.process_count() > 1:  # Gloo's C++ chatter on stdout: into the run's log files
        stack.enter_context(output.libraries_to_log(
            output.log_path(cfg.train.output_dir, jax.process_index())))
      summary = run(cfg)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  if not distributed.is_main():
    return _exit_code(summary)
  if summary["message"]:
    print(summary["message"], file=sys.stderr if summary["stopped"] else sys.stdout, flush=True)
  if summary["stopped"] or not summary["losses"]:
    return _exit_code(summary)
  last = max(summary["losses"])
  msg = f"done: step {summary['final_step']}, loss {summary['losses'][last]:.4f}"
  if summary["val_loss"] is not None:
    msg += f", val_loss {summary['val_loss']:.4f} ({console_lib.covered(summary)})"
  print(msg + f"; metrics in {os.path.join(cfg.train.output_dir, 'metrics.jsonl')}")
  if cfg.checkpoint.every > 0:
    out = cfg.train.output_dir
    prompt = "def " if cfg.data.source == "stdlib" else "your text"
    print(f"next: {sampling.suggestion(out, prompt)}   |   python -m jscale.eval --model {out}"
          f"   |   python -m jscale.convert jscale-to-hf --ckpt {out} --out {out}-hf")
  return 0


def _exit_code(summary: dict[str, Any]) -> int:
  return {"preempted": exit_codes.PREEMPTED, "nonfinite": exit_codes.NONFINITE,
          "unsaved": exit_codes.UNSAVED}.get(summary["stopped"], 0)


if __name__ == "__main__":
  sys.exit(main())
