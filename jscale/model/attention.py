"""Attention dispatch: `model.attention_impl` picks how softmax(QKᵀ/√d)·V is computed.

"auto" (the default) picks per backend and layout (`auto_impl`): cuDNN flash attention on a GPU
where it applies, the ring under context parallelism, plain XLA on CPU; the runtime resolves it
once and the train loop prints and records the choice.

Every impl takes q [B, L, H, K], k [B, S, G, K] and v [B, S, G, Kv] with H a multiple of G
(grouped-query attention: K/V are never repeated in memory) and returns [B, L, H, Kv]: V's head
size may differ from Q's (e.g. MLA). cuDNN runs such sizes as they are from 9.10 on Hopper
(`jax_compat.cudnn_mla_attention`: MLA's 192 / 128 does (3K + 2Kv) / 5K of the padded
backward's work); before, V is zero-padded to K's size and the output sliced (`with_v_padded`).
The causal mask is the usual one, or, given token positions (context parallelism reorders
tokens), query i sees key j when pos_q[i] >= pos_k[j]. "ring" is ring attention over the
`sequence` mesh axis (`jscale.parallel.context.ring`, called through the model's seam); on one
device it is one diagonal block, i.e. plain attention. "pallas" is the Pallas flash attention
kernel (`pallas_kernels.flash_attention`, GPU; `interpret=True` runs it in the Pallas
interpreter), index-causal only; under a mesh the model's seam runs it on each device's shards
(`Seam.kernel`).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jscale import jax_compat
from jscale.model import blockwise_attention, matmul
from jscale.model import positions as positions_lib
from jscale.model.positions import Positions
from pallas_kernels.flash_attention import flash_attention, ring_block


def xla_attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array,
                  causal: bool = True, positions=None) -> jax.Array:
  """Plain einsum attention with fp32 scores and softmax: [B, L, H, Kv] (V's head size, here
  V); `positions` = (q's, k's), each a `positions.Positions` or its index array [B, L] / [B, S],
  masks by position (and document: `positions.sees`) instead of by index."""
  b, l, h, k = q_BLHK.shape
  g = k_BSGK.shape[2]
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, k)
  # fp32 scores for the softmax; the backward's products still take bf16 operands.
  scores_BGRLS = matmul.einsum_f32("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                                   q_BLHK.dtype) / jnp.sqrt(jnp.float32(k))
  if causal and positions is not None:
    mask_BLS = positions_lib.sees(*(p if isinstance(p, Positions) else Positions(p)
                                    for p in positions))
    scores_BGRLS = jnp.where(mask_BLS[:, None, None], scores_BGRLS, jnp.finfo(jnp.float32).min)
  elif causal:
    s = k_BSGK.shape[1]
    mask_LS = jnp.arange(l)[:, None] + (s - l) >= jnp.arange(s)[None, :]
    scores_BGRLS = jnp.where(mask_LS, scores_BGRLS, jnp.finfo(jnp.float32).min)
  probs_BGRLS = jax.nn.softmax(scores_BGRLS, axis=-1).astype(v_BSGV.dtype)
  out_BLGRV = matmul.einsum("BGRLS,BSGV->BLGRV", probs_BGRLS, v_BSGV, q_BLHK.dtype)
  return out_BLGRV.reshape(b, l, h, v_BSGV.shape[-1])


def with_v_padded(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`attend(q, k, v, ...)` for a V head size Kv below K's: V zero-padded to K's, the output
  sliced back. Exact (softmax(QKᵀ)·[V, 0] = [softmax(QKᵀ)·V, 0]), and so are the gradients
  (the pad's transpose drops the padded columns of dV); the kernel does (K + K) / (K + Kv) of
  the work (MLA's 192 / 128: 1.2x)."""

  def padded(q_BLHK, k_BSGK, v_BSGV, *args, **kwargs):
    kv, k = v_BSGV.shape[-1], k_BSGK.shape[-1]
    if kv == k:
      return attend(q_BLHK, k_BSGK, v_BSGV, *args, **kwargs)
    v_BSGK = jnp.pad(v_BSGV, [(0, 0)] * 3 + [(0, k - kv)])
    return attend(q_BLHK, k_BSGK, v_BSGK, *args, **kwargs)[..., :kv]

  return padded


