"""The peers' published H100 figures beside jscale's **predicted** ones, on the peers' own
configurations: for each, the planner's pick (`jscale.plan`'s first layout that fits) compiled
for that many H100s with the real XLA:GPU compiler on this machine and timed by
`jscale.predict`. MFU is one formula for both sides: jscale's model FLOPs per token
(`metrics.flops_per_token`, causal attention counted as half, as MaxText does) over the dense
BF16 peak, the peer's from its tok/s.

    python scripts/peers_h100.py [--only 8b,70b] [--collectives both] [--out results/peers_h100.md]
    python scripts/peers_h100.py --only dsv3_1024,dsv3_nemo1024,dsv3_256 --collectives manual \
        --guided 0     # DeepSeek-V3 671B: 20 compiles of ~4 minutes here, ~3 GB each
    python scripts/peers_h100.py --only dsv3_1024,dsv3_nemo1024 --given "mesh.fsdp=16 ..."
        # a layout given by hand in place of the planner's pick, said so in the table

Writes a table per family (dense, MoE) with the commit that predicted it, keeping the other
family's table as it was, and a family's rows `--only` does not name as they were (its header
says when they were predicted); the predictions are predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: the GPUs are descriptions

# pylint: disable=wrong-import-position
from jscale import hardware, metrics, predict  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.plan.rank import rank  # noqa: E402

# DeepSeek-V3 as its peers train it: Adam's moments in bf16 (as DeepSeek did), the receive
# buffers bounded at 1.25x the even share (`model.moe.receive_factor`), the node-limited
# exchange.
DSV3 = ("model.preset=deepseek_v3_671b", "model.moe.receive_factor=1.25",
        "model.moe.exchange=node_limited")
# Megatron-Bridge's FP8 run beside jscale's FP8: the routed experts' products in e4m3 with a
# scale per row (`fp8.experts_scaling=row`, the Hopper kernel's FP8 operands); the attention
# and dense layers' products stay bf16.
FP8_EXPERTS = ("fp8.enabled=true", "fp8.recipe=current", "fp8.targets=[experts]",
               "fp8.experts_scaling=row")
LLAMA2_7B = ["model.preset=llama3_8b", "model.vocab_size=32000", "model.n_kv_heads=32",
             "model.d_ff=11008", "model.rope_theta=10000", "model.rope_scaling=null"]


@dataclasses.dataclass(frozen=True)
class Peer:
  """A published configuration: its model, GPUs, sequence, tokens per step, and its figure
  (tok/s per GPU, or where only that was published, MFU or model TFLOP/s by its count)."""
  key: str
  what: str
  model: tuple[str, ...]
  gpus: int
  seq: int
  step_tokens: int
  source: str
  tok_s: float | None = None
  mfu: float | None = None
  tflop_s: float | None = None
  family: str = "dense"              # which table: dense | moe
  moments: str = "float32"           # train.moments_dtype the planner plans for
  numerics: tuple[str, ...] = ()     # overrides for the peer's precision (its FP8)


PEERS = (
    Peer("8b", "torchtitan Llama 3 8B × 8, seq 8192, FSDP 8, BF16 (on 500 W H100s)",
         ("model.preset=llama3_8b",), 8, 8192, 16 * 8192,
         "torchtitan benchmarks/llama3_h100_202412_torchtitan.md", tok_s=6667),
    Peer("7b", "MaxText Llama 2 7B × 8, seq 4096, FSDP, BF16", tuple(LLAMA2_7B), 8, 4096,
         32 * 4096, "MaxText configs/gpu/a3/llama_2_7b/README.md (492 TFLOP/s per GPU)",
         tflop_s=492e12),
    Peer("1b", "the playbook's 1B × 8 at 1M tokens, seq 4096", ("model.preset=llama3_1b",), 8,
         4096, 2**20, "Ultra-Scale Playbook, best MFU on 1 node (44.3%)", mfu=0.443),
    Peer("pb8b", "the playbook's 8B × 8 at 1M tokens, seq 4096", ("model.preset=llama3_8b",), 8,
         4096, 2**20, "Ultra-Scale Playbook, best MFU on 1 node (45.2%)", mfu=0.452),
    Peer("70b", "MaxText Llama 3 70B × 128, seq 8192, FSDP 128, BF16",
         ("model.preset=llama3_70b",), 128, 8192, 256 * 8192,
         "NVIDIA DGXC 'Maxtext Llama3 70B 25.02' (NGC)", tok_s=1052),
    Peer("dsv3_1024", "Megatron-Bridge DeepSeek-V3 671B × 1,024, seq 4096, GBS 8192, FP8 "
         "(blockwise), TP2 PP8 VP4 EP64", DSV3, 1024, 4096, 8192 * 4096,
         "Megatron-Bridge performance archive (25.09)", tok_s=1297, family="moe",
         moments="bfloat16", numerics=FP8_EXPERTS),
    Peer("dsv3_nemo1024", "NeMo AutoModel DeepSeek-V3 671B × 1,024, seq 4096, GBS 8192, BF16 "
         "(TE + DeepEP), PP4 VP8 EP64 FSDP 256", DSV3, 1024, 4096, 8192 * 4096,
         "NeMo AutoModel performance-summary.mdx", tok_s=865, family="moe",
         moments="bfloat16"),
    Peer("dsv3_256", "NeMo AutoModel DeepSeek-V3 671B × 256, seq 4096, GBS 512, BF16 "
         "(TE + DeepEP), PP4 VP8 EP64 FSDP 64", DSV3, 256, 4096, 512 * 4096,
         "NeMo AutoModel performance-summary.mdx", tok_s=1002, family="moe",
         moments="bfloat16"),
)
H100 = hardware.GPUS["h100"]
TITLES = {"dense": "Dense models.", "moe": "Mixture of experts."}
INTRO = ("Peers' published H100 figures beside jscale's **predicted** figures for the planner's "
         "pick (`python scripts/peers_h100.py`: XLA:GPU compiled on a CPU machine, timed by "
         "`jscale.predict`; not measured).")
HEADER = ("| configuration | peer tok/s/GPU | peer MFU | planner's pick | planner MFU | "
          "**predicted** tok/s/GPU | **predicted** MFU | predicted / peer | memory | source |",
          "|---|---|---|---|---|---|---|---|---|---|")


def peer_tok_s(p: Peer, flops_per_token: float) -> float:
  """The peer's tok/s per GPU, derived from its MFU or TFLOP/s where that is what it gave."""
  if p.tok_s is not None:
    return p.tok_s
  flops = p.tflop_s if p.tflop_s is not None else p.mfu * H100.peak_flops["bf16"]
  return flops / flops_per_token


