"""grain pipelines over packed windows: an infinite shuffled train iterator, fixed eval batches.

Train: windows -> shuffle -> repeat (reshuffled each epoch) -> this process's share -> batch.
The share is taken from the repeated stream (`ds[process_index::process_count]`), so global
batch s holds stream positions [s*B, (s+1)*B) whatever the process count: processes never
overlap, nothing is dropped, and a run can change process count without changing its data.
Every step is index arithmetic on a MapDataset, so the iterator state is a few integers.
"""

from __future__ import annotations

from typing import Callable

import grain
import numpy as np

from jscale.config import ConfigError, DataConfig
from jscale.data.sources import components, load_splits
from jscale.data.windows import Windows

# One reader thread overlaps loading with the train step; no worker processes, so the
# pipeline stays deterministic and its state checkpointable. Batches are memmap slices:
# cheap, so a short buffer suffices (scripts/bench_data.py: far above what a host consumes).
_PREFETCH = 4

Batch = dict[str, np.ndarray]


Transform = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def make_train_iterator(data_cfg: DataConfig, seq_len: int, global_batch: int,
                        process_index: int = 0, process_count: int = 1,
                        transform: Transform | None = None,
                        read_threads: int = 1) -> grain.DatasetIterator:
  """Infinite iterator of this process's train batches (leading dim global_batch // count).

  `transform` maps each example before batching (context parallelism's token order,
  `jscale.runtime.Runtime.reorder`); `read_threads`: grain's reader threads.

  Deterministic for `data.seed`; `get_state()` / `set_state()` resume it exactly (checkpoint
  it with jscale.data.checkpoint_save / checkpoint_restore).
  """
  local = _local_batch(global_batch, process_index, process_count)
  sources = []
  for i, part in enumerate(components(data_cfg)):
    splits = load_splits(part.cfg)
    windows = _windows(splits.train, seq_len, splits.eos_id, "train", data_cfg.document_mask)
    ds = grain.MapDataset.source(windows).shuffle(seed=_shuffle_seed(data_cfg.seed, i))
    # MapDataset.repeat folds the epoch into the shuffle seed: a fresh order every epoch.
    sources.append((ds.repeat(), part.weight))
  # A mixture interleaves its sources deterministically in proportion to their weights.
  ds = (sources[0][0] if len(sources) == 1 else
        grain.MapDataset.mix([d for d, _ in sources], [w for _, w in sources]))
  ds = ds[process_index::process_count]
  if transform is not None:
    ds = ds.map(transform)
  ds = ds.batch(local, drop_remainder=True)
  options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=_PREFETCH)
  return iter(ds.to_iter_dataset(options))


def make_eval_sets(data_cfg: DataConfig, seq_len: int, global_batch: int, num_batches: int,
                   process_index: int = 0, process_count: int = 1,
                   transform: Transform | None = None) -> dict[str, list[Batch]]:
  """`make_eval_batches` of each source's own validation split, by its label ("" for a single
  source: `sources.components`)."""
  return {part.label: make_eval_batches(part.cfg, seq_len, global_batch, num_batches,
                                        process_index, process_count, transform)
          for part in components(data_cfg)}


def make_eval_batches(data_cfg: DataConfig, seq_len: int, global_batch: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1,
                      transform: Transform | None = None, split: str = "val") -> list[Batch]:
  """`num_batches` of this process's batches of a split ("val" or "train") of one source, in
  order, cycling if too few; `num_batches=0`: every full batch of the split, once
  (`jscale.eval`)."""
  local = _local_batch(global_batch, process_index, process_count)
  splits = load_splits(data_cfg)
  stream = splits.val if split == "val" else splits.train
  if len(stream) < 2:
    raise ConfigError(f"data.val_fraction={data_cfg.val_fraction} leaves no {split} tokens: "
                      "change data.val_fraction (e.g. 0.01), or set train.eval_every=0")
  windows = _windows(stream, seq_len, splits.eos_id, "validation" if split == "val" else split,
                     data_cfg.document_mask)
  if num_batches == 0:
    num_batches = len(windows) // global_batch
    if num_batches == 0:
      raise ConfigError(f"the {split} split holds {len(windows)} windows of {seq_len} tokens, "
                        f"fewer than one batch of {global_batch}: lower the batch size")
  ds = grain.MapDataset.source(windows).repeat()[process_index::process_count]
  if transform is not None:
    ds = ds.map(transform)
  ds = ds.batch(local, drop_remainder=True)
  batches: list[Batch] = []
  for i in range(num_batches):
    batch = ds[i]
    if batch is None:  # grain's "filtered out": the pipeline above never filters
      raise RuntimeError(f"the {split} split's batch {i} came back empty")
    batches.append(batch)
  return batches


def _windows(stream: np.ndarray, seq_len: int, eos_id: int, split: str,
             document_mask: bool) -> Windows:
  if seq_len <= 0:
    raise ConfigError(f"train.seq_len={seq_len} must be positive")
  # Padding is EOS too: each padded token is a document of its own, and never in the loss.
  windows = Windows(stream, seq_len, eos_id, eos_id if document_mask else None)
  if len(windows) == 0:
    raise ConfigError(f"the {split} split has {len(stream)} tokens, too few for one example: "
                      "give more data (data.path) or change data.val_fraction")
  return windows


def _local_batch(global_batch: int, process_index: int, process_count: int) -> int:
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must lie in [0, {process_count})")
  if global_batch <= 0 or global_batch % process_count:
    raise ConfigError(f"train.batch_size={global_batch} must be a positive multiple of the "
                      f"process count {process_count}: change train.batch_size")
  return global_batch // process_count


def _shuffle_seed(seed: int, source: int = 0) -> int:
  if seed < 0:
    raise ConfigError(f"data.seed={seed} must be >= 0")
  # grain shuffles epoch e with seed + e; hashing keeps seed 1 from replaying seed 0's epoch 1
  # (and a mixture's sources from sharing an order). Source 0 keeps a single source's seed.
  entropy = seed if source == 0 else (seed, source)
  return int(np.random.SeedSequence(entropy).generate_state(1)[0])
