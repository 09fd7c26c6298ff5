"""The executor's lockstep tables (`jscale/parallel/pipeline/lockstep.py`): every schedule
re-timed in steps stays a valid table with each stage's order and residual sets, never runs
longer in lockstep, and brings DualPipeV's executed bubble at p = 4, m = 16 from 0.229 to
0.094 (issue 50, item 2); the program executes one tick per step. Parity of the executed
schedules with one device: tests/parallel/test_pipeline.py and test_pipeline_v.py, which run
the tables `lockstep.executed_table` picks."""

import numpy as np
import pytest

from jscale.parallel.pipeline import lockstep, program, schedules
from jscale.parallel.pipeline.table import B, F, W, fusable

SHAPES = [(name, p, m, v) for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2),
                                          ("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2))
          for p in (2, 4, 8) for m in (2 * p, 4 * p)]


def _actions(table):
  return [[a for op in ops for a in op] for ops in lockstep.stage_ops(table)]


@pytest.mark.parametrize("name,p,m,v", SHAPES)
def test_steps_keep_the_order_and_never_cost_more(name, p, m, v):
  table = schedules.make_table(name, p, m, v)
  stepped = lockstep.in_steps(table)
  schedules.validate(stepped)
  assert _actions(stepped) == _actions(table)  # each stage's actions, in its order
  np.testing.assert_array_equal(stepped.live().max(0), table.live().max(0))
  # Every op starts on a step's first row: the table's bubble is what lockstep runs.
  assert stepped.bubble() == pytest.approx(stepped.lockstep_bubble())
  assert stepped.lockstep_bubble() <= table.lockstep_bubble() + 1e-12


def test_executed_bubbles():
  got = {name: (schedules.make_table(name, 4, 16, v).lockstep_bubble(),
                lockstep.executed_table(name, 4, 16, v).lockstep_bubble())
         for name, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2))}
  assert got["dualpipev"] == pytest.approx((22 / 96, 9 / 96))  # issue 50: <= 0.1
  assert got["1f1b"] == pytest.approx((112 / 96, 48 / 96))
  assert got["interleaved"] == pytest.approx((184 / 192, 72 / 192))
  assert got["zbv"] == pytest.approx((3 / 96, 3 / 96))  # one action a tick: nothing to gain
  # Where steps do not pay, the papers' table runs as it is.
  table = lockstep.executed_table("zbv", 4, 16, 2)
  np.testing.assert_array_equal(table.kind, schedules.make_table("zbv", 4, 16, 2).kind)


def test_dualpipev_runs_its_pairs_in_fewer_longer_ticks():
  paper = program.compile_program(schedules.make_table("dualpipev", 4, 16, 2))
  stepped = program.compile_program(lockstep.executed_table("dualpipev", 4, 16, 2))
  # The same 89 forward + backward pairs (the overlap DualPipeV is for), the same buffers.
  assert paper.table.paired().sum() == stepped.table.paired().sum() == 89
  assert (stepped.n_res, stepped.n_in_f, stepped.n_in_b, len(stepped.channels)) == (
      paper.n_res, paper.n_in_f, paper.n_in_b, len(paper.channels))
  # One executed tick per step (the rows where no op starts are not run): 49 ticks lasting
  # 105 unit ticks in lockstep, against 56 lasting 118.
  assert (len(paper.rows), len(stepped.rows)) == (56, 49)
  assert stepped.table.ticks == 105 == 96 + 9
  np.testing.assert_array_equal(stepped.executed(stepped.code), stepped.table.kind)


def test_fusable_is_what_the_executor_runs():
  C = 8
  assert fusable([(B, 0, 3), (W, 0, 3)], C) and fusable([(F, 2, 0), (B, 0, 7), (W, 0, 7)], C)
  assert not fusable([(B, 0, 3), (W, 1, 3)], C)  # a W of another B
  assert not fusable([(F, 0, 7), (B, 0, 7)], C)  # a B reading its own op's F
  assert not fusable([(F, 1, 7), (B, 0, 3)], C)  # the head's gradient and a B's, one channel
  assert not fusable([(W, 0, 3), (F, 1, 3)], C)
