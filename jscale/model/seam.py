"""The model's seam: every place where the forward pass (and its loss) may communicate, as one
named operation the model calls and a parallel layout implements.

The model owns this interface and imports nothing from `jscale.parallel`. `Seam` itself is the
single-device version (`LOCAL`), where each operation is the plain math (identity for the
communication). The parallel modes implement it per axis in `jscale.parallel` (in "xla" mode
arrays are global and the operations become sharding constraints; in "manual" mode arrays are
per-device shards inside `jax.shard_map` and the operations issue real collectives). Model code
takes sizes from the arrays it receives, never from the global config, so it runs unchanged on
shards. The train step's own operations (gradients, optimizer, program) are a separate protocol:
`jscale.parallel.comms.Comms`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp

from jscale.model import attention as attn_lib
from jscale.model import moe_dispatch, phases
from jscale.model.positions import Positions

Names = Sequence[str | None]

# checkpoint_name of whole weights gathered for ZeRO-3: never saved for the backward (which
# gathers again), or the forward would keep every layer's full weights alive, undoing ZeRO-3.
GATHERED = "zero3_gathered_params"


class EntersTensorParallel:
  """Marks a block module that enters and leaves the tensor-parallel region itself, through
  `Seam.tp_column` / `Seam.tp_row` (so a layout may fuse the collectives with its matmuls):
  `Block` hands it the normed input and takes its output as reduced."""


class LayerChunks(Protocol):
  """One layer's ZeRO-3 gather in pieces, a piece per trip of a neighbouring layer's loop (the
  prefetch, `jscale.model.layer_prefetch`); `layer` is its stored shards.
  Implemented by the layout that gathers layers by hand (`jscale.parallel.zero_prefetch`)."""

  def empty(self, layer: Any) -> jax.Array:
    """The buffer the trips fill, before any piece is gathered."""
    ...

  def fetch(self, got: jax.Array, layer: Any, t: jax.Array) -> jax.Array:
    """`got` with piece `t` of `layer` gathered into it."""
    ...

  def whole(self, layer: Any) -> jax.Array:
    """`empty` with every piece of `layer` gathered into it, at once."""
    ...

  def assemble(self, got: jax.Array, layer: Any) -> Any:
    """The gathered layer from every piece."""
    ...

  @property
  def forward(self) -> LayerChunks:
    """The pieces the forward gathers into the same buffer: values only its products read
    may travel narrower (the routed experts' e4m3 columns); itself where none do."""
    ...


class Seam:
  """One device: no communication. Parallel layouts override the operations they need."""

  mode = "local"

  # ---------------------------------------------------------------- layouts and kernels

  def activation(self, x: jax.Array, names: Names) -> jax.Array:
    """Lays out an activation by logical axis names (e.g. ("batch", "seq", "embed"))."""
    del names
    return x

  def local_shape(self, shape: Sequence[int], names: Names) -> tuple[int, ...]:
    """The shape of one device's block of an activation of `shape` laid out by logical
    `names` (one device and manual mode: arrays already are that block)."""
    del names
    return tuple(shape)

  def kernel(self, fn: Callable, args: Sequence[jax.Array], in_names: Sequence[Names],
             out_names: Names) -> jax.Array:
    """`fn(*args)` for a Pallas kernel, which GSPMD cannot partition (a custom call): run on
    each device's shards, the dims of `args` / the result carrying logical `in_names` /
    `out_names` (the kernel must be per-row / per-head along the split dims). One device and
    manual mode: arrays are already per-device shards, so this is the call itself."""
    del in_names, out_names
    return fn(*args)

  def kernel_device(self) -> jax.Device:
    """The device kernels are chosen for (the Hopper ones by its compute capability): this
    process's first; a mesh's seam answers for the mesh, so a step compiled here for other
    GPUs runs what they would."""
    return jax.devices()[0]

  def amax(self, x: jax.Array) -> jax.Array:
    """max |x| over the whole (possibly sharded) tensor, an fp32 scalar: FP8's scales. Global
    arrays (one device, xla mode) need nothing more; manual mode takes the max over devices."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)

  # ---------------------------------------------------------------- weights (DP / ZeRO)

  def gather_params(self, params: Any, dtype: Any) -> Any:
    """Makes (possibly ZeRO-3 sharded) weights whole just before use; ZeRO-3 gathers them
    already cast to the compute `dtype` (half the bytes of fp32 masters)."""
    del dtype
    return params

  def weight_grad(self, g: jax.Array, names: Names, stored_names: Names) -> jax.Array:
    """A weight's gradient the model summed over the token shards itself (the chunked loss's
    dW), laid out as the weight is stored: `names` are `g`'s dims, `stored_names` the same
    names in the weight's own order (a tied head is the embedding transposed). Under ZeRO-2/3
    in xla mode that is the weight's fsdp shard, so the sum becomes a reduce-scatter."""
    del names, stored_names
    return g

  def layer_inputs(self, stacked: Any) -> Any:
    """What the layer scan iterates over, given the stacked layer weights; each slice goes
    through `gather_layer`."""
    return stacked

  def gather_layer(self, layer: Any, dtype: Any, depth: int) -> Any:
    """One slice of `layer_inputs` (a stack of `depth` layers) made into the layer's whole
    weights (`gather_params`, unless the layout scans something else: manual ZeRO-2's stored
    weights)."""
    del depth
    return self.gather_params(layer, dtype)

  def layer_chunks(self, layer: Any, dtype: Any, chunks: int,
                   e4m3_experts: bool = False) -> LayerChunks | None:
    """ZeRO-3's `gather_layer` of one slice of `layer_inputs` in `chunks` pieces, where the
    layout gathers layers by hand; None elsewhere. `e4m3_experts`: the routed experts'
    forward products quantise their weights per column (`matmul.expert_columns_e4m3`), so
    the forward's pieces may carry them so (`LayerChunks.forward`)."""
    del layer, dtype, chunks, e4m3_experts
    return None

  # ---------------------------------------------------------------- attention (CP)

  def attention(self, q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                positions: Positions, impl: str, interpret: bool = False) -> jax.Array:
    """Causal self-attention of the sequence (split over `sequence` under context parallelism:
    K/V all-gathered, a ring, or Ulysses' all-to-alls), within each token's document
    (`positions.Positions`: where the tokens sit). `interpret`: run a Pallas impl in the Pallas
    interpreter."""
    # One device (or no context parallelism): tokens are in order, so only documents mask.
    docs_BL = positions.start_BL
    impl = attn_lib.local_impl(impl, q_BLHK, v_BSGK)
    if impl in attn_lib.KERNEL_IMPLS:  # kernels: run on each device's shards of batch and heads
      # (cuDNN too: a custom call inside GSPMD regions such as a pipeline stage, and only ever
      # per-device work, so it gets the same per-shard dispatch as the Pallas kernel)
      names = [attn_lib.Q_NAMES, attn_lib.KV_NAMES, attn_lib.KV_NAMES]
      args = [q_BLHK, k_BSGK, v_BSGK]
      if docs_BL is not None:
        names, args = names + [("batch", "seq")], args + [docs_BL]
      fn = attn_lib.kernel_fn(impl, interpret, self.kernel_device())
      # Not named "attn_ctx": the policy saves the kernel's outputs (`attn_lib.KERNEL_IMPLS`).
      return self.kernel(fn, args, names, attn_lib.Q_NAMES)
    return attn_lib.in_order(q_BLHK, k_BSGK, v_BSGK, impl, positions)

  # ---------------------------------------------------------------- tensor parallelism

  def enter_tensor_parallel(self, x_BLD: jax.Array) -> jax.Array:
    """Input of a column-parallel linear: Megatron's f (identity fwd, all-reduce bwd)."""
    return x_BLD

  def leave_tensor_parallel(self, y_BLD: jax.Array) -> jax.Array:
    """Output of a row-parallel linear: Megatron's g (all-reduce fwd, identity bwd)."""
    return y_BLD

  def tp_column(self, h_BLD: jax.Array, linears: Sequence[Callable]) -> list[jax.Array]:
    """Enters the tensor-parallel region with `h_BLD` and applies the column-parallel
    `linears` (each [B, L, D] -> [B, L, ...]) to it. A layout may fuse the two: collective
    matmul overlaps SP's all-gather with the products (`jscale.parallel.tensor`)."""
    h_BLD = self.enter_tensor_parallel(h_BLD)
    return [f(h_BLD) for f in linears]

  def tp_row(self, x: jax.Array, linear: Callable) -> jax.Array:
    """A row-parallel `linear` ([B, L, ...] -> partial sums [B, L, D]) and the region's exit;
    collective matmul overlaps SP's reduce-scatter with the product."""
    return self.leave_tensor_parallel(linear(x))


  def embed(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """Token embedding lookup (vocab-parallel when the table is sharded over vocab)."""
    return jnp.take(table_VD, tokens_BL, axis=0)

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

  # ---------------------------------------------------------------- experts (EP)

  def expert_groups(self, batch: int) -> int:
    """How many groups the batch's tokens are routed in (capacity is per group): one per
    batch shard, so a group is one device's tokens."""
    del batch
    return 1

  def token_sum(self, x: jax.Array) -> jax.Array:
    """Sums a per-token statistic over the devices holding other tokens, inside the
    differentiated loss: each device's gradient stays its own tokens' share."""
    return x

  def sequence_sum(self, x: jax.Array) -> jax.Array:
    """Sums a per-sequence statistic over the devices holding other parts of the same
    sequences (manual context parallelism: a psum over `sequence`, which autodiff transposes
    into another: every part's gradient sees the whole sequence's)."""
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
              w: moe_dispatch.ExpertWeights, moe: Any, dtype: Any,
              gemm: moe_dispatch.GroupedDot = moe_dispatch.GroupedDot()):
    """Applies each token's chosen experts, weighted by its gates, per group:
    (output [G, T, D], number of dropped assignments). `moe`: the model's MoeConfig; `gemm`:
    the dropless grouped matmul (`moe_gemm`)."""
    outs, dropped = [], 0
    for g in range(x_GTD.shape[0]):
      if moe.dispatch == "dropless":
        outs.append(moe_dispatch.dropless(x_GTD[g], ids_GTK[g], gates_GTK[g], w, dtype, gemm))
      else:
        y, d = moe_dispatch.with_capacity(x_GTD[g], ids_GTK[g], gates_GTK[g], w, dtype,
                                          moe.capacity_factor)
        outs.append(y)
        dropped = dropped + d
    return jnp.stack(outs), jnp.asarray(dropped, jnp.int32)

  def expert_phases(self, x_GTD: jax.Array, ids_GTK: jax.Array, gates_GTK: jax.Array,
                    w: moe_dispatch.ExpertWeights, moe: Any, dtype: Any,
                    gemm: moe_dispatch.GroupedDot = moe_dispatch.GroupedDot()
                    ) -> phases.Phases[tuple[jax.Array, jax.Array]]:
    """`experts` as phases (`jscale.model.phases`): here one, nothing to overlap; a seam
    that exchanges tokens yields at the exchange's boundaries."""
    return (yield from phases.finished(self.experts(x_GTD, ids_GTK, gates_GTK, w, moe, dtype,
                                                    gemm)))


LOCAL = Seam()
