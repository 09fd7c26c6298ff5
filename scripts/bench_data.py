"""Data pipeline throughput per host (issue 51), measured on this machine, beside what a trainer
consumes (predicted).

    python scripts/bench_data.py            # -> results/bench_data.md (~5 minutes on 2 cores)

The corpus: every .py file of this Python's standard library as one document, written as text
files, JSON Lines, Parquet and Arrow; a byte-level BPE tokenizer of 8,192 ids trained on it.
For each source, with 1 and 2 workers (the Rust tokenizer's threads, RAYON_NUM_THREADS, for
the first pass; grain's reader threads for training batches), in a fresh process:
- tokenize: the cold cache, documents read, tokenized and written (`load_splits`), tokens/s;
- train batches: the warm cache, batches of 8 x 4096 drawn from `make_train_iterator`, tokens/s.
Consumption: the planner's estimate for Llama 3 8B on one host of 8 H100s (seq 4096, 1M tokens
per step: `python -m jscale.plan`'s #1). The pipeline must deliver 3x that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

from jscale.analysis import tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "bench_data.md")
SOURCES = ("text", "jsonl", "parquet", "arrow")
BATCH, SEQ, BATCHES = 8, 4096, 200


def build_corpus(root: str) -> str:
  """The standard library's .py files as text, JSON Lines, Parquet and Arrow under `root`, and
  a tokenizer.json; returns the tokenizer's path."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa
  from jscale.data.sources import stdlib_files  # pylint: disable=import-outside-toplevel
  files = stdlib_files(sysconfig.get_paths()["stdlib"])
  docs = [open(f, encoding="utf-8", errors="replace").read() for f in files]
  docs = [d for d in docs if d]
  os.makedirs(os.path.join(root, "text"))
  for i, d in enumerate(docs):
    with open(os.path.join(root, "text", f"{i:05d}.txt"), "w", encoding="utf-8") as f:
      f.write(d)
  with open(os.path.join(root, "docs.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
  table = pa.table({"text": docs})
  pq.write_table(table, os.path.join(root, "docs.parquet"), row_group_size=256)
  with pa.ipc.new_stream(os.path.join(root, "docs.arrow"), table.schema) as w:
    w.write_table(table, max_chunksize=256)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(docs[:300], trainers.BpeTrainer(
      vocab_size=8192, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = os.path.join(root, "tokenizer.json")
  tok.save(path)
  return path


def _path(root: str, source: str) -> str:
  return os.path.join(root, {"text": "text", "jsonl": "docs.jsonl", "parquet": "docs.parquet",
                             "arrow": "docs.arrow"}[source])


def measure(root: str, source: str, workers: int) -> dict:
  """One source with `workers`, in this process (RAYON_NUM_THREADS set by the caller)."""
  from jscale.config import DataConfig  # pylint: disable=import-outside-toplevel
  from jscale.data import load_splits, make_train_iterator  # noqa
  cfg = DataConfig(source=source, path=_path(root, source),  # type: ignore[arg-type]
                   tokenizer=os.path.join(root, "tokenizer.json"), val_fraction=0.01,
                   cache_dir=os.path.join(root, f"cache-{source}-{workers}"))
  t0 = time.perf_counter()
  splits = load_splits(cfg)
  tokenize_s = time.perf_counter() - t0
  tokens = len(splits.train) + len(splits.val)
  it = make_train_iterator(cfg, SEQ, BATCH, read_threads=workers)
  next(it)  # the first batch starts the reader
  t0 = time.perf_counter()
  for _ in range(BATCHES):
    next(it)
  batches_s = time.perf_counter() - t0
  return {"source": source, "workers": workers, "tokens": tokens,
          "tokenize_tok_s": tokens / tokenize_s, "train_tok_s": BATCHES * BATCH * SEQ / batches_s}


def consumption() -> float:
  """Tokens/s the planner's #1 trains at on one host of 8 H100s (Llama 3 8B, seq 4096, 1M
  tokens per step): predicted."""
  from jscale import hardware  # pylint: disable=import-outside-toplevel
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel
  from jscale.plan import rank  # pylint: disable=import-outside-toplevel
  model = load_config(None, ["model.preset=llama3_8b"]).model
  return rank.rank(model, 8, SEQ, 1 << 20, hardware.GPUS["h100"])[0].tokens_per_s


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--one", nargs=3, metavar=("ROOT", "SOURCE", "WORKERS"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.one:
    print(json.dumps(measure(args.one[0], args.one[1], int(args.one[2]))))
    return
  head = tables.head_commit()
  rows = []
  with tempfile.TemporaryDirectory() as root:
    build_corpus(root)
    for source in SOURCES:
      for workers in (1, 2):
        env = dict(os.environ, RAYON_NUM_THREADS=str(workers), JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, __file__, "--one", root, source, str(workers)],
                              env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
  need = consumption()
  lines = ["# Data pipeline throughput per host (measured) beside a trainer's consumption "
           "(predicted)\n",
           f"`python scripts/bench_data.py` at {head}, on this machine "
           f"({os.cpu_count()} cores): the standard library ({rows[0]['tokens']:,} tokens of a "
           "byte-level BPE of 8,192 ids) as each source. Llama 3 8B on one host of 8 H100s "
           f"consumes **{need:,.0f} tokens/s** (the planner's #1 at seq 4096, 1M tokens a step; "
           "predicted).\n",
           "| source | workers | tokenize, cold cache (tokens/s) | train batches 8 x 4096 "
           "(tokens/s) | batches / consumption |", "|---|---|---|---|---|",
           *(f"| {r['source']} | {r['workers']} | {r['tokenize_tok_s']:,.0f} | "
             f"{r['train_tok_s']:,.0f} | {r['train_tok_s'] / need:.0f}x |" for r in rows),
           "", "Tokenizing happens once per corpus (the cache); training reads memory-mapped "
           "windows. Workers: the tokenizer's threads for the first, grain's reader threads for "
           "the second."]
  tables.write_markdown(lines, OUT)


if __name__ == "__main__":
  sys.exit(main())
