"""Packing by concatenate-and-chunk (nanoGPT style), as a random-access grain source.

Window i is tokens[i*L : i*L + L + 1] of the stream; tokens = w[:-1], labels = w[1:].
Consecutive windows share one token, so every next-token pair of the stream is a label exactly
once. The last window is padded with the pad id and its padded labels get loss_mask 0: no
data is dropped and padding never counts in the loss.

Document masking (`data.document_mask`): each document ends with EOS, so a document starts at
the window's first token and after each EOS; `doc_starts[i]` is the index of token i's
document's first token in the window (`jscale.model.positions`). A document cut by the window
edge continues as a new one in the next window, as in Megatron and torchtitan. Every label
counts, the EOS token's too (its label is the next document's first token, predicted from the
EOS alone): Megatron's default (`eod_mask_loss` off) and torchtitan's.
"""

from __future__ import annotations

import numpy as np


class Windows:
  """Random-access packed examples {"tokens", "labels": int32[L], "loss_mask": float32[L]}
  (and "doc_starts": int32[L] with an `eos_id`)."""

  def __init__(self, stream: np.ndarray, seq_len: int, pad_id: int,
               eos_id: int | None = None):
    """`eos_id`: mark documents (each ended by it) with "doc_starts"; None: no document mask."""
    self._stream = stream
    self._seq_len = seq_len
    self._pad_id = pad_id
    self._eos_id = eos_id
    # ceil((n - 1) / L) windows cover every label position 1 .. n-1.
    self._len = max(0, -(-(len(stream) - 1) // seq_len))

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self._len:
      raise IndexError(f"window {index} out of range [0, {self._len})")
    seq_len = self._seq_len
    start = index * seq_len
    w = np.asarray(self._stream[start:start + seq_len + 1], dtype=np.int32)
    n_labels = len(w) - 1
    mask = np.ones(seq_len, np.float32)
    if n_labels < seq_len:
      w = np.concatenate([w, np.full(seq_len - n_labels, self._pad_id, np.int32)])
      mask[n_labels:] = 0.0
    example = {"tokens": w[:-1], "labels": w[1:], "loss_mask": mask}
    if self._eos_id is not None:
      example["doc_starts"] = doc_starts(example["tokens"], self._eos_id)
    return example


def doc_starts(tokens_L: np.ndarray, eos_id: int) -> np.ndarray:
  """int32 [L]: for each token, the index of its document's first token (documents start at
  0 and after each `eos_id`)."""
  index = np.arange(len(tokens_L), dtype=np.int32)
  first = np.concatenate([[True], tokens_L[:-1] == eos_id])
  return np.maximum.accumulate(np.where(first, index, 0)).astype(np.int32)
