"""Long context on 8 H100s (issue 52): Llama 3 8B at 32k, 64k and 128k tokens per sequence, the
planner's pick among the ring, the K/V all-gather and Ulysses, offload and TP, each compiled by
XLA:GPU for 8 H100s on this CPU machine and timed by `jscale.predict` (predictions, not
measurements).

    python scripts/long_context.py   # -> results/long_context_h100x8.md (+ .csv), ~5 minutes

Every row keeps 262,144 tokens per step (2 sequences of 128k, as torchtitan's FSDP 2 x CP 4
run holds; 4 of 64k; 8 of 32k). For each length: the planner's #1 (`jscale.plan`'s estimate),
and the best-estimated layout of each family it chose among (the ring, Ulysses, no context
parallelism, remat=offload), plus the ring's layout with the K/V all-gather instead (xla mode,
`model.attention_impl=xla`: plain XLA attention over (L/n) x L scores; the planner does not
offer it). Memory: the planner's estimate beside the compiled program's.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for GPUs from their descriptions

# pylint: disable=wrong-import-position
from jscale import hardware, predict  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.plan import rank  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "long_context_h100x8.md")
MODEL, GPUS, TOKENS = "llama3_8b", 8, 262_144
SEQS = (32_768, 65_536, 131_072)
# torchtitan's published Llama 3.1 8B at 131k on 8 H100s (FSDP 2 x CP 4; measured, tokens/s
# per GPU): ../shared/measurements/peers_h100_published.md
TORCHTITAN_131K = 1_071
GiB = 2**30

FAMILIES = {
    "ring": lambda lay: lay.sequence > 1 and not lay.ulysses,
    "Ulysses": lambda lay: lay.ulysses,
    "no context parallelism": lambda lay: lay.sequence == 1,
    "offload": lambda lay: lay.remat == "offload",
}


def picks(seq: int) -> list[tuple[str, rank.Row, tuple[str, ...]]]:
  """(what, the planner's row, extra overrides) for one sequence length."""
  model = load_config(None, [f"model.preset={MODEL}"]).model
  rows = rank.rank(model, GPUS, seq, TOKENS, hardware.GPUS["h100"])
  out = [("planner #1", rows[0], ())]
  for family, wanted in FAMILIES.items():
    best = next((r for r in rows if wanted(r.layout) and r.fits), None)
    if best is not None and best.layout != rows[0].layout:
      out.append((f"best {family}", best, ()))
    if family == "ring" and best is not None:
      out.append(("ring's layout, K/V all-gathered", best, ("model.attention_impl=xla",)))
  return out


def row(seq: int, what: str, planned: rank.Row, extra: tuple[str, ...]) -> dict:
  lay = planned.layout
  cfg = load_config(None, [f"model.preset={MODEL}", f"model.max_seq_len={seq}",
                           "checkpoint.every=0", *lay.overrides(seq, 8), *extra])
  text, memory, remat = predict.compile_for(cfg, f"h100x{GPUS}")
  p = predict.predict_config(cfg, f"h100x{GPUS}", text, top=0, memory_bytes=memory, remat=remat)
  return {"seq": seq, "what": what, "layout": lay.describe() + (
              " K/V all-gather" if extra else ""),
          "est_gib": planned.memory.total / GiB, "gib": memory / GiB, "fits": p.fits,
          "est_s": planned.cost.step_s, "step_s": p.step_s, "mfu": p.mfu,
          "tok_s_gpu": TOKENS / p.step_s / GPUS, "exposed_s": p.exposed_collectives_s,
          "overrides": " ".join(lay.overrides(seq, 8) + list(extra))}


COLUMNS = [
    ("seq", lambda r: f"{r['seq'] // 1024}k"), ("row", lambda r: r["what"]),
    ("layout", lambda r: r["layout"]),
    ("memory GiB: planner / compiled", lambda r: f"{r['est_gib']:.1f} / {r['gib']:.1f}"
     + ("" if r["fits"] else " (does not fit)")),
    ("compiled / planner", lambda r: f"{r['gib'] / r['est_gib']:.2f}"),
    ("step s: planner / predicted", lambda r: f"{r['est_s']:.2f} / {r['step_s']:.2f}"),
    ("exposed comm. s", lambda r: f"{r['exposed_s']:.2f}"),
    ("predicted tok/s/GPU", lambda r: f"{r['tok_s_gpu']:,.0f}"),
    ("predicted MFU", lambda r: f"{r['mfu']:.1%}"),
    ("vs torchtitan 1,071", lambda r: f"{r['tok_s_gpu'] / TORCHTITAN_131K:.2f}x"
     if r["seq"] == 131_072 else ""),
]


def main() -> None:
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip()
  rows = []
  for seq in SEQS:
    for what, planned, extra in picks(seq):
      rows.append(row(seq, what, planned, extra))
      print({k: v for k, v in rows[-1].items() if k != "overrides"}, flush=True)
  table = write_table(rows, COLUMNS, OUT)  # (and the raw rows beside it, .csv)
  text = (
      "# Long context on 8 H100s: Llama 3 8B at 32k-128k tokens (predicted)\n\n"
      f"`python scripts/long_context.py` at {head}: 262,144 tokens per step at every length; the "
      "planner's #1 and the best-estimated layout of each family, each compiled by XLA:GPU "
      "for 8 H100s on a CPU machine and timed kernel by kernel by `jscale.predict` "
      "(**predictions, not measurements**: cuDNN's attention is timed at rates measured up to "
      "seq 8192 and held there beyond). torchtitan's figure is measured (Llama 3.1 8B, 131k, "
      "8 H100s, FSDP 2 x CP 4: 1,071 tokens/s per GPU).\n\n" + table +
      "\n\nEach row's overrides (`python -m jscale.predict --target h100x8 model.preset="
      "llama3_8b ...` reproduces it):\n\n" +
      "\n".join(f"- {r['seq'] // 1024}k {r['what']}: `{r['overrides']}`" for r in rows) + "\n")
  with open(OUT, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  sys.exit(main())
