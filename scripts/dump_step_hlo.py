"""Compile one train step for a GPU target as a given checkout's launcher did; write its
optimised HLO text and memory analysis. Run by `scripts/measured_rows.py` in a subprocess,
with the checkout (this repo, or a git worktree of an older commit) as working directory.

  python dump_step_hlo.py --code ROOT --gpu-target DIR --target h100x1 --mem-fraction 0.75 \
      --overrides '["model.preset=llama3_1b", ...]' --out PREFIX

Only APIs that exist back to 29f9f33 are used: `load_config` (jscale.config_load, or
jscale.config before it moved), `compile_train_step(cfg, devices)` (jscale.analysis.introspect,
or jscale.introspect). How the launcher's XLA flags reach the compiler follows the checkout:

* a checkout with `introspect.compile_as_launched` passes the overlap flags as
  compiler_options itself (what `python -m jscale.train` set there);
* an older one gets them as `python -m jscale.train` gave them: its own `xla_flags.apply()`
  puts them in XLA_FLAGS before JAX starts.

On a GPU, JAX compiles with `device_memory_size` = its allocator's limit (total memory x
XLA_PYTHON_CLIENT_MEM_FRACTION), which XLA:GPU's scheduler and rematerialisation budget
against; a compile for a topology has no allocator and would use 0.8 x total instead. The
same limit is set here (`gpu_target.launched_memory`; today's `compile_as_launched` sets the
launcher's own, the same figure at 0.9).

Extra XLA flags (e.g. --xla_gpu_enable_triton_gemm=false) come in through XLA_FLAGS; the old
launcher's apply() keeps them, and compiler_options only add the overlap flags.

The GPU description comes from `--gpu-target`: a copy of today's jscale.analysis.gpu_target
and its gpu_specs/ (older checkouts have none).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--code", required=True, help="checkout root to import jscale from")
  p.add_argument("--gpu-target", required=True, help="dir with gpu_target.py and gpu_specs/")
  p.add_argument("--target", required=True, help="e.g. h100x1")
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--overrides", required=True, help="JSON list of key=value")
  p.add_argument("--mem-fraction", type=float, required=True)
  p.add_argument("--out", required=True, help="prefix: writes PREFIX.hlo.txt.gz, PREFIX.json")
  a = p.parse_args()

  code, gpu_dir, out = (os.path.abspath(x) for x in (a.code, a.gpu_target, a.out))
  os.chdir(code)  # configs/ and the launcher's relative paths are the checkout's
  sys.path[:0] = [code, gpu_dir]
  introspect_file = os.path.join(code, "jscale", "analysis", "introspect.py")
  with_options = (os.path.exists(introspect_file) and
                  "def compile_as_launched" in open(introspect_file, encoding="utf-8").read())
  if not with_options:
    from jscale import xla_flags  # pylint: disable=import-outside-toplevel
    xla_flags.apply()  # the old launcher's XLA_FLAGS, before JAX starts

  import jax  # pylint: disable=import-outside-toplevel
  import gpu_target  # pylint: disable=import-outside-toplevel  (the copy)

  spec_dir = os.path.join(gpu_dir, "gpu_specs")
  gpu_target.spec = lambda gpu: open(os.path.join(spec_dir, gpu_target.TARGETS[gpu]),
                                     encoding="utf-8").read()
  gpu, _ = gpu_target.parse(a.target)
  total = int(re.search(r"device_memory_size:\s*(\d+)", gpu_target.spec(gpu)).group(1))
  device_memory_size = int(total * a.mem_fraction)

  try:
    from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  except ImportError:
    from jscale.config import load_config  # pylint: disable=import-outside-toplevel
  try:
    from jscale.analysis import introspect  # pylint: disable=import-outside-toplevel
  except ImportError:
    from jscale import introspect  # pylint: disable=import-outside-toplevel

  cfg = load_config(a.config, json.loads(a.overrides))
  t0 = time.perf_counter()
  with gpu_target.launched_memory(device_memory_size):
    compiled, times = introspect.compile_train_step(cfg, gpu_target.devices(a.target))
  total_s = time.perf_counter() - t0
  text = compiled.as_text()
  m = compiled.memory_analysis()
  meta = {
      "memory": {"temp": m.temp_size_in_bytes, "argument": m.argument_size_in_bytes,
                 "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
                 "generated_code": m.generated_code_size_in_bytes},
      "lower_s": times["lower_s"], "compile_s": times["compile_s"], "total_s": total_s,
      "hlo_chars": len(text), "jax": jax.__version__,
      "flags_via": "compiler_options" if with_options else "XLA_FLAGS",
      "xla_flags_env": os.environ.get("XLA_FLAGS", ""),
      "device_memory_size": device_memory_size, "mem_fraction": a.mem_fraction,
      "device_kind": gpu_target.devices(a.target)[0].device_kind,
  }
  with gzip.open(out + ".hlo.txt.gz.tmp", "wt", encoding="utf-8") as f:
    f.write(text)
  os.replace(out + ".hlo.txt.gz.tmp", out + ".hlo.txt.gz")
  with open(out + ".json.tmp", "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  os.replace(out + ".json.tmp", out + ".json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
