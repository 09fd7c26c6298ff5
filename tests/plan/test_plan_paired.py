"""The planner's layouts that run jscale's hand-written collectives (`Layout.collectives`): the
node-limited expert exchange, and DeepSeek-V3's pairing (`Layout.overlap`). What it offers runs
(the trainer's own checks pass, every lever of the pairing takes effect), and what it prices:
the exchange's two hops, the paired transfers behind the other micro-batch, the exchange's row
buffers."""

import dataclasses

import pytest

from jscale import hardware, validate
from jscale.config_conditional import RULES
from jscale.config_load import load_config
from jscale.mesh import axis_sizes, make_mesh
from jscale.plan import cost, memory
from jscale.plan.layout import OVERLAP, Layout, candidates, layout_of
from jscale.plan.rank import evaluate

H100 = hardware.GPUS["h100"]
TINY = ["model.preset=deepseek_v3_tiny", "model.moe.exchange=node_limited"]
SEQ = 256
WIRES = ["model.moe.dispatch_dtype=e4m3", "model.moe.dispatch_grad_dtype=e4m3",
         "model.moe.combine_dtype=e4m3", "model.moe.combine_grad_dtype=e4m3"]
BIG = ["model.preset=deepseek_v3_671b", "model.moe.receive_factor=1.25",
       "model.moe.exchange=node_limited", *WIRES]
# The compiled program the pairing's constants were fitted on (docs/deepseek.md's best).
OURS = Layout(fsdp=16, expert=64, zero_stage=3, remat="full_offload", mbs=2, accum=4,
              moments="bfloat16", accumulate="layer", collectives="manual", overlap=True)


def _checked(lay: Layout):
  """The config `lay`'s overrides give the tiny node-limited DeepSeek, through the trainer's
  mesh checks."""
  cfg = load_config(None, [*TINY, *lay.overrides(SEQ, 8)])
  validate.check_mesh(cfg, make_mesh(cfg.mesh))
  return cfg


def test_a_node_limited_models_expert_layouts_run_by_hand():
  """`model.moe.exchange=node_limited` is the hand-written exchange: every layout with experts
  split runs in manual mode, and its overrides say so (the planner printed xla-mode overrides
  that the trainer refused); none where the groups cannot tile mesh.expert."""
  model = load_config(None, TINY).model
  lays = list(candidates(model, 8, SEQ, 16))
  assert {lay.collectives for lay in lays if lay.expert > 1} == {"manual"}
  assert {lay.collectives for lay in lays if lay.expert == 1} == {"xla"}
  seen = set()
  for lay in lays:
    key = (lay.data, lay.stage, lay.fsdp, lay.expert, lay.sequence, lay.tensor, lay.zero_stage,
           lay.sequence_parallel, lay.collectives)
    if key not in seen:
      seen.add(key)
      _checked(lay)
  four = load_config(None, [*TINY, "model.moe.n_group=4"]).model  # 4 groups tile 4 and 8 only
  assert {lay.expert for lay in candidates(four, 8, SEQ, 16)} == {1, 4, 8}


def test_pairing_is_offered_where_each_of_its_levers_takes_effect():
  """Paired layouts: ZeRO-3 over fsdp with the layers taking an even number of micro-batches in
  turn, the dropless exchange over mesh.expert, no pipeline; each also offered unpaired. Their
  overrides run every lever of `OVERLAP` (none a no-op the trainer would warn about), and the
  config they give is the layout again."""
  model = load_config(None, TINY).model
  lays = set(candidates(model, 8, SEQ, 16))
  paired = [lay for lay in lays if lay.overlap]
  assert paired
  for lay in paired:
    assert (lay.expert > 1 and lay.fsdp > 1 and lay.zero_stage == 3 and lay.stage == 1
            and lay.accumulate == "layer" and lay.accum % 2 == 0), lay
    assert dataclasses.replace(lay, overlap=False) in lays
  for lay in paired[:3]:
    cfg = _checked(lay)
    sizes = {a: i * d for a, (i, d) in axis_sizes(cfg.mesh, 8).items()}
    assert layout_of(cfg, sizes) == lay
    keys = {o.split("=")[0] for o in OVERLAP}
    assert all(r.live(cfg, sizes) for r in RULES if r.key in keys), lay
  flat = load_config(None, ["model.preset=deepseek_v3_tiny"]).model  # the flat exchange pairs too
  assert [lay for lay in candidates(flat, 8, SEQ, 16) if lay.overlap]
  capacity = load_config(None, ["model.preset=deepseek_v3_tiny",
                                "model.moe.dispatch=capacity"]).model
  assert not [lay for lay in candidates(capacity, 8, SEQ, 16) if lay.overlap]


