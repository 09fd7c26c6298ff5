"""Next-token cross-entropy in fp32, masked, vocab-parallel, whole or in chunks of tokens.

`head_loss_sums` multiplies the head and takes the loss. The head's product writes its logits
in fp32 or, as Megatron, torchtitan and Hugging Face do, rounded to bf16 (`Logits.dtype`): the
softmax and the loss are fp32 math either way, but each pass over bf16 logits moves half the
bytes. Unchunked, it materialises the logits [tokens, vocab] and leaves the backward to
autodiff: fastest where memory allows, but at Llama-3's 128,256 vocabulary 16k tokens' fp32
logits are 8.4 GB, and the step holds ~3 such arrays.
Chunked (`chunks > 1`), a scan over slices of the sequence computes each slice's logits, its
loss and, in the same pass, its gradients (dh and the head's dW accumulated in fp32): the
softmax gradient is p - onehot, known in the forward. The backward only scales them by the
loss's cotangent, so the chunked path runs the head's three matmuls once each, like the
unchunked one, and never holds more than one chunk's logits. It reads each chunk's logits
twice: once for the max and sum-exp together (`max_sum_exp`, an online softmax reduction),
once for the softmax gradient; the label's logit is gathered, one element a token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jscale.model import layer_microbatches, matmul, mtp
from jscale.model.positions import Positions
from jscale.model.seam import LOCAL, Seam

LOGITS_NAMES = ("batch", "seq", "vocab")


class Logits(NamedTuple):
  """How the head makes its logits: `train.logits_chunk_mb` and `train.logits_dtype`."""
  chunk_mb: float = 0.0  # chunk when one device's logits exceed this many MiB (0: never)
  dtype: str = "float32"  # what the head's product writes them in

  @classmethod
  def of(cls, train) -> "Logits":
    """From a `TrainConfig` (not imported: the loss takes no config)."""
    return cls(train.logits_chunk_mb, train.logits_dtype)


def cross_entropy_sums(logits_BLV: jax.Array, labels_BL: jax.Array, mask_BL: jax.Array,
                       comms: Seam = LOCAL) -> tuple[jax.Array, jax.Array]:
  """Returns (sum of masked token losses, number of unmasked tokens), both fp32 scalars.

  Sums rather than a mean so that micro-batches accumulate exactly: the step divides once by
  the total token count. The vocab axis may be sharded: max, sum-exp and the label logit are
  reduced through the model's seam, so no device ever holds the full-vocab logits.
  """
  token_loss = _token_losses(logits_BLV.astype(jnp.float32), labels_BL, comms)
  mask = mask_BL.astype(jnp.float32)
  return jnp.sum(token_loss * mask), jnp.sum(mask)


def _token_losses(logits, labels, comms: Seam) -> jax.Array:
  """Each token's loss, differentiable in the logits: max, sum-exp and the label logit reduced
  over the (possibly sharded) vocab through the seam, so no device collects the full-vocab
  logits. The label logit is a masked sum over the vocab (not a gather, whose transpose would
  scatter into a zeroed [..., V]): vocab shards give partial sums."""
  m = jax.lax.stop_gradient(comms.vocab_max(logits))
  s = comms.vocab_sum(jnp.exp(logits - m))
  target = comms.vocab_sum(jnp.where(_hit(logits, labels, comms), logits, 0.0))
  return _token_loss(m, s, target)


def _hit(logits, labels, comms: Seam) -> jax.Array:
  """Whether each (possibly sharded) vocab entry of `logits` is the token's label [..., V]."""
  vocab_ids_V = jnp.arange(logits.shape[-1]) + comms.vocab_offset(logits.shape[-1])
  return vocab_ids_V == labels[..., None]


def _token_loss(m, s, target) -> jax.Array:
  """-log softmax at the label: log(sum-exp) + max - the label's logit (all [..., 1])."""
  return (jnp.log(s) + m - target)[..., 0]


