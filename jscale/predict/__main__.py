"""`python -m jscale.predict`: a train step's time on GPUs that are not here.

    python -m jscale.predict --config configs/llama3_1b.yaml --target h100x1
    python -m jscale.predict --config configs/tiny.yaml mesh.data=2 mesh.tensor=4 --target h100x8
    python -m jscale.predict --config configs/llama3_1b.yaml --hlo step.txt --target h200x1

Compiles the config's train step as `python -m jscale.train` launches it, with the real XLA:GPU
compiler for the target (`jscale.analysis.gpu_target`: JAX's CUDA plugin and cuDNN, no GPU),
or reads an optimised HLO text given with --hlo, and prints the predicted step time, tokens/s
and MFU, time by the categories of `python -m jscale.profile`, the top kernels and what stands
between the step and 55% MFU. Without a GPU XLA cannot autotune; the step is compiled with its
gemms as cuBLAS calls (`predict.AUTOTUNED_GEMMS`: what the autotuner picked for most gemms on
our GPUs), so a gemm the autotuner would give a tuned Triton kernel is timed as cuBLAS's.
How the predictions compare with every measured GPU row: docs/predict.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys

import jax

from jscale import exit_codes
from jscale.analysis import gpu_target
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.predict import predict_config, summary


def _read_hlo(path: str) -> str:
  with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
    return f.read()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jscale.predict", description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None, help="a config YAML (default: the embedded tiny)")
  p.add_argument("--target", default="h100x1", metavar="GPUxN",
                 help="the GPUs to compile and predict for (h100x1, h100x8, h200x1, ...)")
  p.add_argument("--hlo", default=None, help="predict this optimised HLO text (.txt or .txt.gz) "
                 "instead of compiling (the config still gives the model FLOPs and tokens)")
  p.add_argument("--top", type=int, default=20, help="kernels to list")
  p.add_argument("--json", action="store_true", help="the figures as JSON")
  p.add_argument("overrides", nargs="*", help="dotted config overrides: train.batch_size=8 ...")
  args = p.parse_args(argv)
  # Nothing runs on a device: the target's GPUs come from their descriptions. CPU is the
  # platform unless asked otherwise, as in `jscale.plan --verify`; on a machine without a GPU,
  # starting the CUDA plugin as a backend fails (cuFFT) and takes its topologies with it.
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", "cpu")
  try:
    cfg = load_config(args.config, args.overrides)
    if args.hlo is None:  # the compiler is needed: say so now if it cannot load
      gpu_target.devices(args.target)
    else:
      gpu_target.parse(args.target)
      if not os.path.isfile(args.hlo):
        raise ValueError(f"--hlo {args.hlo}: no such file (an XLA dump's "
                         "*after_optimizations.txt, e.g. from XLA_FLAGS=--xla_dump_to=DIR)")
  except (ConfigError, ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  hlo_text = _read_hlo(args.hlo) if args.hlo else None
  try:  # the layout against the target's devices (mesh sizes, kernels) is checked here
    r = predict_config(cfg, args.target, hlo_text, args.top)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  if args.json:
    print(json.dumps(dataclasses.asdict(r), indent=1))
  else:
    print(summary.format_summary(r, f"{args.config or 'the default config (tiny)'} "
                                   f"{' '.join(args.overrides)} on {args.target}"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