# The programs the `guided` fastest are compiled again as: XLA's scheduler told the predicted
# kernel costs, the layers unrolled into straight-line code, and both.
VARIANTS = ((", predicted costs", ("parallel.schedule_costs=predicted",)),
            (", unrolled", ("model.scan_layers=false",)),
            (", unrolled, predicted costs", ("model.scan_layers=false",
                                             "parallel.schedule_costs=predicted")))


@functools.lru_cache(maxsize=None)
def _predicted(model: tuple[str, ...], gpus: int, overrides: tuple[str, ...]):
  cfg = load_config(None, [*model, "model.dtype=bfloat16", "checkpoint.every=0", *overrides])
  return predict.predict_config(cfg, f"h100x{gpus}")


def predicted(p: Peer, pick, mode: str, variant: tuple[str, ...] = ()):
  """`pick`'s program on `p`'s H100s at the peer's precision, predicted (one compile per
  distinct program: two peers of one configuration share it)."""
  return _predicted(p.model, p.gpus, (*pick.layout.overrides(p.seq, H100.gpus_per_node),
                                      f"parallel.collectives={mode}", *variant, *p.numerics))


def _order(t):  # a program that does not fit ranks after every one that does
  return (not t[0].fits, t[0].step_s)


def given_row(p: Peer, overrides: tuple[str, ...]) -> dict:
  """The peer's figures and jscale's predicted ones for a layout given by hand (`overrides`:
  the mesh, parallelism and numerics), which the planner did not pick, at the peer's precision
  (`Peer.numerics`)."""
  model = load_config(None, [*p.model, "model.dtype=bfloat16"]).model
  fpt = metrics.flops_per_token(model, p.seq)
  r = _predicted(p.model, p.gpus, (f"train.seq_len={p.seq}",
                                   f"train.batch_size={p.step_tokens // p.seq}", *overrides,
                                   *p.numerics))
  given = [o.split(".", 1)[1] for o in overrides] + list(p.numerics)
  return _figures(p, fpt, r, "given: " + " ".join(given), None)


def _figures(p: Peer, fpt: float, r, pick: str, planner_mfu: float | None) -> dict:
  peer = peer_tok_s(p, fpt)
  ours = r.tokens_per_s / p.gpus
  return {"peer": p.what, "source": p.source, "peer_tok_s": peer,
          "peer_mfu": peer * fpt / H100.peak_flops["bf16"], "pick": pick,
          "planner_mfu": planner_mfu, "predicted_tok_s": ours, "predicted_mfu": r.mfu,
          "ratio": ours / peer,
          "memory": (f"{r.memory_bytes / 2**30:.1f} GiB, " if r.memory_bytes else "")
          + ("fits" if r.fits else "does not fit")}


def row(p: Peer, top: int, modes: tuple[str, ...], guided: int) -> dict:
  """The peer's figures and jscale's predicted ones for the planner's pick: its estimate's
  first layout, or with `top` > 1 the fastest compiled program of its first `top`, each in
  each of `modes` (what `python -m jscale.plan --rank compiled --verify top --collectives
  both` picks); the `guided` fastest of those compiled again as each of `VARIANTS`
  (`--schedule-costs both --scan-layers both`), the fastest program counting."""
  model = load_config(None, [*p.model, "model.dtype=bfloat16"]).model
  fpt = metrics.flops_per_token(model, p.seq)
  rows = rank(model, p.gpus, p.seq, p.step_tokens, H100, moments=p.moments)[:top]
  tried = sorted(((predicted(p, x, mode), x, mode, "") for x in rows for mode in modes),
                 key=_order)
  tried += [(predicted(p, x, mode, variant), x, mode, name)
            for _, x, mode, _ in tried[:guided] for name, variant in VARIANTS]
  r, pick, mode, costs = min(tried, key=_order)
  return _figures(p, fpt, r, f"{pick.layout.describe()} ({mode}{costs})", pick.cost.mfu)


