"""Every GPU train-step row measured so far, and the optimised XLA:GPU HLO of each row's step
compiled for the GPU it ran on from the code it was measured on: what `jscale.predict` is
calibrated and checked against.

  python scripts/measured_rows.py                     # compile (or reuse) all rows, print a table
  python scripts/measured_rows.py --only h200_1b_selective_b4,h100_main_xla_selective_b4

  from measured_rows import ROWS, hlo_text, compile_info
  text = hlo_text(ROWS[0])        # compiled.as_text() of the row's step (cached)

Rows at 29f9f33 (+ the bf16-dots experiment's patch) compile inside a detached git worktree of
that commit under the cache dir; rows whose commit has this checkout's model code (jscale/
but jscale/analysis/ except introspect.py, pallas_kernels/, configs/) compile with this
checkout. Each compile runs `scripts/dump_step_hlo.py` in its own process (how the flags and
memory limit are set: its docstring). The measured figures and where they come from:
`measured_data.py`.

Without a GPU XLA cannot autotune gemms: every dot stays a Triton gemm fusion, where the GPU
ran cuBLAS for most (nvjet_* / sm90_xmma_* in the profiles). `xla_flags=CUBLAS_GEMMS` compiles
the all-cuBLAS program instead (its own cache entry). Compiled memory (arguments + temps +
outputs - aliased) against the measured peak, jax 0.10.2: all-cuBLAS within 0.6 GiB on 19 of
the 21 rows with a peak (llama3_3b full b2 +3.1; the xla-attention row +12.3, where the Triton
default is -0.3); the Triton default is 1.6-11.9 GiB low on six rows (at 29f9f33 the fp32
(TF32) cuBLAS gemms need materialised fp32 operands; Triton fusions convert inside).

Cache (`--cache`, default .cache/predict_hlo/): hlo/<row>__<key>.hlo.txt.gz and .json (the
record `compile_info` returns), worktrees/<commit>[+<patch sha>]/, gpu_target/ (the copy).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measured_data import ROWS, Row, by_name  # noqa: E402  pylint: disable=wrong-import-position

__all__ = ["ROWS", "Row", "by_name", "hlo_text", "compile_info", "DEFAULT_CACHE", "CUBLAS_GEMMS"]
CUBLAS_GEMMS = "--xla_gpu_enable_triton_gemm=false"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.path.join(REPO, ".cache", "predict_hlo")
DRIVER = os.path.join(REPO, "scripts", "dump_step_hlo.py")
GPU_TARGET = os.path.join(REPO, "jscale", "analysis", "gpu_target.py")
GPU_SPECS = os.path.join(REPO, "jscale", "analysis", "gpu_specs")
# What the compiled step depends on (pathspec groups: git excludes win over includes, so
# introspect.py gets its own); a commit equal to this checkout here compiles with it.
CODE_PATHS = (("jscale", ":(exclude)jscale/analysis", "pallas_kernels", "configs"),
              ("jscale/analysis/introspect.py",))
TIMEOUT_S = 1800
# XLA's warning when a step does not fit the memory limit (the H100 'xla attention' row had it).
_REMAT = re.compile(r"Can't reduce memory use below .*")


def _git(*args: str, cwd: str = REPO) -> str:
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                        text=True).stdout.strip()


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def _jax_version() -> str:
  from importlib.metadata import version  # pylint: disable=import-outside-toplevel
  return f"jax {version('jax')} jaxlib {version('jaxlib')} plugin {version('jax-cuda13-plugin')}"


def _same_code_as_here(commit: str) -> bool:
  """This checkout's compiled-step code (committed and not) equals `commit`'s."""
  return all(subprocess.run(["git", "diff", "--quiet", commit, "--", *paths],
                            cwd=REPO).returncode == 0 for paths in CODE_PATHS)


def _gpu_target_dir(cache: str) -> str:
  """Today's gpu_target module and specs copied beside the worktrees (older commits lack them)."""
  out = os.path.join(cache, "gpu_target")
  os.makedirs(out, exist_ok=True)
  shutil.copyfile(GPU_TARGET, os.path.join(out, "gpu_target.py"))
  shutil.copytree(GPU_SPECS, os.path.join(out, "gpu_specs"), dirs_exist_ok=True)
  return out


def _key(row: Row, commit: str, patch: bytes, xla_flags: str) -> str:
  specs = b"".join(_read(os.path.join(GPU_SPECS, n)) for n in sorted(os.listdir(GPU_SPECS)))
  parts = {"commit": commit, "patch": _sha(patch) if patch else None,
           "config": row.config, "overrides": list(row.overrides), "target": row.target,
           "mem_fraction": row.mem_fraction, "xla_flags": xla_flags,
           "jax": _jax_version(), "specs": _sha(specs),
           "gpu_target": _sha(_read(GPU_TARGET)), "driver": _sha(_read(DRIVER))}
  return _sha(json.dumps(parts, sort_keys=True).encode())[:20]


