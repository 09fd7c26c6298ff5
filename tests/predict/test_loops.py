"""`jscale.predict.loops`: each loop's two streams per trip, the waits inside it, and the step's
ceiling with every collective hidden within its own loop, on hand-made launches."""

import dataclasses

import pytest

from jscale import hardware
from jscale.analysis import hlo
from jscale.predict import launches, loops, rates, summary, timing

CHIP = rates.chip("h100")
FIT = CHIP.fit


def _collective(name: str, ms: float) -> launches.Launch:
  bytes_ = int((ms * 1e-3 - FIT.collective_s) * hardware.busbw("all-gather", 1))
  c = hlo.Collective("all-gather", name, "main", ("u8",), ("u8",), bytes_, "", ((0, 1),), 2,
                     None)
  return launches.Launch(name, "all-gather-start", "collective", "all-gather", "", collective=c)


def _done(name: str) -> launches.Launch:
  return launches.Launch(name + "d", "all-gather-done", "done", "all-gather", "", done_of=name)


def _work(name: str, ms: float, op_name: str = "") -> launches.Launch:
  return launches.Launch(name, "fusion", "memory", "kLoop", op_name,
                         bytes=(ms * 1e-3 - FIT.launch_s) * CHIP.hbm_bytes_s * FIT.memory)


def _step():
  """A loop that sends 3 ms a trip and computes 1 ms (4 trips), then one that computes 5 ms a
  trip and sends nothing (10 trips): 12 ms of transfers against 54 ms of compute in all."""
  exchange = launches.Loop("while.1", 4, [_collective("a2a", 3.0), _work("experts", 1.0),
                                          _done("a2a")])
  dense = launches.Loop("while.2", 10, [_work("attention", 5.0)])
  items = [exchange, dense]
  s = timing.schedule(items, CHIP)
  s.loops, s.loop_ceiling_s = loops.loop_times(s, items, CHIP), loops.ceiling_s(items, s, CHIP)
  return items, s


def test_each_loop_is_told_by_its_own_two_streams():
  """A trip's compute and transfers, the trips per step, and the waits inside the loop; a loop
  whose transfers outlast its compute is collective-bound."""
  _, s = _step()
  exchange, dense = s.loops
  assert (exchange.name, exchange.runs, dense.runs) == ("while.1", 4, 10)
  assert exchange.compute_s == pytest.approx(1e-3) and exchange.collectives_s == pytest.approx(3e-3)
  assert exchange.collective_bound and not dense.collective_bound
  assert exchange.exposed_s > 0
  assert exchange.exposed_s == pytest.approx(sum(s.waits.values()))
  assert dense.exposed_s == 0


def test_the_loop_ceiling_bounds_the_step_tighter_than_the_two_streams():
  """The whole step's two streams say 54 ms (compute); the exchange loop cannot hide its 3 ms a
  trip under the other loop's compute, so with every collective hidden within its own loop the
  step takes 4 x 3 + 10 x 5 = 62 ms, and the predicted schedule never beats that."""
  _, s = _step()
  r = summary.summarize(s, CHIP, 1e9, 1000)
  assert r.overlap_ceiling_s == pytest.approx(54e-3)
  assert r.loop_ceiling_s == pytest.approx(62e-3)
  assert r.loop_ceiling_s <= r.step_s * (1 + 1e-9)
  text = summary.format_summary(r, "")
  assert "while.1 x4: 1.0 / 3.0 ms collective-bound" in text
  assert "with every collective hidden within its own loop: 62.0 ms" in text


def test_nested_loops_count_by_their_trips():
  """An outer loop's trip holds its inner loop's trips: per trip 3 x (1 ms compute, 2 ms sent)."""
  inner = launches.Loop("inner", 3, [_collective("ag", 2.0), _work("w", 1.0), _done("ag")])
  items = [launches.Loop("outer", 2, [inner])]
  s = timing.schedule(items, CHIP)
  outer, nested = loops.loop_times(s, items, CHIP)
  assert (outer.runs, nested.runs, nested.depth) == (2, 6, 1)
  assert outer.compute_s == pytest.approx(3e-3) and outer.collectives_s == pytest.approx(6e-3)
  assert nested.exposed_s > 0 and outer.exposed_s == pytest.approx(nested.exposed_s)
  assert loops.ceiling_s(items, s, CHIP) == pytest.approx(12e-3)


def test_a_rewritten_loop_is_named_by_what_its_launches_share():
  """XLA's double-buffered and peeled loops carry no op_name: the loop is named by the
  `.../while` its launches' op_names share."""
  body = [_work("a", 1.0, "jit(step)/shard_map/backward/jvp(forward)/layers/while/body/mlp/dot"),
          _work("b", 1.0, "jit(step)/shard_map/backward/jvp(forward)/layers/while/body/attn/x")]
  loop = launches.Loop("while.7.double_buffer_clone", 2, body)
  assert loops.source(loop) == "jit(step)/shard_map/backward/jvp(forward)/layers/while"
  assert loops.source(dataclasses.replace(loop, op_name="named")) == "named"
