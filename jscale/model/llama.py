"""Llama in Flax NNX: embedding, scanned stack of (attention + MLP) blocks, norm, head.

Layers are created stacked along a leading `layers` axis (nnx.vmap) and run with `lax.scan`, so
compile time does not grow with depth (or unrolled into straight-line code,
`model.scan_layers`). Weights are stored in `param_dtype` (fp32 master) and cast to `dtype`
(bf16) at use. Communication goes through the model's seam (`jscale.model.seam`).
The blocks' attention and MLP modules are swappable (`Block`; GQA, or MLA with `model.mla`, and
SwiGLU or MoE by default), and every linear layer's product, the head's included, is
`dot_general`'s (`jscale.model.matmul`). With `model.moe.first_dense` = k the first k layers
are dense blocks of their own stack (`dense_blocks`, run before the scanned MoE stack; a
pipeline runs them in its first stage with the embedding), and with `model.mtp` the
multi-token prediction modules (`jscale.model.mtp`) follow the trunk in training.

Shape suffixes: B batch, L sequence, D d_model, H query heads, G kv heads, K head dim,
F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.config import ModelConfig
from jscale.model import kv_cache, layer_microbatches, layer_prefetch, matmul, phases, rope
from jscale.model import positions as positions_lib
from jscale.model import remat as remat_lib
from jscale.model.gqa import GQA
from jscale.model.layers import RMSNorm, param
from jscale.model.mla import MLA
from jscale.model.mlp import Mlp
from jscale.model.moe import MoE
from jscale.model.mtp import MtpModule, shift
from jscale.model.positions import Positions
from jscale.model.seam import LOCAL, EntersTensorParallel, Seam


class AttentionModule(Protocol):
  """What `Block` asks of its attention module (`GQA` by default): the normed input [B, L, D]
  inside the tensor-parallel region in, a partial sum [B, L, D] out (a row-parallel linear's);
  or, for a module that is `seam.EntersTensorParallel` (GQA), the normed input as it stands and
  the reduced output. It communicates only through `comms`, the model's seam."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *,
               dot_general: matmul.DotGeneral = jax.lax.dot_general) -> None: ...

  def __call__(self, h_BLD: jax.Array, positions: Positions, inv_freq: jax.Array,
               comms: Seam) -> jax.Array: ...


@runtime_checkable
class CachedAttention(AttentionModule, Protocol):
  """An attention module generation can run (`Block.cached`): through a KV cache."""

  def cached(self, h_BLD: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array,
             cache: Any, layer: jax.Array,
             prefill: bool) -> tuple[jax.Array, Any]: ...  # cache: `kv_cache.init`'s kind


class MlpModule(Protocol):
  """What `Block` asks of its MLP module (`Mlp`, or `MoE` with `cfg.moe`): as
  `AttentionModule`, and statistics to average over layers ({} if none; MoE's router's)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *,
               dot_general: matmul.DotGeneral = jax.lax.dot_general) -> None: ...

  def __call__(self, h_BLD: jax.Array, comms: Seam) -> tuple[jax.Array, dict[str, jax.Array]]:
    ...


def _enter(module, comms: Seam, h_BLD: jax.Array) -> jax.Array:
  """The tensor-parallel region's entry, unless `module` enters it itself."""
  return h_BLD if isinstance(module, EntersTensorParallel) else comms.enter_tensor_parallel(h_BLD)


def _leave(module, comms: Seam, out_BLD: jax.Array) -> jax.Array:
  """The region's exit (the row-parallel sum), unless `module` leaves it itself."""
  return out_BLD if isinstance(module, EntersTensorParallel) else comms.leave_tensor_parallel(
      out_BLD)


