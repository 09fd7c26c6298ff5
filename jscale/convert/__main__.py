"""`python -m jscale.convert`: Hugging Face Llama / Mixtral <-> jscale params checkpoints.

  hf-to-jscale --hf DIR --out DIR    HF dir -> params checkpoint for `checkpoint.init_from`
  jscale-to-hf --ckpt DIR --out DIR  params checkpoint -> HF dir (`from_pretrained` loads it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from jscale.config import ConfigError

_DTYPES = ("float32", "bfloat16")
# Copied beside model.yaml: init_from checks a run's data.tokenizer against tokenizer.json, and
# HFTokenizer reads the EOS token from tokenizer_config.json.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jscale.convert",
      description="Convert Llama and Mixtral weights between Hugging Face (safetensors) "
      "and jscale.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="examples:\n"
      "  python -m jscale.convert hf-to-jscale --hf ~/Llama-3.2-1B --out ckpt/llama1b\n"
      "  python -m jscale.convert jscale-to-hf --ckpt ckpt/llama1b --out hf/llama1b "
      "--dtype bfloat16\n"
      "run `python -m jscale.convert COMMAND --help` for a command's options")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  a = sub.add_parser("hf-to-jscale", help="HF Llama/Mixtral dir -> jscale params checkpoint",
                     description="Read a transformers Llama or Mixtral dir (config.json + "
                     "safetensors) and "
                     "write a jscale params checkpoint (params/ + model.yaml, and the HF "
                     "dir's tokenizer.json if it has one) that checkpoint.init_from=DIR loads.")
  a.add_argument("--hf", required=True, metavar="DIR", help="HF checkpoint directory")
  a.add_argument("--out", required=True, metavar="DIR", help="new jscale checkpoint directory")
  a.add_argument("--param-dtype", default="float32", choices=_DTYPES,
                 help="dtype the weights are stored in (default: float32 master weights)")
  a.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                 help="compute dtype recorded in model.yaml (default: bfloat16)")
  b = sub.add_parser("jscale-to-hf", help="jscale params checkpoint -> HF Llama/Mixtral dir",
                     description="Read a jscale params checkpoint (params/ + model.yaml) and "
                     "write config.json + safetensors that transformers' "
                     "LlamaForCausalLM.from_pretrained loads (MixtralForCausalLM for a model "
                     "with model.moe).")
  b.add_argument("--ckpt", required=True, metavar="DIR", help="jscale params checkpoint dir")
  b.add_argument("--out", required=True, metavar="DIR", help="output directory (empty or new)")
  b.add_argument("--dtype", default=None, choices=_DTYPES,
                 help="dtype of the exported weights (default: as stored in the checkpoint)")
  return p


def _hf_to_jscale(args) -> None:
  from jscale import params_io  # pylint: disable=import-outside-toplevel
  from jscale.convert import load_hf  # pylint: disable=import-outside-toplevel
  if not os.path.isdir(args.hf):
    raise FileNotFoundError(f"--hf {args.hf}: no such directory")
  if os.path.exists(os.path.join(args.out, "params")):  # fail before the (slow) load
    raise FileExistsError(f"--out {args.out} already holds a checkpoint; choose a new directory")
  cfg, model = load_hf(args.hf, dtype=args.dtype, param_dtype=args.param_dtype)
  params_io.save_params(args.out, model, cfg)
  copied = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(args.hf, f))]
  for f in copied:
    shutil.copyfile(os.path.join(args.hf, f), os.path.join(args.out, f))
  moe = "" if cfg.moe is None else f", {cfg.moe.n_experts} experts top-{cfg.moe.top_k}"
  tok = (f" data.tokenizer={os.path.join(args.out, 'tokenizer.json')}"
         if "tokenizer.json" in copied else "")
  print(f"wrote {args.out} ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab "
        f"{cfg.vocab_size}{moe}{'; copied ' + ', '.join(copied) if copied else ''}); train "
        f"from it with checkpoint.init_from={args.out}{tok}")


def _jscale_to_hf(args) -> None:
  # pylint: disable=import-outside-toplevel
  from flax import nnx

  from jscale import params_io
  from jscale.convert import save_hf
  from jscale.model import llama
  if not os.path.isdir(args.ckpt):
    raise FileNotFoundError(f"--ckpt {args.ckpt}: no such directory")
  cfg = params_io.load_model_config(args.ckpt)
  if not os.path.isdir(os.path.join(args.ckpt, "params")):
    raise FileNotFoundError(f"--ckpt {args.ckpt}: no params/ there; is it a jscale params "
                            "checkpoint (from hf-to-jscale or params_io.save_params)?")
  model = nnx.eval_shape(lambda: llama.create(cfg))  # shapes only: restore fills the values
  params_io.load_params_into(args.ckpt, model)
  save_hf(model, cfg, args.out, dtype=args.dtype)
  arch = "LlamaForCausalLM" if cfg.moe is None else "MixtralForCausalLM"
  print(f"wrote {args.out}; load it with transformers.{arch}.from_pretrained")


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for user errors, printed without traceback)."""
  args = _parser().parse_args(argv)
  try:
    {"hf-to-jscale": _hf_to_jscale, "jscale-to-hf": _jscale_to_hf}[args.command](args)
  except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
