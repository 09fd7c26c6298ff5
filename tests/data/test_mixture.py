"""`data.mixture`: sources drawn in proportion to their weights (within 1% over 10k windows),
deterministically from the seed, resumable; each source's own validation split and loss; bad
mixtures refused."""

import json

import numpy as np
import pytest

from conftest import small_config
from jscale import train as train_lib
from jscale.config import ConfigError, DataConfig, MixSource
from jscale.data import make_eval_sets, make_train_iterator

L = 16


def _bin(path, low, n=40_000):
  """A .bin whose every id lies in [low, low + 100): its windows name their source."""
  np.random.default_rng(low).integers(low, low + 100, n).astype(np.uint16).tofile(path)
  return str(path)


def _mixture(tmp_path, seed=0, weights=(0.7, 0.3)):
  # Written once: rewriting a file another iterator has memory-mapped would pull it away.
  a, b = tmp_path / "a.bin", tmp_path / "b.bin"
  if not a.exists():
    _bin(a, 1), _bin(b, 150)
  a, b = str(a), str(b)
  return DataConfig(mixture=[MixSource(source="bin", path=a, weight=weights[0], name="low"),
                             MixSource(source="bin", path=b, weight=weights[1], name="high")],
                    seed=seed, val_fraction=0.05, cache_dir=str(tmp_path / "cache"))


def _low_share(it, windows):
  rows = np.concatenate([next(it)["tokens"] for _ in range(windows // 100)])
  return float(np.mean(rows[:, 0] < 128)), rows


def test_the_weights_are_the_proportions(tmp_path):
  share, rows = _low_share(make_train_iterator(_mixture(tmp_path), L, 100), 10_000)
  assert abs(share - 0.7) <= 0.01, share
  assert all((r < 128).all() or (r >= 150).all() for r in rows)  # a window is one source's
  again = _low_share(make_train_iterator(_mixture(tmp_path), L, 100), 10_000)[1]
  np.testing.assert_array_equal(rows, again)  # deterministic
  other = _low_share(make_train_iterator(_mixture(tmp_path, seed=1), L, 100), 10_000)[1]
  assert not np.array_equal(rows, other)  # the seed draws another order


def test_a_mixture_resumes_where_it_stopped(tmp_path):
  cfg = _mixture(tmp_path, weights=(1.0, 3.0))
  it = make_train_iterator(cfg, L, 8)
  for _ in range(5):
    next(it)
  state = it.get_state()
  want = [next(it)["tokens"] for _ in range(3)]
  resumed = make_train_iterator(cfg, L, 8)
  resumed.set_state(state)
  np.testing.assert_array_equal([next(resumed)["tokens"] for _ in range(3)], want)


def test_each_source_has_its_own_validation_split(tmp_path):
  sets = make_eval_sets(_mixture(tmp_path), L, 4, 2)
  assert list(sets) == ["low", "high"]
  assert all((b["tokens"] < 128).all() for b in sets["low"])
  assert all((b["tokens"] >= 150).all() for b in sets["high"])


def test_a_run_reports_the_loss_of_each_source(tmp_path, capsys):
  corpus = tmp_path / "prose.txt"
  corpus.write_text("the cat sat on the mat. " * 400)
  code = tmp_path / "code.jsonl"
  code.write_text("".join(json.dumps({"text": f"def f{i}(x):\n  return x * {i}\n"}) + "\n"
                          for i in range(400)))
  mixture = (f"data.mixture=[{{source: text, path: {corpus}, weight: 0.5, name: prose}}, "
             f"{{source: jsonl, path: {code}, weight: 0.5, name: code}}]")
  cfg = small_config(tmp_path, mixture, "train.steps=4", "train.eval_every=4",
                     "train.eval_batches=2", "checkpoint.every=0", "data.val_fraction=0.1")
  train_lib.run(cfg)
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  evals = [r for r in rows if "val_loss" in r]
  assert evals and {"val_loss/prose", "val_loss/code"} <= set(evals[-1])
  out = capsys.readouterr().out
  assert "mixture of prose 50% (text" in out and "(prose " in out and ", code " in out


@pytest.mark.parametrize("mixture, match", [
    ("[]", "data.mixture is empty"),
    ("[{source: text, path: a.txt, weight: 0}]", r"data.mixture\[0\].weight=0.0 must be > 0"),
    ("[{source: text}]", r"data.mixture\[0\].source=text needs data.mixture\[0\].path"),
    ("[{source: text, path: a}, {source: text, path: b}]", "two sources are named 'text'"),
    ("[{source: csv, path: a}]", r"data.mixture\[0\].source='csv': choose one of"),
])
def test_bad_mixtures_are_refused(mixture, match):
  with pytest.raises(ConfigError, match=match):
    small_config(None, f"data.mixture={mixture}")


def test_a_mixture_with_data_path_is_refused():
  with pytest.raises(ConfigError, match="data.path='x.txt' with data.mixture"):
    small_config(None, "data.mixture=[{source: text, path: a.txt}]", "data.path=x.txt")
