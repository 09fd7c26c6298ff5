"""scripts/bench_kernels.py's output: one line per result, and the markdown + CSV tables."""

from __future__ import annotations

import csv
import os

FIELDS = ["bench", "impl", "kind", "seq", "head_dim", "batch", "heads", "rows", "d", "flops",
          "bytes", "ms_loop", "ms_kernel", "timed", "tflops", "gbs", "pct_copy", "err", "note"]


def _num(v, spec):
  return "-" if v is None else format(v, spec)


def fmt(r: dict) -> str:
  """One result as a line of console output."""
  ms = f"loop {_num(r.get('ms_loop'), '9.4f')} ms kernel {_num(r.get('ms_kernel'), '9.4f')} ms"
  if r["bench"] == "attention":
    return (f"attention {r['impl']:>7} L={r['seq']:<6} K={r['head_dim']:<4} {r['kind']:<8} {ms} "
            f"{_num(r['tflops'], '8.3g')} TFLOP/s err {_num(r['err'], '.2e')} {r['note']}")
  if r["bench"] in ("rmsnorm", "copy"):
    return (f"{r['bench']:<7} {r['impl']:>10} N={r['rows']:<6} D={r['d']:<6} {r['kind']:<14} "
            f"{ms} {_num(r['gbs'], '8.1f')} GB/s {_num(r['pct_copy'], '5.1f')}% of copy "
            f"{r['note']}")
  return f"{r['bench']} {r['impl']}: {r['note']}"


def _source(rows: list[dict]) -> str:
  used = {r["timed"] for r in rows if r.get("timed")}
  if used == {"kernel"}:
    return "the profiler's kernel time (ms_kernel)"
  if used == {"loop"}:
    return "loop time (ms_loop: no profiler kernel time here)"
  return "the profiler's kernel time; cells marked * from loop time (no kernel time for them)"


def _mark(r: dict, rows: list[dict]) -> str:
  mixed = len({x["timed"] for x in rows if x.get("timed")}) > 1
  return "*" if mixed and r.get("timed") == "loop" else ""


def _pivot(rows: list[dict], key, cell) -> tuple[list[str], list[list[str]]]:
  """(impl names, one list of cells per distinct `key(row)`): the key's values, then
  `cell(row, rows_by_impl)` per impl."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  table = []
  for k in dict.fromkeys(key(r) for r in rows):
    by_impl = {r["impl"]: r for r in rows if key(r) == k}
    table.append([str(v) for v in k] + [
        "n/a" if i not in by_impl else cell(by_impl[i], by_impl) for i in impls])
  return impls, table


def _attention_md(rows: list[dict]) -> list[str]:
  # cuDNN is the bar to meet; xla only where no cuDNN cell ran (CPU, or cuDNN failing).
  base = "cudnn" if any(r["impl"] == "cudnn" and r["tflops"] for r in rows) else "xla"

  def cell(r, by_impl):
    if r["tflops"] is None:
      return "failed"
    b = by_impl.get(base, {}).get("tflops")
    return (f"{r['tflops']:.3g}{_mark(r, rows)}"
            + (f" ({r['tflops'] / b:.2f}x)" if b and r["impl"] != base else ""))

  key = lambda r: (r["seq"], r["head_dim"], f"{r['batch']} x {r['heads']}", r["kind"])
  impls, table = _pivot(rows, key, cell)
  return ["## Attention (bf16, causal)\n",
          f"TFLOP/s from {_source(rows)}. Causal FLOPs: fwd 4·B·H·L²·K/2, fwd+bwd 3.5x that. "
          f"Speedup vs {base} in ().\n",
          "| L | K | B x H | pass | " + " | ".join(impls) + " |",
          "|---|---|---|---|" + "---|" * len(impls)] + ["| " + " | ".join(t) + " |"
                                                       for t in table]


def _norm_md(rows: list[dict], copies: list[dict], copy_gbs, copy_name) -> list[str]:
  lines = ["\n## Copy reference (bf16 [N, D], read + write)\n",
           "| copy | N | D | ms_loop | ms_kernel | GB/s |", "|---|---|---|---|---|---|"]
  for r in copies:
    used = " (used)" if r["impl"] == copy_name else ""
    lines.append(f"| {r['impl']} | {r['rows']} | {r['d']} | {_num(r['ms_loop'], '.4f')} | "
                 f"{_num(r['ms_kernel'], '.4f')} | {_num(r['gbs'], '.1f')}{used} |")

  def cell(r, _):
    if r["gbs"] is None:
      return "failed"
    pct = "" if r["pct_copy"] is None else f" ({r['pct_copy']:.0f}%)"
    return f"{r['gbs']:.1f}{_mark(r, rows)}{pct}"

  impls, table = _pivot(rows, lambda r: (r["rows"], r["d"], r["kind"]), cell)
  copy = (f"{copy_gbs:.1f} GB/s, {copy_name}" if copy_gbs else "no copy reference ran")
  lines += ["\n## RMSNorm (bf16 x, fp32 weight)\n",
            f"GB/s from {_source(rows)}; % of the best copy ({copy}) in (). Bytes counted "
            "(the traffic an ideal kernel cannot avoid): fwd reads x, writes y, reads w; "
            "fwd+bwd adds reading x and dy, writing dx, reading w, writing dw; fused = residual "
            "add + norm (rms_norm(x, w, residual_ND=r) -> (y, h = x + r)): fwd reads x, r, "
            "writes y, h, reads w; fwd+bwd adds reading h, dy, dh, writing dx (the residual's "
            "gradient is the same array), reading w, writing dw.\n",
            "| N | D | pass | " + " | ".join(impls) + " |",
            "|---|---|---|" + "---|" * len(impls)]
  return lines + ["| " + " | ".join(t) + " |" for t in table]


def _notes_md(rows: list[dict]) -> list[str]:
  skipped = [f"- {r['impl']}: {r['note']}" for r in rows if r["bench"] == "skipped"]
  groups: dict[tuple, list[str]] = {}  # the same failure in every cell is one note
  for r in rows:
    if r["bench"] != "skipped" and r["note"]:
      where = (f"{r['kind']} L={r['seq']} K={r['head_dim']}" if r["bench"] == "attention"
               else f"{r['kind']} D={r['d']}")
      groups.setdefault((r["bench"], r["impl"], r["note"]), []).append(where)
  notes = [f"- {b} {i}: {n} ({', '.join(w)})" for (b, i, n), w in groups.items()]
  return ((["\nSkipped:\n"] + skipped if skipped else [])
          + (["\nNotes (failures, missing kernel times):\n"] + notes if notes else []))


def write(rows: list[dict], out: str, header: str, copy_gbs, copy_name) -> None:
  """`out`.csv (every row, FIELDS) and `out`.md (attention, copy and RMSNorm tables, notes)."""
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".csv", "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: "" if r.get(k) is None else r[k] for k in FIELDS})
  pick = lambda bench: [r for r in rows if r["bench"] == bench]
  lines = [f"# Pallas kernels vs XLA / cuDNN / Mosaic GPU\n\n{header}\n"]
  lines += _attention_md(pick("attention"))
  lines += _norm_md(pick("rmsnorm"), pick("copy"), copy_gbs, copy_name)
  lines += _notes_md(rows)
  with open(out + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {out}.md and {out}.csv")
