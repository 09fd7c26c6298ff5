"""A lent GPU's half hour, planned: the measurements the open issues wait for, as parts that
each fit one call of the device tool (10 minutes), with what the GPU image lacks carried in.

Here, on a machine with the package registries (once per checkout):
  python scripts/gpu_session.py wheels       # cp312 wheels the image lacks -> .whl/ (git-ignored)
There, one device-tool call per part, `carry: [".whl"]`:
  python3 scripts/gpu_session.py run train   # issue 16: llama3_1b / 8B-shaped rows of bench_train
  python3 scripts/gpu_session.py run kernels # issue 19: compiled Hopper kernel tests, bench_kernels
  python3 scripts/gpu_session.py run moe     # issue 20: grouped matmul kernels, MoE training rows
  python3 scripts/gpu_session.py run fp8     # issue 18: FP8 gemms and llama3_1b rows
  python3 scripts/gpu_session.py run deepseek  # issue 41: DeepSeek-V3 16B-like MFU
  python3 scripts/gpu_session.py run unrolled  # issue 49: the layers unrolled vs the layer scan
  python3 scripts/gpu_session.py run memory  # issue 49: a layout the remat pass warned about (H100)
  python3 scripts/gpu_session.py run memory_h200  # the same on an H200 (measured 2026-11-28)
  python3 scripts/gpu_session.py run curves  # issue 18: FP8's 200-step loss curves
  python3 scripts/gpu_session.py run long_context  # issues 51/52: 8B at 32k, document mask
  python3 scripts/gpu_session.py run pipeline_modes  # jax 0.11's spelling of the pipeliner modes
  python3 scripts/gpu_session.py run jax011_checks  # compiled kernel tests and GPU targets, jax 0.11
  python3 scripts/gpu_session.py run followup_50  # issue 50: FP8 gathers, the proxy (run 11-30)
  python3 scripts/gpu_session.py run loss_passes  # issue 50: cuDNN MLA, 1408 columns, zero fills, loss passes, proxy
  python3 scripts/gpu_session.py plan        # every part's commands, runnable by hand
A part installs the wheels into /tmp/site (no network there), runs its commands in order, each
with what is left of --budget-s (default 540 s, under the tool's 600), logs to $OUT/<part>.log
and copies the result files it wrote into $OUT (the tool brings back at most 8). A command cut
off by the budget is reported and the part goes on. The benchmarks write their tables as rows
finish, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What jscale needs beyond the GPU image's packages (/work/.library/device/KINDS.md lists them):
# grain and its two missing requirements, and tensorboardX.
WHEELS = ("grain==0.2.18", "array_record==0.8.6", "portpicker==1.6.0", "tensorboardX==2.6.5")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")
PY = "python3"
MIN_LEFT_S = 30  # a command is not started with less of the budget left
HOPPER_TESTS = ["tests/kernels/test_hopper_attention.py", "tests/kernels/test_hopper_rms_norm.py",
                "tests/kernels/test_grouped_matmul.py"]
# part -> [(label, argv, extra environment, result files it writes)]
PARTS: dict[str, list[tuple[str, list[str], dict, list[str]]]] = {
    # Issue 38: the rows jscale.predict needs most, in one call of <= 8 minutes (start-up
    # included): llama3_1b as configured, the 8B-shaped row, the Hopper kernels compiled and
    # timed at the model's shapes, MoE dropless. `second` holds the rest.
    "first": [
        ("bench_train: llama3_1b default (b8 selective) and 8B-shaped rows",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "1b selective b8,8b-8L selective b2"], {},
         ["results/bench_train.md", "results/bench_train.csv"]),
        ("Hopper kernels compiled: values and gradients against the references",
         [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *HOPPER_TESTS[:2], "-k",
          "on_hopper"], {"JAX_PLATFORMS": "cuda"}, []),
        ("bench_kernels: attention TFLOP/s and RMSNorm GB/s at llama3_1b's shapes",
         [PY, "scripts/bench_kernels.py", "--seq", "4096", "--head-dim", "64", "--norm-dims",
          "2048,4096", "--repeats", "2"], {},
         ["results/bench_kernels.md", "results/bench_kernels.csv"]),
        ("bench_moe_gpu: dropless with the grouped matmul kernel",
         [PY, "scripts/bench_moe_gpu.py", "--part", "train", "--steps", "15", "--only",
          "dropless pallas"], {}, ["results/bench_moe_gpu.md", "results/bench_moe_gpu.csv"]),
    ],
    "second": [
        ("bench_train: llama3_1b pallas and b4 rows",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "1b selective b4,1b selective b4 pallas", "--out", "results/bench_train_second.md"],
         {}, ["results/bench_train_second.md", "results/bench_train_second.csv"]),
        ("bench_moe_gpu: capacity 1.25 against dropless", [PY, "scripts/bench_moe_gpu.py",
         "--part", "train", "--steps", "15", "--only", "capacity 1.25", "--out",
         "results/bench_moe_gpu_second.md"], {},
         ["results/bench_moe_gpu_second.md", "results/bench_moe_gpu_second.csv"]),
        ("bench_fp8: FP8 gemms", [PY, "scripts/bench_fp8.py", "--only", "gemm"], {},
         ["results/bench_fp8.md", "results/bench_fp8.csv"]),
    ],
    "train": [
        ("bench_train: llama3_1b (cuDNN, Pallas) and 8B-shaped rows",
         [PY, "scripts/bench_train.py", "--exact", "--only",
          "1b selective b4,1b selective b8,1b selective b4 pallas,8b-8L selective b2"], {},
         ["results/bench_train.md", "results/bench_train.csv"]),
    ],
    "kernels": [
        ("Hopper kernels compiled: values and gradients against the references",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *HOPPER_TESTS, "-k", "on_hopper"],
         {"JAX_PLATFORMS": "cuda"}, []),
        ("bench_kernels: attention TFLOP/s and RMSNorm GB/s",
         [PY, "scripts/bench_kernels.py", "--seq", "2048,4096,8192"], {},
         ["results/bench_kernels.md", "results/bench_kernels.csv"]),
    ],
    "moe": [
        ("bench_moe_gpu: grouped matmul kernels",
         [PY, "scripts/bench_moe_gpu.py", "--part", "kernels", "--no-sweep"], {},
         ["results/bench_moe_gpu_kernels.md", "results/bench_moe_gpu_kernels.csv"]),
        ("bench_moe_gpu: dropless (kernel, tiled) against capacity 1.25",
         [PY, "scripts/bench_moe_gpu.py", "--part", "train", "--only",
          "dropless pallas,dropless tiled,capacity 1.25"], {},
         ["results/bench_moe_gpu.md", "results/bench_moe_gpu.csv"]),
    ],
    # What no lent GPU has measured yet, most wanted first, in one call: the compiled rerun of
    # the fixed Hopper NaN case, the DeepSeek-V3 16B proxy (issue 50), FP8 end to end (issue
    # 18), the grouped matmul's rate (the predictor's missing constant), FP8 on the 8B shape.
    # The V schedules need 4 GPUs (one stage per device): no single-GPU lease measures them.
    "unmeasured": [
        ("Hopper attention compiled: the fixed NaN case (d 128, segments) and its neighbours",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", HOPPER_TESTS[0], "-k",
          "on_hopper"], {"JAX_PLATFORMS": "cuda"}, []),
        ("bench_train: DeepSeek-V3 16B-like, 3 layers + MTP", [PY, "scripts/bench_train.py",
         "--exact", "--steps", "15", "--only",
         "dsv3-16b-3L selective b2,dsv3-16b-3L selective b2 bf16 moments", "--out",
         "results/bench_train_deepseek.md"], {},
         ["results/bench_train_deepseek.md", "results/bench_train_deepseek.csv"]),
        ("bench_fp8: llama3_1b bf16 / fp8 delayed / fp8 current end to end",
         [PY, "scripts/bench_fp8.py", "--only", "1b", "--steps", "15"], {},
         ["results/bench_fp8.md", "results/bench_fp8.csv"]),
        ("bench_moe_gpu: grouped matmul kernel rates",
         [PY, "scripts/bench_moe_gpu.py", "--part", "kernels", "--no-sweep"], {},
         ["results/bench_moe_gpu_kernels.md", "results/bench_moe_gpu_kernels.csv"]),
        ("bench_fp8: the 8B shape bf16 / fp8 delayed end to end",
         [PY, "scripts/bench_fp8.py", "--only", "8b", "--steps", "15"], {},
         ["results/bench_fp8.md", "results/bench_fp8.csv"]),
    ],
    # Issue 49: the layers unrolled (model.scan_layers=false) against the layer scan, the lever
    # the peers table's picks use (predicted on an H100: llama3_1b b8 556 -> 528 ms)
    "unrolled": [
        ("bench_train: llama3_1b and the 8B shape, layer scan vs unrolled",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "1b selective b8,1b selective b8 unrolled,8b-8L selective b2,"
          "8b-8L selective b2 unrolled", "--out", "results/bench_train_unrolled.md"], {},
         ["results/bench_train_unrolled.md", "results/bench_train_unrolled.csv"]),
    ],
    # Issue 49: does a step XLA's remat pass warned about run (its buffers fit), and does one
    # whose buffers do not fit run out of memory, as `jscale.predict` says? On an H200
    # (memory_h200, 2026-11-28): the warned batch 8 ran, batch 16 ran out of memory. `memory`
    # is the H100's pair (batch 4 warned, batch 8 over), not yet run.
    "memory": [
        ("memory_check: llama3_1b without recomputation, batch 4 (warned) and 8 (DOES NOT FIT)",
         [PY, "scripts/memory_check.py", "--config", "configs/llama3_1b.yaml", "--layouts",
          "train.batch_size=4 train.remat=none;train.batch_size=8 train.remat=none"], {},
         ["results/memory_check.md"]),
    ],
    "memory_h200": [
        ("memory_check: llama3_1b without recomputation, batch 8 (warned) and 16 (DOES NOT FIT)",
         [PY, "scripts/memory_check.py", "--config", "configs/llama3_1b.yaml", "--layouts",
          "train.batch_size=8 train.remat=none;train.batch_size=16 train.remat=none", "--out",
          "results/memory_check_h200.md"], {}, ["results/memory_check_h200.md"]),
    ],
    # Issue 18: 200 steps of llama3_1b, bf16 against FP8 delayed (run on an H200 2026-11-28:
    # +1.67% final loss), and FP8 current scaling's curve beside them.
    "curves": [
        ("bench_fp8 --curves: llama3_1b 200 steps, bf16 vs fp8 delayed",
         [PY, "scripts/bench_fp8.py", "--curves", "--out", "results/bench_fp8_curves.md"], {},
         ["results/bench_fp8_curves.md", "results/bench_fp8_curves.csv",
          "results/bench_fp8_curves_loss.png"]),
    ],
    "deepseek": [  # issue 41: MFU of a DeepSeek-V3 16B-like shape on one GPU; issue 50: FP8 experts
        ("bench_moe_gpu: the grouped matmul at DeepSeek-V3's expert widths (1408 padded to "
         "whole tiles and on 64-column ones, [gate | up] 2816, down)",
         [PY, "scripts/bench_moe_gpu.py", "--part", "kernels", "--shapes", "deepseek",
          "--no-sweep", "--out", "results/bench_moe_gpu_deepseek.md"], {},
         ["results/bench_moe_gpu_deepseek_kernels.md",
          "results/bench_moe_gpu_deepseek_kernels.csv"]),
        ("bench_train: DeepSeek-V3 16B-like, 3 layers + MTP", [PY, "scripts/bench_train.py",
         "--exact", "--steps", "15", "--only",
         "dsv3-16b-3L selective b2 bf16 moments bf16 logits,"  # issue 50's proxy first
         "dsv3-16b-3L selective b2 bf16 moments fp8 experts rows,"
         "dsv3-16b-3L selective b2,dsv3-16b-3L selective b2 bf16 moments,"
         "dsv3-16b-3L selective b2 bf16 moments fp8 experts", "--out",
         "results/bench_train_deepseek.md"], {},
         ["results/bench_train_deepseek.md", "results/bench_train_deepseek.csv"]),
    ],
    # Issue 52: one GPU's slice of the 128k-on-8-H100s table (scripts/long_context.py): the
    # attention rates beyond seq 8192 that the predictor holds at 8192's, and the 8B shape at
    # 32k tokens with cuDNN and with the Hopper flash kernel. Issue 51: what the document mask
    # costs (scripts/document_mask_cost.py predicts it).
    "long_context": [
        ("bench_kernels: attention at seq 16k and 32k, head 128",
         [PY, "scripts/bench_kernels.py", "--seq", "16384,32768", "--head-dim", "128",
          "--tokens", "32768", "--norm-dims", "4096", "--repeats", "2", "--out",
          "results/bench_kernels_long"], {},
         ["results/bench_kernels_long.md", "results/bench_kernels_long.csv"]),
        ("bench_train: the 8B shape at 32k tokens, cuDNN and the Hopper flash kernel",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "8", "--only",
          "8b-8L full b1 32k,8b-8L full b1 32k pallas", "--out",
          "results/bench_train_long.md"], {},
         ["results/bench_train_long.md", "results/bench_train_long.csv"]),
        ("bench_train: llama3_1b with packed documents masked (issue 51), and without",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "1b selective b4,1b selective b4 document mask", "--out",
          "results/bench_train_documents.md"], {},
         ["results/bench_train_documents.md", "results/bench_train_documents.csv"]),
    ],
    # Issue 50 after the 2026-11-29 lease, in one call: the FP8 tiled experts since their weights
    # gather as 32-bit words (198 ms with byte gathers), the proxy again beside it (both rows'
    # step programs and traces kept, to join measured kernels to predicted ones by name), the
    # kernel at DeepSeek's widths on balanced groups, and the pipeliner modes' spelling. Run
    # 2026-11-30 (135 ms, 41.5%: results/h200_measured/README.md).
    "followup_50": [
        ("compile options: the collective pipeliner's modes under this jax",
         [PY, "scripts/pipeline_modes.py"], {}, []),
        ("bench_train: the proxy (gate and up one parameter), and FP8 experts per expert (tiled, "
         "word gathers)",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "dsv3-16b-3L selective b2 bf16 moments fp8 experts,"
          "dsv3-16b-3L selective b2 bf16 moments bf16 logits", "--out",
          "results/bench_train_deepseek.md", "--keep", "results/kept"], {},
         ["results/bench_train_deepseek.md", "results/bench_train_deepseek.csv",
          *(f"results/kept/dsv3-16b-3L_selective_b2_bf16_moments_{row}.{kind}.gz"
            for row in ("fp8_experts", "bf16_logits") for kind in ("hlo.txt", "xplane.pb"))]),
        ("bench_moe_gpu: the grouped matmul at DeepSeek-V3's widths, balanced groups",
         [PY, "scripts/bench_moe_gpu.py", "--part", "kernels", "--shapes", "deepseek",
          "--no-sweep", "--out", "results/bench_moe_gpu_deepseek.md"], {},
         ["results/bench_moe_gpu_deepseek_kernels.md"]),  # 8 files come back: the log and these
    ],
    # cuDNN's attention at MLA's own head sizes (2026-12-01; V was padded to 192 before) against
    # the plain reference; the tiny DeepSeek's losses with XLA's zero-init elimination on and
    # off (`xla_flags`, 2026-12-01: equal, or the flag comes out); the chunked loss's passes:
    # the online (max, sum-exp) reduction against two plain ones (predicted 0.6 ms a step faster
    # on the proxy, 0.5 GiB more at its peak) and the label's logit gathered (since 2026-11-30)
    # against its masked sum, alone at one chunk of the proxy's head; then the proxy (96 ms
    # measured on an H200 on 2026-11-30), its program and trace kept to join to the prediction
    # (the cuDNN MLA kernel's own rate).
    "loss_passes": [
        ("cuDNN's attention at MLA's head sizes (V 128, Q 192): values and gradients",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
          "tests/model/test_attention_v_head_dim.py", "-k", "on_hopper"],
         {"JAX_PLATFORMS": "cuda"}, []),
        ("the grouped matmul at DeepSeek's 1408 columns, whole tiles and a narrow launch",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
          "tests/kernels/test_grouped_matmul.py", "-k", "hopper"],
         {"JAX_PLATFORMS": "cuda"}, []),
        ("zero_init_parity: the loop outputs' zero fills elided change no loss",
         [PY, "scripts/zero_init_parity.py"], {}, []),
        ("softmax_passes: the loss's passes over a 4096 x 102400 chunk",
         [PY, "scripts/softmax_passes.py"], {}, ["results/softmax_passes.md"]),
        ("bench_train: the proxy, its loss in chunks and whole",
         [PY, "scripts/bench_train.py", "--exact", "--steps", "15", "--only",
          "dsv3-16b-3L selective b2 bf16 moments bf16 logits,"
          "dsv3-16b-3L selective b2 bf16 moments bf16 logits whole", "--out",
          "results/bench_train_deepseek.md", "--keep", "results/kept"], {},
         ["results/bench_train_deepseek.md", "results/bench_train_deepseek.csv",
          *(f"results/kept/dsv3-16b-3L_selective_b2_bf16_moments_bf16_logits{whole}.{kind}.gz"
            for whole in ("", "_whole") for kind in ("hlo.txt", "xplane.pb"))]),
    ],
    # What the 2026-11-30 lease left unrun under jax 0.11.2 once the suite ran there (conftest):
    # the compiled RMSNorm kernels, and the GPU-target test of xla mode's reduce-scatters with
    # the pipeliner's modes given by name (the accumulation cases passed).
    "jax011_checks": [
        ("Hopper kernels compiled: values and gradients against the references",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *HOPPER_TESTS, "-k", "on_hopper"],
         {"JAX_PLATFORMS": "cuda"}, []),
        ("XLA:GPU targets under this jax: the pipeliner's modes as compile options",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/plan/test_gpu_compile.py",
          "-k", "accumulation_leaves_out or reduce_scatters_start"], {}, []),
    ],
    # jax >= 0.11 refuses the pipeliner's booleans as compile options (jscale/xla_flags.py):
    # which spelling of its `xla_gpu_pipeline_*` modes does it take? (seconds, no GPU work)
    "pipeline_modes": [
        ("compile options: the collective pipeliner's modes under this jax",
         [PY, "scripts/pipeline_modes.py"], {}, []),
    ],
    "fp8": [
        ("bench_fp8: FP8 gemms and llama3_1b rows", [PY, "scripts/bench_fp8.py", "--only",
                                                     "gemm,1b"], {},
         ["results/bench_fp8.md", "results/bench_fp8.csv"]),
    ],
}


def wheels(dest: str) -> None:
  """Downloads WHEELS for the GPU image's Python (3.12, x86-64) into `dest`, and makes git
  ignore it (they travel with `carry`, not in a commit)."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", "-d", dest]
  for p in PLATFORMS:
    cmd += ["--platform", p]
  subprocess.run(cmd + list(WHEELS), check=True)
  exclude = os.path.join(ROOT, ".git", "info", "exclude")
  if os.path.isdir(os.path.dirname(exclude)):
    lines = open(exclude, encoding="utf-8").read().split() if os.path.exists(exclude) else []
    if "/.whl/" not in lines:
      with open(exclude, "a", encoding="utf-8") as f:
        f.write("/.whl/\n")
  print(f"{len(glob.glob(os.path.join(dest, '*.whl')))} wheels in {dest}: carry it")