class Block(nnx.Module):
  """Pre-norm transformer block: x + Attn(norm(x)), then x + MLP(norm(x)).

  The block owns the norms, the residuals and the tensor-parallel entry / exit; attention and
  MLP are swappable modules (`AttentionModule`, `MlpModule`), constructed as
  `cls(cfg, rngs, dot_general=...)`: GQA, and SwiGLU (`Mlp`) or `MoE` when `cfg.moe` is set.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs,
               attention: type[AttentionModule] | None = None,
               mlp: type[MlpModule] | None = None,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    pd = jnp.dtype(cfg.param_dtype)
    norm = dict(impl=cfg.norm_impl, interpret=cfg.kernel_interpret)
    attention = attention or (GQA if cfg.mla is None else MLA)
    mlp = mlp or (Mlp if cfg.moe is None else MoE)
    # Attention before MLP: the order of the random draws, so seeded inits stay the same.
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.dtype, pd, **norm)
    self.attn = attention(cfg, rngs, dot_general=dot_general)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.dtype, pd, **norm)
    self.mlp = mlp(cfg, rngs, dot_general=dot_general)

  def __call__(self, x_BLD, positions: Positions, inv_freq, comms: Seam):
    return phases.run(self.in_phases(x_BLD, positions, inv_freq, comms))

  def in_phases(self, x_BLD, positions: Positions, inv_freq, comms: Seam
                ) -> phases.Phases[tuple[jax.Array, dict]]:
    """The block as phases (`jscale.model.phases`): its input first, then the MLP's (an
    `MoE`'s exchange boundaries)."""
    x_BLD = yield x_BLD
    h_BLD = _enter(self.attn, comms, self.attn_norm(x_BLD, comms))
    out_BLD = _leave(self.attn, comms, self.attn(h_BLD, positions, inv_freq, comms))
    # Outputs are named once out of the tensor-parallel region: `selective` keeps the reduced
    # sums (1/t of them under SP), so recomputing the MLP's norm input redoes no all-reduce.
    out_BLD = checkpoint_name(out_BLD, "attn_out")
    h_BLD, x_BLD = self.mlp_norm(out_BLD, comms, residual_BLD=x_BLD)  # add + norm in one pass
    h_BLD = _enter(self.mlp, comms, h_BLD)
    out_BLD, stats = yield from (self.mlp.in_phases(h_BLD, comms) if isinstance(self.mlp, MoE)
                                 else phases.finished(self.mlp(h_BLD, comms)))
    return x_BLD + checkpoint_name(_leave(self.mlp, comms, out_BLD), "mlp_out"), stats

  def cached(self, x_BLD, positions_BL, inv_freq, cache: kv_cache.Cache, layer: jax.Array,
             prefill: bool) -> tuple[jax.Array, kv_cache.Cache]:
    """The block for generation: attention through layer `layer` of the KV cache (the
    attention module's `cached`), no seam (one device, or GSPMD-sharded weights)."""
    attn = self.attn
    if not isinstance(attn, CachedAttention):
      raise TypeError(f"{type(attn).__name__} cannot run through a KV cache (no `cached`)")
    out_BLD, cache = attn.cached(self.attn_norm(x_BLD), positions_BL, inv_freq, cache, layer,
                                 prefill)
    x_BLD = x_BLD + out_BLD
    out_BLD, _ = self.mlp(self.mlp_norm(x_BLD), LOCAL)
    return x_BLD + out_BLD, cache


