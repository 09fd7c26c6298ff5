"""Pipeline schedules as data: tables, validator, bubble against theory, slots, pictures."""

import numpy as np
import pytest

from jscale.parallel.pipeline import placement, program, schedules, timeline
from jscale.parallel.pipeline.schedules import B, F, IDLE, W

CASES = [(name, v, p, m) for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2),
                                         ("zero_bubble", 1))
         for p in (2, 4) for m in (4, 8, 16)]


@pytest.mark.parametrize("name,v,p,m", CASES)
def test_tables_are_valid_and_bubble_matches_theory(name, v, p, m):
  table = schedules.make_table(name, p, m, v)
  schedules.validate(table)
  assert table.bubble() == pytest.approx(schedules.theory_bubble(name, p, m, v), abs=1e-12)
  assert (table.kind != IDLE).sum() == 3 * m * v * p  # useful work: F, B, W per mb and chunk


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_is_at_most_a_third_of_1f1b(p, m):
  zb, ofob = schedules.make_table("zero_bubble", p, m), schedules.make_table("1f1b", p, m)
  assert zb.bubble() <= ofob.bubble() / 3 + 1e-12
  assert zb.ticks == 3 * m + p - 1 and ofob.ticks == 3 * (m + p - 1)


def test_interleaving_deeper_shrinks_the_bubble():
  bubbles = [schedules.make_table("interleaved", 4, 8, v).bubble() for v in (2, 3, 4)]
  assert bubbles == pytest.approx([3 / 16, 3 / 24, 3 / 32])


@pytest.mark.parametrize("m", [4, 8, 16])
def test_residual_buffers_stay_bounded(m):
  p = 4
  res = {name: program.compile_program(schedules.make_table(name, p, m, v)).n_res
         for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))}
  assert res == {"afab": m, "1f1b": p, "interleaved": 2 * p, "zero_bubble": min(m, 2 * p - 1)}
  assert list(schedules.make_table("1f1b", p, m).live().max(axis=0)) == [4, 3, 2, 1]


def _broken(table, **arrays):
  import dataclasses
  return dataclasses.replace(table, **arrays)


def test_validator_rejects_broken_tables():
  table = schedules.make_table("1f1b", 2, 4)
  kind = table.kind.copy()
  t, s = np.argwhere((table.kind == W))[0]
  kind[t, s] = IDLE  # a missing W
  with pytest.raises(ValueError, match="no W"):
    schedules.validate(_broken(table, kind=kind))
  # Stage 1's first forward moved to tick 0: before stage 0 sent its activation.
  kind, mb, chunk = table.kind.copy(), table.mb.copy(), table.chunk.copy()
  t1 = int(np.argwhere((table.kind[:, 1] == F) & (table.mb[:, 1] == 0))[0, 0])
  kind[0, 1], mb[0, 1], chunk[0, 1] = F, 0, 1
  kind[t1, 1], mb[t1, 1], chunk[t1, 1] = IDLE, -1, -1
  with pytest.raises(ValueError, match="after F of the chunk before"):
    schedules.validate(_broken(table, kind=kind, mb=mb, chunk=chunk))
  chunk = table.chunk.copy()
  chunk[0, 0] = 1  # chunk 1 lives on stage 1
  with pytest.raises(ValueError, match="lives on stage 1"):
    schedules.validate(_broken(table, chunk=chunk))
  with pytest.raises(ValueError, match="above the bound"):
    schedules.validate(_broken(table, bound=1))


def test_bad_arguments_name_the_key():
  with pytest.raises(ValueError, match="pipeline.microbatches .* multiple of mesh.stage"):
    schedules.make_table("interleaved", 4, 6, 2)
  with pytest.raises(ValueError, match="pipeline.virtual_stages=2 is only for"):
    schedules.make_table("1f1b", 2, 4, 2)
  with pytest.raises(ValueError, match=">= mesh.stage"):
    schedules.make_table("1f1b", 4, 2)
  with pytest.raises(ValueError, match="pipeline.schedule='gpipe'"):
    schedules.make_table("gpipe", 2, 4)


def test_program_slots_and_forward_table():
  prog = program.compile_program(schedules.make_table("1f1b", 4, 8))
  assert (prog.n_in_f, prog.n_in_b) == (1, 1)
  # Every F reads a slot filed on its stage by then (at the latest at the start of its tick).
  for s in range(4):
    for t in np.nonzero(np.isin(prog.code[:, s], [program.C_F, program.C_F_LAST]))[0]:
      filed = np.nonzero(prog.file_f[:t + 1, s] == prog.read_f[t, s])[0]
      assert filed.size, (t, s)
  fwd = schedules.forward_table(4, 8)
  schedules.validate(fwd)
  assert fwd.ticks == 8 + 3 and set(np.unique(fwd.kind)) == {IDLE, F}


def test_storage_order_round_trips():
  order = placement.storage_order(8, 2, 2)  # chunks of 2 layers; stage 0 holds chunks 0 and 2
  assert list(order) == [0, 1, 4, 5, 2, 3, 6, 7]
  x = {"w": np.arange(8)}
  assert list(placement.to_model(placement.to_storage(x, 8, 2, 2), 8, 2, 2)["w"]) == list(range(8))


def test_timeline_pictures(tmp_path):
  table = schedules.make_table("interleaved", 2, 4, 2)
  text = timeline.ascii_timeline(table)
  lines = text.splitlines()
  assert len(lines) == 3 and lines[1].startswith("stage 0 |F0a F1a F0b")
  assert "bubble 0.125 (theory 0.125)" in lines[0]
  timeline.render_png(table, str(tmp_path / "t.png"))
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