def _worktree(cache: str, commit: str, patch_path: str | None, patch: bytes) -> str:
  """A detached worktree of `commit` with `patch` applied, made once under the cache."""
  name = commit[:12] + (f"+{_sha(patch)[:8]}" if patch else "")
  path = os.path.join(cache, "worktrees", name)
  done = path + ".ready"
  if os.path.exists(done) and os.path.isdir(path):
    return path
  if os.path.isdir(path):
    _git("worktree", "remove", "--force", path)
  _git("worktree", "prune")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  _git("worktree", "add", "--detach", path, commit)
  if patch_path:
    _git("apply", os.path.join(REPO, patch_path), cwd=path)
  with open(done, "w", encoding="utf-8") as f:
    f.write(f"{commit} {patch_path or ''}\n")
  return path


def compile_info(row: Row, cache_dir: str | None = None, xla_flags: str = "",
                 force: bool = False) -> dict:
  """Compiles `row`'s step unless cached; returns its record: memory (bytes: temp, argument,
  output, alias), compile seconds, flags, XLA's warnings, `hlo_path` (gzipped text), `cached`.

  `xla_flags`: extra XLA flags for this compile (a separate cache entry), e.g.
  "--xla_gpu_enable_triton_gemm=false": without a GPU XLA cannot autotune and keeps every gemm
  a Triton fusion, where on the GPU the autotuner picked cuBLAS for many (profiles: nvjet_*,
  sm90_xmma_*); all-cuBLAS is the other bound."""
  cache = os.path.abspath(cache_dir or DEFAULT_CACHE)
  commit = _git("rev-parse", f"{row.commit}^{{commit}}")
  patch = _read(os.path.join(REPO, row.patch)) if row.patch else b""
  key = _key(row, commit, patch, xla_flags)
  prefix = os.path.join(cache, "hlo", f"{row.name}__{key}")
  if not force and os.path.exists(prefix + ".json") and os.path.exists(prefix + ".hlo.txt.gz"):
    with open(prefix + ".json", encoding="utf-8") as f:
      return {**json.load(f), "hlo_path": prefix + ".hlo.txt.gz", "cached": True}
  os.makedirs(os.path.dirname(prefix), exist_ok=True)
  here = not patch and _same_code_as_here(commit)
  code = REPO if here else _worktree(cache, commit, row.patch, patch)
  cmd = [sys.executable, DRIVER, "--code", code, "--gpu-target", _gpu_target_dir(cache),
         "--target", row.target, "--config", row.config,
         "--overrides", json.dumps(list(row.overrides)),
         "--mem-fraction", str(row.mem_fraction), "--out", prefix]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  # CPU JAX (the CUDA plugin cannot start without a GPU; the topology compile still uses it).
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=code, XLA_FLAGS=xla_flags)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
    raise RuntimeError(f"{row.name}: compile failed (rc {proc.returncode}):\n{tail}")
  with open(prefix + ".json", encoding="utf-8") as f:
    meta = json.load(f)
  meta.update(row=row.name, commit=commit, patch=row.patch, key=key, wall_s=wall,
              extra_xla_flags=xla_flags,
              code="this checkout" if here else os.path.relpath(code, cache),
              warnings=[m.group(0)[:300] for m in map(_REMAT.search, proc.stderr.splitlines())
                        if m])
  with open(prefix + ".json", "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  return {**meta, "hlo_path": prefix + ".hlo.txt.gz", "cached": False}


def hlo_text(row: Row, cache_dir: str | None = None, xla_flags: str = "") -> str:
  """The optimised HLO text (`compiled.as_text()`) of `row`'s train step for its target."""
  info = compile_info(row, cache_dir, xla_flags)
  with gzip.open(info["hlo_path"], "rt", encoding="utf-8") as f:
    return f.read()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description="Compile every measured row's step; print a table.")
  p.add_argument("--only", default="", help="comma-separated row names")
  p.add_argument("--cache", default=DEFAULT_CACHE)
  p.add_argument("--xla-flags", default="", help="extra XLA flags (a separate cache entry)")
  p.add_argument("--force", action="store_true", help="recompile cached rows")
  a = p.parse_args(argv)
  rows = [by_name(n) for n in a.only.split(",") if n] if a.only else list(ROWS)
  gib = lambda b: b / 2 ** 30
  print(f"{'row':38} {'commit':13} {'target':6} {'compile_s':>9} {'temp':>5} {'total':>5} "
        f"{'measured':>8} {'hlo_MB':>6}  error / XLA warning", flush=True)
  failed = 0
  for row in rows:
    commit = row.commit + ("+patch" if row.patch else "")
    try:
      info = compile_info(row, a.cache, a.xla_flags, a.force)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      failed += 1
      last = str(e).strip().splitlines()[-1][:160]
      print(f"{row.name:38} {commit:13} {row.target:6} {'-':>9} {'-':>5} {'-':>5} {'-':>8} "
            f"{'-':>6}  ERROR {last}", flush=True)
      continue
    m = info["memory"]
    total = gib(m["temp"] + m["argument"] + m["output"] - m["alias"])
    peak = f"{row.peak_gib:.1f}" if row.peak_gib else "-"
    secs = f"{info['total_s']:.0f}" + ("c" if info["cached"] else "")
    print(f"{row.name:38} {commit:13} {row.target:6} {secs:>9} {gib(m['temp']):5.1f} "
          f"{total:5.1f} {peak:>8} {info['hlo_chars'] / 1e6:6.2f}  "
          f"{'; '.join(info.get('warnings', []))[:100]}", flush=True)
  print("GiB: temp = temporaries, total = arguments + temp + outputs - aliased, measured = the "
        "run's peak; compile_s: lower + compile ('c': cached)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