class MoeGroup(nnx.Module):
  """`moe.every` = k consecutive layers: k-1 dense blocks (stacked on `sublayers`), then one
  MoE block. The model stacks groups on `layers`, so the layer scan stays homogeneous."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, **modules):
    if cfg.moe is None:
      raise ValueError("a group of MoE layers needs model.moe")
    every, dense_cfg = cfg.moe.every, dataclasses.replace(cfg, moe=None)

    @nnx.split_rngs(splits=every - 1)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
    def make_dense(rngs):
      return Block(dense_cfg, rngs, **modules)

    self.dense = make_dense(rngs)
    self.dense_count = every - 1
    self.scan_layers = cfg.scan_layers
    self.moe_block = Block(cfg, rngs, **modules)

  def __call__(self, x_BLD, positions: Positions, inv_freq, comms: Seam):
    return phases.run(self.in_phases(x_BLD, positions, inv_freq, comms))

  def in_phases(self, x_BLD, positions: Positions, inv_freq, comms: Seam
                ) -> phases.Phases[tuple[jax.Array, dict]]:
    """The group as phases: its input, its dense blocks in one, then the MoE block's."""
    x_BLD = yield x_BLD
    graphdef, stacked = nnx.split(self.dense)

    def dense(x_BLD, state):
      return nnx.merge(graphdef, state)(x_BLD, positions, inv_freq, comms)[0], None

    x_BLD, _ = jax.lax.scan(dense, x_BLD, stacked, unroll=not self.scan_layers)
    return (yield from self.moe_block.in_phases(x_BLD, positions, inv_freq, comms))

  def cached(self, x_BLD, positions_BL, inv_freq, cache: kv_cache.Cache, group: jax.Array,
             prefill: bool) -> tuple[jax.Array, kv_cache.Cache]:
    """`Block.cached` over the group's layers: cache layers group·k .. group·k + k-1."""
    graphdef, stacked = nnx.split(self.dense)
    every = self.dense_count + 1
    first = group * every

    def dense(carry, inputs):
      x_BLD, cache = carry
      state, j = inputs
      return nnx.merge(graphdef, state).cached(x_BLD, positions_BL, inv_freq, cache, first + j,
                                               prefill), None

    (x_BLD, cache), _ = jax.lax.scan(dense, (x_BLD, cache),
                                     (stacked, jnp.arange(self.dense_count)),
                                     unroll=not self.scan_layers)
    return self.moe_block.cached(x_BLD, positions_BL, inv_freq, cache, first + every - 1,
                                 prefill)


