"""The expert exchange hidden under compute (`parallel.expert_chunks`, issue 50), predicted: the
DeepSeek-V3 16B proxy (3 layers + MTP, seq 4096, 2 sequences per GPU, selective remat, bf16
moments) with manual expert parallelism over 8 H100s (one node) and 64 (8 nodes), its tokens
exchanged whole or in 2 or 4 slices. Each program is compiled by XLA:GPU on this CPU machine and
timed by `jscale.predict` (predictions, not measurements).

    python scripts/expert_overlap.py   # -> results/expert_overlap_h100.md (~15 minutes)
    python scripts/expert_overlap.py --pipelines   # only the second table (DualPipeV's pairs)

Columns: the predicted step and MFU, the collectives' time and the part of it the compute
stream waits for (exposed), the ragged all-to-alls' time, and how many Hopper grouped-matmul
kernels XLA scheduled inside the all-to-alls' start...done windows (`jscale.analysis.overlap`).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for GPUs from their descriptions

# pylint: disable=wrong-import-position
from jscale import predict  # noqa: E402
from jscale.analysis import gpu_target, overlap  # noqa: E402
from jscale.analysis.tables import write_table  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "expert_overlap_h100.md")
PROXY = ("model.preset=deepseek_v3_16b", "model.n_layers=3", "train.seq_len=4096",
         "train.remat=selective", "train.moments_dtype=bfloat16", "checkpoint.every=0",
         "parallel.collectives=manual", "mesh.data=1")
MESHES = {8: ("mesh.expert=8",), 64: ("mesh.expert=8", "mesh.dcn_expert=8")}
# DualPipeV's pairs beside it: 5 layers (4 MoE layers: 2 stages x 2 chunks), the same tokens per
# GPU, expert parallelism alone or over half the GPUs under 2 stages, 4 micro-batches.
PIPELINED = ("model.n_layers=5",)
STAGED = {8: ("mesh.expert=4",), 64: ("mesh.expert=4", "mesh.dcn_expert=8")}
SCHEDULES = {"none": (), "1f1b": ("pipeline.virtual_stages=1",),
             "dualpipev": ("pipeline.virtual_stages=2",)}


def config_of(gpus: int, chunks: int, schedule: str | None):
  """The proxy on `gpus` H100s: expert parallelism alone (schedule None: 3 layers, as the first
  table; "none": 5 layers) or under 2 pipeline stages with `schedule`."""
  if schedule is None:
    return load_config(None, [*PROXY, *MESHES[gpus], f"train.batch_size={2 * gpus}",
                              f"parallel.expert_chunks={chunks}"])
  if schedule == "none":
    return load_config(None, [*PROXY, *PIPELINED, *MESHES[gpus], f"train.batch_size={2 * gpus}"])
  return load_config(None, [*PROXY, *PIPELINED, *STAGED[gpus], "mesh.stage=2",
                            f"pipeline.schedule={schedule}", *SCHEDULES[schedule],
                            "pipeline.microbatches=4", f"train.batch_size={2 * gpus}"])


def row(gpus: int, chunks: int, schedule: str | None = None) -> dict:
  cfg = config_of(gpus, chunks, schedule)
  target = f"h100x{gpus}"
  text, memory, remat = predict.compile_for(cfg, target)
  r = predict.predict_config(cfg, target, text, top=0, memory_bytes=memory, remat=remat)
  sched = predict.predict(text, "h100", routed_rows=predict.routed_rows(cfg, gpus),
                          ticks=predict.pipeline_ticks(cfg, gpus),
                          devices=predict.partition_devices(
                              cfg, gpu_target.devices(target)),
                          node_rows=predict.node_rows(cfg, gpus))
  a2a = sum(t.seconds * t.runs for t in sched.timed
            if t.launch.collective is not None and t.launch.collective.kind == "ragged-all-to-all")
  held = sum(w.count("mosaic_gpu") for w in overlap.windows(text, "ragged-all-to-all"))
  return {"gpus": gpus, "chunks": chunks, "schedule": schedule or "none", "memory": memory,
          "step": r.step_s, "mfu": r.mfu,
          "collectives": r.by_category.get("collectives", 0.0),
          "exposed": r.exposed_collectives_s, "a2a": a2a, "held": held}


COLUMNS = [("H100s", lambda r: f"{r['gpus']} ({r['gpus'] // 8} node{'s' * (r['gpus'] > 8)})"),
           ("parallel.expert_chunks", lambda r: str(r["chunks"])),
           ("step (ms)", lambda r: f"{1e3 * r['step']:.1f}"),
           ("MFU", lambda r: f"{r['mfu']:.1%}"),
           ("collectives (ms)", lambda r: f"{1e3 * r['collectives']:.1f}"),
           ("of them ragged all-to-all (ms)", lambda r: f"{1e3 * r['a2a']:.1f}"),
           ("exposed (ms)", lambda r: f"{1e3 * r['exposed']:.1f}"),
           ("grouped matmuls inside all-to-all windows", lambda r: str(r["held"]))]


PIPE_COLUMNS = [COLUMNS[0], ("schedule", lambda r: r["schedule"]), *COLUMNS[2:],
                ("memory (GiB)", lambda r: f"{r['memory'] / 2**30:.1f}")]


def main() -> None:
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip()
  only_pipelines = "--pipelines" in sys.argv
  rows = [] if only_pipelines else [row(g, c) for g in MESHES for c in (1, 2, 4)]
  piped = [row(g, 1, sched) for g in MESHES for sched in SCHEDULES]
  for r in rows + piped:
    print(r, flush=True)
  text = ("# The expert exchange under compute: `parallel.expert_chunks` (predicted)\n\n"
          f"`python scripts/expert_overlap.py` at {head}: the DeepSeek-V3 16B proxy (3 layers + "
          "MTP, seq 4096, 2 sequences per GPU, selective remat, bf16 moments), manual expert "
          "parallelism, compiled by XLA:GPU on a CPU machine and timed by `jscale.predict` "
          "(predictions, not measurements).\n\n")
  if only_pipelines:  # keep the first table as it stands
    with open(OUT, encoding="utf-8") as f:
      text = f.read().split("\n## ")[0].rstrip() + "\n"
  else:
    text += write_table(rows, COLUMNS, OUT)  # (and the raw rows beside it, .csv)
  text += ("\n## DualPipeV's pairs beside it\n\n"
           "5 layers (4 MoE layers: 2 stages x 2 chunks), 2 sequences per GPU: expert "
           "parallelism over every GPU (schedule none), or over half of them under 2 pipeline "
           "stages of 4 micro-batches (`python scripts/expert_overlap.py --pipelines` at "
           f"{head}).\n\n" +
           write_table(piped, PIPE_COLUMNS, OUT.replace(".md", "_pipelines.md")))
  with open(OUT, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  sys.exit(main())
