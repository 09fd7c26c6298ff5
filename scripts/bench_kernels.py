"""Pallas kernels against XLA / cuDNN on one GPU: flash attention TFLOP/s, RMSNorm GB/s.

  python scripts/bench_kernels.py [--seq 1024,2048,4096,8192,16384] [--head-dim 64,128]
      [--tokens 16384] [--hidden 2048] [--norm-dims 2048,4096,8192] [--iters 20]
      [--out results/bench_kernels]
  python scripts/bench_kernels.py --interpret --quick   # CPU smoke run: tiny shapes, interpreter

Attention: bf16, causal, [B, L, H, K] with B = tokens / L and H = hidden / K (MHA), forward and
forward + backward (a vjp with a fixed cotangent) of the Pallas flash kernel, and of
jax.nn.dot_product_attention(implementation="xla") and (implementation="cudnn"). FLOPs count
only the causal half of the scores: forward 4·B·H·L²·K / 2 (QKᵀ and PV, 2 flops a MAC), backward
2.5x the forward (5 matmuls for the forward's 2: QKᵀ recomputed, dV, dP, dQ, dK; FlashAttention-2's
convention), so forward + backward = 3.5x forward. `err` is max |out - out_xla| of the forward.

RMSNorm: bf16 [N, D] rows, fp32 weight; GB/s = (read x + write y + read weight) / time for the
Pallas kernel, the XLA RMSNorm (the model's formula, jitted) and the Triton kernel (jax-triton,
when it imports), against the device's copy bandwidth: x + 1 on the largest input (read +
write: what a memory-bound elementwise op can reach).

Timing: each function jitted and compiled, run --warmup times, then --iters calls each ended by
block_until_ready; the median. Refuses to run on CPU except as `--interpret --quick` (a smoke
run of the script itself: interpreter timings mean nothing).
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.rms_norm import reference as xla_rms_norm, rms_norm  # noqa: E402

EPS = 1e-6


def _time(fn, args, warmup: int, iters: int) -> float:
  """Median seconds of one call of the jitted, compiled `fn(*args)`."""
  compiled = jax.jit(fn).lower(*args).compile()
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _measure(fn, args, opts):
  """(seconds, None), or (None, a short reason) when it cannot run (e.g. out of memory)."""
  try:
    return _time(fn, args, opts.warmup, opts.iters), None
  except Exception as e:  # pylint: disable=broad-except  (one failed cell, not the run)
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "RESOURCE_EXHAUSTED" in reason or "out of memory" in reason.lower():
      reason = "out of memory"
    return None, f"{type(e).__name__}: {reason[:120]}"


def attention_impls(opts, on_gpu: bool):
  impls = {"pallas": functools.partial(flash_attention, causal=True, interpret=opts.interpret),
           "xla": functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                    implementation="xla")}
  if on_gpu:
    impls["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                       implementation="cudnn")
  return impls


def bench_attention(opts, on_gpu: bool) -> list[dict]:
  rows, impls = [], attention_impls(opts, on_gpu)
  for k in opts.head_dim:
    for l in opts.seq:
      b, h = max(opts.tokens // l, 1), max(opts.hidden // k, 1)
      keys = jax.random.split(jax.random.key(0), 4)
      q, kk, v, do = (jax.random.normal(key, (b, l, h, k), jnp.bfloat16) for key in keys)
      fwd_flops = 4 * b * h * l * l * k / 2
      outs = {}
      for name, fn in impls.items():
        try:
          outs[name] = np.asarray(jax.jit(fn)(q, kk, v), np.float32)
        except Exception:  # pylint: disable=broad-except  (reported by _measure below)
          pass
      for name, fn in impls.items():
        fb = lambda q, k_, v, do, fn=fn: jax.vjp(fn, q, k_, v)[1](do)
        for kind, f, args, flops in (("fwd", fn, (q, kk, v), fwd_flops),
                                     ("fwd+bwd", fb, (q, kk, v, do), 3.5 * fwd_flops)):
          sec, note = _measure(f, args, opts)
          err = (float(np.max(np.abs(outs[name] - outs["xla"])))
                 if kind == "fwd" and name != "xla" and name in outs and "xla" in outs else None)
          rows.append(dict(bench="attention", impl=name, seq=l, head_dim=k, batch=b, heads=h,
                           kind=kind, ms=None if sec is None else sec * 1e3,
                           tflops=None if sec is None else flops / sec / 1e12,
                           err=err, note=note or ""))
          print(_fmt(rows[-1]), flush=True)
  return rows


def bench_norm(opts, on_gpu: bool) -> list[dict]:
  impls = {"pallas": functools.partial(rms_norm, eps=EPS, interpret=opts.interpret),
           "xla": functools.partial(xla_rms_norm, eps=EPS)}
  if on_gpu:
    try:
      import jax_triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      from pallas_kernels.rms_norm.triton_kernel import rms_norm_triton  # pylint: disable=import-outside-toplevel
      impls["triton"] = functools.partial(rms_norm_triton, eps=EPS)
    except ImportError as e:
      print(f"jax-triton RMSNorm skipped: {e}", flush=True)
  rows, n = [], opts.tokens
  big = jax.random.normal(jax.random.key(1), (n, max(opts.norm_dims)), jnp.bfloat16)
  copy_sec, note = _measure(lambda x: x + jnp.asarray(1, x.dtype), (big,), opts)
  copy_gbs = None if copy_sec is None else 2 * big.size * 2 / copy_sec / 1e9
  rows.append(dict(bench="rmsnorm", impl="copy (x + 1)", rows=n, d=big.shape[1], kind="fwd",
                   ms=None if copy_sec is None else copy_sec * 1e3, gbs=copy_gbs,
                   pct_copy=None if copy_gbs is None else 100.0, note=note or ""))
  print(_fmt(rows[-1]), flush=True)
  for d in opts.norm_dims:
    x = jax.random.normal(jax.random.key(2), (n, d), jnp.bfloat16)
    w = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (d,), jnp.float32)
    nbytes = 2 * n * d * 2 + d * 4
    for name, fn in impls.items():
      sec, note = _measure(fn, (x, w), opts)
      gbs = None if sec is None else nbytes / sec / 1e9
      rows.append(dict(bench="rmsnorm", impl=name, rows=n, d=d, kind="fwd",
                       ms=None if sec is None else sec * 1e3, gbs=gbs,
                       pct_copy=None if gbs is None or copy_gbs is None else 100 * gbs / copy_gbs,
                       note=note or ""))
      print(_fmt(rows[-1]), flush=True)
  return rows


def _num(v, spec):
  return "-" if v is None else format(v, spec)


def _fmt(r: dict) -> str:
  if r["bench"] == "attention":
    return (f"attention {r['impl']:>6} L={r['seq']:<6} K={r['head_dim']:<4} {r['kind']:<8} "
            f"{_num(r['ms'], '9.3f')} ms {_num(r['tflops'], '8.3g')} TFLOP/s "
            f"err {_num(r['err'], '.2e')} {r['note']}")
  return (f"rmsnorm {r['impl']:>12} N={r['rows']:<6} D={r['d']:<6} {_num(r['ms'], '9.4f')} ms "
          f"{_num(r['gbs'], '8.1f')} GB/s {_num(r['pct_copy'], '5.1f')}% of copy {r['note']}")


def write(rows: list[dict], out: str, header: str) -> None:
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  fields = ["bench", "impl", "kind", "seq", "head_dim", "batch", "heads", "rows", "d", "ms",
            "tflops", "gbs", "pct_copy", "err", "note"]
  with open(out + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    for r in rows:
      w.writerow({k: r.get(k, "") if r.get(k) is not None else "" for k in fields})
  lines = [f"# Pallas kernels vs XLA / cuDNN\n\n{header}\n", "## Attention (bf16, causal)\n",
           "TFLOP/s (causal FLOPs: fwd 4·B·H·L²·K/2, fwd+bwd 3.5x that); speedup vs xla in ().\n",
           "| L | K | B x H | pass | " + " | ".join(_attn_impls(rows)) + " |",
           "|---|---|---|---|" + "---|" * len(_attn_impls(rows))]
  attn = [r for r in rows if r["bench"] == "attention"]
  for key in dict.fromkeys((r["seq"], r["head_dim"], r["batch"], r["heads"], r["kind"])
                           for r in attn):
    cells = {r["impl"]: r for r in attn
             if (r["seq"], r["head_dim"], r["batch"], r["heads"], r["kind"]) == key}
    base = cells.get("xla", {}).get("tflops")
    row = []
    for impl in _attn_impls(rows):
      r = cells.get(impl)
      if r is None or r["tflops"] is None:
        row.append("n/a" if r is None else "failed")
      else:
        row.append(f"{r['tflops']:.3g}" + (f" ({r['tflops'] / base:.2f}x)" if base else ""))
    lines.append(f"| {key[0]} | {key[1]} | {key[2]} x {key[3]} | {key[4]} | "
                 + " | ".join(row) + " |")
  lines += ["\n## RMSNorm forward (bf16 x, fp32 weight)\n",
            "GB/s of (read x + write y + read weight); % of the measured copy bandwidth in ().\n",
            "| impl | N | D | ms | GB/s |", "|---|---|---|---|---|"]
  for r in rows:
    if r["bench"] == "rmsnorm":
      gbs = "failed" if r["gbs"] is None else f"{r['gbs']:.1f} ({r['pct_copy']:.0f}%)"
      lines.append(f"| {r['impl']} | {r['rows']} | {r['d']} | {_num(r['ms'], '.4f')} | {gbs} |")
  notes = [f"- {r['impl']} {r.get('seq', r.get('d'))}: {r['note']}" for r in rows if r["note"]]
  if notes:
    lines += ["\nFailures:\n"] + notes
  with open(out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {out}.md and {out}.csv")


def _attn_impls(rows):
  return list(dict.fromkeys(r["impl"] for r in rows if r["bench"] == "attention"))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ints = lambda s: [int(v) for v in s.split(",")]
  ap.add_argument("--seq", type=ints, default=[1024, 2048, 4096, 8192, 16384])
  ap.add_argument("--head-dim", type=ints, default=[64, 128])
  ap.add_argument("--tokens", type=int, default=16384, help="B x L (attention), N (norm)")
  ap.add_argument("--hidden", type=int, default=2048, help="H x K")
  ap.add_argument("--norm-dims", type=ints, default=[2048, 4096, 8192])
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke)")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 iterations")
  ap.add_argument("--out", default=None, help="path prefix (default results/bench_kernels, "
                  "with --quick results/bench_kernels_quick)")
  opts = ap.parse_args(argv)
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  if not on_gpu and not (opts.interpret and opts.quick):
    print(f"bench_kernels: a GPU benchmark, and the backend is {backend!r}. The kernels compile "
          "for GPUs (Triton); for a smoke run of this script on CPU use --interpret --quick "
          "(interpreter timings mean nothing).", file=sys.stderr)
    return 2
  if opts.quick:
    opts.seq, opts.head_dim, opts.tokens, opts.hidden = [32, 64], [16], 64, 32
    opts.norm_dims, opts.warmup, opts.iters = [64, 96], 1, 2
  out = opts.out or ("results/bench_kernels_quick" if opts.quick else "results/bench_kernels")
  dev = jax.devices()[0]
  header = (f"Device: {dev.device_kind} ({backend}), jax {jax.__version__}; median of "
            f"{opts.iters} after {opts.warmup} warm-up calls"
            + ("; PALLAS INTERPRETER (smoke run, timings meaningless)" if opts.interpret else "")
            + ".")
  print(header, flush=True)
  rows = bench_attention(opts, on_gpu) + bench_norm(opts, on_gpu)
  write(rows, out, header)
  return 0


if __name__ == "__main__":
  sys.exit(main())
