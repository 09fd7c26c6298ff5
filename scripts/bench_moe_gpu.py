"""Dropless MoE on one GPU: the grouped matmul kernel alone, then whole training runs.

  python scripts/bench_moe_gpu.py                 # both parts -> results/bench_moe_gpu.{md,csv}
  python scripts/bench_moe_gpu.py --part kernels  # grouped matmul TFLOP/s (+ a tile sweep)
  python scripts/bench_moe_gpu.py --part kernels --shapes deepseek --no-sweep \
      --out results/bench_moe_gpu_deepseek.md  # at DeepSeek-V3's expert widths
  python scripts/bench_moe_gpu.py --part train --only dropless
  python scripts/bench_moe_gpu.py --quick         # CPU smoke run of the plumbing (interpreter)

1. kernels: 8 groups of uneven size over 32768 rows, 2048 -> 2048, bf16 (the shape of one
   expert matmul of the training rows below): fwd and fwd+bwd (dlhs + drhs) TFLOP/s of the
   Pallas kernel (`pallas_kernels.grouped_matmul`; its default tiles and a sweep; FP8 scaled
   per row, `jscale.fp8.grouped_kernel`, its quantisation included), the tiled
   XLA matmul (`jscale.model.grouped_tiles`), XLA's jax.lax.ragged_dot (8x the FLOPs on GPU),
   tokamax's ragged_dot when it imports, and a dense matmul of the same FLOPs (the ceiling). Timing: `kernel_timing` (profiler kernel time where it works, else a
   back-to-back loop). `--shapes deepseek`: the DeepSeek-V3 16B proxy's expert products
   instead, 49152 rows (8192 tokens x top-6) in 64 groups: 2048 -> 1408 (gate or up alone,
   and down's dx: the kernel runs 1280 columns on whole tiles and 128 on 64-column ones,
   `hopper_config.column_parts`; timed too all on 64-column tiles, `rates.GROUPED_NARROW`),
   2048 -> 2816 ([gate | up], as the model runs them) and 1408 -> 2048 (down).
2. train: a 1B-wide MoE (16 layers, d_model 2048, 8 experts of d_ff 2048, top-2, vocab 32k,
   seq 4096, batch 4, bf16, attention auto = cuDNN), one `python -m jscale.train` process per
   row (`bench_train.run_row`): dropless with the kernel, with the tiled XLA matmul and with
   ragged_dot, capacity 1.0 and 1.25, and the dense model of equal active parameters (d_ff 4096). tokens/s, MFU on
   active parameters (the trainer's), peak memory, where the device time goes.
Goal (issue 20): dropless with the kernel >= capacity 1.25's throughput and >= 35% active MFU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MOE = ("model.preset=llama3_1b", "model.vocab_size=32768", "model.moe.n_experts=8",
       "model.moe.top_k=2", "model.moe.d_ff=2048", "train.batch_size=4", "train.remat=selective")
ROWS: dict[str, tuple[str, ...]] = {
    "dropless pallas": (*MOE, "model.moe.gemm=pallas"),
    "dropless tiled": (*MOE, "model.moe.gemm=tiled"),
    "dropless ragged_dot": (*MOE, "model.moe.gemm=ragged_dot"),
    "capacity 1.0": (*MOE, "model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0"),
    "capacity 1.25": (*MOE, "model.moe.dispatch=capacity", "model.moe.capacity_factor=1.25"),
    "dense, equal active": ("model.preset=llama3_1b", "model.vocab_size=32768",
                            "model.d_ff=4096", "train.batch_size=4", "train.remat=selective"),
}
QUICK_ROWS = {"dropless ragged_dot": ("model.n_layers=2", "model.moe.n_experts=4",
                                      "model.moe.d_ff=128", "train.batch_size=4",
                                      "model.dtype=float32", "train.seq_len=64")}
# --shapes: name -> [(rows, K, N, groups)] timed by the kernels part.
SHAPES = {"default": [(32768, 2048, 2048, 8)],
          "deepseek": [(49152, 2048, 1408, 64), (49152, 2048, 2816, 64), (49152, 1408, 2048, 64)]}
# (tile_m, tile_n, tile_k, max_concurrent_steps, grid_tile_width) tried beside the default.
SWEEP = [(128, 128, 64, 3, 8), (128, 128, 64, 3, 1), (128, 128, 64, 3, 16), (64, 128, 64, 4, 8),
         (128, 64, 64, 4, 8), (64, 128, 128, 3, 8), (128, 128, 128, 2, 8)]


def _group_sizes(m: int, g: int, seed: int = 0):
  """Rows per group as a balanced router makes them: each row to one of `g` experts uniformly
  at random. Random cuts of [0, m) (before 2026-11-30) make far more uneven groups: at
  DeepSeek's widths the kernel ran 10-20% faster in the H200's proxy step than on them alone."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  return np.random.default_rng(seed).multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)