def _sections(path: str) -> dict[str, list[str]]:
  """The file's tables by family (`<!-- peers:FAMILY -->` opens each; a file without the
  markers is one dense table)."""
  if not os.path.exists(path):
    return {}
  text = open(path, encoding="utf-8").read()
  out: dict[str, list[str]] = {}
  family = "intro" if "<!-- peers:" in text else "dense"
  for line in text.splitlines():
    if line.startswith("<!-- peers:"):
      family = line.removeprefix("<!-- peers:").removesuffix(" -->")
      continue
    out.setdefault(family, []).append(line)
  return {f: lines for f, lines in out.items()
          if f in TITLES and any(x.startswith("|") for x in lines)}


@dataclasses.dataclass(frozen=True)
class _Kept:
  rows: dict[str, str]  # a peer's configuration (`Peer.what`) -> its table line
  note: str  # when they were predicted, as the table said


def _kept(section: list[str], peers: list) -> _Kept:
  """The table lines of `peers` in a family's existing `section` (an `--only` that names some
  of the family's rows keeps the others), and the header's words on when they were predicted."""
  rows = {p.what: line for line in section for p in peers if line.startswith(f"| {p.what} |")}
  header = next((line for line in section if line.startswith("**")), "")
  when = re.search(r"[Pp]redicted at (\w+)", header)
  return _Kept(rows, f"predicted at {when.group(1)}" if when else "predicted earlier")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--only", default="", help="comma-separated keys: " +
                  ",".join(p.key for p in PEERS))
  ap.add_argument("--out", default="results/peers_h100.md")
  ap.add_argument("--rank-compiled", type=int, default=10, metavar="K",
                  help="pick the fastest compiled program of the estimate's first K (1: the "
                  "estimate's first alone)")
  ap.add_argument("--collectives", choices=("xla", "manual", "both"), default="both",
                  help="the modes each layout is compiled in (both: the faster program counts)")
  ap.add_argument("--given", default="", metavar="OVERRIDES",
                  help="space-separated config overrides of a layout given by hand, predicted "
                  "in place of the planner's pick (the table says so)")
  ap.add_argument("--guided", type=int, default=3, metavar="N",
                  help="compile the N fastest programs again with parallel.schedule_costs="
                  "predicted, model.scan_layers=false and both (0: as scanned, XLA's own "
                  "schedule only)")
  args = ap.parse_args()
  modes = ("xla", "manual") if args.collectives == "both" else (args.collectives,)
  keys = set(filter(None, args.only.split(",")))
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=False).stdout.strip()
  how = (f"predicted at {commit}; the pick: " + (
      "the estimate's first layout" if args.rank_compiled == 1 else
      f"`jscale.plan --rank compiled`'s, the fastest compiled program among the estimate's "
      f"first {args.rank_compiled}") + f", in {' or '.join(modes)} mode" + (
      f"; its {args.guided} fastest also with the predicted kernel costs given to XLA's "
      "scheduler (`parallel.schedule_costs=predicted`), with the layers unrolled "
      "(`model.scan_layers=false`), and both" if args.guided else ""))
  given = tuple(args.given.split())
  if given:
    how = (f"predicted at {commit}; not the planner's pick: a layout given by hand "
           "(`scripts/peers_h100.py --given`), the fastest program found that fits")
  path = os.path.join(ROOT, args.out)
  sections = _sections(path)
  for family, title in TITLES.items():
    peers = [p for p in PEERS if p.family == family and (not keys or p.key in keys)]
    if not peers:
      continue
    fresh = {p.what: _line(given_row(p, given) if given else
                           row(p, args.rank_compiled, modes, args.guided)) for p in peers}
    kept = _kept(sections.get(family, []), [p for p in PEERS if p.family == family and
                                            p.what not in fresh])
    note = (f" (the rows not run again as before: {kept.note})" if kept.rows else "")
    sections[family] = ["", f"**{title}** {how[0].upper()}{how[1:]}{note}.", "", *HEADER,
                        *(fresh.get(p.what) or kept.rows[p.what] for p in PEERS
                          if p.what in fresh or p.what in kept.rows)]
  lines = [INTRO]
  for family in TITLES:
    if family in sections:
      lines += [f"<!-- peers:{family} -->", *sections[family]]
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def _line(r: dict) -> str:
  planner = "—" if r["planner_mfu"] is None else f"{r['planner_mfu']:.1%}"
  out = (f"| {r['peer']} | {r['peer_tok_s']:,.0f} | {r['peer_mfu']:.1%} | {r['pick']} | "
         f"{planner} | {r['predicted_tok_s']:,.0f} | {r['predicted_mfu']:.1%} | "
         f"{r['ratio']:.2f}x | {r['memory']} | {r['source']} |")
  print(out, flush=True)
  return out


if __name__ == "__main__":
  main()