def cudnn_attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array,
                    causal: bool = True, positions=None,
                    segment_ids: jax.Array | None = None) -> jax.Array:
  """cuDNN fused attention (GPU only; GQA handled by the kernel; index-causal only; a V head
  size below Q's, MLA's, as it is where cuDNN takes it, `jax_compat.cudnn_mla_supported`,
  else through `with_v_padded`). `segment_ids` [B, L] (documents) mask across documents
  through a dense [B, 1, L, L] mask, which cuDNN reads as a bias: memory quadratic in L,
  unlike the flash kernel's segment ids (`auto` prefers those)."""
  if positions is not None:
    raise ValueError("cudnn attention masks by index, not by token positions: with "
                     "mesh.sequence > 1 use model.attention_impl=ring or xla")
  if v_BSGV.shape[-1] > k_BSGK.shape[-1]:
    raise ValueError(f"cudnn attention needs V's head size at most K's, got "
                     f"{v_BSGV.shape[-1]} and {k_BSGK.shape[-1]}: use "
                     f"model.attention_impl=xla, pallas or ring")
  if v_BSGV.shape[-1] < k_BSGK.shape[-1] and jax_compat.cudnn_mla_supported():
    return jax_compat.cudnn_mla_attention(q_BLHK, k_BSGK, v_BSGV, causal,
                                          _document_mask(segment_ids))
  return with_v_padded(functools.partial(nn_attention, causal=causal, segment_ids=segment_ids,
                                         implementation="cudnn"))(q_BLHK, k_BSGK, v_BSGV)


def nn_attention(q_BLHK, k_BSGK, v_BSGV, causal: bool, segment_ids: jax.Array | None,
                 implementation: Literal["xla", "cudnn"]) -> jax.Array:
  """`jax.nn.dot_product_attention` with documents (`segment_ids` [B, L]) as its boolean
  [B, 1, L, S] mask (tests run the same call with implementation="xla" on CPU)."""
  return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGV, mask=_document_mask(segment_ids),
                                      is_causal=causal, implementation=implementation)


def _document_mask(segment_ids: jax.Array | None) -> jax.Array | None:
  """Documents `segment_ids` [B, L] as a boolean [B, 1, L, L] mask (None: no documents)."""
  if segment_ids is None:
    return None
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def pallas_attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                     causal: bool = True, positions=None, interpret: bool = False,
                     device: jax.Device | None = None,
                     segment_ids: jax.Array | None = None) -> jax.Array:
  """Pallas flash attention (GPU, or the Pallas interpreter; GQA in the kernel; index-causal
  only, within `segment_ids` [B, L] (documents) if given): the Hopper (Mosaic GPU) kernels
  where `pallas_backend` picks them for `device` (the mesh's, from `Seam.kernel_device`;
  default this process's), else the portable (Triton-lowered) ones. Runs on whole arrays:
  under a mesh call it through `Seam.kernel`."""
  if positions is not None:
    raise ValueError("pallas attention masks by index, not by token positions: under context "
                     "parallelism the model's seam runs it as the ring's block function")
  backend, _ = pallas_backend(q_BLHK.shape, k_BSGK.shape, v_BSGK.shape, q_BLHK.dtype, causal,
                              None if interpret else compute_capability(device))
  if backend == "hopper":
    from pallas_kernels.flash_attention import hopper
    out = hopper.flash_attention(q_BLHK, k_BSGK, v_BSGK, causal=causal,
                                 segment_ids=segment_ids)
  else:
    out = flash_attention(q_BLHK, k_BSGK, v_BSGK, causal=causal, segment_ids=segment_ids,
                          interpret=interpret)
  assert isinstance(out, jax.Array)  # (out, lse) comes only with return_lse
  return out


def compute_capability(device: jax.Device | None = None) -> str | None:
  """A GPU's compute capability ("9.0"; default: this process's first device), None off GPU."""
  dev = device or jax.devices()[0]
  return getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None


