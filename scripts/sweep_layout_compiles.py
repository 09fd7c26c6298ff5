"""Does every layout the planner offers compile? One of each distinct mesh / ZeRO / SP /
schedule of `jscale.plan.layout.candidates`, compiled on simulated CPU devices in the default
collectives mode (a small model: what fails here is the SPMD partitioner, not a size).

    python scripts/sweep_layout_compiles.py [--presets tiny,tiny_moe] [--devices 8] \
        [--collectives xla] [--out results/layout_compile_sweep.md]

A worker process compiles the layouts one after another and reports each; one that kills it
(XLA aborts on a check failure) is recorded with the compiler's last line and a new worker goes
on with the rest. Writes a table of every failure and the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH = 256, 16
SMALL = ["model.n_layers=8", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=128", "checkpoint.every=0"]


def layouts(preset: str, devices: int) -> list[list[str]]:
  """The overrides of one layout per distinct key the planner offers for `preset`."""
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  from jscale.plan.layout import candidates  # pylint: disable=import-outside-toplevel
  model = load_config(None, [f"model.preset={preset}", *SMALL]).model
  seen, out = set(), []
  for lay in candidates(model, devices, SEQ, BATCH):
    key = (lay.data, lay.stage, lay.fsdp, lay.expert, lay.sequence, lay.tensor, lay.schedule,
           lay.virtual_stages, lay.sequence_parallel, lay.zero_stage)
    if key not in seen:
      seen.add(key)
      out.append([f"model.preset={preset}", *SMALL, *lay.overrides(SEQ, devices)])
  return out


def worker(todo: list[list[str]], devices: int) -> None:
  """Compiles each layout of `todo`, printing `START i` and `OK i` / `ERROR i <line>`."""
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS)
  from jscale.analysis import introspect  # pylint: disable=import-outside-toplevel
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  for i, overrides in enumerate(todo):
    print(f"START {i}", flush=True)
    try:
      introspect.compile_train_step(load_config(None, overrides), jax.devices()[:devices])
      print(f"OK {i}", flush=True)
    except Exception as e:  # a refused layout or a compile error: recorded, the sweep goes on
      print(f"ERROR {i} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def sweep(todo: list[list[str]], devices: int) -> list[tuple[list[str], str]]:
  """(overrides, what failed) for each layout that did not compile."""
  failed, start = [], 0
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
         + f" --xla_force_host_platform_device_count={devices}"}
  while start < len(todo):
    rest = todo[start:]
    run = subprocess.run([sys.executable, __file__, "--worker", json.dumps(rest),
                          "--devices", str(devices)], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False)
    done = -1
    for line in run.stdout.splitlines():
      word, _, tail = line.partition(" ")
      if word in ("OK", "ERROR"):
        done = int(tail.split()[0])
        if word == "ERROR":
          failed.append((rest[done], tail.split(" ", 1)[1]))
    if run.returncode != 0:  # killed mid-compile: the layout after the last reported one
      said = [x for x in run.stderr.splitlines() if x.strip()]
      failed.append((rest[done + 1], f"exit {run.returncode}: {said[-1][:200] if said else ''}"))
      done += 1
    start += done + 1
    print(f"{start}/{len(todo)} compiled, {len(failed)} failed", flush=True)
  return failed


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="tiny,tiny_moe")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--collectives", default="xla", choices=("xla", "manual"))
  p.add_argument("--out", default="results/layout_compile_sweep.md")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker is not None:
    worker(json.loads(args.worker), args.devices)
    return
  rows = []
  for preset in args.presets.split(","):
    todo = [[*o, f"parallel.collectives={args.collectives}"]
            for o in layouts(preset, args.devices)]
    failed = sweep(todo, args.devices)
    rows.append((preset, len(todo), failed))
  lines = [f"Layouts the planner offers, one per distinct mesh / ZeRO / SP / schedule, compiled "
           f"on {args.devices} simulated CPU devices in {args.collectives} mode "
           "(`python scripts/sweep_layout_compiles.py`).", "",
           "| model | layouts | compiled | failed |", "|---|---|---|---|"]
  lines += [f"| {m} | {n} | {n - len(f)} | {len(f)} |" for m, n, f in rows]
  for m, _, failed in rows:
    lines += [f"\n{m}: `{' '.join(o)}`: {why}" for o, why in failed]
  path = os.path.join(ROOT, args.out)
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
