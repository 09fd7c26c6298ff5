"""The V-shaped schedules as data: the V placement and its stored layer order, ZB-V's and
DualPipeV's executed tables against the papers' bubble and memory figures, DualPipeV's
forward + backward pairs, the channels their programs send on, and their pictures."""

import dataclasses

import numpy as np
import pytest

from jscale.parallel.pipeline import placement, program, schedules, timeline
from jscale.plan import cost, memory
from jscale.parallel.pipeline.schedules import B, F, IDLE, W


def test_v_placement_and_stored_order():
  p = 4
  assert [placement.stage_of(c, p, "v") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
  assert [placement.local_of(c, p, "v") for c in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
  assert [placement.stage_of(c, p) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
  # 8 layers, p = 2, v = 2: stage 0 holds chunks 0 and 3 (V) or 0 and 2 (interleaved).
  assert list(placement.storage_order(8, 2, 2, "v")) == [0, 1, 6, 7, 2, 3, 4, 5]
  assert list(placement.storage_order(8, 2, 2)) == [0, 1, 4, 5, 2, 3, 6, 7]
  x = {"w": np.arange(8)}
  for where in placement.PLACEMENTS:
    stored = placement.to_storage(x, 8, 2, 2, where)
    assert list(placement.to_model(stored, 8, 2, 2, where)["w"]) == list(range(8))
  assert {placement.placement_of(s) for s in ("zbv", "dualpipev")} == {"v"}
  assert placement.placement_of("interleaved") == "interleaved"


def _span_idle(table):
  """Per stage: idle ticks between its first and its last action."""
  busy = table.kind != IDLE
  out = []
  for s in range(table.p):
    ticks = np.nonzero(busy[:, s])[0]
    out.append(int((~busy[ticks[0]:ticks[-1] + 1, s]).sum()))
  return out


@pytest.mark.parametrize("p,m", [(p, m) for p in (4, 8) for m in range(p, 4 * p + 1)])
def test_zbv_bubble_and_memory_match_the_paper(p, m):
  table = schedules.make_table("zbv", p, m, 2)
  schedules.validate(table)
  assert table.placement == "v" and not table.with_next().any()
  assert (table.kind != IDLE).sum() == 6 * m * p
  assert table.bubble() == pytest.approx(schedules.theory_bubble("zbv", p, m, 2), abs=1e-12)
  # 1F1B's activation memory: p micro-batches of a whole stage, 2p of its half-size chunks,
  # counted both as the paper does (F done, B not yet) and as the executor holds them (to W).
  assert table.in_flight().max() == table.live().max() == 2 * p
  if m >= 2 * p - 1:  # the paper's zero bubble: each stage busy from its first action to its
    assert _span_idle(table) == [0] * p  # last, idle only while the pipeline fills / drains
    assert table.ticks == 6 * m + p - 1
    assert list(table.live().max(axis=0)) == [2 * p] * p  # balanced over the stages


def _pairs_per_stage(p, m):
  # Steady state: two pairs a round (the last stage's first F0 & B1 runs apart), then one
  # pair in each of the p - s - 1 rounds of the drain's start.
  return [2 * (m - 2 * p + s + 1) - (s == p - 1) + (p - s - 1) for s in range(p)]


@pytest.mark.parametrize("p,m", [(p, m) for p in (4, 8) for m in range(2 * p, 4 * p + 1, 2)])
def test_dualpipev_bubble_memory_and_pairs_match_the_report(p, m):
  table = schedules.make_table("dualpipev", p, m, 2)
  schedules.validate(table)
  assert (table.kind != IDLE).sum() == 6 * m * p
  assert table.bubble() == pytest.approx(schedules.theory_bubble("dualpipev", p, m, 2),
                                         abs=1e-12)
  # (PP/2 - 1)(F&B + B - 3W) on every device, PP = 2p: 2(p - 1) idle ticks each.
  assert list((table.kind == IDLE).sum(axis=0)) == [2 * (p - 1)] * p
  assert list(table.in_flight().max(axis=0)) == [2 * p + 1] * p  # PP + 1
  assert list(table.live().max(axis=0)) == [2 * p + 1] * p
  pairs = table.paired()
  assert list(pairs.sum(axis=0)) == _pairs_per_stage(p, m)
  for t, s in zip(*np.nonzero(pairs)):  # a forward of one micro-batch, a backward (+ its W)
    assert table.kind[t + 1, s] == B and table.kind[t + 2, s] == W  # of another
    assert table.mb[t, s] != table.mb[t + 1, s]
    assert (table.mb[t + 1, s], table.chunk[t + 1, s]) == (table.mb[t + 2, s],
                                                           table.chunk[t + 2, s])


def test_v_tables_beat_zb_h1_in_unit_ticks():
  # Per stage, in ticks of a whole stage (two V chunks): ZB-V idles (p - 1)/2 where ZB-H1
  # idles p - 1 and holds p sets where ZB-H1 holds 2p - 1; DualPipeV idles as ZB-H1 (its gain
  # is the pairs' overlap, not in unit ticks) and holds p + 1/2.
  p, m = 4, 16
  zb = schedules.make_table("zero_bubble", p, m)
  zbv, dpv = (schedules.make_table(name, p, m, 2) for name in ("zbv", "dualpipev"))
  assert zbv.bubble() == pytest.approx(zb.bubble() / 2)
  assert dpv.bubble() == pytest.approx(zb.bubble())
  assert (zbv.live().max() / 2, zb.live().max(), dpv.live().max() / 2) == (4, 7, 4.5)


def test_program_channels_and_codes():
  # Interleaved: activations down, gradients up, one channel each (wrapping round with v > 1).
  prog = program.compile_program(schedules.make_table("interleaved", 4, 8, 2))
  assert prog.carries == ("f", "b") and prog.codes == program.CODES
  assert prog.channels == (((0, 1), (1, 2), (2, 3), (3, 0)), ((1, 0), (2, 1), (3, 2), (0, 3)))
  # ZB-V: one action a tick, so one channel each way, carrying both; the V's turn stays home.
  prog = program.compile_program(schedules.make_table("zbv", 4, 8, 2))
  assert prog.carries == ("fb", "fb") and not prog.has_pairs
  assert prog.channels == (((0, 1), (1, 2), (2, 3)), ((1, 0), (2, 1), (3, 2)))
  assert (prog.self_f[:, 3] != prog.n_in_f).sum() == 8  # chunk 3 -> 4, on stage 3
  assert (prog.self_f[:, :3] == prog.n_in_f).all()
  # DualPipeV: a pair sends its forward's activation and its backward's gradient the same
  # way (down for F0 & B1, up for F1 & B0): two channels each way.
  prog = program.compile_program(schedules.make_table("dualpipev", 4, 8, 2))
  assert len(prog.channels) == 4 and prog.has_pairs
  assert set(prog.codes) - set(program.CODES) == {"f+bw", "f_first+bw", "f_last+bw_first"}
  # Executed ticks are the table's where some op starts (54 -> 40 here: the rest are inside
  # ops on every stage), and what runs on them is the table.
  assert prog.code.shape == (40, 4) and len(prog.table.kind) == 54
  np.testing.assert_array_equal(prog.executed(prog.code), prog.table.kind)


def test_validator_rejects_broken_v_tables():
  table = schedules.make_table("dualpipev", 2, 4, 2)
  t, s = np.argwhere(table.paired())[0]
  fuse = table.with_next().copy()
  fuse[t + 1, s] = False  # the pair's B without its W: a pair of F and B, still valid
  schedules.validate(dataclasses.replace(table, fuse=fuse))
  fuse[t - 1, s] = True  # the op before joined to the pair: F, F, B is no op
  with pytest.raises(ValueError, match="neither a full backward"):
    schedules.validate(dataclasses.replace(table, fuse=fuse))
  # A pair whose backward's input arrives while the pair runs.
  zbv = schedules.make_table("zbv", 2, 4, 2)
  f1 = int(np.argwhere((zbv.kind[:, 1] == F) & (zbv.chunk[:, 1] == 2) & (zbv.mb[:, 1] == 0))[0, 0])
  fuse = np.zeros_like(zbv.kind, bool)
  fuse[f1 - 1, 1] = True  # stage 1's op before chunk 2's F, fused with it: F0 then F2 of mb 0
  with pytest.raises(ValueError, match="neither a full backward"):
    schedules.validate(dataclasses.replace(zbv, fuse=fuse))
  chunk = zbv.chunk.copy()
  chunk[0, 0] = 2  # chunk 2 lives on stage 1 in the V
  with pytest.raises(ValueError, match="lives on stage 1"):
    schedules.validate(dataclasses.replace(zbv, chunk=chunk))


def test_v_config_errors_name_the_key():
  with pytest.raises(ValueError, match="set pipeline.virtual_stages=2"):
    schedules.make_table("zbv", 4, 8, 1)
  with pytest.raises(ValueError,
                     match=r"dualpipev needs pipeline.microbatches >= 2 x .*\(it is 6\)"):
    schedules.make_table("dualpipev", 4, 6, 2)
  with pytest.raises(ValueError, match="zbv needs pipeline.microbatches"):
    schedules.make_table("zbv", 4, 3, 2)
  with pytest.raises(ValueError, match="or 2 for zbv and dualpipev"):
    schedules.make_table("1f1b", 4, 8, 2)


def test_forward_table_in_the_v():
  table = schedules.forward_table(4, 8, 2, "v")
  schedules.validate(table)
  assert set(np.unique(table.kind)) == {IDLE, F} and table.placement == "v"


def test_v_timelines(tmp_path):
  text = timeline.ascii_timeline(schedules.make_table("dualpipev", 2, 4, 2))
  head, stage0 = text.splitlines()[:2]
  assert "bubble 0.083 (theory 0.083), residual sets 5 (theory 5)" in head
  assert "&B" in stage0 and "&W" in stage0  # a pair's backward, in its op
  assert stage0.startswith("stage 0 | F0a  F1a  F2a  F0b  B0b  W0b  F1b  F3a &B1b &W1b")
  timeline.render_png(schedules.make_table("zbv", 4, 8, 2), str(tmp_path / "t.png"))
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_lockstep_bubble_and_the_planner_follow_the_table():
  # Every tick ends with the stages' ppermutes: ZB-V's single-action ticks cost what the table
  # says; DualPipeV's pairs (3 ticks at their first) are staggered over the stages, so the
  # executor's ticks last longer than the table's (its gain is the pairs' overlap).
  zbv, dpv = (schedules.make_table(name, 4, 16, 2) for name in ("zbv", "dualpipev"))
  assert zbv.lockstep_bubble() == pytest.approx(zbv.bubble())
  assert dpv.lockstep_bubble() == pytest.approx(22 / 96)
  # The planner's bubble, residual sets and stage sends are the executed table's.
  assert cost.bubble("zbv", 4, 16, 2) == zbv.bubble()
  assert memory.in_flight("dualpipev", 4, 16, 2) == 9
  assert [memory.channels(name, 4, 16, v) for name, v in (("zero_bubble", 1), ("zbv", 2),
                                                          ("dualpipev", 2))] == [2, 2, 4]