def pallas_backend(q_shape, k_shape, v_shape, dtype, causal: bool,
                   compute_capability: str | None) -> tuple[str, str]:
  """("hopper" | "portable", why) for `attention_impl: pallas`: the warp-specialised Mosaic
  GPU kernels on compute capability 9.x where they tile the shapes (bf16 / fp16, V's head size
  equal to K's, a multiple of 64), the portable Triton-lowered kernels otherwise (other GPUs,
  the interpreter, fp32, odd head sizes)."""
  if compute_capability is None or not str(compute_capability).startswith("9"):
    return "portable", f"compute capability {compute_capability}: not Hopper"
  from pallas_kernels.flash_attention import hopper
  if tuple(v_shape) != tuple(k_shape):
    return "portable", f"V {tuple(v_shape)} differs from K {tuple(k_shape)}"
  if (why := hopper.why_not(q_shape, k_shape, dtype, causal=causal)) is not None:
    return "portable", why
  sm = str(compute_capability).replace(".", "")
  return "hopper", f"Hopper (sm_{sm}): Mosaic GPU kernels"


# Fused kernels: `remat: selective` saves their forward's outputs (with the softmax statistics
# their backward reads) by primitive (`remat.remat_policy`). Their output is not also named:
# JAX would save the same values twice (1 GiB per step at llama3_1b batch 4, seq 4096).
KERNEL_IMPLS = ("cudnn", "pallas")

IMPLS: dict[str, Callable[..., jax.Array]] = {"xla": xla_attention, "cudnn": cudnn_attention,
                                               "ring": xla_attention, "pallas": pallas_attention}
# Backends each impl can run on; checked at config validation, never a silent fallback
# (`jscale.validate.check_backend`). Pallas kernels run anywhere with model.kernel_interpret.
# "auto" resolves to one of the others for the backend (`auto_impl`).
BACKENDS: dict[str, tuple[str, ...]] = {"xla": ("cpu", "gpu", "tpu"), "cudnn": ("gpu",),
                                        "ring": ("cpu", "gpu", "tpu"), "pallas": ("gpu",),
                                        "auto": ("cpu", "gpu", "tpu")}


def cudnn_applies(dtype, head_dim: int, compute_capability: str | None = None,
                  v_head_dim: int | None = None) -> str | None:
  """None if cuDNN's fused flash attention runs this attention, else why not: it takes fp16 /
  bf16 operands, head dims that are multiples of 8 up to 128 (256 on Hopper and later, as
  JAX's cuDNN checks say), a V head size at most Q's (MLA's runs as it is on cuDNN 9.10+ on
  Hopper, `jax_compat.cudnn_mla_supported`, else padded: `with_v_padded`), and
  Ampere or newer GPUs."""
  if v_head_dim is not None and v_head_dim > head_dim:
    return f"v head_dim {v_head_dim} > q head_dim {head_dim} (V is padded to Q's, not cut)"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"model.dtype={jnp.dtype(dtype).name} (cuDNN flash attention needs bf16 or fp16)"
  hopper = compute_capability is not None and float(compute_capability) >= 9.0
  most = 256 if hopper else 128
  if head_dim % 8 or head_dim > most:
    return (f"head_dim={head_dim} (cuDNN flash attention needs a multiple of 8, at most "
            f"{most}{'' if hopper else ' before Hopper'})")
  if compute_capability and float(compute_capability) < 8.0:
    return f"compute capability {compute_capability} (cuDNN flash attention needs >= 8.0)"
  return None