def _label_logit(logits, labels, comms: Seam) -> jax.Array:
  """The label's logit [..., 1], gathered: one element a token where a masked sum reads every
  logit once more (the chunked loss, which makes its own gradients, so nothing transposes the
  gather). On a vocab shard a label outside it gives 0, and the seam's sum the logit."""
  v = logits.shape[-1]
  local = labels[..., None] - comms.vocab_offset(v)
  picked = jnp.take_along_axis(logits, jnp.clip(local, 0, v - 1), axis=-1)
  return comms.vocab_sum(jnp.where((local >= 0) & (local < v), picked, 0.0))


def _online_combine(a, b):
  # (max, sum of exp(x - max)) of two parts -> of their union: the part with the larger max
  # keeps its sum (its exp(0) is 1, exactly), the other's is rescaled by exp(-|m1 - m2|), one
  # exp an element where the symmetric form takes two (XLA:GPU ran that one at 1.2 TB/s); the
  # same values, bit for bit. A union whose max is -inf sums to 0: its entries are all -inf (an
  # entry enters as (x, 1)), and exp(-inf - -inf) would be nan.
  (m1, s1), (m2, s2) = a, b
  m = jnp.maximum(m1, m2)
  first = m1 >= m2
  gap = jnp.where(m1 == m2, 0.0, jnp.abs(m1 - m2))
  big, small = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
  return m, jnp.where(m == -jnp.inf, 0.0, big + small * jnp.exp(-gap))


def max_sum_exp(logits: jax.Array, comms: Seam = LOCAL) -> tuple[jax.Array, jax.Array]:
  """(max, sum of exp(logits - max)) over the (possibly sharded) vocab axis, keeping dims, in
  one pass over the logits: a reduction of (max, sum) pairs, each part's sum rescaled to the
  larger max as the parts meet (the online softmax of Milakov & Gimelshein, 2018). The two-pass
  form reads fp32 logits twice, once for the max and once for the sum. Each shard's pair is
  combined over the vocab shards through the seam (GSPMD combines a sharded reduction's
  partial pairs itself; the seam then sees one pair). Not differentiable (a custom reduction):
  for the chunked loss, which makes its own gradients."""
  f32 = jnp.float32
  m, s = jax.lax.reduce((logits, jnp.ones_like(logits)), (f32(-jnp.inf), f32(0.0)),
                        _online_combine, (logits.ndim - 1,))
  m, s = m[..., None], s[..., None]
  m_all = comms.vocab_max(m)
  return m_all, comms.vocab_sum(s * jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all)))


def num_chunks(local_shape: tuple[int, int, int], budget_mb: float, itemsize: int = 4) -> int:
  """Chunks along the sequence so one chunk's logits on a device ([rows, positions, vocab] =
  `local_shape`, one device's share, `itemsize` bytes each) take at most `budget_mb` MiB: the
  smallest such divisor of the device's positions, at most one position per chunk (1:
  unchunked; `budget_mb` 0: never chunk)."""
  rows, positions, vocab = local_shape
  if budget_mb <= 0:
    return 1
  need = math.ceil(rows * positions * vocab * itemsize / (budget_mb * 2**20))
  return next((n for n in range(max(need, 1), positions + 1) if positions % n == 0), positions)


def head_loss_sums(h_BLD: jax.Array, head_DV: jax.Array, labels_BL: jax.Array,
                   mask_BL: jax.Array, comms: Seam = LOCAL, logits: Logits = Logits(),
                   dot_general: matmul.DotGeneral = jax.lax.dot_general,
                   head_stored: tuple[str, str] = ("embed", "vocab")
                   ) -> tuple[jax.Array, jax.Array]:
  """(loss sum, token count) of the head `h_BLD @ head_DV` (both in the compute dtype; the
  logits in `logits.dtype`), chunked by `num_chunks` when its logits exceed `logits.chunk_mb`
  MiB per device. The head's products are `dot_general`'s (the model's,
  `Llama.dot_general`); `head_stored`: the head weight's dim names in its stored order
  (`Llama.head_stored`: a tied head is the embedding, [vocab, embed])."""
  b, l, _ = h_BLD.shape
  dtype = jnp.dtype(logits.dtype)
  n = num_chunks(comms.local_shape((b, l, head_DV.shape[-1]), LOGITS_NAMES), logits.chunk_mb,
                 dtype.itemsize)
  if n == 1:
    with jax.named_scope("head"):
      if dtype == jnp.float32:  # the backward's products in the compute dtype, not fp32
        logits_BLV = matmul.einsum_f32("BLD,DV->BLV", h_BLD, head_DV, h_BLD.dtype, dot_general)
      else:
        logits_BLV = matmul.contract("BLD,DV->BLV", h_BLD, head_DV, dot_general,
                                     preferred_element_type=dtype)
    return cross_entropy_sums(comms.activation(logits_BLV, LOGITS_NAMES), labels_BL, mask_BL,
                              comms)
  mask = mask_BL.astype(jnp.float32)
  with jax.named_scope("head_loss_chunked"):
    return (_chunked(h_BLD, head_DV, labels_BL, mask, comms, n, dtype, dot_general,
                     head_stored), jnp.sum(mask))


