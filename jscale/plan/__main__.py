"""`python -m jscale.plan`: which layout to train a model with, estimated and ranked.

    python -m jscale.plan --model llama3_70b --gpus 64 --seq 4096 --global-batch-tokens 4M
    python -m jscale.plan --model configs/tiny.yaml --gpus 8 --seq 256 --global-batch-tokens 16k \\
        --verify 3                       # AOT-compile the top 3 on 8 simulated CPU devices
    python -m jscale.plan --model llama3_8b --gpus 8 --seq 4096 --global-batch-tokens 1M \\
        --verify 3 --target h100x8       # ... with XLA:GPU for 8 H100s (CUDA plugin, no GPU)
        [--rank compiled]                # ... ordered by their programs' predicted step time

Enumerates every layout jscale can run (`jscale.plan.layout`), estimates per-device memory
(`jscale.plan.memory`) and step time (`jscale.plan.cost`), and prints the fastest that fit,
each with the `python -m jscale.train` overrides that run it. `--explain` prints every term,
`--json` the rows for tools, `--plot` a picture of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jscale import exit_codes, hardware
from jscale.config import ConfigError

COMPILED_TOP = 10  # layouts `--rank compiled` compiles unless --verify says otherwise
# GPUs whose HBM bandwidth jscale measured: the planner prices memory-bound passes by it.
PLANNABLE = tuple(name for name, g in hardware.GPUS.items() if g.hbm_bytes_s)
_SUFFIX = {"k": 2**10, "m": 2**20, "g": 2**30}  # 4M tokens = 1024 x 4096 (playbook)


def _count(text: str) -> int:
  t = text.strip().lower()
  try:
    return int(float(t[:-1]) * _SUFFIX[t[-1]]) if t and t[-1] in _SUFFIX else int(float(t))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 4M, 512k, 4194304)")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jscale.plan", description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True,
                 help="a preset (llama3_8b, mixtral_8x7b, ...) or a config YAML file")
  p.add_argument("--gpus", type=int, required=True, help="devices in the run")
  p.add_argument("--gpu", default="h100",
                 help="device type: one of jscale/hardware.py's measured GPUs (h100, h200)")
  p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
  p.add_argument("--global-batch-tokens", type=_count, required=True,
                 help="tokens per optimizer step (4M = 4 x 2^20, 512k, or a number)")
  p.add_argument("--top", type=int, default=10, help="rows to print")
  p.add_argument("--max-tensor", type=int, default=None,
                 help="largest mesh.tensor to consider (default: GPUs per node)")
  p.add_argument("--moments-dtype", choices=("float32", "bfloat16"), default="float32",
                 help="train.moments_dtype of the run: Adam's moments in bf16 halve their "
                 "memory and update traffic")
  p.add_argument("--explain", action="store_true", help="every memory and time term per row")
  p.add_argument("--json", action="store_true", help="rows as JSON (stdout)")
  p.add_argument("--plot", default=None, metavar="PNG",
                 help="memory by term and step time by part for the rows shown")
  p.add_argument("--verify", type=int, default=0, metavar="N",
                 help="AOT-compile the top N on simulated CPU devices and print the compiled "
                 "memory and collectives beside the estimate")
  p.add_argument("--rank", choices=("estimate", "compiled"), default="estimate",
                 help="order --verify's layouts by the planner's estimate, or by the step time "
                 "`jscale.predict` gives their compiled programs (needs --target; --verify "
                 f"defaults to {COMPILED_TOP} then)")
  p.add_argument("--compile-budget-s", type=float, default=900.0, metavar="S",
                 help="--verify compiles no further layout once this many seconds have gone")
  p.add_argument("--collectives", choices=("xla", "manual", "both"), default="xla",
                 help="parallel.collectives of the --verify compiles of the layouts that run in "
                 "either (manual ones compile in manual; both: each layout in "
                 "each mode; with --rank compiled the faster program of the two ranks)")
  p.add_argument("--schedule-costs", choices=("default", "predicted", "both"),
                 default="default", help="parallel.schedule_costs of the --verify compiles "
                 "for --target (predicted: XLA's scheduler told the predicted kernel times; "
                 "both: each layout each way, and with --rank compiled the faster ranks)")
  p.add_argument("--scan-layers", choices=("true", "false", "both"), default="true",
                 help="model.scan_layers of the --verify compiles (false: the layers unrolled "
                 "into straight-line code; both: each layout each way, and with --rank compiled "
                 "the faster ranks)")
  p.add_argument("--target", default=None, metavar="GPUxN",
                 help="compile --verify's layouts with the real XLA:GPU compiler for N GPUs "
                 "(h100x8: N = --gpus) instead of on simulated CPU devices; needs JAX's CUDA "
                 "plugin and cuDNN (pip install -e '.[gpu-compile]'), not a GPU")
  p.add_argument("overrides", nargs="*", help="model.* overrides (model.dtype=float32, ...)")
  return p


def _model(spec: str, overrides: list[str]):
  from jscale.config_load import load_config
  from jscale.presets import PRESETS
  if os.path.isfile(spec):
    return load_config(spec, overrides).model
  if spec not in PRESETS:
    raise ConfigError(f"--model {spec!r} is neither a config file nor a preset: choose a file or "
                      f"one of {', '.join(sorted(PRESETS))}")
  return load_config(None, [f"model.preset={spec}", *overrides]).model


def _target_devices(args):
  """--target's GPU descriptions (None: simulated CPU devices); ValueError / RuntimeError say
  what to change or install."""
  if args.target is None:
    return None
  from jscale.analysis import gpu_target
  _, n = gpu_target.parse(args.target)
  if n != args.gpus:
    raise ValueError(f"--target {args.target} compiles for {n} GPUs but --gpus is {args.gpus}: "
                     f"make them equal")
  return gpu_target.devices(args.target)


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; exit 2 with one line for bad input."""
  args = _parser().parse_args(argv)
  if args.rank == "compiled" and not args.verify:
    args.verify = COMPILED_TOP
  # Imported here: --verify sets the simulated device count before JAX starts. Nothing runs on
  # a device: CPU is the platform even where GPUs are present (--target compiles for GPUs
  # from their descriptions), which also keeps a CUDA plugin without a GPU quiet.
  if args.verify:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.gpus}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from jscale.plan import listing
  from jscale.plan.rank import rank
  try:
    if args.gpu not in PLANNABLE:
      raise ConfigError(f"--gpu {args.gpu!r}: the planner knows the measured HBM bandwidth "
                        f"of {', '.join(PLANNABLE)} only (jscale/hardware.py)")
    model = _model(args.model, args.overrides)
    gpu = hardware.GPUS[args.gpu]
    if args.schedule_costs != "default" and not args.target:
      raise ValueError("--schedule-costs tells XLA:GPU's scheduler the predicted kernel "
                       "times: give --target (e.g. h100x8)")
    if args.rank == "compiled" and not args.target:
      raise ValueError("--rank compiled orders the compiled programs by their predicted step "
                       "time on GPUs: give --target (e.g. h100x8)")
    devices = _target_devices(args) if args.verify else None
    rows = rank(model, args.gpus, args.seq, args.global_batch_tokens, gpu,
                include_unfit=True, max_tensor=args.max_tensor, moments=args.moments_dtype)
  except (ConfigError, ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.BAD_INPUT
  fitting = [r for r in rows if r.fits]
  shown = (fitting or rows)[:args.top]
  if args.json:
    print(json.dumps([listing.as_dict(r, args.seq, gpu) for r in shown], indent=1))
  else:
    print(listing.header(model, args, gpu, len(rows), len(fitting)))
    print(listing.table(shown, args.seq, gpu, args.explain))
  if args.plot:
    from jscale.plan import plot
    print(f"wrote {plot.plot(shown, shown[0].limit, args.plot)}", file=sys.stderr)
  if args.verify:
    from jscale.plan import verify
    checked = _compile((fitting or rows)[:args.verify], args, gpu, devices)
    if args.rank == "compiled":  # a program that does not fit ranks after every one that does
      checked.sort(key=lambda r: (not r["fits_compiled"], r["step_compiled"]))
      n = len(checked)  # programs: a layout compiles once per mode, schedule and loop asked
      print(f"--verify's {n} compiled program{'' if n == 1 else 's'}, the fastest that fits "
            "first (those that do not fit last, marked):")
    for r in checked:
      print(verify.describe(r))
  return 0 if fitting else 1


MODES = {"xla": ("xla",), "manual": ("manual",), "both": ("xla", "manual")}
COSTS = {"default": ("default",), "predicted": ("predicted",), "both": ("default", "predicted")}
SCANS = {"true": (True,), "false": (False,), "both": (True, False)}


def _compile(rows, args, gpu, devices) -> list[dict]:
  """`verify.compare` of each row in order (in each of --collectives' modes and
  --schedule-costs' schedules, --scan-layers' loops), a progress line each on stderr, until
  --compile-budget-s has gone (the rest are said to be left out)."""
  from jscale.plan import verify
  start, out = time.monotonic(), []
  # a layout that needs the hand-written collectives (`Layout.collectives`) compiles in manual
  todo = [(row, mode, costs, scan) for row in rows
          for mode in (("manual",) if row.layout.collectives == "manual"
                       else MODES[args.collectives])
          for costs in COSTS[args.schedule_costs] for scan in SCANS[args.scan_layers]]
  for i, (row, mode, costs, scan) in enumerate(todo):
    if i and time.monotonic() - start > args.compile_budget_s:  # the first always compiles
      print(f"compile budget of {args.compile_budget_s:.0f} s spent: compiles {i + 1}-"
            f"{len(todo)} left out (raise --compile-budget-s)", file=sys.stderr, flush=True)
      break
    t0 = time.monotonic()
    out.append(verify.compare(args.model, args.overrides, row, args.seq, gpu, devices,
                              collectives=mode, schedule_costs=costs, scan_layers=scan))
    print(f"compiled {i + 1}/{len(todo)}: {out[-1]['layout']} in "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
  return out


if __name__ == "__main__":
  sys.exit(main())
