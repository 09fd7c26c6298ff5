"""`python -m jscale.generate --model PATH --prompt TEXT [...]`: text from a trained model.

PATH is a training run's output_dir (its latest checkpoint, or `--step`), one checkpoint step
directory, a params checkpoint (`python -m jscale.convert hf-to-jscale`) or a Hugging Face
Llama / Mixtral directory. `--temperature`, `--top-k`, `--top-p`, `--seed` sample (the command a
finished run suggests samples, `sampling.suggestion`: a small model's greedy text soon loops on
its likeliest word); `--greedy`, or no temperature, takes the likeliest token. A row stops at
the tokenizer's EOS (unless `--ignore-eos`) or after `--max-new-tokens`.
Prompts of different lengths run as one batch through a KV cache (`jscale.infer.generator`);
`--tensor N` splits the model over N devices (each parameter is read straight onto its shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jscale.ckpt import model_source
from jscale.config import ConfigError
from jscale.infer import setup
from jscale.infer.generator import Generator
from jscale.infer.sampling import Sampling
from jscale.infer.setup import run_cli


def _parser() -> argparse.ArgumentParser:
  p = setup.model_parser("python -m jscale.generate",
                         "Generate text from a jscale run, checkpoint or Hugging Face model.")
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompt-file", metavar="FILE",
                 help="prompts, one per line (blank lines skipped)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0: no top-k truncation")
  p.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus truncation")
  p.add_argument("--seed", type=int, default=0, help="the sampling's random seed")
  p.add_argument("--greedy", action="store_true",
                 help="always the most likely token (overrides --temperature, --top-k, --top-p)")
  p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
  p.add_argument("--tokenizer", default=None,
                 help="byte or a tokenizer.json (default: the run's, or the model dir's)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                 help="compute dtype (default: the model's)")
  p.add_argument("--tensor", type=int, default=1, help="split the model over this many devices")
  return p


def _prompts(args) -> list[str]:
  prompts = list(args.prompt)
  if args.prompt_file:
    try:
      with open(args.prompt_file, encoding="utf-8") as f:
        prompts += [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise FileNotFoundError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
  if not prompts:
    raise ConfigError("no prompt: pass --prompt TEXT (repeatable) or --prompt-file FILE")
  return prompts


def run(args) -> list[str]:
  """Generates per `args` (parsed by `_parser`), prints prompts, completions and speed;
  returns the completions."""
  prompts = _prompts(args)
  sampling = Sampling() if args.greedy else Sampling(args.temperature, args.top_k, args.top_p)
  try:
    sampling.check()
  except ValueError as e:
    raise ConfigError(f"--{str(e).replace('_', '-')}") from None
  data = model_source.data_config(args.model)
  tok_path = setup.tokenizer_path(args.model, data.tokenizer if data else None, args.tokenizer)
  tokenizer = setup.load_tokenizer_at(tok_path)
  mesh = setup.tensor_mesh(args.tensor)
  cfg, model = model_source.load(args.model, step=args.step, mesh=mesh)  # read onto its shards
  setup.check_vocab(tokenizer, cfg, tok_path)
  if tokenizer.vocab_size < cfg.vocab_size:  # a padded vocabulary: never draw an id the
    # tokenizer cannot decode
    sampling = dataclasses.replace(sampling, ids=tokenizer.vocab_size)
    print(f"note: the tokenizer ({tok_path}) has {tokenizer.vocab_size:,} ids, the model "
          f"{cfg.vocab_size:,}: sampling only the tokenizer's", flush=True)
  cfg, model = setup.for_this_backend(cfg, model, args.dtype)
  ids = [tokenizer.encode(p) for p in prompts]
  if any(not i for i in ids):
    raise ConfigError("a prompt encodes to no tokens: give non-empty prompts")
  gen = Generator(model, mesh).generate(
      ids, args.max_new_tokens, sampling, args.seed,
      None if args.ignore_eos else tokenizer.eos_id)
  texts = [tokenizer.decode(t) for t in gen.tokens]
  for i, (p, t) in enumerate(zip(prompts, texts)):
    print(f"--- [{i}]{'' if gen.finished[i] else ' (max tokens)'}\n{p}{t}")
  n = sum(len(t) for t in gen.tokens)
  print(f"--- {len(prompts)} prompt(s), {n} new tokens, {_how(sampling, args.seed)}; prefill "
        f"{gen.prefill_s:.2f} s and first "
        f"decode step {gen.first_decode_s:.2f} s (with compile), then decode "
        f"{gen.tokens_per_s:,.0f} tokens/s ({gen.decode_steps} steps x batch {len(prompts)}, "
        f"{cfg.dtype}, attention {cfg.attention_impl})", flush=True)
  return texts


def _how(sampling: Sampling, seed: int) -> str:
  """How the tokens were chosen, in words."""
  if sampling.temperature == 0:
    return "greedy"
  cut = "".join([f", top-k {sampling.top_k}" if sampling.top_k else "",
                 f", top-p {sampling.top_p:g}" if sampling.top_p < 1 else ""])
  return f"sampled at temperature {sampling.temperature:g}{cut}, seed {seed} (--greedy: argmax)"


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for user errors, without a traceback)."""
  return run_cli(_parser(), run, argv)


if __name__ == "__main__":
  sys.exit(main())