def test_the_node_limited_exchange_crosses_nodes_once_per_chosen_group():
  """Its first hop carries a row per token and chosen group (topk_group) across nodes, its
  second a row per routed assignment (top-k) inside the node; the flat exchange all top-k
  across nodes."""
  model = load_config(None, BIG).model
  moe = model.moe
  ts = {t.what: t for t in cost.transfers(model, OURS, 4096, 8) if t.axis == "expert"
        and t.kind == "all-to-all"}
  across = ts["node-limited exchange across nodes, fwd and bwd"]
  inside = ts["node-limited exchange inside the node, fwd and bwd"]
  assert across.bytes / inside.bytes == pytest.approx(moe.topk_group / moe.top_k)
  assert (across.nodes, inside.nodes) == (8, 1)
  rows = 4 * 8192 * moe.top_k * (58 + 1)  # a step's 4 micro-batches; 58 MoE layers and MTP's
  assert inside.bytes == pytest.approx(rows * 4 * (model.d_model + 4))  # four e4m3 passes


def test_paired_transfers_hide_behind_the_other_microbatch():
  """Paired, ZeRO-3's gathers and each trip's reduce-scatters (two trips of two micro-batches
  here: twice the bytes) and the exchange leave `Exposure.paired` of their time exposed;
  unpaired the exchange and the reduce-scatters are on the critical path whole."""
  model = load_config(None, BIG).model
  pair = evaluate(model, OURS, 4096, H100)
  alone = evaluate(model, dataclasses.replace(OURS, overlap=False), 4096, H100)
  scatter = lambda row: next(t for t in row.cost.transfers if t.kind == "reduce-scatter")
  assert scatter(pair).bytes == 2 * scatter(alone).bytes
  paired = [t for t in pair.cost.transfers if t.overlap == "paired"]
  assert {t.kind for t in paired} == {"all-gather", "reduce-scatter", "all-to-all"}
  hidden = sum(t.seconds() for t in paired)
  assert hidden < pair.cost.compute_s
  host = sum(t.exposed_seconds() for t in pair.cost.transfers if t.axis == "host")
  assert pair.cost.exposed_s == pytest.approx(cost.EXPOSURE.paired * hidden + host)
  whole = sum(t.seconds() for t in alone.cost.transfers
              if t.kind in ("all-to-all", "reduce-scatter"))
  assert alone.cost.exposed_s == pytest.approx(whole + host)  # the gathers prefetched


def test_a_paired_program_holds_the_exchanges_buffers_of_two_microbatches():
  """The node-limited exchange's experts run on hop 2's buffer: f·T·K rows with
  `model.moe.receive_factor` f (as the compiled program's [81920, 7168] buffers at T 8192,
  top-8, f 1.25). Paired, `EXCHANGE_BUFFERS` of them are live for each of the two micro-batches
  in flight; unpaired, the activations count the rows (none here). The fitted program's
  estimate is its compiled 64.2 GiB."""
  model = load_config(None, BIG).model
  assert memory.receive_ratio(model, OURS, 8192) == 1.25
  unbounded = load_config(None, [*BIG, "model.moe.receive_factor=0"]).model
  # unbounded: the node's 8 devices each relay hop 1's 8 blocks of T rows, each row to up to
  # min(K, E_l) = 4 local experts, over T·K
  assert memory.receive_ratio(unbounded, OURS, 8192) == 8 * 8 * 4 / 8
  assert memory.exchange_buffers(model, OURS, 8192) == pytest.approx(
      memory.EXCHANGE_BUFFERS * 2 * 81920 * model.d_model * 2)
  assert memory.exchange_buffers(model, dataclasses.replace(OURS, overlap=False), 8192) == 0
  assert memory.estimate(model, OURS, 4096).total / 2**30 == pytest.approx(64.2, abs=0.1)
