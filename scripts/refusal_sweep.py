"""Which DeepSeek-V3 / MoE layouts a user can ask for that cannot work, and whether jscale
refuses each before compiling (issue 50, item 5: "every config that cannot work is refused
before compile with the key and the fix").

Each case is the tiny DeepSeek-V3 (MLA, sigmoid routing, a dense first layer, MTP; 5 layers)
with a few overrides, on 8 CPU devices. A case is loaded and validated as the trainer does
(`load_config`, then `runtime.build`'s checks on the mesh), then its train step is compiled:

  refused    a ConfigError before any compile (its first line is shown)
  compiles   accepted, and the step compiles (the parity tests say whether it trains right);
             "warned, compiles" where the trainer would print a no-op warning (shown)
  FAILS      accepted, then any other error: a hole to close

    JAX_PLATFORMS=cpu python scripts/refusal_sweep.py [case ...] [--out results/refusal_sweep.md]

About 10 seconds a case that compiles here. The trainer's machine checks (`jscale.validate.
machine`: a GPU-only option on a CPU) run in `python -m jscale.train`, not here.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the environment is set)

from jscale import runtime, validate  # noqa: E402
from jscale.analysis.introspect import abstract_batch  # noqa: E402
from jscale.config import ConfigError  # noqa: E402
from jscale.config_load import load_config  # noqa: E402

BASE = ("model.preset=deepseek_v3_tiny", "model.n_layers=5", "model.dtype=float32",
        "train.batch_size=16", "train.seq_len=32")
M = ("parallel.collectives=manual",)
DUALPIPEV = ("mesh.stage=2", "pipeline.schedule=dualpipev", "pipeline.virtual_stages=2",
             "pipeline.microbatches=4")
LAYER = ("train.accumulate=layer", "train.microbatches=2")

CASES: dict[str, tuple[str, ...]] = {
    "expert_chunks in xla mode": ("mesh.expert=4", "parallel.expert_chunks=2"),
    "expert_chunks, capacity dispatch": M + ("mesh.expert=4", "parallel.expert_chunks=2",
                                             "model.moe.dispatch=capacity"),
    "expert_chunks without EP": M + ("parallel.expert_chunks=2",),
    "expert_chunks not dividing the tokens": M + ("mesh.expert=4", "parallel.expert_chunks=3"),
    "expert_chunks, node-limited": M + ("mesh.expert=4", "parallel.expert_chunks=2",
                                        "model.moe.exchange=node_limited"),
    "expert_chunks, DualPipeV": M + ("mesh.expert=4", "parallel.expert_chunks=2") + DUALPIPEV,
    "expert_chunks, micro-batches": M + ("mesh.expert=4", "parallel.expert_chunks=2",
                                         "train.microbatches=2"),
    "node-limited, capacity dispatch": M + ("mesh.expert=4", "model.moe.exchange=node_limited",
                                            "model.moe.dispatch=capacity"),
    "FP8 experts, Pallas kernel": ("fp8.enabled=true", "fp8.targets=[experts]",
                                   "fp8.experts_scaling=row", "model.moe.gemm=pallas"),
    "FP8 experts, ragged_dot": ("fp8.enabled=true", "fp8.targets=[experts]",
                                "model.moe.gemm=ragged_dot"),
    "FP8 experts, manual EP": M + ("mesh.expert=2", "fp8.enabled=true",
                                   "fp8.targets=[experts]"),
    "FP8 linears on MLA": M + ("fp8.enabled=true",) + DUALPIPEV,
    "DualPipeV with MTP": M + DUALPIPEV,
    "DualPipeV, train.microbatches": M + DUALPIPEV + ("train.microbatches=2",),
    "ZB-V with MoE": M + ("mesh.stage=2", "pipeline.schedule=zbv", "pipeline.virtual_stages=2",
                          "pipeline.microbatches=4"),
    "interleaved, dense first layer": M + ("mesh.stage=2", "pipeline.schedule=interleaved",
                                           "pipeline.virtual_stages=2",
                                           "pipeline.microbatches=4"),
    "1F1B with EP and MTP": M + ("mesh.stage=2", "mesh.expert=2", "pipeline.microbatches=2"),
    "pipeline with data shards in xla mode": ("mesh.stage=2", "mesh.expert=2",
                                              "pipeline.microbatches=2"),
    "layers not dividing the stages": M + ("model.n_layers=4", "mesh.stage=2"),
    "context parallelism with MTP": ("mesh.sequence=2",),
    "zigzag chunks not dividing seq": ("model.mtp=null", "mesh.sequence=2", "train.seq_len=30"),
    "TP on MLA": ("mesh.tensor=2",),
    "TP + SP on MLA, manual": M + ("mesh.tensor=2", "parallel.sequence_parallel=true"),
    "SP not dividing seq": M + ("mesh.tensor=2", "parallel.sequence_parallel=true",
                                "train.seq_len=31"),
    "collective matmul with MoE": M + ("mesh.tensor=2", "parallel.sequence_parallel=true",
                                       "parallel.collective_matmul=true"),
    "ZeRO-3 with EP, manual": M + ("mesh.fsdp=2", "mesh.expert=2", "parallel.zero_stage=3"),
    "ZeRO-3 with EP, xla": ("mesh.fsdp=2", "mesh.expert=2", "parallel.zero_stage=3"),
    "EP with TP, manual": M + ("mesh.tensor=2", "mesh.expert=2"),
    "EP with micro-batches": M + ("mesh.expert=2", "train.microbatches=2"),
    "batch smaller than the EP ways": M + ("mesh.expert=8", "train.batch_size=4"),
    "receive_factor in xla mode (warned)": ("mesh.expert=2", "model.moe.receive_factor=1.5"),
    "bf16 moments, b2 0.999": ("train.moments_dtype=bfloat16", "train.b2=0.999"),
    "cuDNN attention in fp32": ("model.attention_impl=cudnn",),
    "Pallas kernels on a CPU": ("model.moe.gemm=pallas",),
    # The layer loop's micro-batches, FP8 on the wire and host offload (2026-11-29/30)
    "layer micro-batches, xla mode": ("train.accumulate=layer", "train.microbatches=2"),
    "layer micro-batches, EP, manual": M + LAYER + ("mesh.expert=4",),
    "layer micro-batches side by side": M + LAYER + ("mesh.expert=4",
                                                     "parallel.overlap_microbatches=2"),
    "side by side, not dividing": M + LAYER + ("mesh.expert=4", "parallel.overlap_microbatches=3"),
    "side by side, step accumulation": M + ("mesh.expert=4", "train.microbatches=2",
                                            "parallel.overlap_microbatches=2"),
    "layer micro-batches, ZeRO-3 x EP": M + LAYER + ("mesh.fsdp=2", "mesh.expert=4",
                                                     "parallel.zero_stage=3",
                                                     "parallel.overlap_microbatches=2"),
    "layer micro-batches, node-limited": M + LAYER + ("mesh.expert=4",
                                                      "model.moe.exchange=node_limited",
                                                      "parallel.overlap_microbatches=2"),
    "layer micro-batches, expert_chunks": M + LAYER + ("mesh.expert=4",
                                                       "parallel.expert_chunks=2"),
    "layer micro-batches, DualPipeV": M + ("train.accumulate=layer",) + DUALPIPEV,
    "layer micro-batches, offload": M + LAYER + ("mesh.expert=4", "train.remat=offload",
                                                 "parallel.overlap_microbatches=2"),
    "layer micro-batches, TP": M + LAYER + ("mesh.tensor=2",),
    "layer micro-batches, context parallel": LAYER + ("model.mtp=null", "mesh.sequence=2"),
    "FP8 dispatch, xla mode": ("mesh.expert=4", "model.moe.dispatch_dtype=e4m3"),
    "FP8 dispatch, manual flat": M + ("mesh.expert=4", "model.moe.dispatch_dtype=e4m3",
                                      "model.moe.dispatch_grad_dtype=e4m3"),
    "FP8 dispatch, node-limited": M + ("mesh.expert=4", "model.moe.exchange=node_limited",
                                       "model.moe.dispatch_dtype=e4m3",
                                       "model.moe.dispatch_grad_dtype=e4m3"),
    "FP8 dispatch without EP": M + ("model.moe.dispatch_dtype=e4m3",),
    "FP8 dispatch, capacity dispatch": M + ("mesh.expert=4", "model.moe.dispatch=capacity",
                                            "model.moe.dispatch_dtype=e4m3"),
    "FP8 gradient rows alone": M + ("mesh.expert=4", "model.moe.dispatch_grad_dtype=e4m3"),
    "FP8 dispatch and FP8 experts": M + ("mesh.expert=4", "model.moe.dispatch_dtype=e4m3",
                                         "fp8.enabled=true", "fp8.targets=[experts]"),
    "bf16 logits, fp32 model": ("train.logits_dtype=bfloat16",),
    "bf16 logits, chunked, vocab-parallel": M + ("model.dtype=bfloat16", "mesh.tensor=2",
                                                 "train.logits_dtype=bfloat16",
                                                 "train.logits_chunk_mb=0.01"),
    "chunked loss, context parallel": ("model.mtp=null", "mesh.sequence=2",
                                       "train.logits_chunk_mb=0.01"),
    "bf16 moments, ZeRO-1": ("mesh.fsdp=2", "parallel.zero_stage=1",
                             "train.moments_dtype=bfloat16", "model.dtype=bfloat16"),
    "compute copies, ZeRO-1 x EP, manual": M + ("mesh.fsdp=2", "mesh.expert=2",
                                                "parallel.zero_stage=1", "model.dtype=bfloat16"),
    "compute copies, micro-batches, bf16": ("model.dtype=bfloat16", "train.microbatches=2"),
    "full remat in host memory": ("train.remat=full_offload",),
}


def run_case(overrides: tuple[str, ...]) -> tuple[str, str]:
  """(outcome, detail) of one case: refused / compiles / FAILS."""
  try:
    cfg = load_config(None, [*BASE, *overrides])
    rt = runtime.build(cfg, jax.devices())  # mesh.data (-1) fills the 8 devices
  except ConfigError as e:
    return "refused", str(e).splitlines()[0]
  try:
    rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)).compile()
  except Exception as e:  # noqa: BLE001  (the sweep reports whatever breaks)
    return "FAILS", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  warned = validate.no_op_warnings(cfg, rt.mesh)
  return ("warned, compiles", warned[0]) if warned else ("compiles", "")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("cases", nargs="*", help="case names (default: all)")
  p.add_argument("--out", default="results/refusal_sweep.md")
  args = p.parse_args()
  rows = []
  for name in args.cases or list(CASES):
    outcome, detail = run_case(CASES[name])
    print(f"{outcome:9s} {name}: {detail[:160]}", flush=True)
    rows.append(f"| {name} | `{' '.join(CASES[name])}` | {outcome} | {detail[:220]} |")
  head = ["# Layouts that cannot work: refused before compile?", "",
          "`JAX_PLATFORMS=cpu python scripts/refusal_sweep.py` (tiny DeepSeek-V3, 5 layers, 8 CPU "
          "devices; overrides on top of "
          f"`{' '.join(BASE)}`). refused: a ConfigError before compile; compiles: accepted and "
          "compiled (warned: the trainer prints a no-op warning); FAILS: accepted, then broke.", "",
          "| case | overrides | outcome | the error's (or warning's) first line |",
          "|---|---|---|---|"]
  with open(args.out, "w") as f:
    f.write("\n".join(head + rows) + "\n")


if __name__ == "__main__":
  main()
