"""The comms seam: every place where a parallelism communicates, as one named operation.

The model and the loss are written once and call these operations. `Comms` is the single-device
version, where each is the plain math (identity for the communication). The two parallel modes
subclass it: in "xla" mode arrays are global and the operations become sharding constraints; in
"manual" mode arrays are per-device shards inside `jax.shard_map` and the operations issue real
collectives (`all_gather`, `psum`, `psum_scatter`, `ppermute`, `all_to_all`). Model code takes
sizes from the arrays it receives, never from the global config, so it runs unchanged on shards.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jscale.model import attention as attn_lib
from jscale.model import moe_dispatch
from jscale.optim import global_norm

Names = Sequence[str | None]

# checkpoint_name of whole weights gathered for ZeRO-3: never saved for the backward (which
# gathers again), or the forward would keep every layer's full weights alive, undoing ZeRO-3.
GATHERED = "zero3_gathered_params"


class Comms:
  """Single device: no communication. Subclasses override the operations they need."""

  mode = "local"

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    """Lays out an activation by logical axis names (e.g. ("batch", "seq", "embed"))."""
    del names
    return x

  def local_shape(self, shape: Sequence[int], names: Names) -> tuple[int, ...]:
    """The shape of one device's block of an activation of `shape` laid out by logical
    `names` (one device and manual mode: arrays already are that block)."""
    del names
    return tuple(shape)

  def gather_params(self, layer_params: Any, dtype: Any) -> Any:
    """Makes one layer's (possibly ZeRO-3 sharded) weights whole just before use; ZeRO-3
    gathers them already cast to the compute `dtype` (half the bytes of fp32 masters)."""
    del dtype
    return layer_params

  def bind(self, params: Any) -> "Comms":
    """This seam for one step over stored `params` (manual ZeRO-2 reads its full weights)."""
    del params
    return self

  def params_for_grad(self, params: Any) -> Any:
    """What the gradient is taken with respect to (manual ZeRO-2: layer weights' shards)."""
    return params

  def layer_inputs(self, stacked: Any) -> Any:
    """What the layer scan iterates over, given the stacked layer state; each slice goes
    through `gather_params`."""
    return stacked

  def gather_updated_params(self, new_params: Any, old_params: Any) -> Any:
    """ZeRO-1/2: parameters updated shard by shard, made whole again (may reuse `old_params`)."""
    del old_params
    return new_params

  def attention(self, q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                positions_BL: jax.Array, impl: str, interpret: bool = False) -> jax.Array:
    """Causal self-attention of the sequence (split over `sequence` under context parallelism:
    K/V all-gathered, or a ring). `positions_BL` are the tokens' positions in their sequence.
    `interpret`: run a Pallas impl in the Pallas interpreter."""
    del positions_BL  # one device (or no context parallelism): tokens are in order
    impl = attn_lib.local_impl(impl, q_BLHK)
    if impl in ("pallas", "cudnn"):  # kernels: run on each device's shards of batch and heads
      # (cuDNN too: a custom call inside GSPMD regions such as a pipeline stage, and only ever
      # per-device work, so it gets the same per-shard dispatch as the Pallas kernel)
      fn = (functools.partial(attn_lib.pallas_attention, interpret=interpret)
            if impl == "pallas" else attn_lib.cudnn_attention)
      names = (attn_lib.Q_NAMES, attn_lib.KV_NAMES, attn_lib.KV_NAMES)
      return attn_lib.named(self.kernel(fn, (q_BLHK, k_BSGK, v_BSGK), names, attn_lib.Q_NAMES))
    return attn_lib.attention(q_BLHK, k_BSGK, v_BSGK, impl)

  def kernel(self, fn: Callable, args: Sequence[jax.Array], in_names: Sequence[Names],
             out_names: Names) -> jax.Array:
    """`fn(*args)` for a Pallas kernel, which GSPMD cannot partition (a custom call): run on
    each device's shards, the dims of `args` / the result carrying logical `in_names` /
    `out_names` (the kernel must be per-row / per-head along the split dims). One device and
    manual mode: arrays are already per-device shards, so this is the call itself."""
    del in_names, out_names
    return fn(*args)

  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    """Input of a column-parallel linear: Megatron's f (identity fwd, all-reduce bwd)."""
    return x_BLD

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    """Output of a row-parallel linear: Megatron's g (all-reduce fwd, identity bwd)."""
    return y_BLD

  def embed(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """Token embedding lookup (vocab-parallel when the table is sharded over vocab)."""
    return jnp.take(table_VD, tokens_BL, axis=0)

  def expert_groups(self, batch: int) -> int:
    """How many groups the batch's tokens are routed in (capacity is per group): one per
    batch shard, so a group is one device's tokens."""
    del batch
    return 1

  def token_sum(self, x: jax.Array) -> jax.Array:
    """Sums a per-token statistic over the devices holding other tokens, inside the
    differentiated loss: each device's gradient stays its own tokens' share."""
    return x

  def router_input(self, h_GTD: jax.Array) -> jax.Array:
    """The MoE router's view of the (tensor-parallel region's) input: its gradient is whole
    on every tensor rank, which the region's exit would otherwise count once per rank."""
    return h_GTD

  def expert_gates(self, gates_GTK: jax.Array) -> jax.Array:
    """Gates as the experts' combine uses them: with experts split over `tensor` each rank's
    gate gradient is a partial sum (of its hidden slice), summed here."""
    return gates_GTK

  def experts(self, x_GTD: jax.Array, ids_GTK: jax.Array, gates_GTK: jax.Array,
              w: moe_dispatch.ExpertWeights, moe: Any, dtype: Any):
    """Applies each token's chosen experts, weighted by its gates, per group:
    (output [G, T, D], number of dropped assignments). `moe`: the model's MoeConfig."""
    outs, dropped = [], 0
    for g in range(x_GTD.shape[0]):
      if moe.dispatch == "dropless":
        outs.append(moe_dispatch.dropless(x_GTD[g], ids_GTK[g], gates_GTK[g], w, dtype))
      else:
        y, d = moe_dispatch.with_capacity(x_GTD[g], ids_GTK[g], gates_GTK[g], w, dtype,
                                          moe.capacity_factor)
        outs.append(y)
        dropped = dropped + d
    return jnp.stack(outs), jnp.asarray(dropped, jnp.int32)

  def vocab_max(self, x: jax.Array) -> jax.Array:
    """Max over the (possibly sharded) vocab axis, the last one, keeping dims."""
    return jnp.max(x, axis=-1, keepdims=True)

  def vocab_sum(self, x: jax.Array) -> jax.Array:
    """Sum over the (possibly sharded) vocab axis, the last one, keeping dims."""
    return jnp.sum(x, axis=-1, keepdims=True)

  def vocab_offset(self, local_size: int) -> int | jax.Array:
    """Index of this shard's first vocab entry, given the shard's vocab size (0 unless the
    vocab is sharded)."""
    del local_size
    return 0

  def program(self, fn: Callable, in_shardings: Any, out_shardings: Any) -> Callable:
    """The function a step jits: `fn` on global arrays, or (manual) on each device's shards."""
    del in_shardings, out_shardings
    return fn

  @property
  def stages(self) -> int:
    """Pipeline stages (the `stage` mesh axis size)."""
    return 1

  def in_pipeline(self) -> "Comms":
    """The seam to use inside `over_stages` (xla mode: constraints as bare specs)."""
    return self

  def over_stages(self, fn: Callable, params: Any, microbatches: Any, scale: jax.Array,
                  grads: bool = True):
    """Runs `fn(params, microbatches, scale) -> (grads, loss, codes)` on each stage's shards:
    layer weights and their gradients split over `stage` (the pipeline's executor runs in it).
    `grads=False`: forward only, `fn` returns None for the gradients."""
    raise NotImplementedError("pipeline parallelism needs a mesh with a stage axis")

  def batch_sum(self, x: jax.Array) -> jax.Array:
    """Sums a per-batch quantity (loss, token count) over the devices holding other rows."""
    return x

  def zero_grads(self, params: Any) -> Any:
    """The fp32 gradient accumulator before the first micro-batch."""
    return self.grad_accumulator(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def grad_accumulator(self, grads: Any) -> Any:
    """One micro-batch's gradient, in the accumulator's layout (ZeRO-2: reduced to a shard)."""
    return grads

  def stage_grads(self, grads: Any) -> Any:
    """One pipeline (micro-batch, chunk) gradient in the stage accumulator's layout: a dict with
    some of the parameters' top-level keys, stacked leaves holding one chunk's layers (ZeRO-2:
    reduced to this device's fsdp shard, so the accumulators are shard-sized)."""
    return grads

  def sync_grads(self, grads: Any) -> Any:
    """Reduces gradients over the data-parallel axes, once per optimizer step."""
    return grads

  def grad_norm(self, grads: Any) -> jax.Array:
    """Global L2 norm of the synced gradients (whatever devices their pieces live on)."""
    return global_norm(grads)

  def params_for_update(self, params: Any) -> Any:
    """The part of the parameters this device updates (ZeRO-1/2 manual: its fsdp shard)."""
    return params


LOCAL = Comms()


def gather_layers_in_place(new: jax.Array, old: jax.Array,
                           gather_layer: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """ZeRO-1/2's weight all-gather for a stacked [layers, ...] leaf: `gather_layer` makes one
  layer whole, written over the old (donated) weights in place, so the gather buffer is one
  layer, not the largest stacked leaf (GBs at 8B)."""

  def body(i, out):
    return jax.lax.dynamic_update_index_in_dim(out, gather_layer(new[i]), i, 0)

  return jax.lax.fori_loop(0, new.shape[0], body, old)
