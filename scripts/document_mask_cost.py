"""What document masking (`data.document_mask`) costs a train step: measured on this CPU, and
predicted on an H100 from the compiled XLA:GPU program (`jscale.predict`).

    python scripts/document_mask_cost.py   # -> results/document_mask_cost.md (~3 minutes)

CPU (measured): a small Llama (4 layers, d_model 256, seq 1024, batch 4, fp32, plain XLA
attention) on one CPU device, the median of 6 steps after a compile and a warm-up, with and
without the mask on the same batches (4 documents a row). H100 (predicted): llama3_1b (seq 4096,
batch 4, selective remat) without the mask (cuDNN), with it (`auto` runs the Hopper flash
kernel: cuDNN has no document mask), and the flash kernel without it, which separates the
kernel switch from the mask. The predictor prices attention kernels by FLOPs at measured rates:
it does not see the mask's compares inside the kernel, nor blocks the kernel could skip.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jscale import predict, runtime  # noqa: E402
from jscale.analysis import tables  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.data.windows import doc_starts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "document_mask_cost.md")
CPU_SHAPE = ["model.preset=tiny", "model.n_layers=4", "model.d_model=256", "model.n_heads=4",
             "model.n_kv_heads=4", "model.d_ff=768", "model.dtype=float32", "train.seq_len=1024",
             "model.max_seq_len=1024", "train.batch_size=4", "model.attention_impl=xla",
             "checkpoint.every=0"]
GPU_ROWS = {"no mask (cuDNN)": [],
            "document mask (auto: the Hopper flash kernel)": ["data.document_mask=true"],
            "no mask, the Hopper flash kernel": ["model.attention_impl=pallas"]}
STEPS = 6


def _batches(cfg, eos: int = 0):
  rng = np.random.default_rng(0)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  tokens = rng.integers(1, cfg.model.vocab_size, (b, l + 1)).astype(np.int32)
  for row in tokens:  # 3 EOS a row: 4 documents
    row[rng.choice(np.arange(1, l), 3, replace=False)] = eos
  batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
           "loss_mask": np.ones((b, l), np.float32)}
  if cfg.data.document_mask:
    batch["doc_starts"] = np.stack([doc_starts(t, eos) for t in batch["tokens"]])
  return batch


def cpu_step_ms(mask: bool) -> float:
  cfg = load_config(None, CPU_SHAPE + [f"data.document_mask={str(mask).lower()}"])
  rt = runtime.build(cfg, jax.devices()[:1])
  state, step = rt.init_state(), rt.train_step()
  batch = jax.device_put(_batches(cfg), rt.layouts.batch())
  times = []
  for _ in range(STEPS + 2):  # compile, warm-up, then the timed steps
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times[2:])


def gpu_step_ms(extra: list[str]) -> float:
  cfg = load_config(os.path.join(ROOT, "configs", "llama3_1b.yaml"),
                    ["train.batch_size=4", "train.remat=selective", "checkpoint.every=0", *extra])
  text, memory, remat = predict.compile_for(cfg, "h100x1")
  return 1e3 * predict.predict_config(cfg, "h100x1", text, top=0, memory_bytes=memory,
                                      remat=remat).step_s


def main() -> None:
  head = tables.head_commit()
  cpu = {mask: cpu_step_ms(mask) for mask in (False, True)}
  gpu = {name: gpu_step_ms(extra) for name, extra in GPU_ROWS.items()}
  base = gpu["no mask (cuDNN)"]
  lines = [
      "# What document masking costs a step\n",
      f"`python scripts/document_mask_cost.py` at {head}.\n",
      "| where | run | step (ms) | vs no mask |", "|---|---|---|---|",
      f"| CPU, measured (small Llama, seq 1024, plain XLA attention) | no mask | "
      f"{cpu[False]:.0f} | |",
      f"| | document mask | {cpu[True]:.0f} | {cpu[True] / cpu[False] - 1:+.1%} |",
      *(f"| {'H100, predicted (llama3_1b, seq 4096, b4)' if i == 0 else ''} | {name} | "
        f"{ms:.1f} | {'' if i == 0 else f'{ms / base - 1:+.1%}'} |"
        for i, (name, ms) in enumerate(gpu.items())),
      "",
      "The predictor prices the attention kernel by its FLOPs at a measured rate: the switch from "
      "cuDNN to the flash kernel shows, the mask's compares inside the kernel do not. "
      "`python3 scripts/gpu_session.py run long_context` measures the masked row on a lent GPU.",
  ]
  tables.write_markdown(lines, OUT)


if __name__ == "__main__":
  sys.exit(main())