def kernel_rows(m: int, k: int, n: int, g: int, sweep: bool, quick: bool) -> list[dict]:
  """Fwd and fwd+bwd TFLOP/s of each grouped matmul implementation at one shape."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import kernel_timing  # pylint: disable=import-outside-toplevel
  from jscale.model import grouped_tiles  # pylint: disable=import-outside-toplevel
  from jscale.fp8 import grouped_kernel  # pylint: disable=import-outside-toplevel
  from pallas_kernels import grouped_matmul as gm  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16) / k ** 0.5
  dout = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  sizes = jnp.asarray(_group_sizes(m, g))
  impls = {"pallas default": functools.partial(gm.grouped_matmul, blocks=gm.DEFAULT,
                                               interpret=quick),
           # FP8 experts scaled per row: forward and dx on e4m3 operands, dW in bf16; the
           # quantisation passes and the scaling of the results timed with them
           "pallas FP8 rows": functools.partial(grouped_kernel.row_scaled_matmul,
                                                interpret=quick),
           "tiled (XLA)": lambda a, b, s: grouped_tiles.grouped_dot(a, b, s, a.dtype),
           "ragged_dot": jax.lax.ragged_dot}
  if n % (2 * gm.DEFAULT.tile_n):  # whole tiles and a narrow rest by default; all narrow
    impls["pallas 64-col tiles"] = functools.partial(
        gm.grouped_matmul, blocks=dataclasses.replace(gm.DEFAULT, tile_n=64), interpret=quick)
  if g > 8:  # XLA:GPU runs it densely against every group: g times the FLOPs, not timed
    del impls["ragged_dot"]
  if sweep and not quick:
    for t in SWEEP:
      b = gm.GmmBlocks(*t)
      try:
        gm.check_shapes(lhs, rhs, sizes, b)
      except ValueError:
        continue
      impls[f"pallas {'x'.join(map(str, t))}"] = functools.partial(gm.grouped_matmul, blocks=b)
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
    impls["tokamax"] = tokamax.ragged_dot
  except ImportError:
    pass
  impls["dense (same FLOPs)"] = lambda a, b, s: a @ b[0]
  rows, flops = [], 2 * m * k * n
  for name, fn in impls.items():
    fwd = jax.jit(lambda a, b, fn=fn: fn(a, b, sizes))

    def fwd_bwd(a, b, d, fn=fn):
      out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), a, b)
      return out, vjp(d)
    both = jax.jit(fwd_bwd)
    row = {"impl": name, "shape": f"{m}x{k}->{n}, {g} groups"}
    try:
      timing = (dict(iters=1, repeats=1, warmup=1, profile_calls=0) if quick else
                dict(iters=30, repeats=3, warmup=3, profile_calls=10))
      t_f = kernel_timing.measure(fwd, (lhs, rhs), **timing)
      t_b = kernel_timing.measure(both, (lhs, rhs, dout), **timing)
      row.update(fwd_tflops=flops / t_f.seconds / 1e12,
                 fwd_bwd_tflops=3 * flops / t_b.seconds / 1e12,
                 bwd_tflops=2 * flops / max(t_b.seconds - t_f.seconds, 1e-12) / 1e12,
                 timing=t_f.source, status="ok")
    except Exception as e:  # pylint: disable=broad-except  (one failed impl, not the table)
      row.update(status=f"failed: {type(e).__name__} {str(e).splitlines()[0][:100]}")
    print(row, flush=True)
    rows.append(row)
  return rows


def _fmt(v, spec):
  return "—" if v is None else format(v, spec)


KERNEL_COLUMNS = [("impl", lambda r: r["impl"]), ("shape", lambda r: r["shape"]),
                  ("fwd TFLOP/s", lambda r: _fmt(r.get("fwd_tflops"), ".0f")),
                  ("bwd TFLOP/s", lambda r: _fmt(r.get("bwd_tflops"), ".0f")),
                  ("fwd+bwd TFLOP/s", lambda r: _fmt(r.get("fwd_bwd_tflops"), ".0f")),
                  ("timing", lambda r: r.get("timing") or r["status"])]


def main() -> None:
  from jscale.analysis.tables import write_table  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--part", choices=("all", "kernels", "train"), default="all")
  p.add_argument("--only", default="", help="train rows whose name contains one of these (,)")
  p.add_argument("--no-sweep", action="store_true", help="kernels: the default tiles only")
  p.add_argument("--shapes", choices=tuple(SHAPES), default="default",
                 help="kernels: the products timed (default: 32768 x 2048 -> 2048, 8 groups)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--quick", action="store_true", help="CPU smoke run (tiny, interpreter)")
  p.add_argument("--out", default="results/bench_moe_gpu.md")
  args = p.parse_args()
  import bench_train  # pylint: disable=import-outside-toplevel
  out = []
  if args.part in ("all", "kernels"):
    # quick: whole 128-column tiles, so no extra 64-column row (its plumbing is the default's)
    shapes = [(256, 128, 256, 2)] if args.quick else SHAPES[args.shapes]
    rows = [r for shape in shapes
            for r in kernel_rows(*shape, sweep=not args.no_sweep, quick=args.quick)]
    out.append(write_table(rows, KERNEL_COLUMNS, args.out.replace(".md", "_kernels.md")))
  if args.part in ("all", "train"):
    chosen = {n: o for n, o in (QUICK_ROWS if args.quick else ROWS).items()
              if any(k in n for k in args.only.split(","))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_moe_gpu_") as work:
      for n, o in chosen.items():  # the table after every row: a run cut short keeps its rows
        row = bench_train.run_row(n, o, 4 if args.quick else args.steps,
                                  2 if args.quick else 5, work, ())
        rows.append({k: v for k, v in row.items() if k != "profile"})
        table = write_table(rows, bench_train.COLUMNS, args.out)
    out.append(table)
  print("\n\n".join(out))


if __name__ == "__main__":
  main()
