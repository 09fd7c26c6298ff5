"""Token order for context parallelism: which sequence positions each `sequence` rank holds.

With the sequence split over n devices, the batch's sequence axis is laid out contiguously over
the mesh: device i gets slots [i*L/n, (i+1)*L/n). `token_order` says which original position
sits in each slot. Zig-zag cuts the sequence into 2n chunks and places chunks i and 2n-1-i on
device i, so that causal attention costs every device the same. The pipeline permutes tokens,
labels and loss mask (and document starts) together once at load and adds the tokens'
`positions`; since the loss is a masked sum over tokens, it is unchanged.
"""

from __future__ import annotations

import numpy as np

# parallel.context_layout's values (a test keeps them equal to the config's Literal).
LAYOUTS = ("zigzag", "contiguous")
_PERMUTED = ("tokens", "labels", "loss_mask", "doc_starts")


def chunks_per_device(layout: str) -> int:
  """How many equal chunks of the sequence each `sequence` rank holds (ValueError naming the
  config key for an unknown layout; `jscale.validate` checks configs before this runs)."""
  if layout not in LAYOUTS:
    raise ValueError(f"parallel.context_layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
  return 2 if layout == "zigzag" else 1


def token_order(seq_len: int, n: int, layout: str) -> np.ndarray:
  """[seq_len] int32: the original position of the token in each slot."""
  chunks = n * chunks_per_device(layout)
  if seq_len % chunks:
    raise ValueError(f"train.seq_len={seq_len} is not divisible into {chunks} {layout} chunks "
                     f"for mesh.sequence={n}: use a multiple of {chunks}")
  pos_CT = np.arange(seq_len, dtype=np.int32).reshape(chunks, -1)
  if layout == "zigzag":
    pos_CT = np.concatenate([pos_CT[[i, chunks - 1 - i]] for i in range(n)])
  return pos_CT.reshape(-1)


class Reorder:
  """Applies a token order to an example or batch (last axis = sequence); adds `positions`."""

  def __init__(self, seq_len: int, n: int, layout: str):
    self.order = token_order(seq_len, n, layout)

  def __call__(self, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {k: (v[..., self.order] if k in _PERMUTED else v) for k, v in example.items()}
    shape = example["tokens"].shape
    out["positions"] = np.broadcast_to(self.order, shape).astype(np.int32)
    return out
