"""Record sources (`data.source=jsonl|parquet|arrow`, `jscale.data.records`): each reads the same
documents as text files of them would give; a saved `datasets` directory through `datasets` and
through pyarrow alone; one clear line for what cannot be read; an interrupted tokenization
leaves nothing in the cache."""

import json
import os
import re
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from conftest import ROOT, TINY_RUN
from jscale.config import ConfigError, DataConfig
from jscale.data import corpus as corpus_lib
from jscale.data import load_splits, make_train_iterator, records
from jscale.data.tokenizer import ByteTokenizer

DOCS = ["the cat sat on the mat", "", "a dog ate the hat\nand then some", "héllo wörld ✓",
        "x" * 300]


def _jsonl(path, docs, field="text"):
  path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)),
                  encoding="utf-8")


def _table(docs):
  return pa.table({"id": list(range(len(docs))), "text": docs})


def _write(fmt, directory, docs):
  """`docs` split over two files of `fmt` in `directory`."""
  directory.mkdir(parents=True, exist_ok=True)
  halves = (docs[:2], docs[2:])
  for i, part in enumerate(halves):
    path = directory / f"part-{i}{records.EXTENSIONS[fmt][0]}"
    if fmt == "jsonl":
      _jsonl(path, part)
    elif fmt == "parquet":
      pq.write_table(_table(part), path, row_group_size=2)
    elif i == 0:  # arrow: the IPC stream format for one, the file format for the other
      with pa.ipc.new_stream(str(path), _table(part).schema) as w:
        w.write_table(_table(part), max_chunksize=2)
    else:
      with pa.ipc.new_file(str(path), _table(part).schema) as w:
        w.write_table(_table(part))


def _want():
  return corpus_lib.tokenize(DOCS, ByteTokenizer()).tokens


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_each_format_reads_the_documents(fmt, tmp_path):
  _write(fmt, tmp_path / "data" / "sub", DOCS)
  cfg = DataConfig(source=fmt, path=str(tmp_path / "data"), val_fraction=0.0,
                   cache_dir=str(tmp_path / "cache"))
  np.testing.assert_array_equal(load_splits(cfg).train, _want())  # empty documents skipped
  np.testing.assert_array_equal(load_splits(cfg).train, _want())  # again, from the cache
  glob = DataConfig(source=fmt, path=str(tmp_path / "data" / "**" / "part-1*"), val_fraction=0.0,
                    cache_dir=str(tmp_path / "cache"))
  np.testing.assert_array_equal(load_splits(glob).train,
                                corpus_lib.tokenize(DOCS[2:], ByteTokenizer()).tokens)
  assert next(make_train_iterator(cfg, 8, 2))["tokens"].shape == (2, 8)


