"""`jscale.predict`'s schedule on hand-made launches: the two streams' overlap arithmetic (a
collective's -start queues it beside the compute, its -done waits), loops' steady state, and
the exposed time told by the collectives the compute waits for."""

import dataclasses

import pytest

from jscale import hardware
from jscale.analysis import hlo
from jscale.predict import launches, rates, summary, timing

CHIP = rates.chip("h100")
FIT = CHIP.fit


def _collective(ms: float) -> launches.Launch:
  """A start whose transfer takes `ms` (all-gather volume over one node's busbw)."""
  bytes_ = int((ms * 1e-3 - FIT.collective_s) * hardware.busbw("all-gather", 1))
  c = hlo.Collective("all-gather", "ag", "main", ("u8",), ("u8",), bytes_, "", ((0, 1),), 2,
                     None)
  return launches.Launch("ag", "all-gather-start", "collective", "all-gather", "", collective=c)


def _work(name: str, ms: float) -> launches.Launch:
  return launches.Launch(name, "fusion", "memory", "kLoop", "",
                        bytes=ms * 1e-3 * CHIP.hbm_bytes_s * FIT.memory)


@pytest.mark.parametrize("between_ms", [0.0, 0.6, 1.5])
def test_async_collective_hides_behind_the_compute_between_start_and_done(between_ms):
  """The playbook's overlap: a 1 ms transfer with `between_ms` of compute between its start
  and done exposes only what outlasts that compute (all of it with none, nothing past 1 ms)."""
  done = launches.Launch("agd", "all-gather-done", "done", "all-gather", "", done_of="ag")
  items = [_collective(1.0)] + ([_work("w", between_ms)] if between_ms else []) + [done]
  busy = between_ms * 1e-3 + (FIT.launch_s if between_ms else 0.0)
  s = timing.schedule(items, CHIP)
  assert s.seconds == pytest.approx(max(busy, 1e-3))
  # ... and what is exposed is the wait for that collective
  assert s.waits.get("ag", 0.0) == pytest.approx(max(0.0, 1e-3 - busy), abs=1e-12)


def test_loop_carried_collective_overlaps_the_next_iteration():
  """XLA's pipelined collectives: the next iteration's transfer starts in this one and is
  waited for at the top of the next; the steady state hides it behind this body's compute, and
  exposes it when nothing runs between the start and the loop's back edge."""
  done = launches.Launch("agd", "all-gather-done", "done", "all-gather", "", done_of="ag")
  hidden = [done, _collective(1.0), _work("w", 2.0)]
  assert timing.schedule([launches.Loop("l", 5, hidden)], CHIP).seconds == pytest.approx(
      5 * (2e-3 + FIT.launch_s))
  late = [done, _work("w", 2.0), _collective(1.0)]
  s = timing.schedule([launches.Loop("l", 5, late)], CHIP)
  assert s.seconds == pytest.approx(5 * (2e-3 + FIT.launch_s) + 4 * 1e-3)
  # The waits as the time is extrapolated: none in the first trip, 1 ms in each other.
  assert s.waits == pytest.approx({"ag": 4e-3})
  assert not timing.schedule([launches.Loop("l", 5, hidden)], CHIP).waits


def test_a_collective_in_flight_across_a_loop_finishes_when_it_does():
  """A transfer started before a loop and waited for after it (a host copy, or a collective
  where XLA keeps more than one in flight) ends at its own time, not moved with the trips
  that the steady state extrapolates: 5 ms under five trips of 2 ms is hidden."""
  done = launches.Launch("agd", "all-gather-done", "done", "all-gather", "", done_of="ag")
  s = timing.schedule([_collective(5.0), launches.Loop("l", 5, [_work("w", 2.0)]), done], CHIP)
  assert s.seconds == pytest.approx(5 * (2e-3 + FIT.launch_s))
  assert not s.waits


def test_the_exposed_time_is_told_by_the_collectives_waited_for():
  """`summary.exposed_by`: the waits grouped by kind, size and span, the longest first, and
  the report prints them."""
  done = lambda n: launches.Launch(n + "d", "all-gather-done", "done", "all-gather", "",
                                   done_of=n)
  big, small = _collective(3.0), dataclasses.replace(_collective(1.0), name="ag2")
  items = [big, _work("w", 1.0), done("ag"), small, done("ag2")]
  s = timing.schedule(items, CHIP)
  r = summary.summarize(s, CHIP, 1e9, 1000)
  (w1, t1), (w2, t2) = r.exposed_by
  assert w1.startswith("all-gather") and w1.endswith("1 launch") and w2.endswith("1 launch")
  assert t1 == pytest.approx(2e-3 - FIT.launch_s) and t2 == pytest.approx(1e-3)
  assert t1 + t2 == pytest.approx(r.exposed_collectives_s)
  assert "the collectives the compute waits for" in summary.format_summary(r, "")


def test_the_report_sums_the_kinds_it_does_not_list():
  """Past `EXPOSED_KINDS` kinds the report says how much the rest hold, so its exposed rows add
  up to the exposed total (the 671B on 2,048 H100s: 0.7 s of 5.3 s in kinds past the eighth)."""
  n = summary.EXPOSED_KINDS + 3
  items = []
  for i in range(n):  # n collectives of distinct sizes, each waited for at once: n kinds
    c = dataclasses.replace(_collective(1.0 + 0.1 * i), name=f"ag{i}")
    items += [c, launches.Launch(f"d{i}", "all-gather-done", "done", "all-gather", "",
                                 done_of=c.name)]
  r = summary.summarize(timing.schedule(items, CHIP), CHIP, 1e9, 1000)
  assert len(r.exposed_by) == n
  text = summary.format_summary(r, "")
  assert "3 more kinds, the largest" in text
  listed = text.split("by kind):\n")[1].split("\n\n")[0].splitlines()
  assert len(listed) == summary.EXPOSED_KINDS + 1
  total_ms = sum(float(line.split()[0]) for line in listed)
  assert total_ms == pytest.approx(r.exposed_collectives_s * 1e3, abs=0.1 * len(listed))


def test_the_overlap_ceiling_is_the_longer_stream():
  """`Summary.overlap_ceiling_s`: with every collective hidden a step still takes its compute
  stream's time or its one collective stream's, whichever is longer; the report says which."""
  done = lambda n: launches.Launch(n + "d", "all-gather-done", "done", "all-gather", "",
                                   done_of=n)
  small = dataclasses.replace(_collective(1.0), name="ag2")
  comm_bound = [_collective(3.0), _work("w", 1.0), done("ag"), small, done("ag2")]
  r = summary.summarize(timing.schedule(comm_bound, CHIP), CHIP, 1e9, 1000)
  assert r.collectives_s == pytest.approx(4e-3) and r.busy_s == pytest.approx(1e-3 + FIT.launch_s)
  assert r.overlap_ceiling_s == pytest.approx(4e-3) == pytest.approx(r.step_s)
  assert "collective stream's" in summary.format_summary(r, "")
  compute_bound = [_collective(1.0), _work("w", 0.5), done("ag"), _work("v", 2.0)]
  r = summary.summarize(timing.schedule(compute_bound, CHIP), CHIP, 1e9, 1000)
  assert r.exposed_collectives_s > 0 and r.overlap_ceiling_s == pytest.approx(r.busy_s)
  assert r.overlap_ceiling_s < r.step_s
  assert "compute stream's" in summary.format_summary(r, "")
