"""What `python -m jscale.generate` and `python -m jscale.eval` share: the model's numerics for
this machine, the tokenizer that goes with a model, a tensor-parallel mesh."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
from flax import nnx

from jscale import config_cli, exit_codes, platforms
from jscale import mesh as mesh_lib
from jscale.config import ConfigError, DataConfig, MeshConfig, ModelConfig
from jscale.data import load_tokenizer
from jscale.data.tokenizer import Tokenizer
from jscale.model import attention, llama
from jscale.model.llama import Llama


def for_this_backend(cfg: ModelConfig, model: Llama, dtype: str | None = None
                     ) -> tuple[ModelConfig, Llama]:
  """(cfg, model) with the same weights, runnable here: compute `dtype` if given; the attention
  `auto` picks for this backend and dtype (cuDNN on a GPU where it applies; a run trained with
  other kernels may be sampled anywhere); GPU-only kernels (Pallas norm, the Pallas grouped
  matmul) replaced by XLA's off the GPU (`auto`'s tiled grouped matmul); MoE dropless."""
  dtype = dtype or cfg.dtype
  on_gpu = jax.default_backend() == "gpu"
  impl = attention.local_impl("auto", jax.ShapeDtypeStruct((1, 1, 1, cfg.qk_head_dim), dtype),
                              jax.ShapeDtypeStruct((1, 1, 1, cfg.v_head_dim), dtype))
  moe = cfg.moe
  if moe is not None:
    moe = dataclasses.replace(moe, dispatch="dropless",  # generation never drops a token
                              gemm=moe.gemm if on_gpu else "auto")
  cfg = dataclasses.replace(cfg, dtype=dtype, attention_impl=impl, moe=moe,
                            norm_impl=cfg.norm_impl if on_gpu else "xla", kernel_interpret=False)
  rebuilt = nnx.eval_shape(lambda: llama.create(cfg))
  nnx.update(rebuilt, nnx.state(model, nnx.Param))
  return cfg, rebuilt


def tokenizer_path(model_path: str, run_tokenizer: str | None, explicit: str | None) -> str:
  """The tokenizer to use with the model at `model_path`: `explicit` (--tokenizer), else the
  run's `data.tokenizer`, else a tokenizer.json beside the weights; ConfigError if none."""
  if explicit:
    return explicit
  if run_tokenizer:
    return run_tokenizer
  beside = os.path.join(model_path, "tokenizer.json")
  if os.path.isfile(beside):
    return beside
  raise ConfigError(f"{model_path} has no tokenizer.json and is not a training run: pass "
                    "--tokenizer byte or --tokenizer path/to/tokenizer.json")


def check_vocab(tokenizer: Tokenizer, cfg: ModelConfig, where: str) -> None:
  """Refuses a tokenizer that produces ids the model has no embedding for."""
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f"the tokenizer ({where}) has {tokenizer.vocab_size} ids, more than the "
                      f"model's vocab_size {cfg.vocab_size}: pass the model's own tokenizer "
                      "(--tokenizer)")


def load_tokenizer_at(path: str) -> Tokenizer:
  """"byte" or a tokenizer.json path -> the tokenizer."""
  return load_tokenizer(DataConfig(tokenizer=path))


def tensor_mesh(tensor: int) -> jax.sharding.Mesh | None:
  """A mesh of `tensor` devices splitting the model over `tensor` (None for 1)."""
  if tensor <= 1:
    return None
  if tensor > jax.device_count():
    raise ConfigError(f"--tensor {tensor}: only {jax.device_count()} devices here")
  return mesh_lib.make_mesh(MeshConfig(data=1, tensor=tensor), jax.devices()[:tensor])


def model_parser(prog: str, description: str, epilog: str | None = None
                 ) -> argparse.ArgumentParser:
  """A CLI's parser with the model it reads: `--model PATH` (`jscale.ckpt.model_source`) and
  `--step`; `epilog`: the config keys it takes (`jscale.config_cli.reference`)."""
  p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                              formatter_class=config_cli.HelpFormatter)
  p.add_argument("--model", required=True, metavar="PATH",
                 help="run dir, checkpoint dir, params checkpoint or HF dir")
  p.add_argument("--step", type=int, default=None, help="checkpoint step of a run (latest)")
  return p


def run_cli(parser, run, argv: list[str] | None) -> int:
  """Parses `argv` (`--section.key=value` as `section.key=value`, for a parser with
  `overrides`), calls `run(args)`; a user error (bad config, missing file, bad value) is one
  `error: ...` line on stderr and exit status 2, not a traceback."""
  args, overrides = config_cli.parse(parser, argv)
  if overrides and not hasattr(args, "overrides"):
    parser.error(f"{overrides[0]}: {parser.prog} takes no config keys (--help lists its options)")
  if overrides:
    args.overrides += overrides
  platforms.settle()  # before anything starts a JAX backend
  try:
    run(args)
  except (ConfigError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  return 0
