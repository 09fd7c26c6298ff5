"""Pallas / Mosaic GPU kernels against XLA / cuDNN on one GPU: attention TFLOP/s, RMSNorm GB/s.

  python scripts/bench_kernels.py [--seq 1024,2048,4096,8192,16384] [--head-dim 64,128]
      [--tokens 16384] [--hidden 2048] [--norm-dims 2048,4096,8192] [--iters 30]
      [--repeats 3] [--warmup 3] [--profile-calls 10] [--attention-sweep] [--norm-sweep]
      [--out results/bench_kernels]
  python scripts/bench_kernels.py --interpret --quick   # CPU smoke run: tiny shapes, interpreter

Timing (scripts/kernel_timing.py), each function jitted and compiled first, two figures per call:
  ms_loop    --warmup calls, then --iters calls dispatched back to back with one block on the
             last result; total / iters, the median of --repeats such loops. Device time for
             calls longer than their dispatch; for shorter ones, the dispatch rate.
  ms_kernel  (GPU only) --profile-calls calls under jax.profiler.trace: the busy time of the
             GPU plane's stream lines (kernels, memcpys, memsets) / calls. Excludes the gaps
             between a call's kernels.
TFLOP/s and GB/s use ms_kernel where it was measured, else ms_loop; each table says which. (The
former method, block_until_ready after every call, read an H100's copy at 1.5 TB/s of ~3.)

Attention: bf16, causal, [B, L, H, K] with B = tokens / L and H = hidden / K (MHA), forward and
forward + backward (a vjp with a fixed cotangent; out, dq, dk, dv returned) of: pallas (the
Triton-lowered flash kernel), xla and cudnn (jax.nn.dot_product_attention), hopper (the Mosaic
GPU kernel in pallas_kernels/flash_attention/hopper.py, when it imports) and tokamax
(implementation="mosaic", when installed); the last three on GPU only. A kernel that is missing
or fails gets a note, not a crash. FLOPs count only the causal half of the scores: forward
4·B·H·L²·K / 2 (QKᵀ and PV), backward 2.5x the forward (FlashAttention-2's convention: QKᵀ
recomputed, dV, dP, dQ, dK), so forward + backward = 3.5x forward. `err` is max |out - out_xla|
of the forward.

RMSNorm: bf16 [N, D] rows, fp32 weight: pallas (pallas_kernels.rms_norm, Triton-lowered),
hopper (pallas_kernels.rms_norm.hopper, Mosaic GPU; Hopper GPUs and the interpreter), xla (the
jnp reference, jitted), triton (jax-triton, when it imports); fwd, fwd+bwd (vjp with a fixed
cotangent; y, dx and dw all returned), and the same fused with the residual add the model uses
(rms_norm(x, w, residual_ND=r) -> (y, h = x + r)). Bytes counted, the traffic an ideal kernel
cannot avoid (e = 2 bytes of x, 4 of w):
  fwd            read x, write y, read w                               2·N·D·e + 4·D
  fwd+bwd        fwd + read x, dy, write dx, read w, write dw          5·N·D·e + 3·4·D
  fused fwd      read x, r, write y, h, read w                         4·N·D·e + 4·D
  fused fwd+bwd  fused fwd + read h, dy, dh, write dx, read w, write dw 8·N·D·e + 3·4·D
(the residual's gradient is dx itself: not returned twice). % of copy is against the best of
three copies of the largest input (read + write 2·N·D·e): x + 1 (an XLA loop fusion), jnp.copy
under jit (an HLO copy of the parameter) and jax.device_put(x, may_alias=False) (a runtime
copy); a copy whose result is the input's own buffer (elided) is reported and not used.

Refuses to run on CPU except as `--interpret --quick` (a smoke run of the script itself:
interpreter timings mean nothing, and there is no kernel time).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_kernels_report as report  # noqa: E402
import kernel_timing  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.rms_norm import reference as xla_rms_norm, rms_norm  # noqa: E402

EPS = 1e-6
# --attention-sweep: Hopper attention tiles changed from its tuned table (hopper_config.TUNED),
# one change per row; a setting that does not fit gets a note.
HOPPER_ATTENTION_SWEEP = {
    "kv64": dict(block_kv=64), "slots3": dict(max_concurrent_steps=3),
    "kv64 slots3": dict(block_kv=64, max_concurrent_steps=3),
    "dkv kv128": dict(block_kv_dkv=128), "dkv q128": dict(block_q_dkv=128),
    "dq kv128": dict(block_kv_dq=128), "dq q128": dict(block_q_dq=128),
}
# --norm-sweep: (slabs in flight, CUDA blocks per SM) of the Hopper RMSNorm, beside its
# default (2, 2); rows per slab follow from the shared-memory budget (hopper_pipeline.rows_for).
HOPPER_NORM_SWEEP = [(1, 4), (2, 1), (3, 1), (4, 1), (2, 3), (3, 2), (2, 4)]


def _reason(e: BaseException) -> str:
  text = str(e).strip()
  first = text.splitlines()[0] if text else ""
  if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
    first = "out of memory"
  return f"{type(e).__name__}: {first[:120]}".rstrip(": ")


def _run(fn, args, opts, *, jit: bool = True):
  """(Timing, the first call's output) of fn(*args), jitted and compiled unless jit=False;
  (Timing(None, note=why), None) when it cannot run (one failed cell, not a failed run)."""
  try:
    f = jax.jit(fn).lower(*args).compile() if jit else fn
    out = jax.block_until_ready(f(*args))
    timing = kernel_timing.measure(f, args, iters=opts.iters, repeats=opts.repeats,
                                   warmup=opts.warmup, profile_calls=opts.profile_calls)
  except Exception as e:  # pylint: disable=broad-except
    return kernel_timing.Timing(None, note=_reason(e)), None
  return timing, out


def _row(bench: str, impl: str, kind: str, timing, **fields) -> dict:
  ms = lambda s: None if s is None else s * 1e3
  return dict(bench=bench, impl=impl, kind=kind, **fields, ms_loop=ms(timing.loop_s),
              ms_kernel=ms(timing.kernel_s), timed=timing.source, note=timing.note)


def _tokamax_attention():
  """(tokamax.dot_product_attention with the Mosaic GPU implementation, None), or (None, why)."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
    fn = tokamax.dot_product_attention
    params = inspect.signature(fn).parameters
  except Exception as e:  # pylint: disable=broad-except  (not installed, or broken imports)
    return None, _reason(e)
  kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  missing = [p for p in ("is_causal", "implementation") if p not in params and not kwargs]
  if missing:
    return None, f"tokamax.dot_product_attention{inspect.signature(fn)} has no {missing}"
  return functools.partial(fn, is_causal=True, implementation="mosaic"), None


def attention_impls(opts, on_gpu: bool):
  """({name: fn(q, k, v)}, [(name, why skipped)])."""
  impls = {"pallas": functools.partial(flash_attention, causal=True, interpret=opts.interpret),
           "xla": functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                    implementation="xla")}
  if not on_gpu:
    return impls, [(n, "GPU only") for n in ("cudnn", "hopper", "tokamax")]
  skipped = []
  impls["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                     implementation="cudnn")
  try:  # in progress elsewhere, Hopper only: a failed import (here) or call (_run) is a note
    hopper = importlib.import_module("pallas_kernels.flash_attention.hopper")
    impls["hopper"] = functools.partial(hopper.flash_attention, causal=True)
    for name, changes in HOPPER_ATTENTION_SWEEP.items() if opts.attention_sweep else ():
      blocks_fn = lambda l, k, c=changes: dataclasses.replace(hopper.blocks_for(l, k), **c)
      impls[f"hopper {name}"] = lambda q, k, v, f=blocks_fn: hopper.flash_attention(
          q, k, v, causal=True, block_sizes=f(q.shape[1], q.shape[-1]))
  except Exception as e:  # pylint: disable=broad-except
    skipped.append(("hopper", _reason(e)))
  fn, why = _tokamax_attention()
  if fn is None:
    skipped.append(("tokamax", why))
  else:
    impls["tokamax"] = fn
  return impls, skipped


def bench_attention(opts, on_gpu: bool) -> list[dict]:
  """Attention rows (fwd and fwd+bwd per impl and shape), and a row per skipped impl."""
  impls, skipped = attention_impls(opts, on_gpu)
  rows = [dict(bench="skipped", impl=n, note=f"attention: {why}") for n, why in skipped]
  for r in rows:
    print(report.fmt(r), flush=True)
  for k in opts.head_dim:
    for l in opts.seq:
      b, h = max(opts.tokens // l, 1), max(opts.hidden // k, 1)
      keys = jax.random.split(jax.random.key(0), 4)
      q, kk, v, do = (jax.random.normal(key, (b, l, h, k), jnp.bfloat16) for key in keys)
      fwd_flops = 4 * b * h * l * l * k / 2
      shape_rows, outs = [], {}
      for name, fn in impls.items():
        def fb(q, k_, v, do, fn=fn):  # the output too, as a step uses it (XLA could skip PV)
          out, vjp = jax.vjp(fn, q, k_, v)
          return (out, *vjp(do))
        for kind, f, args, flops in (("fwd", fn, (q, kk, v), fwd_flops),
                                     ("fwd+bwd", fb, (q, kk, v, do), 3.5 * fwd_flops)):
          timing, out = _run(f, args, opts)
          if kind == "fwd" and out is not None:
            outs[name] = np.asarray(out, np.float32)
          sec = timing.seconds
          shape_rows.append(_row("attention", name, kind, timing, seq=l, head_dim=k, batch=b,
                                 heads=h, flops=flops,
                                 tflops=None if sec is None else flops / sec / 1e12, err=None))
          del out
      for r in shape_rows:  # after every impl ran: xla's output is there to compare with
        if r["kind"] == "fwd" and r["impl"] != "xla" and r["impl"] in outs and "xla" in outs:
          r["err"] = float(np.max(np.abs(outs[r["impl"]] - outs["xla"])))
        print(report.fmt(r), flush=True)
      rows += shape_rows
  return rows


def _same_buffer(a, b) -> bool:
  try:
    return a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
  except Exception:  # pylint: disable=broad-except  (no pointer to compare: assume a copy)
    return False


def bench_copy(opts) -> tuple[list[dict], float | None, str | None]:
  """Copy rows on the largest norm input, and the best GB/s with its copy's name."""
  n, d = opts.tokens, max(opts.norm_dims)
  x = jax.random.normal(jax.random.key(1), (n, d), jnp.bfloat16)
  nbytes = 2 * x.size * x.dtype.itemsize
  dev = jax.devices()[0]
  copies = {"x + 1": (lambda x: x + jnp.asarray(1, x.dtype), True),
            "jit copy": (jnp.copy, True),
            "device_put": (lambda x: jax.device_put(x, dev, may_alias=False), False)}
  rows, best, best_name = [], None, None
  for name, (fn, jit) in copies.items():
    timing, out = _run(fn, (x,), opts, jit=jit)
    if out is not None and _same_buffer(out, x):
      timing = kernel_timing.Timing(None, note="elided: the result is the input's buffer")
    sec = timing.seconds
    gbs = None if sec is None else nbytes / sec / 1e9
    if gbs is not None and (best is None or gbs > best):
      best, best_name = gbs, name
    rows.append(_row("copy", name, "read+write", timing, rows=n, d=d, bytes=nbytes, gbs=gbs))
  for r in rows:
    r["pct_copy"] = None if r["gbs"] is None else 100 * r["gbs"] / best
    print(report.fmt(r), flush=True)
  return rows, best, best_name


def norm_impls(opts, on_gpu: bool):
  """({name: norm(x, w, r=None)} with rms_norm's contract, [(name, why skipped)])."""
  impls = {"pallas": lambda x, w, r=None: rms_norm(x, w, eps=EPS, residual_ND=r,
                                                   interpret=opts.interpret),
           "xla": lambda x, w, r=None: xla_rms_norm(x, w, eps=EPS, residual_ND=r)}
  skipped = []
  capability = str(getattr(jax.devices()[0], "compute_capability", "")) if on_gpu else None
  if opts.interpret or capability.startswith("9"):  # the Mosaic GPU kernels: Hopper only
    from pallas_kernels.rms_norm import hopper  # pylint: disable=import-outside-toplevel
    impls["hopper"] = lambda x, w, r=None: hopper.rms_norm(x, w, eps=EPS, residual_ND=r,
                                                           interpret=opts.interpret)
    for slots, per_sm in HOPPER_NORM_SWEEP if opts.norm_sweep else ():
      blocks = hopper.HopperNormBlocks(max_concurrent_steps=slots, blocks_per_sm=per_sm)
      impls[f"hopper slots={slots} per_sm={per_sm}"] = functools.partial(
          lambda x, w, r=None, b=blocks: hopper.rms_norm(x, w, eps=EPS, residual_ND=r,
                                                         block_sizes=b, interpret=opts.interpret))
  else:
    skipped.append(("hopper", f"compute capability {capability}: not Hopper"))
  if not on_gpu:
    return impls, skipped + [("triton", "GPU only")]
  try:
    importlib.import_module("jax_triton")  # triton_kernel imports it only when called
    from pallas_kernels.rms_norm.triton_kernel import rms_norm_triton  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return impls, skipped + [("triton", _reason(e))]
  impls["triton"] = lambda x, w, r=None: rms_norm_triton(x, w, EPS, residual=r)
  return impls, skipped


def norm_passes(norm, x, w, r, dy, dh) -> dict:
  """{pass: (fn, args, bytes moved)} of one RMSNorm impl (byte model: the module docstring)."""
  e, we, nd, d = x.dtype.itemsize, w.dtype.itemsize, x.size, w.size

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(norm, x, w)
    return (y, *vjp(dy))

  def fused_fwd_bwd(x, w, r, dy, dh):
    (y, h), vjp = jax.vjp(lambda x, w: norm(x, w, r), x, w)
    return (y, h, *vjp((dy, dh)))

  return {"fwd": (norm, (x, w), 2 * nd * e + d * we),
          "fwd+bwd": (fwd_bwd, (x, w, dy), 5 * nd * e + 3 * d * we),
          "fused fwd": (lambda x, w, r: norm(x, w, r), (x, w, r), 4 * nd * e + d * we),
          "fused fwd+bwd": (fused_fwd_bwd, (x, w, r, dy, dh), 8 * nd * e + 3 * d * we)}


def bench_norm(opts, on_gpu: bool, copy_gbs: float | None) -> list[dict]:
  """RMSNorm rows: every pass of every impl per D, with GB/s and % of `copy_gbs`."""
  impls, skipped = norm_impls(opts, on_gpu)
  rows = [dict(bench="skipped", impl=n, note=f"rmsnorm: {why}") for n, why in skipped]
  for r in rows:
    print(report.fmt(r), flush=True)
  n = opts.tokens
  for d in opts.norm_dims:
    keys = jax.random.split(jax.random.key(2), 4)
    x, r, dy, dh = (jax.random.normal(key, (n, d), jnp.bfloat16) for key in keys)
    w = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (d,), jnp.float32)
    for name, norm in impls.items():
      for kind, (fn, args, nbytes) in norm_passes(norm, x, w, r, dy, dh).items():
        timing, _ = _run(fn, args, opts)
        sec = timing.seconds
        gbs = None if sec is None else nbytes / sec / 1e9
        rows.append(_row("rmsnorm", name, kind, timing, rows=n, d=d, bytes=nbytes, gbs=gbs,
                         pct_copy=None if gbs is None or not copy_gbs else 100 * gbs / copy_gbs))
        print(report.fmt(rows[-1]), flush=True)
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ints = lambda s: [int(v) for v in s.split(",")]
  ap.add_argument("--seq", type=ints, default=[1024, 2048, 4096, 8192, 16384])
  ap.add_argument("--head-dim", type=ints, default=[64, 128])
  ap.add_argument("--tokens", type=int, default=16384, help="B x L (attention), N (norm)")
  ap.add_argument("--hidden", type=int, default=2048, help="H x K")
  ap.add_argument("--norm-dims", type=ints, default=[2048, 4096, 8192])
  ap.add_argument("--warmup", type=int, default=3, help="calls before the timed loops")
  ap.add_argument("--iters", type=int, default=30, help="back-to-back calls per timed loop")
  ap.add_argument("--repeats", type=int, default=3, help="timed loops (the median is kept)")
  ap.add_argument("--profile-calls", type=int, default=10,
                  help="calls traced for the kernel time (GPU; 0: no profiler)")
  ap.add_argument("--attention-sweep", action="store_true",
                  help="also time the Hopper attention at each of HOPPER_ATTENTION_SWEEP's tiles")
  ap.add_argument("--norm-sweep", action="store_true",
                  help="also time the Hopper RMSNorm at each of HOPPER_NORM_SWEEP's settings")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke)")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 iterations")
  ap.add_argument("--out", default=None, help="path prefix (default results/bench_kernels, "
                  "with --quick results/bench_kernels_quick)")
  opts = ap.parse_args(argv)
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  if not on_gpu and not (opts.interpret and opts.quick):
    print(f"bench_kernels: a GPU benchmark, and the backend is {backend!r}. The kernels compile "
          "for GPUs (Triton / Mosaic GPU); for a smoke run of this script on CPU use "
          "--interpret --quick (interpreter timings mean nothing).", file=sys.stderr)
    return 2
  if opts.quick:
    opts.seq, opts.head_dim, opts.tokens, opts.hidden = [32], [16], 64, 32
    opts.norm_dims, opts.warmup, opts.iters, opts.repeats = [128], 1, 2, 1
  if not on_gpu:
    opts.profile_calls = 0  # the kernel time reads GPU stream lines; a CPU trace has none
  out = opts.out or ("results/bench_kernels_quick" if opts.quick else "results/bench_kernels")
  dev = jax.devices()[0]
  header = (f"Device: {dev.device_kind} ({backend}), jax {jax.__version__}. Loop time: median of "
            f"{opts.repeats} loops of {opts.iters} back-to-back calls after {opts.warmup} "
            "warm-up calls; kernel time: "
            + (f"profiler, GPU stream busy time over {opts.profile_calls} calls"
               if opts.profile_calls > 0 else "not measured (GPU only)")
            + ("; PALLAS INTERPRETER (smoke run, timings meaningless)" if opts.interpret else "")
            + ".")
  print(header, flush=True)
  rows = bench_attention(opts, on_gpu)
  copies, copy_gbs, copy_name = bench_copy(opts)
  rows += copies + bench_norm(opts, on_gpu, copy_gbs)
  report.write(rows, out, header, copy_gbs, copy_name)
  return 0


if __name__ == "__main__":
  sys.exit(main())