def auto_impl(platform: str, dtype, head_dim: int, context_parallel: bool = False,
              flash_tiles: bool = True, compute_capability: str | None = None,
              v_head_dim: int | None = None, documents: bool = False) -> tuple[str, str]:
  """(impl, why) that `model.attention_impl: auto` runs: under context parallelism the ring
  (its blocks the Pallas flash kernel on GPU where it tiles them, else plain jnp); on a GPU
  cuDNN's fused flash attention where it applies, or with `documents` masked (which cuDNN
  cannot) the flash kernel where it tiles; plain XLA otherwise (CPU)."""
  if context_parallel:
    if platform == "gpu" and flash_tiles:
      return "pallas", "mesh.sequence > 1 on GPU: ring attention, flash-kernel blocks"
    return "ring", "mesh.sequence > 1: ring attention" + (
        ", plain blocks (the flash kernel does not tile them)" if platform == "gpu" else "")
  if platform == "gpu" and documents and flash_tiles:
    return "pallas", ("data.document_mask on GPU: the flash kernel's segment ids (cuDNN would "
                      "read the documents as a dense L x L mask)")
  if platform == "gpu":
    why_not = cudnn_applies(dtype, head_dim, compute_capability, v_head_dim)
    if why_not is None:
      padded = ("" if v_head_dim is None or v_head_dim == head_dim else
                f" (V's {v_head_dim} as it is: cuDNN's MLA sizes)"
                if jax_compat.cudnn_mla_supported(compute_capability) else
                f" (V's {v_head_dim} padded to {head_dim})")
      return "cudnn", (f"GPU, {jnp.dtype(dtype).name}, head_dim {head_dim}: cuDNN flash "
                       f"attention{padded}")
    return "xla", f"GPU, but cuDNN does not apply: {why_not}"
  return "xla", f"{platform}: plain XLA attention"


# Logical axis names of q and of k / v (how the model's seam lays out a kernel's operands).
Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv_heads", "head_dim")


def local_impl(impl: str, q_BLHK: jax.Array, v_BSGV: jax.Array | None = None) -> str:
  """`impl`, with "auto" resolved for the default backend as for one device without context
  parallelism (a model used without a runtime; the runtime resolves it for its mesh)."""
  if impl != "auto":
    return impl
  return auto_impl(jax.default_backend(), q_BLHK.dtype, q_BLHK.shape[-1],
                   v_head_dim=None if v_BSGV is None else v_BSGV.shape[-1])[0]


def attention(q_BLHK, k_BSGK, v_BSGK, impl: str = "xla", causal: bool = True,
              positions=None, interpret: bool = False) -> jax.Array:
  """Dispatches to `impl`; a non-kernel result is named for selective rematerialisation.
  `interpret`: Pallas impls only (run in the Pallas interpreter)."""
  impl = local_impl(impl, q_BLHK, v_BSGK)
  kwargs = {"interpret": interpret} if impl == "pallas" else {}
  ctx_BLHK = IMPLS[impl](q_BLHK, k_BSGK, v_BSGK, causal=causal, positions=positions, **kwargs)
  return ctx_BLHK if impl in KERNEL_IMPLS else named(ctx_BLHK)


# Context parallelism's exchanged attention operands and output (Ulysses' all-to-alls' results):
# kept by `remat: selective`, so the backward does not exchange them again.
CP_EXCHANGED = "attn_cp_exchanged"


def kernel_fn(impl: str, interpret: bool = False, device: jax.Device | None = None
              ) -> Callable[..., jax.Array]:
  """A fused kernel impl ("pallas", "cudnn") as `fn(q, k, v, docs_BL=None)`: index-causal
  attention of tokens in sequence order, within documents if `docs_BL` [B, L] is given (what
  the model's seam and Ulysses run per device's shards)."""
  if impl == "pallas":
    return lambda q, k, v, docs_BL=None: pallas_attention(
        q, k, v, interpret=interpret, device=device, segment_ids=docs_BL)
  return lambda q, k, v, docs_BL=None: cudnn_attention(q, k, v, segment_ids=docs_BL)


def in_order(q_BLHK, k_BSGK, v_BSGK, impl: str, positions: Positions) -> jax.Array:
  """A non-kernel impl on tokens in sequence order: masked by index, and by document when
  `positions` carries documents."""
  pair = None if positions.start_BL is None else (positions, positions)
  return attention(q_BLHK, k_BSGK, v_BSGK, impl, positions=pair)


def named(ctx_BLHK: jax.Array) -> jax.Array:
  """Names a non-kernel attention output "attn_ctx" (kept by `remat: selective`)."""
  return checkpoint_name(ctx_BLHK, "attn_ctx")


def ring_blocks(impl: str, interpret: bool = False):
  """Ring attention's per-block math for `impl`: the flash kernels for "pallas" (each block
  a kernel call, merged by log-sum-exp), else plain jnp."""
  if impl != "pallas":
    return blockwise_attention.JNP
  return blockwise_attention.BlockFns(*ring_block.block_fns(interpret))
