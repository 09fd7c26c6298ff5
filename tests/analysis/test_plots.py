"""Pictures of runs: metrics.jsonl read as series (resumed runs, a crash's partial line), the
3-panel PNG with runs overlaid, `python -m jscale.report plot`, and the PNG a real run writes
when it ends."""

from __future__ import annotations

import contextlib
import io
import json

import matplotlib.image
import pytest

from conftest import small_config
from jscale import report
from jscale import train as train_lib
from jscale.analysis import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, rows, tail: str = ""):
  run_dir.mkdir(parents=True, exist_ok=True)
  text = "".join(json.dumps(r) + "\n" for r in rows) + tail
  (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
  return run_dir


def _rows(losses, mfu=None, start=1):
  return [{"step": start + i, "loss": l, "tokens_per_sec": 1000.0 + i, "mfu": mfu, "time": 0.0}
          for i, l in enumerate(losses)]


def test_series_later_rows_win_and_partial_lines_are_skipped(tmp_path):
  # A run to step 4, resumed from its step-2 checkpoint: steps 3-4 logged again, then a crash
  # mid-line.
  rows = _rows([4.0, 3.0, 2.5, 2.4]) + [{"step": 2, "val_loss": 3.5, "time": 0.0}]
  rows += _rows([2.6, 2.3], start=3)
  run = _write_run(tmp_path / "a", rows, tail='{"step": 5, "loss": 2.')
  series = plots.read_metrics(str(run))
  assert series["loss"] == [(1, 4.0), (2, 3.0), (3, 2.6), (4, 2.3)]
  assert series["val_loss"] == [(2, 3.5)]
  assert "mfu" not in series and "time" not in series  # null MFU (CPU) is no series


def test_png_overlays_runs_and_says_when_mfu_is_missing(tmp_path):
  a = _write_run(tmp_path / "x" / "run", _rows([4.0, 3.0, 2.0], mfu=0.4))
  b = _write_run(tmp_path / "y" / "run", _rows([4.2, 3.5]))  # same basename, no MFU
  out = tmp_path / "cmp.png"
  names = plots.labels([str(a), str(b)])
  assert names == ["x/run", "y/run"]
  drawn = plots.figure({n: plots.read_metrics(str(d)) for n, d in zip(names, (a, b))},
                       str(out))
  assert drawn == {"loss": names, "tokens/s": names, "MFU (%)": ["x/run"]}
  assert out.read_bytes()[:8] == PNG_MAGIC
  height, width, _ = matplotlib.image.imread(str(out)).shape
  assert width > 2 * height  # three panels side by side
  assert not [p for p in tmp_path.iterdir() if p.suffix == ".png" and p != out]  # no temp


def test_report_cli(tmp_path):
  a = _write_run(tmp_path / "a", _rows([3.0, 2.0]))
  b = _write_run(tmp_path / "b", _rows([3.1, 2.2]))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert report.main(["plot", str(a), str(b), "--out", str(tmp_path / "ab.png")]) == 0
  assert out.getvalue().strip() == f"wrote {tmp_path / 'ab.png'}"
  with contextlib.redirect_stdout(io.StringIO()):
    assert report.main(["plot", str(a)]) == 0
  assert (a / "metrics.png").read_bytes()[:8] == PNG_MAGIC
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    assert report.main(["plot", str(tmp_path / "nope")]) == 2
  assert "no metrics.jsonl" in err.getvalue()


def test_run_end_plot_never_fails_the_run(tmp_path, capsys):
  assert plots.plot_run_end(str(tmp_path / "missing")) is None
  assert "warning: no metrics.png" in capsys.readouterr().out


def test_a_run_writes_its_png(tmp_path, data_cache):
  cfg = small_config(None, f"train.output_dir={tmp_path}/run", f"data.cache_dir={data_cache}",
                     "train.steps=2", "model.n_layers=1", "logging.plot=true")
  with contextlib.redirect_stdout(io.StringIO()):
    train_lib.run(cfg)
  assert (tmp_path / "run" / "metrics.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("bad", ["", "not json\n"])
def test_empty_metrics_still_draw(tmp_path, bad):
  run = _write_run(tmp_path / "r", [], tail=bad)
  assert plots.read_metrics(str(run)) == {}
  assert plots.plot_runs([str(run)]).endswith("metrics.png")
