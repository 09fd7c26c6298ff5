"""`python -m jscale.eval --model PATH [section.key=value ...]`: loss and perplexity on a data
source, saying what it covered.

PATH as for `jscale.generate` (run dir, checkpoint, params checkpoint, HF dir). The data is a
run's own (`data.*` of its config) unless overridden (`data.source=text data.path=...
data.tokenizer=...`); a model without a run defaults to the tokenizer.json beside it. The
loss is the training loop's eval (`jscale.infer.evaluate.mean_loss` over the same compiled
eval step), on all devices (`mesh.*`, `parallel.*` overrides lay the model out as in
training). How many batches: on a run, the run's own `train.eval_batches` (so the number agrees
with the val loss the run printed); elsewhere every full batch of the split; `--batches N` or
`--batches all` says otherwise. A line before the first batch says what will be measured (batch
and sequence length, and where they come from); a bar follows the batches in a terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
from flax import nnx
from tqdm import tqdm

from jscale import config_cli, distributed, runtime, validate
from jscale.ckpt import model_source
from jscale.config import ConfigError
from jscale.config_load import from_overrides
from jscale.data import Windows, load_splits, make_eval_batches
from jscale.infer import evaluate, setup
from jscale.infer.setup import run_cli


def _batches(text: str) -> int:
  """--batches: a positive count, or "all" (returned as 0: every full batch of the split)."""
  if text == "all":
    return 0
  if not text.isdigit() or int(text) == 0:
    raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of batches, or all")
  return int(text)


def _parser() -> argparse.ArgumentParser:
  keys = ("data", "train.seq_len", "train.batch_size", "mesh", "parallel", "pipeline")
  p = setup.model_parser("python -m jscale.eval", "Loss and perplexity of a jscale run, "
                         "checkpoint or Hugging Face model on a data source.",
                         epilog=config_cli.reference(only=keys))
  p.add_argument("--split", default="val", choices=("val", "train"),
                 help="which split of the data source (default: val)")
  p.add_argument("--batches", type=_batches, default=None, metavar="N|all",
                 help="batches to evaluate (default: a run's train.eval_batches, as its own "
                      "eval; otherwise all: every full batch of the split)")
  p.add_argument("--json", action="store_true", help="print the result as one JSON line")
  config_cli.add_print_config(p)
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="config overrides: data.*, train.seq_len / batch_size, mesh.*, ... "
                      "(below)")
  return p


def config_for(path: str, model_cfg, overrides: list[str]):
  """The Config evaluating the model: the run's data and train.seq_len / batch_size if `path`
  is a run (else defaults, with the tokenizer.json beside the weights), the loaded model's
  shape, one device layout for all devices, then `overrides`."""
  raw = {"model": dataclasses.asdict(model_cfg), "fp8": {"enabled": False},
         "logging": {"progress": False}}
  data = model_source.data_config(path)
  train = model_source.train_config(path)
  if data is not None:
    raw["data"] = dataclasses.asdict(data)
  elif os.path.isfile(os.path.join(path, "tokenizer.json")):
    raw["data"] = {"tokenizer": os.path.join(path, "tokenizer.json")}
  if train is not None:
    raw["train"] = {"seq_len": train.seq_len, "batch_size": train.batch_size}
  return from_overrides(raw, overrides)


def load_params(path: str, step: int | None, rt) -> dict:
  """The parameters of the model at `path`, laid out as `rt` (a `runtime.build`) trains them:
  each read straight onto its shards of that layout (never whole on one device), then in the
  layer order `rt`'s pipeline stores (a reorder on the shards)."""
  cfg = rt.cfg
  # The storage order permutes stacked layers only: each leaf's sharding is the same in both.
  shardings = rt.state_shardings["params"]
  _, model = model_source.load(path, step=step, dtype=cfg.model.dtype,
                               param_dtype=cfg.model.param_dtype, shardings=shardings)
  params = rt.params_to_storage(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return jax.device_put(params, shardings)  # the reorder's output layout is XLA's choice


def run(args) -> dict:
  """Evaluates per `args`; prints and returns {loss, perplexity, tokens, ...}."""
  cfg = config_for(args.model, model_source.model_config(args.model, args.step), args.overrides)
  if args.print_config:
    print(config_cli.to_yaml(cfg), end="")
    return {}
  validate.check_runtime(cfg)
  if cfg.data.mixture is not None:  # (a run's `val_loss/<source>` already covers each)
    raise ConfigError("python -m jscale.eval reads one source, and this config mixes "
                      f"{len(cfg.data.mixture)}: add data.mixture=null data.source=<kind> "
                      "data.path=<path> for the one to evaluate")
  tokenizer = setup.load_tokenizer_at(cfg.data.tokenizer)
  setup.check_vocab(tokenizer, cfg.model, f"data.tokenizer={cfg.data.tokenizer}")
  source = model_source.describe(args.model, args.step)
  t = cfg.train
  run_train = model_source.train_config(args.model)
  n = args.batches if args.batches is not None else (run_train.eval_batches if run_train else 0)
  batches, how = _plan(cfg, args.split, n, args.batches is None and run_train is not None)
  if distributed.is_main():
    print(f"evaluating {source.label()} on {how}", file=sys.stderr, flush=True)
    if run_train is None:  # nothing to take the batch shape from: say where it comes from
      given = [o.split("=")[0] for o in args.overrides
               if o.startswith(("train.batch_size=", "train.seq_len="))]
      print(f"  batches of train.batch_size={t.batch_size} x train.seq_len={t.seq_len}"
            + ("" if len(set(given)) == 2 else ": jscale's defaults where not set (no run here to "
               "take them from); set both to match another evaluation"), file=sys.stderr,
            flush=True)
  rt = runtime.build(cfg)
  cfg = rt.cfg
  params = load_params(args.model, args.step, rt)
  loaded = make_eval_batches(cfg.data, t.seq_len, t.batch_size, batches, jax.process_index(),
                             jax.process_count(), rt.reorder(), split=args.split)
  shown = tqdm(loaded, desc="eval", unit="batch", leave=False,
               disable=not (sys.stderr.isatty() and distributed.is_main()))
  result = evaluate.mean_loss(rt.eval_step(), params, shown, rt.layouts.batch())
  out = {"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
         "batches": len(loaded), "batch_size": t.batch_size, "seq_len": t.seq_len,
         "split": args.split, "source": cfg.data.source, "tokenizer": cfg.data.tokenizer,
         "model": source.label()}
  if args.json:
    print(json.dumps(out))
  else:
    print(f"loss {result.loss:.4f}, perplexity {result.perplexity:.3f} over "
          f"{result.tokens:,} tokens ({args.split} split of data.source={cfg.data.source}, "
          f"{len(loaded)} batches of {t.batch_size} x {t.seq_len})")
  return out


def _plan(cfg, split: str, n: int, runs_own: bool) -> tuple[int, str]:
  """(batches to evaluate, what that covers, in words)."""
  t = cfg.train
  splits = load_splits(cfg.data)
  stream = splits.val if split == "val" else splits.train
  full = len(Windows(stream, t.seq_len, splits.eos_id)) // t.batch_size
  shape = f"{t.batch_size} x {t.seq_len} tokens"
  where = f"the {split} split of data.source={cfg.data.source}"
  if n == 0:
    return 0, f"{where}: every full batch, {full} of {shape}"
  why = (f" (the run's train.eval_batches, what its own eval covered; --batches all: all {full})"
         if runs_own else f" of the {full} there (--batches all: every one)")
  return n, f"{where}: {n} batches of {shape}{why}"


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for user errors, without a traceback)."""
  return run_cli(_parser(), run, argv)


if __name__ == "__main__":
  sys.exit(main())