def _install(whl_dir: str, site: str) -> dict:
  """The wheels into `site` (offline); the environment that imports them and jscale."""
  found = glob.glob(os.path.join(whl_dir, "*.whl"))
  if found:
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", site, *found], check=True)
  else:
    print(f"no wheels in {whl_dir}: run `python scripts/gpu_session.py wheels` here first and "
          "carry .whl, or grain / tensorboardX imports fail", flush=True)
  path = os.pathsep.join(p for p in (ROOT, site, os.environ.get("PYTHONPATH", "")) if p)
  return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def run(part: str, budget_s: float, out: str, whl_dir: str, site: str) -> int:
  """Runs one part's commands within `budget_s`; the number that failed or were cut off."""
  deadline = time.monotonic() + budget_s
  env = _install(whl_dir, site)
  os.makedirs(out, exist_ok=True)
  failed = 0
  with open(os.path.join(out, f"{part}.log"), "a", encoding="utf-8") as log:
    for label, argv, extra, results in PARTS[part]:
      left = deadline - time.monotonic()
      if left < MIN_LEFT_S:
        print(f"[{part}] skipped, budget spent: {label}", file=log, flush=True)
        failed += 1
        continue
      print(f"[{part}] {label} ({left:.0f} s left): {' '.join(argv)}", file=log, flush=True)
      start = time.monotonic()
      try:
        proc = subprocess.run(argv, cwd=ROOT, env={**env, **extra}, stdout=log,
                              stderr=subprocess.STDOUT, timeout=left, check=False)
        status = f"rc {proc.returncode}"
        failed += proc.returncode != 0
      except subprocess.TimeoutExpired:
        status, failed = "cut off by the budget", failed + 1
      print(f"[{part}] {label}: {status} after {time.monotonic() - start:.0f} s", file=log,
            flush=True)
      for path in results:
        if os.path.exists(os.path.join(ROOT, path)):
          shutil.copy(os.path.join(ROOT, path), out)
  print(open(os.path.join(out, f"{part}.log"), encoding="utf-8").read()[-6000:])
  return failed


def plan() -> None:
  for part, commands in PARTS.items():
    print(f"# {part}")
    for label, argv, extra, _ in commands:
      env = " ".join(f"{k}={v}" for k, v in extra.items())
      print(f"#   {label}\n{env + ' ' if env else ''}{shlex.join(argv)}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("verb", choices=("wheels", "run", "plan"))
  p.add_argument("part", nargs="?", choices=tuple(PARTS))
  p.add_argument("--budget-s", type=float, default=540)
  p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "results", "gpu")))
  p.add_argument("--wheels-dir", default=os.path.join(ROOT, ".whl"))
  p.add_argument("--site", default="/tmp/site")
  args = p.parse_args(argv)
  if args.verb == "wheels":
    wheels(args.wheels_dir)
  elif args.verb == "plan":
    plan()
  else:
    if args.part is None:
      p.error(f"run needs a part: one of {', '.join(PARTS)}")
    return 1 if run(args.part, args.budget_s, args.out, args.wheels_dir, args.site) else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
