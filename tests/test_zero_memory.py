"""ZeRO stages 0-3 at fsdp=8: compiled per-device memory against the playbook formulas."""

import pytest

from jscale import introspect


@pytest.fixture(scope="module")
def rows():
  return introspect.zero_memory_rows(8)


def test_model_state_arguments_are_sharded_per_stage(rows):
  # Stored state is params + optimizer (gradients are temporaries of the step).
  for r in rows:
    stored = r["f_params"] + r["f_optimizer"]
    assert r["argument"] == pytest.approx(stored, rel=0.01), r["stage"]


def test_memory_follows_the_formula_within_15_percent(rows):
  for r in rows:
    assert 0.97 <= r["ratio"] <= 1.15, (r["stage"], r["measured"], r["f_total"])


def test_each_stage_saves_what_it_shards(rows):
  # Temps hold the gradients: full size until ZeRO-2 shards them.
  full_grads = rows[0]["f_grads"]
  assert rows[0]["temp"] >= full_grads and rows[1]["temp"] >= full_grads
  assert rows[2]["temp"] < 0.25 * full_grads and rows[3]["temp"] < 0.25 * full_grads
  assert [r["measured"] for r in rows] == sorted((r["measured"] for r in rows), reverse=True)
