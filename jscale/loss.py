"""Next-token cross-entropy in fp32, masked, vocab-parallel ready (reductions via the seam)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jscale.parallel.comms import LOCAL, Comms


def cross_entropy_sums(logits_BLV: jax.Array, labels_BL: jax.Array, mask_BL: jax.Array,
                       comms: Comms = LOCAL) -> tuple[jax.Array, jax.Array]:
  """Returns (sum of masked token losses, number of unmasked tokens), both fp32 scalars.

  Sums rather than a mean so that micro-batches accumulate exactly: the step divides once by
  the total token count. The vocab axis may be sharded: max, sum-exp and the label logit are
  reduced through the comms seam, so no device ever holds the full-vocab logits.
  """
  logits = logits_BLV.astype(jnp.float32)
  m_BL1 = jax.lax.stop_gradient(comms.vocab_max(logits))
  lse_BL = (jnp.log(comms.vocab_sum(jnp.exp(logits - m_BL1))) + m_BL1)[..., 0]
  # The label logit as a masked sum over the vocab (not a gather), so a vocab-sharded layout
  # reduces partial sums instead of collecting the full-vocab logits on one device.
  vocab_ids_V = jnp.arange(logits.shape[-1]) + comms.vocab_offset(logits.shape[-1])
  hit_BLV = vocab_ids_V == labels_BL[..., None]
  target_BL = comms.vocab_sum(jnp.where(hit_BLV, logits, 0.0))[..., 0]
  mask = mask_BL.astype(jnp.float32)
  return jnp.sum((lse_BL - target_BL) * mask), jnp.sum(mask)
