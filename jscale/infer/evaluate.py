"""Mean token loss over a list of batches: the training loop's eval and `python -m jscale.eval`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import jax
import numpy as np

from jscale import distributed


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Mean loss (nats per token) over `tokens` target tokens (padding excluded)."""
  loss: float
  tokens: int

  @property
  def perplexity(self) -> float:
    return math.exp(self.loss) if self.loss < 700 else math.inf


def to_global(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """This process's rows of the global batch -> global arrays laid out by `sharding`."""
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)
  return distributed.global_batch(batch, sharding)


def mean_loss(eval_step: Callable, params: Any, batches: Iterable[dict[str, np.ndarray]],
              sharding, dot_state: Any = None) -> EvalResult:
  """Sums `eval_step(params, batch[, dot_state]) -> (loss sum, token count)` (a
  `train_step.make_eval_step`, summed over the global batch) over `batches`."""
  total, count = 0.0, 0.0
  extra = () if dot_state is None else (dot_state,)
  for b in batches:
    s, n = eval_step(params, to_global(b, sharding), *extra)
    total, count = total + float(s), count + float(n)
  return EvalResult(total / max(count, 1.0), int(count))