def test_a_saved_datasets_directory(tmp_path):
  """`save_to_disk` output (a Dataset and a DatasetDict's train split) reads through
  `datasets` and, as any Arrow files, through pyarrow alone: the same documents."""
  datasets = pytest.importorskip("datasets")
  ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "body": DOCS})
  ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)
  datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
  for path in (tmp_path / "ds", tmp_path / "dd"):
    via_datasets = list(records.documents(str(path), "arrow", "body"))
    by_pyarrow = [d for f in records.record_files(str(path), "arrow")
                  for d in records._arrow(f, "body")]  # pylint: disable=protected-access
    assert via_datasets == by_pyarrow == DOCS
  cfg = DataConfig(source="arrow", path=str(tmp_path / "dd"), text_field="body",
                   val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
  np.testing.assert_array_equal(load_splits(cfg).train, _want())


def _error(tmp_path, fmt, name, content=None, **cfg):
  path = tmp_path / name
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(ConfigError) as e:
    load_splits(DataConfig(source=fmt, path=str(path), cache_dir=str(tmp_path / "c"), **cfg))
  return str(e.value)


def test_what_cannot_be_read_is_named(tmp_path):
  line2 = b'{"text": "ok"}\n{"body": "no text"}\n'
  assert "a.jsonl line 2 has no field 'text' (it has ['body'])" in _error(
      tmp_path, "jsonl", "a.jsonl", line2)
  assert "data.text_field" in _error(tmp_path, "jsonl", "a.jsonl", line2)
  assert "b.jsonl line 1 is not UTF-8" in _error(tmp_path, "jsonl", "b.jsonl",
                                                  b'{"text": "caf\xe9"}\n')
  assert "c.jsonl line 1 is not a JSON object" in _error(tmp_path, "jsonl", "c.jsonl",
                                                         b"plain text\n")
  assert "e.jsonl is empty" in _error(tmp_path, "jsonl", "e.jsonl", b"")
  assert "matches no file" in _error(tmp_path, "jsonl", "nothing/*.jsonl")
  pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
  assert "has no column 'text' (it has ['body'])" in _error(tmp_path, "parquet", "p.parquet")
  pq.write_table(pa.table({"id": [7]}), tmp_path / "i.parquet")
  assert "i.parquet row 0: column 'id' holds int, not text" in _error(
      tmp_path, "parquet", "i.parquet", text_field="id")
  pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
  assert "n.parquet row 1: column 'text' holds NoneType" in _error(tmp_path, "parquet",
                                                                   "n.parquet")
  assert "needs data.path" in str(pytest.raises(
      ConfigError, load_splits, DataConfig(source="parquet")).value)


def test_an_interrupted_tokenization_leaves_nothing(tmp_path):
  def documents():
    yield from ["one", "two"] * 100
    raise KeyboardInterrupt  # Ctrl-C half-way
  cfg = DataConfig(cache_dir=str(tmp_path))
  with pytest.raises(KeyboardInterrupt):
    corpus_lib.cached_corpus(cfg, "k", ByteTokenizer(), documents)
  assert list(tmp_path.iterdir()) == []
  corpus = corpus_lib.cached_corpus(cfg, "k", ByteTokenizer(), lambda: ["one", "two"])
  np.testing.assert_array_equal(corpus.tokens, list(b"one\0two\0"))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["k-v1.docs.npy", "k-v1.tokens.npy"]


def test_the_docs_example_runs(tmp_path, child_env, data_cache):
  """docs/data.md's example, as written but under a temporary directory and on a smaller model
  (the example's data flags are what it shows; the model's size only costs time here): a JSON
  Lines corpus and 20 steps on it with documents masked."""
  with open(os.path.join(ROOT, "docs", "data.md"), encoding="utf-8") as f:
    doc = f.read()
  block = re.search(r"## Example.*?```bash\n(.*?)```", doc, re.S).group(1)
  smaller = " ".join(o for o in TINY_RUN if o.split("=")[0].startswith("model."))
  script = (block.replace("/tmp/", f"{tmp_path}/").rstrip()
            + f" data.cache_dir={data_cache} train.seq_len=64 {smaller}\n")
  done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=child_env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=600, check=False)
  assert done.returncode == 0, done.stdout[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "jsonl_run" / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) >= 2 and losses[-1] < losses[0]
  assert any("val_loss" in r for r in rows)


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
  """With a text tokenizer (which decodes), bytes that are not UTF-8 stop the run with the
  file and line; the byte tokenizer reads bytes as ids and takes them as they are."""
  (tmp_path / "a.txt").write_bytes(b"the cat\nsat on\nthe m\xe0t\n")
  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1}, unk_token="[UNK]"))
  tok.save(str(tmp_path / "tokenizer.json"))
  cfg = DataConfig(source="text", path=str(tmp_path / "a.txt"),
                   tokenizer=str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "c"),
                   val_fraction=0.0)
  with pytest.raises(ConfigError, match=r"a.txt line 3 is not UTF-8 .*re-encode the file"):
    load_splits(cfg)
  assert not list((tmp_path / "c").glob("*.npy"))  # nothing cached
  byte = DataConfig(source="text", path=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "c"),
                    val_fraction=0.0)
  assert list(load_splits(byte).train[-4:]) == [0xE0, ord("t"), ord("\n"), 0]  # and EOS
