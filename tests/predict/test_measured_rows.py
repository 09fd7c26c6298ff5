"""scripts/measured_data.py's rows agree with themselves and with the MFU formula (no compile,
no worktree): what jscale.predict is calibrated against must not carry a typo."""

import os
import sys

import pytest

from jscale import metrics
from jscale.config_load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from measured_data import PEAK_TFLOPS, ROWS  # noqa: E402  pylint: disable=wrong-import-position


def test_rows_are_the_22_measured_and_well_formed():
  assert len(ROWS) == 22 and len({r.name for r in ROWS}) == 22
  for r in ROWS:
    assert (r.device, r.target, r.commit) in {("H100", "h100x1", "29f9f33"),
                                              ("H200", "h200x1", "6f9fa39")}, r.name
    assert r.patch is None or os.path.isfile(os.path.join(ROOT, r.patch)), r.name
    assert f"train.batch_size={r.batch}" in r.overrides, r.name
    assert f"train.seq_len={r.seq}" in r.overrides, r.name
    assert r.peak_gib is None or 0 < r.peak_gib < (80 if r.device == "H100" else 141), r.name
    assert os.path.isfile(os.path.join(ROOT, r.source.split(":")[0])), r.name


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_tokens_step_and_mfu_agree(row):
  # The overrides also load with today's config (HEAD rows exactly as measured).
  cfg = load_config(os.path.join(ROOT, row.config), list(row.overrides))
  assert (cfg.train.batch_size, cfg.train.seq_len) == (row.batch, row.seq)
  assert row.step_s * row.tokens_per_s == pytest.approx(row.batch * row.seq, rel=2e-3)
  mfu = row.tokens_per_s * metrics.flops_per_token(cfg.model, row.seq) / (PEAK_TFLOPS * 1e12)
  assert mfu == pytest.approx(row.mfu, abs=6e-3)  # sources round to 0.1% ("~48%")
  if row.category_ms:  # a profile's categories add up to about one step
    assert sum(row.category_ms.values()) / 1e3 == pytest.approx(row.step_s, rel=0.04)
  if row.shares:
    assert sum(row.shares.values()) == pytest.approx(1.0, abs=0.01)
