"""`python -m jscale.eval --model PATH [key=value ...]`: loss and perplexity on a data source.

PATH as for `jscale.generate` (run dir, checkpoint, params checkpoint, HF dir). The data is a
run's own (`data.*` of its config) unless overridden (`data.source=text data.path=...
data.tokenizer=...`); a model without a run defaults to the tokenizer.json beside it. The
loss is the training loop's eval (`jscale.infer.evaluate.mean_loss` over the same compiled
eval step), over every full batch of the split once (`--batches N` for fewer), on all devices
(`mesh.*`, `parallel.*` overrides lay the model out as in training).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
from flax import nnx

from jscale import runtime, validate
from jscale.ckpt import model_source
from jscale.config import ConfigError
from jscale.config_load import from_overrides
from jscale.data import make_eval_batches
from jscale.infer import evaluate, setup
from jscale.infer.setup import run_cli


def _parser() -> argparse.ArgumentParser:
  p = setup.model_parser("python -m jscale.eval", "Loss and perplexity of a jscale run, "
                         "checkpoint or Hugging Face model on a data source.")
  p.add_argument("--split", default="val", choices=("val", "train"),
                 help="which split of the data source (default: val)")
  p.add_argument("--batches", type=int, default=0, help="0: every full batch of the split")
  p.add_argument("--json", action="store_true", help="print the result as one JSON line")
  p.add_argument("overrides", nargs="*",
                 help="config overrides: data.*, train.seq_len / batch_size, mesh.*, ...")
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
  if args.batches < 0:
    raise ConfigError(f"--batches {args.batches}: must be >= 0 (0: the whole split)")
  cfg = config_for(args.model, model_source.model_config(args.model, args.step), args.overrides)
  validate.check_runtime(cfg)
  tokenizer = setup.load_tokenizer_at(cfg.data.tokenizer)
  setup.check_vocab(tokenizer, cfg.model, f"data.tokenizer={cfg.data.tokenizer}")
  rt = runtime.build(cfg)
  cfg = rt.cfg
  params = load_params(args.model, args.step, rt)
  t = cfg.train
  batches = make_eval_batches(cfg.data, t.seq_len, t.batch_size, args.batches,
                              jax.process_index(), jax.process_count(), rt.reorder(),
                              split=args.split)
  result = evaluate.mean_loss(rt.eval_step(), params, batches, rt.layouts.batch())
  out = {"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
         "batches": len(batches), "batch_size": t.batch_size, "seq_len": t.seq_len,
         "split": args.split, "source": cfg.data.source, "tokenizer": cfg.data.tokenizer}
  if args.json:
    print(json.dumps(out))
  else:
    print(f"loss {result.loss:.4f}, perplexity {result.perplexity:.3f} over "
          f"{result.tokens:,} tokens ({args.split} split of data.source={cfg.data.source}, "
          f"{len(batches)} batches of {t.batch_size} x {t.seq_len})")
  return out


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for user errors, without a traceback)."""
  return run_cli(_parser(), run, argv)


if __name__ == "__main__":
  sys.exit(main())
