"""`python -m jscale.convert`: Hugging Face Llama / Mixtral / DeepSeek-V3 <-> jscale params
checkpoints.

  hf-to-jscale --hf DIR --out DIR    HF dir -> params checkpoint for `checkpoint.init_from`
  jscale-to-hf --ckpt DIR --out DIR  a trained run / checkpoint -> HF dir (`from_pretrained`)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from jscale import exit_codes, platforms
from jscale.ckpt import model_source, params_io
from jscale.config import ConfigError
from jscale.convert import load_hf, save_hf

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
      "  python -m jscale.convert jscale-to-hf --ckpt runs/tiny --out hf/tiny   "
      "(a run's latest checkpoint)\n"
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
  b = sub.add_parser("jscale-to-hf", help="jscale run / checkpoint -> HF Llama/Mixtral dir",
                     description="Read a training run's output_dir (its latest checkpoint, or "
                     "--step), one checkpoint step dir, or a params checkpoint (params/ + "
                     "model.yaml) — parameters only, the optimizer state is not read — and "
                     "write config.json + safetensors that transformers' "
                     "LlamaForCausalLM.from_pretrained loads (MixtralForCausalLM for a model "
                     "with model.moe). The output appears whole or not at all: it is written "
                     "to a temporary dir beside --out, then renamed.")
  b.add_argument("--ckpt", "--model", dest="ckpt", required=True, metavar="DIR",
                 help="run output_dir, checkpoints/<step> dir or params checkpoint")
  b.add_argument("--step", type=int, default=None, help="checkpoint step of a run (latest)")
  b.add_argument("--out", required=True, metavar="DIR", help="output directory (empty or new)")
  b.add_argument("--dtype", default=None, choices=_DTYPES,
                 help="dtype of the exported weights (default: as stored in the checkpoint)")
  return p


def _hf_to_jscale(args) -> None:
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
  src = model_source.describe(args.ckpt, args.step)
  if src.kind == "hf":
    raise ConfigError(f"--ckpt {args.ckpt} is already a Hugging Face dir")
  out = os.path.abspath(args.out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"--out {args.out} exists and is not empty; choose a new directory")
  if src.kind == "params" and not os.path.isdir(os.path.join(args.ckpt, "params")):
    raise FileNotFoundError(f"--ckpt {args.ckpt}: no params/ there; is it a jscale params "
                            "checkpoint (from hf-to-jscale or params_io.save_params)?")
  cfg, model = model_source.load(args.ckpt, step=args.step)
  tokenizer = _tokenizer_of(src)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  # Written beside --out, then renamed: a crash or a refused config leaves no partial --out.
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
  try:
    save_hf(model, cfg, tmp, dtype=args.dtype)
    for f in _TOKENIZER_FILES:
      path = os.path.join(os.path.dirname(tokenizer), f) if tokenizer else None
      if path and os.path.isfile(path):
        shutil.copyfile(path, os.path.join(tmp, f))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make the export private
    if os.path.isdir(out):
      os.rmdir(out)  # empty (checked above)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  arch = ("DeepseekV3ForCausalLM" if cfg.mla is not None else "LlamaForCausalLM"
          if cfg.moe is None else "MixtralForCausalLM")
  tok = ("; its tokenizer.json copied beside" if tokenizer else
         "; no tokenizer.json (the byte tokenizer has none: token id = byte value)")
  print(f"wrote {args.out} from {src.label()}{tok}; load it with "
        f"transformers.{arch}.from_pretrained")
  if cfg.mtp is not None:
    print(mtp_note(cfg))


def mtp_note(cfg) -> str:
  """What a DeepSeek export with MTP tells its user about transformers' load report."""
  first = cfg.n_layers
  return (f"  its multi-token-prediction module is written as model.layers.{first}"
          f"{'' if cfg.mtp.depth == 1 else f'..{first + cfg.mtp.depth - 1}'}.*, as DeepSeek "
          "publishes it: transformers builds no MTP module, so its load report lists those "
          "tensors as UNEXPECTED; that is expected (HF's model is the trunk without them; "
          "jscale reads them back)")


def _tokenizer_of(src) -> str | None:
  """The tokenizer.json that goes with `src`: a run's data.tokenizer, or the one beside a
  params checkpoint; None for the byte tokenizer."""
  if src.config is not None:
    tok = src.config.data.tokenizer
    return os.path.expanduser(tok) if tok != "byte" and os.path.isfile(
        os.path.expanduser(tok)) else None
  beside = os.path.join(src.path, "tokenizer.json")
  return beside if os.path.isfile(beside) else None


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for user errors, printed without traceback)."""
  args = _parser().parse_args(argv)
  platforms.settle()  # before anything starts a JAX backend
  try:
    {"hf-to-jscale": _hf_to_jscale, "jscale-to-hf": _jscale_to_hf}[args.command](args)
  except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  return 0


if __name__ == "__main__":
  sys.exit(main())