class Llama(nnx.Module):
  """Decoder-only Llama. `model(tokens_BL)` returns fp32 logits [B, L, vocab].

  `attention` / `mlp`: the blocks' module classes (`Block`); `dot_general`: the product of every
  linear layer and of the head (default `jax.lax.dot_general`), or a per-layer factory
  (`matmul.for_linear`; e.g. FP8 on chosen layers, `jscale.fp8`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *,
               attention: type[AttentionModule] | None = None,
               mlp: type[MlpModule] | None = None,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    self.cfg = cfg
    self.head_dot = matmul.for_linear(dot_general, "lm_head")
    self.expert_columns_e4m3 = matmul.expert_columns_e4m3(dot_general)
    if isinstance(self.head_dot, nnx.Module):
      raise ValueError("the head's product must be a plain function (jnp.einsum's static hook)")
    modules = dict(attention=attention, mlp=mlp, dot_general=dot_general)
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pd)

    every = cfg.moe.every if cfg.moe is not None else 1
    if cfg.first_dense:
      dense = dict(modules, mlp=None)

      @nnx.split_rngs(splits=cfg.first_dense)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
      def make_dense(rngs):
        return Block(dataclasses.replace(cfg, moe=None), rngs, **dense)

      self.dense_blocks = make_dense(rngs)

    @nnx.split_rngs(splits=cfg.stack_layers // every)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
      return Block(cfg, rngs, **modules) if every == 1 else MoeGroup(cfg, rngs, **modules)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.dtype, pd, impl=cfg.norm_impl,
                              interpret=cfg.kernel_interpret)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                           cfg.init_std, pd)
    if cfg.mtp is not None:

      @nnx.split_rngs(splits=cfg.mtp.depth)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
      def make_mtp(rngs):
        return MtpModule(cfg, rngs, Block, **modules)

      self.mtp = make_mtp(rngs)

  def __call__(self, tokens_BL: jax.Array, positions: Positions | jax.Array | None = None, *,
               comms: Seam = LOCAL, remat: str = "none") -> jax.Array:
    return self.forward(tokens_BL, positions, comms=comms, remat=remat)[0]

  def forward(self, tokens_BL: jax.Array, positions: Positions | jax.Array | None = None, *,
              comms: Seam = LOCAL, remat: str = "none") -> tuple[jax.Array, dict]:
    """(fp32 logits [B, L, V], MoE router statistics averaged over layers; {} if dense)."""
    x_BLD, stats, embed_VD = self.trunk(tokens_BL, positions, comms=comms, remat=remat)
    return self.logits(x_BLD, comms, embed_VD), stats

  def trunk(self, tokens_BL: jax.Array, positions: Positions | jax.Array | None = None, *,
            comms: Seam = LOCAL, remat: str = "none",
            turns: layer_microbatches.Turns = layer_microbatches.WHOLE
            ) -> tuple[jax.Array, dict, jax.Array]:
    """Embedding and layers: (hidden states [B, L, D] before the final norm, MoE statistics,
    the embedding table in the compute dtype, which a tied head reuses). `positions`: the
    tokens' (`positions.resolve`: None for tokens in order, one document per row);
    `turns`: how each layer takes the batch (`layer_microbatches`)."""
    positions = positions_lib.resolve(positions, tokens_BL.shape)
    # Weights outside the layer stack also go through the seam (ZeRO-3 stores them as shards).
    # They are gathered once per step: the embedding's backward (a scatter-add) does not need
    # the table, and the head's backward runs right after its forward.
    embed_VD = comms.gather_params(self.embed, self.cfg.dtype)[...]
    x_BLD = self.dense_prefix(self.embed_tokens(tokens_BL, comms, embed_VD), positions,
                              comms, remat, turns)
    graphdef, weights, dot_state = nnx.split(self.blocks, nnx.Param, ...)
    x_BLD, stats = run_layers(graphdef, weights, x_BLD, positions, self.cfg, comms, remat,
                              with_stats=True, dot_state=dot_state, turns=turns,
                              e4m3_experts=self.expert_columns_e4m3)
    return x_BLD, stats, embed_VD

  def cached_hidden(self, tokens_BL: jax.Array, positions_BL: jax.Array,
                    cache: kv_cache.Cache, prefill: bool
                    ) -> tuple[jax.Array, kv_cache.Cache]:
    """Generation's forward (one device or GSPMD-sharded; `jscale.model.kv_cache`): hidden
    states [B, L, D] before the final norm (`logits` takes them), and the cache with these
    tokens' K / V stored. `prefill`: the tokens are positions 0..L-1 of every row."""
    embed_VD = self.embed[...].astype(self.cfg.dtype)
    x_BLD = self.embed_tokens(tokens_BL, LOCAL, embed_VD)
    inv_freq = rope.for_model(self.cfg)
    first = 0
    for stack in ([self.dense_blocks] if self.cfg.first_dense else []) + [self.blocks]:
      graphdef, weights, rest = nnx.split(stack, nnx.Param, ...)

      def layer(carry, inputs):
        x_BLD, cache = carry
        w, r, index = inputs
        return nnx.merge(graphdef, w, r).cached(x_BLD, positions_BL, inv_freq, cache, index,
                                                prefill), None

      n = jax.tree.leaves(weights)[0].shape[0]
      (x_BLD, cache), _ = jax.lax.scan(layer, (x_BLD, cache),
                                       (weights, rest, first + jnp.arange(n)),
                                       unroll=not self.cfg.scan_layers)
      first += n
    return x_BLD, cache

  def dense_prefix(self, x_BLD: jax.Array, positions: Positions, comms: Seam = LOCAL,
                   remat: str = "none",
                   turns: layer_microbatches.Turns = layer_microbatches.WHOLE) -> jax.Array:
    """The leading dense layers (`model.moe.first_dense`; identity without), a scan whose
    weights are gathered once per call (ZeRO-3), like the embedding's. `positions`: the
    whole sequence's (under SP `x_BLD` holds a part of it)."""
    if not self.cfg.first_dense:
      return x_BLD
    graphdef, weights, rest = nnx.split(self.dense_blocks, nnx.Param, ...)
    weights = comms.gather_params(weights, self.cfg.dtype)
    inv_freq = rope.for_model(self.cfg)

    def block(inputs, part):
      return nnx.merge(graphdef, *inputs).in_phases(part[0], part[1], inv_freq, comms)

    def layer(x_BLD, inputs):
      x_BLD = remat_lib.layer_input(x_BLD, remat)
      return layer_microbatches.over_microbatches(block, inputs, (x_BLD, positions), turns,
                                                  remat, self.cfg)[0], None

    layer = layer_microbatches.outer(layer, remat, turns.n, self.cfg)
    with jax.named_scope("dense_prefix"):
      return jax.lax.scan(layer, x_BLD, (weights, rest),
                          unroll=not self.cfg.scan_layers)[0]

  def mtp_hidden(self, x_BLD: jax.Array, labels_BL: jax.Array,
                 positions: Positions | jax.Array | None = None, comms: Seam = LOCAL,
                 remat: str = "none", embed_VD: jax.Array | None = None,
                 turns: layer_microbatches.Turns = layer_microbatches.WHOLE
                 ) -> list[jax.Array]:
    """The multi-token prediction modules' outputs (`jscale.model.mtp`), one [B, L, D] per
    depth d = 1..D, after their final norms: what the shared head reads to predict token
    t+1+d. `x_BLD`: the trunk's output (before the final norm); `turns`: how each module
    takes the batch (`layer_microbatches`)."""
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    if cfg.mtp is None:
      raise ValueError("multi-token prediction needs model.mtp")
    # From the labels' shape: under SP x_BLD holds 1/t of the sequence.
    positions = positions_lib.resolve(positions, labels_BL.shape)
    if embed_VD is None:
      embed_VD = comms.gather_params(self.embed, dt)[...]
    norm_graphdef, norm_state = nnx.split(self.final_norm)
    h_BLD = nnx.merge(norm_graphdef, comms.gather_params(norm_state, dt))(x_BLD, comms)
    graphdef, weights, rest = nnx.split(self.mtp, nnx.Param, ...)
    weights = comms.gather_params(weights, dt)
    inv_freq = rope.for_model(cfg)

    def module(state, part):
      h_BLD, e_BLD, positions = part
      return phases.finished((nnx.merge(graphdef, *state)(h_BLD, e_BLD, positions, inv_freq,
                                                          comms), {}))

    def depth(h_BLD, inputs):
      w, r, tokens_BL = inputs
      part = (remat_lib.layer_input(h_BLD, remat), self.embed_tokens(tokens_BL, comms, embed_VD),
              positions)
      return layer_microbatches.over_microbatches(module, (w, r), part, turns, remat, cfg)[0]

    depth = layer_microbatches.outer(depth, remat, turns.n, cfg)
    out = []
    with jax.named_scope("mtp"):
      for d in range(cfg.mtp.depth):  # module d+1 embeds t_{i+d+1}: the label of i+d
        h_BLD = depth(h_BLD, jax.tree.map(lambda a: a[d], (weights, rest)) +
                      (shift(labels_BL, d),))
        out.append(h_BLD)
    return out

  def embed_tokens(self, tokens_BL: jax.Array, comms: Seam = LOCAL,
                   embed_VD: jax.Array | None = None) -> jax.Array:
    """Token embeddings [B, L, D] in the compute dtype (the pipeline's first chunk)."""
    dt = jnp.dtype(self.cfg.dtype)
    if embed_VD is None:
      embed_VD = comms.gather_params(self.embed, dt)[...]
    with jax.named_scope("embed"):
      x_BLD = comms.embed(embed_VD, tokens_BL).astype(dt)
      return comms.activation(x_BLD, ("batch", "res_seq", "embed"))

  @property
  def head_stored(self) -> tuple[str, str]:
    """The head weight's dim names in its stored order: [embed, vocab], or tied [vocab, embed]
    (`jscale.step.loss` lays the head's gradient out as the weight is stored)."""
    return ("vocab", "embed") if self.cfg.tie_embeddings else ("embed", "vocab")

  def head_inputs(self, x_BLD: jax.Array, comms: Seam = LOCAL,
                  embed_VD: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The head's operands: final-normed hidden states [B, L, D] (entering the tensor-parallel
    region) and the head weight [D, V], both in the compute dtype (`jscale.step.loss` multiplies
    them, whole or in chunks of tokens, with `self.head_dot`)."""
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    with jax.named_scope("head"):
      norm_graphdef, norm_state = nnx.split(self.final_norm)
      final_norm = nnx.merge(norm_graphdef, comms.gather_params(norm_state, dt))
      h_BLD = comms.enter_tensor_parallel(final_norm(x_BLD, comms))
      if cfg.tie_embeddings:
        table_VD = (embed_VD if embed_VD is not None
                    else comms.gather_params(self.embed, dt)[...])
        head_DV = table_VD.T
      else:
        head_DV = comms.gather_params(self.lm_head, dt)[...]
    return h_BLD.astype(dt), head_DV.astype(dt)

  def logits(self, x_BLD: jax.Array, comms: Seam = LOCAL,
             embed_VD: jax.Array | None = None) -> jax.Array:
    """Final norm and head: fp32 logits [B, L, V] (bf16 operands, in the backward too)."""
    h_BLD, head_DV = self.head_inputs(x_BLD, comms, embed_VD)
    with jax.named_scope("head"):
      logits_BLV = matmul.einsum_f32("BLD,DV->BLV", h_BLD, head_DV, self.cfg.dtype,
                                     self.head_dot)
    return comms.activation(logits_BLV, ("batch", "seq", "vocab"))


def run_layers(block_graphdef: nnx.GraphDef, stacked, x_BLD: jax.Array, positions: Positions,
               cfg: ModelConfig, comms: Seam = LOCAL, remat: str = "none",
               with_stats: bool = False, dot_state=None, unroll: bool = False,
               turns: layer_microbatches.Turns = layer_microbatches.WHOLE,
               e4m3_experts: bool = False):
  """The blocks of `stacked` (weights with a leading layers axis: the whole stack, or one
  pipeline chunk of it) applied in order, as a scan of rematerialised layers. With
  `with_stats`, also the blocks' MoE router statistics averaged over the layers. `dot_state`:
  the layers' `matmul.DotState` (stacked likewise; FP8's amax histories), scanned beside the
  weights but never gathered or cast. `unroll`: the layers as straight-line code, not a loop
  (a pipeline's forward + backward pairs, whose halves XLA can only interleave so), as
  `model.scan_layers: false` asks of every stack. `turns`: each layer runs the batch's
  micro-batches in turn (`layer_microbatches`, `train.accumulate: layer`). `e4m3_experts`:
  the routed experts' forward products quantise their weights per column
  (`matmul.expert_columns_e4m3`), so a prefetching forward may gather them so."""
  dt = jnp.dtype(cfg.dtype)
  inv_freq = rope.for_model(cfg)
  depth = jax.tree.leaves(stacked)[0].shape[0]

  def block(weights, dots, part):
    return nnx.merge(block_graphdef, weights, *dots).in_phases(part[0], part[1], inv_freq,
                                                                comms)

  def layer(x_BLD, inputs):
    weights, dots = inputs
    x_BLD = remat_lib.layer_input(x_BLD, remat)
    return layer_microbatches.over_microbatches(
        lambda w, part: block(w, dots, part), weights, (x_BLD, positions), turns, remat, cfg,
        gather=lambda w: comms.gather_layer(w, dt, depth))

  layer = layer_microbatches.outer(layer, remat, turns.n, cfg)
  dots = () if dot_state is None else (dot_state,)
  stored = comms.layer_inputs(stacked)
  chunks = comms.layer_chunks(jax.tree.map(lambda a: a[0], stored), dt, turns.trips,
                              e4m3_experts)
  with jax.named_scope("layers"):
    if turns.prefetch and chunks is not None and not unroll and cfg.scan_layers:
      x_BLD, stats = layer_prefetch.scan(
          block, stored, dots, x_BLD, positions, turns, remat, cfg,
          lambda w: comms.gather_layer(w, dt, depth), chunks)
    else:
      x_BLD, stats = jax.lax.scan(layer, x_BLD, (stored, dots),
                                  unroll=unroll or not cfg.scan_layers)
  if not with_stats:
    return x_BLD
  return x_BLD, jax.tree.map(lambda v: jnp.mean(v, axis=0), stats)


def create(cfg: ModelConfig, seed: int = 0, **modules) -> Llama:
  """A randomly initialised model; `modules`: `Llama`'s attention / mlp / dot_general."""
  return Llama(cfg, nnx.Rngs(params=seed), **modules)
