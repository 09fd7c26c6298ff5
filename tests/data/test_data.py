"""Data pipeline: tokenizers, sources, packing, grain iterators (real grain, small corpora)."""

import os

import numpy as np
import pytest

from jscale.config import ConfigError, DataConfig
from jscale.data import (ByteTokenizer, HFTokenizer, Windows, load_splits, load_tokenizer,
                         make_eval_batches, make_train_iterator, tokenizer_vocab_size)
from jscale.data import corpus as corpus_lib
from jscale.data import sources

L = 32  # sequence length used throughout


@pytest.fixture(scope="session")
def stdlib_cfg(tmp_path_factory):
  """The real stdlib source with a per-session cache (built once, < 1 s)."""
  return DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture()
def bin_cfg(tmp_path):
  """A .bin whose window i starts with token i*L: windows are identifiable by tokens[0]."""
  n_windows = 48
  stream = np.arange(n_windows * L + 1, dtype=np.uint16)
  path = tmp_path / "tokens.bin"
  stream.tofile(path)
  return DataConfig(source="bin", path=str(path), tokenizer=_word_tokenizer(tmp_path, 4096),
                    val_fraction=0.0, cache_dir=str(tmp_path / "cache"))


def _word_tokenizer(tmp_path, min_vocab=0) -> str:
  """A WordLevel tokenizer.json trained in memory (optionally padded to min_vocab ids)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  words = [f"w{i}" for i in range(min_vocab)]
  trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
  tok.train_from_iterator(["the cat sat on the mat", "a dog ate the hat", " ".join(words)],
                          trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return str(path)


def _rows(batch):
  return [tuple(r) for r in batch["tokens"]]


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# ------------------------------------------------------------------ tokenizers

def test_byte_tokenizer_roundtrip():
  tok = ByteTokenizer()
  text = "def f(x):\n  return 'héllo ✓'\n"
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
  assert tok.decode(ids) == text
  assert tok.eos_id == 0 and tokenizer_vocab_size(DataConfig()) == 256


def test_hf_tokenizer(tmp_path):
  path = _word_tokenizer(tmp_path)
  tok = load_tokenizer(DataConfig(tokenizer=path))
  assert isinstance(tok, HFTokenizer)
  ids = tok.encode("the cat sat")
  assert len(ids) == 3 and tok.decode(ids) == "the cat sat"
  assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
  assert tokenizer_vocab_size(DataConfig(tokenizer=path)) == tok.vocab_size


def test_tokenizer_errors_name_the_key(tmp_path):
  with pytest.raises(ConfigError, match="data.tokenizer"):
    load_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")))
  from tokenizers import Tokenizer, models
  no_eos = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
  no_eos.save(str(tmp_path / "no_eos.json"))
  with pytest.raises(ConfigError, match="data.tokenizer"):
    load_tokenizer(DataConfig(tokenizer=str(tmp_path / "no_eos.json")))


# --------------------------------------------------------------------- sources

def test_stdlib_files_exclude_site_packages():
  files = sources.stdlib_files()
  assert files == sorted(files) and len(files) > 500
  assert any(f.endswith(os.sep + "os.py") for f in files)
  assert not any(s in f.split(os.sep) for f in files
                 for s in ("site-packages", "dist-packages"))


def test_stdlib_source_is_cached_and_deterministic(stdlib_cfg, tmp_path):
  a = load_splits(stdlib_cfg)
  cached = os.listdir(stdlib_cfg.cache_dir)
  assert len(cached) == 2 and not any(f.endswith(".tmp") for f in cached)
  assert isinstance(a.train, np.memmap)  # reopened from the cache, not rebuilt
  b = load_splits(DataConfig(cache_dir=str(tmp_path)))  # an independent rebuild
  assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
  n = len(a.train) + len(a.val)
  assert 0.005 < len(a.val) / n < 0.02  # ~ val_fraction=0.01
  assert a.train[-1] == a.eos_id  # the split falls on a document boundary
  assert b"import" in a.train[:100_000].tobytes()


def test_split_corpus_moves_to_document_boundary():
  tokens = np.arange(100, dtype=np.uint16)
  corpus = corpus_lib.Corpus(tokens, np.array([0, 40, 93, 97]))
  train, val = sources.split_corpus(corpus, 0.1)  # target 90 -> boundary 93
  assert len(train) == 93 and len(val) == 7
  corpus = corpus_lib.Corpus(tokens, np.array([0]))  # one document: cut inside it
  train, val = sources.split_corpus(corpus, 0.1)
  assert len(train) == 90 and len(val) == 10


def test_bin_source_layouts(tmp_path):
  stream = np.arange(1000, dtype=np.uint16) % 250
  stream.tofile(tmp_path / "one.bin")
  cfg = DataConfig(source="bin", path=str(tmp_path / "one.bin"), val_fraction=0.1)
  s = load_splits(cfg)
  assert np.array_equal(s.train, stream[:900]) and np.array_equal(s.val, stream[900:])
  np.save(tmp_path / "one.npy", stream.astype(np.uint32))
  s = load_splits(DataConfig(source="bin", path=str(tmp_path / "one.npy"), val_fraction=0.1))
  assert np.array_equal(s.val, stream[900:])
  nano = tmp_path / "nano"
  nano.mkdir()
  stream[:600].tofile(nano / "train.bin")
  stream[600:].tofile(nano / "val.bin")
  s = load_splits(DataConfig(source="bin", path=str(nano)))
  assert len(s.train) == 600 and np.array_equal(s.val, stream[600:])
  batch = next(make_train_iterator(DataConfig(source="bin", path=str(nano)), L, 4))
  assert batch["tokens"].shape == (4, L) and batch["tokens"].dtype == np.int32


def test_bin_source_errors(tmp_path):
  with pytest.raises(ConfigError, match="data.path"):
    load_splits(DataConfig(source="bin", path=str(tmp_path / "nope.bin")))
  with pytest.raises(ConfigError, match="data.path"):
    load_splits(DataConfig(source="bin", path=str(tmp_path)))  # no train.bin/val.bin
  (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
  with pytest.raises(ConfigError, match="data.bin_dtype"):
    load_splits(DataConfig(source="bin", path=str(tmp_path / "odd.bin")))
  np.full(100, 5000, np.uint16).tofile(tmp_path / "big.bin")  # ids beyond the byte vocab
  with pytest.raises(ConfigError, match="data.tokenizer"):
    load_splits(DataConfig(source="bin", path=str(tmp_path / "big.bin")))


def test_text_source_with_tokenizer_json(tmp_path):
  corpus = tmp_path / "corpus"
  (corpus / "sub").mkdir(parents=True)
  (corpus / "a.txt").write_text("the cat sat on the mat " * 20)
  (corpus / "sub" / "b.md").write_text("a dog ate the hat " * 20)
  (corpus / "skip.bin").write_bytes(b"\xff\xfe")  # not a text extension
  path = _word_tokenizer(tmp_path)
  cfg = DataConfig(source="text", path=str(corpus), tokenizer=path, val_fraction=0.5,
                   cache_dir=str(tmp_path / "cache"))
  tok = load_tokenizer(cfg)
  s = load_splits(cfg)
  assert s.eos_id == tok.eos_id
  # Two documents (121 and 101 tokens), each followed by EOS; val moves from the 50% point
  # to the next document boundary.
  assert tok.decode(s.train) == " ".join(["the cat sat on the mat"] * 20 + ["<|endoftext|>"])
  assert tok.decode(s.val[:5]) == "a dog ate the hat"
  again = load_splits(cfg)  # from the cache
  assert np.array_equal(again.train, s.train)
  glob_cfg = DataConfig(source="text", path=str(corpus / "**" / "*.md"), tokenizer=path,
                        cache_dir=str(tmp_path / "cache"))
  assert tok.decode(load_splits(glob_cfg).train[:5]) == "a dog ate the hat"
  batches = _take(make_train_iterator(cfg, 8, 2), 3)
  assert batches[0]["tokens"].shape == (2, 8)
  assert make_eval_batches(cfg, 8, 2, 2)[0]["labels"].shape == (2, 8)


def test_text_source_errors(tmp_path):
  with pytest.raises(ConfigError, match="data.path"):
    load_splits(DataConfig(source="text", path=str(tmp_path / "missing_dir")))
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match="data.path"):
    load_splits(DataConfig(source="text", path=str(tmp_path / "empty")))
  (tmp_path / "a.txt").write_text("hello")
  with pytest.raises(ConfigError, match="data.tokenizer"):
    load_splits(DataConfig(source="text", path=str(tmp_path / "a.txt"),
                           tokenizer=str(tmp_path / "missing" / "tokenizer.json")))


# --------------------------------------------------------------------- packing

def test_windows_shift_and_mask_padded_tail():
  stream = np.arange(10, dtype=np.uint16)
  w = Windows(stream, seq_len=4, pad_id=0)
  assert len(w) == 3  # ceil((10 - 1) / 4): no token dropped
  ex = w[0]
  assert ex["tokens"].tolist() == [0, 1, 2, 3] and ex["labels"].tolist() == [1, 2, 3, 4]
  assert ex["tokens"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32
  assert w[1]["tokens"].tolist() == [4, 5, 6, 7]  # windows overlap by one token
  tail = w[2]
  assert tail["tokens"].tolist() == [8, 9, 0, 0] and tail["labels"].tolist() == [9, 0, 0, 0]
  assert tail["loss_mask"].tolist() == [1, 0, 0, 0]
  # Every next-token pair of the stream is a label exactly once.
  labels = np.concatenate([w[i]["labels"][w[i]["loss_mask"] > 0] for i in range(len(w))])
  assert labels.tolist() == list(range(1, 10))


# ------------------------------------------------------------------- iterators

def test_train_iterator_seeded(stdlib_cfg):
  a = _take(make_train_iterator(stdlib_cfg, L, 8), 3)
  b = _take(make_train_iterator(stdlib_cfg, L, 8), 3)
  other = DataConfig(cache_dir=stdlib_cfg.cache_dir, seed=1)
  c = _take(make_train_iterator(other, L, 8), 3)
  assert _same(a, b) and not _same(a, c)
  assert a[0]["tokens"].shape == (8, L) and np.array_equal(a[0]["tokens"][:, 1:],
                                                           a[0]["labels"][:, :-1])


def test_train_iterator_state_roundtrip(stdlib_cfg):
  it = make_train_iterator(stdlib_cfg, L, 8)
  _take(it, 3)
  state = it.get_state()
  expected = _take(it, 3)
  fresh = make_train_iterator(stdlib_cfg, L, 8)
  fresh.set_state(state)
  assert _same(_take(fresh, 3), expected)


def test_process_shards_partition_each_epoch(bin_cfg):
  n_windows, batch = 48, 8
  steps = n_windows // batch  # one epoch
  one = _take(make_train_iterator(bin_cfg, L, batch), 2 * steps)
  shards = [_take(make_train_iterator(bin_cfg, L, batch, p, 2), 2 * steps) for p in range(2)]
  assert shards[0][0]["tokens"].shape == (batch // 2, L)
  for epoch in range(2):
    span = range(epoch * steps, (epoch + 1) * steps)
    p0 = [r for s in span for r in _rows(shards[0][s])]
    p1 = [r for s in span for r in _rows(shards[1][s])]
    single = [r for s in span for r in _rows(one[s])]
    assert not set(p0) & set(p1)
    assert sorted(p0 + p1) == sorted(single)
    assert len(set(single)) == n_windows  # every window exactly once per epoch
  # Each global batch holds the same examples whatever the process count.
  assert sorted(_rows(shards[0][0]) + _rows(shards[1][0])) == sorted(_rows(one[0]))
  # Epochs are reshuffled.
  firsts = [[r[0] for s in range(e * steps, (e + 1) * steps) for r in _rows(one[s])]
            for e in range(2)]
  assert firsts[0] != firsts[1]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 4)])
def test_a_position_saved_by_some_processes_resumes_on_others(bin_cfg, before, after):
  """Every process saves the same position (global batches consumed): set on any other number
  of processes it continues the same global batches, none repeated, none skipped."""
  batch, done, more = 8, 3, 5
  whole = _take(make_train_iterator(bin_cfg, L, batch), done + more)
  saved = [make_train_iterator(bin_cfg, L, batch, p, before) for p in range(before)]
  for it in saved:
    _take(it, done)
  positions = [it.get_state() for it in saved]
  assert all(x == positions[0] for x in positions)
  resumed = []
  for p in range(after):
    it = make_train_iterator(bin_cfg, L, batch, p, after)
    it.set_state(positions[0])
    resumed.append(_take(it, more))
  for s in range(more):
    got = sorted(r for shard in resumed for r in _rows(shard[s]))
    assert got == sorted(_rows(whole[done + s]))


def test_eval_batches_in_order_and_cycle(tmp_path):
  stream = np.arange(10 * L + 1, dtype=np.uint16) % 256
  stream.tofile(tmp_path / "t.bin")
  cfg = DataConfig(source="bin", path=str(tmp_path / "t.bin"), val_fraction=0.5)
  val = load_splits(cfg).val
  windows = Windows(val, L, 0)
  batches = make_eval_batches(cfg, L, 4, 3)  # 12 examples from fewer windows: cycles
  assert len(batches) == 3 and len(windows) < 12
  flat = [row for b in batches for row in b["tokens"]]
  for i, row in enumerate(flat):
    assert np.array_equal(row, windows[i % len(windows)]["tokens"])
  again = make_eval_batches(cfg, L, 4, 3)
  assert _same(batches, again)
  halves = [make_eval_batches(cfg, L, 4, 3, p, 2) for p in range(2)]
  assert sorted(_rows(halves[0][1]) + _rows(halves[1][1])) == sorted(_rows(batches[1]))
  with pytest.raises(ConfigError, match="data.val_fraction"):
    make_eval_batches(DataConfig(source="bin", path=str(tmp_path / "t.bin"),
                                 val_fraction=0.0), L, 4, 1)
  with pytest.raises(ConfigError, match="train.batch_size"):
    make_eval_batches(cfg, L, 3, 1, 0, 2)


def test_orbax_checkpoint_of_iterator(bin_cfg, tmp_path):
  import orbax.checkpoint as ocp
  from jscale.data import checkpoint_restore, checkpoint_save
  it = make_train_iterator(bin_cfg, L, 4)
  _take(it, 2)
  mngr = ocp.CheckpointManager(tmp_path / "ckpt")
  mngr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.arange(3.0)}),
                                       data=checkpoint_save(it)))
  expected = _take(it, 3)  # advancing right after save must not change the checkpoint
  mngr.wait_until_finished()
  fresh = make_train_iterator(bin_cfg, L, 4)
  restored = ocp.CheckpointManager(tmp_path / "ckpt").restore(
      2, args=ocp.args.Composite(state=ocp.args.StandardRestore({"w": np.zeros(3)}),
                                 data=checkpoint_restore(fresh)))
  assert restored["data"] is fresh and np.array_equal(restored["state"]["w"], np.arange(3.0))
  assert _same(_take(fresh, 3), expected)
