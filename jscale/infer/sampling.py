"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus).

The settings are traced values, not static arguments: one compiled decode step serves every
setting (greedy is temperature 0). Shape suffixes: B batch, V vocab.
"""

from __future__ import annotations

import dataclasses
import shlex

import jax
import jax.numpy as jnp

# What a finished run suggests: a temperature below 1 and a nucleus keep a small model's text on
# its likelier paths without the loop greedy decoding falls into (`def the the the ...`).
SUGGESTED = "--temperature 0.8 --top-p 0.95 --seed 0"


def suggestion(model: str, prompt: str) -> str:
  """The `python -m jscale.generate` command a finished run suggests: sampled, seeded."""
  return f"python -m jscale.generate --model {model} --prompt {shlex.quote(prompt)} {SUGGESTED}"


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0: greedy (argmax). top_k 0 and top_p 1.0: no truncation. ids > 0: only ids
  below it are ever drawn (a tokenizer smaller than the model's padded vocabulary)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  ids: int = 0

  def check(self) -> None:
    """Raises ValueError naming the bad setting and its valid range."""
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 keeps every token)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 keeps every token)")
    if self.ids < 0:
      raise ValueError(f"ids={self.ids}: must be >= 0 (0 allows every id)")

  def arrays(self) -> tuple[jax.Array, ...]:
    return (jnp.float32(self.temperature), jnp.int32(self.top_k), jnp.float32(self.top_p),
            jnp.int32(self.ids))


def truncate(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Logits with every token outside the top-k and outside the top-p nucleus set to -inf.

  The nucleus is the smallest set of most likely tokens whose probabilities sum to >= top_p
  (the most likely token always stays)."""
  v = logits_BV.shape[-1]
  desc_BV = -jnp.sort(-logits_BV, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth_B1 = jnp.take(desc_BV, k - 1, axis=-1)[:, None]
  # Probability mass strictly before each sorted token: it is kept while that is < top_p.
  probs_BV = jax.nn.softmax(desc_BV, axis=-1)
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  last_kept_B = jnp.sum(before_BV < top_p, axis=-1) - 1
  pth_B1 = jnp.take_along_axis(desc_BV, last_kept_B[:, None], axis=-1)
  keep_BV = (logits_BV >= kth_B1) & (logits_BV >= pth_B1)
  return jnp.where(keep_BV, logits_BV, -jnp.inf)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, ids: jax.Array | int = 0) -> jax.Array:
  """Next tokens [B] (int32) from fp32 logits [B, V]; only ids < `ids` when it is > 0."""
  logits_BV = logits_BV.astype(jnp.float32)
  allowed_V = (jnp.arange(logits_BV.shape[-1]) < ids) | (ids <= 0)
  logits_BV = jnp.where(allowed_V, logits_BV, -jnp.inf)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  scaled_BV = truncate(logits_BV / jnp.maximum(temperature, 1e-6), top_k, top_p)
  drawn_B = jax.random.categorical(key, scaled_BV, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn_B, greedy_B)