def _split(x: jax.Array, n: int) -> jax.Array:
  """[B, L, ...] -> [n, B, L/n, ...], chunk i = positions i, i+n, ...: strided, so a sequence
  sharded over devices (context parallelism) stays sharded the same way inside each chunk."""
  b, l = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, l // n, n, *x.shape[2:]), 2, 0)


def _merge(x: jax.Array) -> jax.Array:
  n, b, c = x.shape[:3]
  return jnp.moveaxis(x, 0, 2).reshape(b, c * n, *x.shape[3:])


def _chunked(h_BLD, head_DV, labels_BL, mask_BL, comms: Seam, n: int, logits_dtype,
             dot_general: matmul.DotGeneral = jax.lax.dot_general,
             head_stored: tuple[str, str] = ("embed", "vocab")) -> jax.Array:
  """Loss sum over n chunks; custom_vjp: the gradients are made in the forward's scan. The
  head's product writes each chunk's logits in `logits_dtype`; the softmax reads them as fp32.

  Sums over tokens stay per device inside the scan: the loss and dW are accumulated as
  [S, Q, ...] with S = batch shards and Q = sequence shards (1 x 1 when arrays are already a
  device's block), each device holding its own [1, 1, ...] partial, and reduced once after the
  loop, into the head weight's stored layout (`Seam.weight_grad`: ZeRO-2/3's fsdp shard, so a
  reduce-scatter). Summing over the sharded tokens inside it would make xla mode all-reduce dW
  per chunk."""
  b, l, _ = h_BLD.shape
  lb, ll = comms.local_shape((b, l), LOGITS_NAMES[:2])
  shards = (b // lb, l // ll)  # (S, Q)
  per_shard = lambda x, *names: comms.activation(x, ("batch", "seq", *names))

  def by_shard(x_BC):  # [B, C, ...] -> [S, B/S, Q, C/Q, ...]
    s, q = shards
    return x_BC.reshape(s, x_BC.shape[0] // s, q, x_BC.shape[1] // q, *x_BC.shape[2:])

  def chunk_loss(head_DV, h_BCD, labels_BC, mask_BC, with_grads: bool):
    logits = comms.activation(matmul.contract("BCD,DV->BCV", h_BCD, head_DV, dot_general,
                                              preferred_element_type=logits_dtype),
                              LOGITS_NAMES).astype(jnp.float32)
    m, s = max_sum_exp(logits, comms)
    token_loss = _token_loss(m, s, _label_logit(logits, labels_BC, comms))
    loss_SQ = jnp.sum(by_shard(token_loss * mask_BC), axis=(1, 3))
    if not with_grads:
      return per_shard(loss_SQ), None, None
    # d(loss)/d(logits) = (softmax - onehot) * mask, cast to the compute dtype for both
    # products (dh: partial over vocab shards, summed by the head's tensor-parallel entry).
    hit = _hit(logits, labels_BC, comms)
    dlogits = ((jnp.exp(logits - m) / s - hit) * mask_BC[..., None]).astype(h_BCD.dtype)
    dh_BCD = matmul.contract("BCV,DV->BCD", dlogits, head_DV, dot_general)
    dw_SQDV = matmul.contract("sbqcd,sbqcv->sqdv", by_shard(h_BCD), by_shard(dlogits),
                              dot_general, preferred_element_type=jnp.float32)
    return per_shard(loss_SQ), dh_BCD, per_shard(dw_SQDV, "embed", "vocab")

  def chunks(h_BLD, labels_BL, mask_BL):
    return _split(h_BLD, n), _split(labels_BL, n), _split(mask_BL, n)

  def loss_only(h_BLD, head_DV, labels_BL, mask_BL):
    body = lambda total, x: (total + chunk_loss(head_DV, *x, with_grads=False)[0], None)
    total = jax.lax.scan(body, per_shard(jnp.zeros(shards, jnp.float32)),
                         chunks(h_BLD, labels_BL, mask_BL))[0]
    return jnp.sum(total)

  def forward(h_BLD, head_DV, labels_BL, mask_BL):
    def body(carry, x):
      loss, dh, dw = chunk_loss(head_DV, *x, with_grads=True)
      return (carry[0] + loss, carry[1] + dw), dh

    # The first chunk outside the loop starts the sums: no zeroed fp32 [D, V] accumulator
    # (0.28 ms a head on an H100 at vocab 102,400). The barrier keeps the chunks one after the
    # other where XLA inlines a one-trip loop (two chunks), as the loop does: one chunk's
    # logits at a time (else +2.1 GiB on the DeepSeek-V3 16B proxy).
    xs = chunks(h_BLD, labels_BL, mask_BL)
    loss, dh0, dw_SQDV = chunk_loss(head_DV, *(x[0] for x in xs), with_grads=True)
    (loss, dw_SQDV, dh0), rest = jax.lax.optimization_barrier(
        ((loss, dw_SQDV, dh0), tuple(x[1:] for x in xs)))
    (loss, dw_SQDV), dh = jax.lax.scan(body, (loss, dw_SQDV), rest)
    dw_DV = comms.weight_grad(jnp.sum(dw_SQDV, axis=(0, 1)), ("embed", "vocab"), head_stored)
    dh = jnp.concatenate([dh0[None], dh], axis=0)
    return jnp.sum(loss), (_merge(dh), dw_DV.astype(head_DV.dtype))

  def backward(res, g):
    dh_BLD, dw_DV = res
    scale = lambda x: (x.astype(jnp.float32) * g).astype(x.dtype)
    return scale(dh_BLD), scale(dw_DV), None, None

  fn = jax.custom_vjp(loss_only)
  fn.defvjp(forward, backward)
  return fn(h_BLD, head_DV, labels_BL, mask_BL)


def mtp_terms(model, x_BLD: jax.Array, labels_BL: jax.Array, mask_BL: jax.Array,
              positions: Positions | jax.Array | None = None, comms: Seam = LOCAL,
              remat: str = "none", logits: Logits = Logits(), embed_VD: jax.Array | None = None,
              head_DV: jax.Array | None = None,
              turns: layer_microbatches.Turns = layer_microbatches.WHOLE
              ) -> dict[str, jax.Array]:
  """Multi-token prediction's terms for one micro-batch (`jscale.model.mtp`), token sums over
  this device's targets like the main loss's `head_loss_sums` (`accumulate.TOKEN_SUMS`):
  "mtp_loss" [D], each depth's cross-entropy, and "mtp_objective", loss_weight times their
  mean. The step scales both by its 1 / (the main loss's token count over the whole batch), as
  it does the token loss, so they do not depend on how the batch is split into micro-batches
  and devices. `model`: a `Llama` with `cfg.mtp`; `x_BLD`: its trunk's output;
  `turns`: how each module takes the batch (`Llama.mtp_hidden`)."""
  if head_DV is None:
    head_DV = model.head_inputs(x_BLD, comms, embed_VD)[1]
  sums = []
  for d, h_BLD in enumerate(model.mtp_hidden(x_BLD, labels_BL, positions, comms, remat,
                                              embed_VD, turns), start=1):
    h_BLD = comms.enter_tensor_parallel(h_BLD).astype(head_DV.dtype)
    sums.append(head_loss_sums(h_BLD, head_DV, mtp.shift(labels_BL, d), mtp.shift(mask_BL, d),
                               comms, logits, model.head_dot, model.head_stored)[0])
  per_depth = jnp.stack(sums)
  return {"mtp_loss": per_depth,
          "mtp_objective": model.cfg.mtp.loss_weight * jnp.mean(per_depth)}
