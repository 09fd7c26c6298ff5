"""The planner's output: a ranked table, every term with --explain, JSON rows."""

from __future__ import annotations

from jscale import hardware
from jscale.config import ModelConfig
from jscale.metrics import count_text, param_counts
from jscale.plan.memory import GiB, usable_bytes
from jscale.plan.rank import Row


def header(model: ModelConfig, args, gpu: hardware.Gpu, n_rows: int, n_fit: int) -> str:
  """What was asked, and how many layouts were considered and fit."""
  n = param_counts(model)["total"]
  return (f"{args.model}: {count_text(n)} parameters, {model.n_layers} layers, d_model "
          f"{model.d_model}; {args.gpus} x {gpu.name} ({gpu.gpus_per_node} per node, "
          f"{usable_bytes(gpu) / GiB:.1f} GiB usable); seq {args.seq}, "
          f"{args.global_batch_tokens:,} tokens per step\n"
          f"{n_rows} valid layouts, {n_fit} fit in memory" +
          ("" if n_fit else " — none fits: the rows below are the smallest"))


def table(rows: list[Row], seq: int, gpu: hardware.Gpu, explain: bool) -> str:
  """The ranked rows, with the overrides that run each (and its terms with `explain`)."""
  lines = ["| # | layout | memory GiB | step s | bubble | exposed comm s | MFU | tokens/s |",
           "|---|---|---|---|---|---|---|---|"]
  for i, r in enumerate(rows, 1):
    lines.append(f"| {i} | {r.layout.describe()} | {r.memory.total / GiB:.1f} | "
                 f"{r.cost.step_s:.3g} | {r.cost.bubble:.2f} | {r.cost.exposed_s:.3g} | "
                 f"{100 * r.cost.mfu:.1f}% | {r.tokens_per_s:,.0f} |")
  out = ["\n".join(lines), ""]
  for i, r in enumerate(rows, 1):
    out.append(f"#{i}: " + " ".join(r.layout.overrides(seq, gpu.gpus_per_node)))
    if explain:
      out += ["    " + line for line in terms(r)]
  return "\n".join(out)


def terms(r: Row) -> list[str]:
  """Every memory and time term of one row."""
  m, c = r.memory, r.cost
  out = ["memory: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in m.terms().items())
         + f" = {m.total / GiB:.2f} GiB"]
  out.append(f"busy {c.compute_s:.3f} s (model {c.model_flops / 1e12:.1f} TFLOP per device): "
             + ", ".join(f"{k} {v:.3f} s" for k, v in c.busy.items())
             + (f"; pipeline bubble {c.bubble:.3f}" if c.bubble else ""))
  for t in c.transfers:
    link = ("the host link" if t.kind == "host" else "NVLink" if t.nodes == 1 else
            f"{t.nodes} nodes")
    hidden = (f" (hidden behind the {t.overlap})" if t.overlap else
              f" (on the critical path: {t.exposed_seconds() / t.seconds():.2f} x its link time)"
              if t.seconds() else "")
    out.append(f"{t.axis}: {t.what}: {t.kind} {t.bytes / 1e9:.3f} GB over {link} = "
               f"{1e3 * t.seconds():.1f} ms" + hidden)
  out.append(f"exposed communication {c.exposed_s:.3f} s; step {c.step_s:.3f} s; "
             f"MFU {100 * c.mfu:.1f}%")
  host = sum(t.exposed_seconds() for t in c.transfers if t.kind == "host")
  if host > 0.1 * c.compute_s:
    out.append(f"the host link, not the GPU, bounds this step: {host:.3f} s of offload copies "
               f"exposed against {c.compute_s:.3f} s busy (train.remat=full needs no link)")
  return out


def as_dict(r: Row, seq: int, gpu: hardware.Gpu) -> dict:
  """A JSON-able row."""
  c = r.cost
  return {"layout": r.layout.describe(), "overrides": r.layout.overrides(seq, gpu.gpus_per_node),
          "fits": r.fits, "memory_bytes": {**r.memory.terms(), "total": r.memory.total},
          "step_s": c.step_s, "compute_s": c.compute_s, "busy_s": c.busy, "bubble": c.bubble,
          "exposed_comm_s": c.exposed_s, "mfu": c.mfu, "tokens_per_s": r.tokens_per_s,
          "transfers": [{"axis": t.axis, "what": t.what, "kind": t.kind, "bytes": t.bytes,
                         "nodes": t.nodes, "overlap": t.overlap, "seconds": t.seconds()}
                        for t in c.transfers]}
