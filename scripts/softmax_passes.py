"""The chunked loss's passes over one chunk of logits, timed on a GPU: the softmax statistics as
one online (max, sum-exp) reduction (`jscale.step.loss.max_sum_exp`: its combiner with one exp
an element since 2026-12-01, and the symmetric one with two that the predictor's rate was
measured on) against two plain reductions (a max, then a sum of exps: 0.6 ms a step faster on
the DeepSeek-V3 proxy as predicted, but 0.5-1.0 GiB more at the compiled peak, so not taken
unmeasured), and the label's logit as a masked sum over the vocab against a gather
(`loss._label_logit`). The shape is one chunk of the DeepSeek-V3 16B proxy's head: 4096 tokens
x 102,400 bf16 logits. The predictor prices the online reduction at its H200 trace's rate
(`jscale.predict.rates.ONLINE_SOFTMAX`) and the rest by their bytes; this measures all five
alone.

    python3 scripts/softmax_passes.py [--out results/softmax_passes.md]   # on a GPU, seconds
    python scripts/softmax_passes.py --rows 8 --reps 2 --out /tmp/sp.md    # a smoke run here
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jscale.step import loss  # noqa: E402

VOCAB = 102400


def one_pass(x):
  return loss.max_sum_exp(x.astype(jnp.float32))


def _symmetric_combine(a, b):
  # the combiner before 2026-12-01, two exps an element (what rates.ONLINE_SOFTMAX measured)
  (m1, s1), (m2, s2) = a, b
  m = jnp.maximum(m1, m2)
  at = jnp.where(m == -jnp.inf, 0.0, m)
  return m, s1 * jnp.exp(m1 - at) + s2 * jnp.exp(m2 - at)


def one_pass_two_exps(x):
  f = x.astype(jnp.float32)
  return jax.lax.reduce((f, jnp.ones_like(f)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                        _symmetric_combine, (f.ndim - 1,))


def two_pass(x):
  f = x.astype(jnp.float32)
  m = jnp.max(f, axis=-1, keepdims=True)
  return m, jnp.sum(jnp.exp(f - m), axis=-1, keepdims=True)


def masked_label(x, labels):
  hit = jnp.arange(x.shape[-1]) == labels[:, None]
  return jnp.sum(jnp.where(hit, x.astype(jnp.float32), 0.0), axis=-1)


def gathered_label(x, labels):
  return loss._label_logit(x.astype(jnp.float32), labels, loss.LOCAL)  # pylint: disable=protected-access


def time_ms(fn, *args, reps: int) -> float:
  """Mean device time of one call, by wall clock around `reps` calls (one sync)."""
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  for _ in range(reps):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="results/softmax_passes.md")
  ap.add_argument("--rows", type=int, default=4096)
  ap.add_argument("--reps", type=int, default=50)
  args = ap.parse_args()
  x = jax.random.normal(jax.random.key(0), (args.rows, VOCAB), jnp.bfloat16) * 4
  labels = jax.random.randint(jax.random.key(1), (args.rows,), 0, VOCAB)
  gb, n = args.rows * VOCAB * 2 / 1e9, args.reps
  rows = [("softmax statistics, one online reduction (one exp an element)",
           time_ms(one_pass, x, reps=n)),
          ("softmax statistics, one online reduction (two exps an element, before 2026-12-01)",
           time_ms(one_pass_two_exps, x, reps=n)),
          ("softmax statistics, max then sum-exp", time_ms(two_pass, x, reps=n)),
          ("label logit, masked sum over the vocab", time_ms(masked_label, x, labels, reps=n)),
          ("label logit, gathered", time_ms(gathered_label, x, labels, reps=n))]
  lines = [f"# The loss's passes over one chunk of logits ({jax.devices()[0].device_kind}, "
           f"jax {jax.__version__})", "",
           f"{args.rows} x {VOCAB} bf16 logits ({gb:.2f} GB), `python3 scripts/softmax_passes.py`;"
           f" mean of {n} calls after one warm-up:", "",
           "| pass | ms | GB/s of the logits read once |", "|---|---|---|"]
  lines += [f"| {name} | {ms:.3f} | {gb / ms * 1e3:.0f} |" for name, ms in rows]
  with open(args.out, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
