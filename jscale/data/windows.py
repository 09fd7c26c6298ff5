"""Packing by concatenate-and-chunk (nanoGPT style), as a random-access grain source.

Window i is tokens[i*L : i*L + L + 1] of the stream; tokens = w[:-1], labels = w[1:].
Consecutive windows share one token, so every next-token pair of the stream is a label exactly
once. The last window is padded with the pad id and its padded labels get loss_mask 0: no
data is dropped and padding never counts in the loss.
"""

from __future__ import annotations

import numpy as np


class Windows:
  """Random-access packed examples {"tokens", "labels": int32[L], "loss_mask": float32[L]}."""

  def __init__(self, stream: np.ndarray, seq_len: int, pad_id: int):
    self._stream = stream
    self._seq_len = seq_len
    self._pad_id = pad_id
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
    return {"tokens": w[:-1], "labels": w[1:], "loss_mask": mask}
