"""scripts/gpu_session.py: the parts a lent GPU runs name scripts, flags and benchmark rows that
exist, and the runner keeps to its budget (a command cut off, the next skipped, results kept).
Its GPU commands themselves run only on a GPU."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_moe_gpu  # noqa: E402
import bench_train  # noqa: E402
import gpu_session  # noqa: E402


def _commands():
  return [argv for commands in gpu_session.PARTS.values() for _, argv, _, _ in commands]


def test_parts_name_what_exists():
  for argv in _commands():
    paths = [a for a in argv if a.endswith(".py")]
    assert paths and all(os.path.exists(os.path.join(ROOT, p)) for p in paths), argv
    if argv[1] == "-m":
      continue  # pytest: its test files are the paths above
    source = open(os.path.join(ROOT, argv[1]), encoding="utf-8").read()
    for flag in (a for a in argv if a.startswith("--")):
      assert f'"{flag}"' in source, (argv[1], flag)  # an argparse option of that script
  for train in (a for a in _commands() if a[1] == "scripts/bench_train.py"):
    assert "--exact" in train
    assert set(train[train.index("--only") + 1].split(",")) <= set(bench_train.ROWS)
  for moe in (a for a in _commands() if a[1] == "scripts/bench_moe_gpu.py" and "train" in a):
    for key in moe[moe.index("--only") + 1].split(","):
      assert [n for n in bench_moe_gpu.ROWS if key in n] == [key], key


def test_first_part_fits_one_call():
  """Issue 38: the rows the predictor needs most run in the first call; each result file has
  its own name, so the two calls' files never overwrite each other in $OUT."""
  first = " ".join(" ".join(a) for _, a, _, _ in gpu_session.PARTS["first"])
  for wanted in ("1b selective b8", "8b-8L selective b2", "bench_kernels", "dropless pallas"):
    assert wanted in first, wanted
  files = [f for part in ("first", "second") for *_, results in gpu_session.PARTS[part]
           for f in results]
  assert len(files) == len(set(files)) and len(files) <= 2 * 7  # 8 files back per call, a log


def test_run_keeps_to_its_budget(tmp_path, monkeypatch):
  py = sys.executable
  part = [
      ("writes a result", [py, "-c", f"open({str(tmp_path / 'r.md')!r}, 'w').write('x')"], {},
       [str(tmp_path / "r.md")]),
      ("outlasts the budget", [py, "-c", "import time; time.sleep(60)"], {}, []),
      ("never starts", [py, "-c", "pass"], {}, []),
  ]
  monkeypatch.setitem(gpu_session.PARTS, "test", part)
  monkeypatch.setattr(gpu_session, "MIN_LEFT_S", 0.5)
  out = tmp_path / "out"
  failed = gpu_session.run("test", 4.0, str(out), str(tmp_path / "no_wheels"),
                           str(tmp_path / "site"))
  log = (out / "test.log").read_text()
  assert failed == 2, log
  assert "writes a result: rc 0" in log and "outlasts the budget: cut off" in log
  assert "skipped, budget spent: never starts" in log
  assert (out / "r.md").read_text() == "x"


def test_run_needs_a_part():
  with pytest.raises(SystemExit):
    gpu_session.main(["run"])
