"""Mixture-of-experts MLP: a softmax top-k router over SwiGLU experts (Mixtral), optionally with
an always-on shared expert, plus the router's load-balancing and z losses. `moe.router:
sigmoid` (or groups) routes as DeepSeek-V3 does (`jscale.model.router`: group-limited top-k,
a balancing bias, scaled gates, the sequence-wise balance loss).

Tokens are routed in groups (`Seam.expert_groups`: one per batch shard), and the experts run
through the model's seam (`Seam.experts`): without a mesh (`LOCAL`), in manual mode, and in
xla mode with the experts not split (per device, in a shard_map) the dropless path sorts
assignments and runs grouped matmuls (`model.moe.gemm`: ragged_dot or the Hopper Pallas
kernel, `moe_gemm`); in manual mode with `mesh.expert` > 1 the rows go to the devices holding
their experts by all-to-all; in xla mode with `mesh.expert` or `mesh.tensor` > 1 the dispatch
is a GShard slot buffer (dropless: one slot per token and expert) whose expert dim XLA
reshards over `expert`.

Shape suffixes: B batch, L sequence, D model, F expert hidden, E experts, K experts per token,
G token groups, T tokens per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.config import ModelConfig
from jscale.model import matmul, moe_dispatch, moe_gemm, phases, router
from jscale.model.layers import einsum, param
from jscale.model.moe_dispatch import ExpertWeights
from jscale.model.seam import GATHERED, Seam


def route(logits_GTE: jax.Array, k: int):
  """(router probabilities, top-k expert ids, gates): the softmax over all experts, its k
  largest entries, renormalised to sum to one (Mixtral's routing)."""
  probs_GTE = jax.nn.softmax(logits_GTE, axis=-1)
  top_GTK, ids_GTK = jax.lax.top_k(probs_GTE, k)
  return probs_GTE, ids_GTK, top_GTK / jnp.sum(top_GTK, axis=-1, keepdims=True)


def router_losses(logits_GTE, probs_GTE, ids_GTK, comms: Seam) -> dict[str, jax.Array]:
  """Switch load-balancing loss E · Σ_e f_e · P_e (f_e: share of the T·K assignments routed to
  e, P_e: mean router probability of e; 1.0 when perfectly balanced), the ST-MoE z-loss
  mean(logsumexp(logits)²), and the per-expert load f_e, all over every token of the batch
  (`comms.token_sum` adds the other devices' tokens)."""
  e, k = logits_GTE.shape[-1], ids_GTK.shape[-1]
  n = comms.token_sum(jnp.asarray(probs_GTE.shape[0] * probs_GTE.shape[1], jnp.float32))
  counts_E = jnp.sum(jax.nn.one_hot(ids_GTK, e, dtype=jnp.float32), axis=(0, 1, 2))
  load_E = jax.lax.stop_gradient(comms.token_sum(counts_E)) / (n * k)
  mean_prob_E = comms.token_sum(jnp.sum(probs_GTE, axis=(0, 1))) / n
  lse_GT = jax.nn.logsumexp(logits_GTE, axis=-1)
  return {"aux_loss": e * jnp.sum(load_E * mean_prob_E),
          "z_loss": comms.token_sum(jnp.sum(jnp.square(lse_GT))) / n, "expert_load": load_E}


def with_objective(stats: dict[str, jax.Array], moe) -> dict[str, jax.Array]:
  """`stats` plus "moe_loss": the router losses weighted as the config asks (`moe`: the
  MoeConfig), the term added to the mean token loss."""
  return {**stats, "moe_loss": (moe.aux_loss_weight * stats["aux_loss"] +
                                moe.z_loss_weight * stats["z_loss"] +
                                moe.seq_aux_loss_weight * stats.get("seq_aux_loss", 0.0))}


def gate_up_param(rngs: nnx.Rngs, e: int, d: int, f: int, std: float, dtype) -> nnx.Param:
  """The experts' gate and up projections as one [E, D, 2, F] parameter (Megatron's fused
  linear_fc1, transformers' gate_up_proj): a layer's slice of the stack is the grouped matmul's
  [gate | up] operand as it lies ([E, D, 2F], gate columns first), read in place by XLA's
  dynamic-slice fusion where a concatenation of two stacks was a copy per use (2.45 ms a step
  of the DeepSeek-V3 16B proxy compiled by jax 0.11.2 for an H100, predicted). Tensor
  parallelism splits F, so every device's slice is its [gate | up] columns. Drawn as the two
  [E, D, F] matrices were, gate then up: the same initial values."""
  gate, up = (param(rngs, (e, d, f), ("experts", "embed", "mlp"), std, dtype)[...]
              for _ in range(2))
  return nnx.Param(jnp.stack([gate, up], axis=2),
                   out_sharding=moe_dispatch.GATE_UP_AXES, eager_sharding=False)


class MoE(nnx.Module):
  """Routed SwiGLU experts (stacked on a logical `experts` axis) and an optional shared one.

  The block's MLP when `model.moe` is set (`Mlp`'s call signature). `dot_general` gives the
  shared expert's products (`matmul.for_linear`); the routed experts' grouped matmuls run in
  the seam (`Seam.experts`) and the router in fp32 on purpose (`matmul.FP32_MATMULS`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    m, d = cfg.moe, cfg.d_model
    if m is None:
      raise ValueError("an MoE layer needs model.moe (set model.moe.n_experts)")
    e, f = m.n_experts, m.d_ff or cfg.d_ff
    pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
    self.router = param(rngs, (d, e), ("embed", "router"), std, pd)
    if m.router == "sigmoid":  # DeepSeek's balancing bias: fp32, never split, not trained
      setattr(self, router.BIAS, nnx.Param(jnp.zeros((e,), jnp.float32),
                                           out_sharding=("expert_bias",), eager_sharding=False))
    self.w_gate_up = gate_up_param(rngs, e, d, f, std, pd)
    self.w_down = param(rngs, (e, f, d), moe_dispatch.DOWN_AXES, std, pd)
    if m.shared_d_ff:
      fs = m.shared_d_ff
      self.shared_gate = param(rngs, (d, fs), ("embed", "mlp"), std, pd)
      self.shared_up = param(rngs, (d, fs), ("embed", "mlp"), std, pd)
      self.shared_down = param(rngs, (fs, d), ("mlp", "embed"), std, pd)
      self.shared_gate_dot, self.shared_up_dot, self.shared_down_dot = (
          matmul.for_linear(dot_general, n) for n in ("shared_gate", "shared_up", "shared_down"))
    self.cfg, self.dtype = m, cfg.dtype
    self.kernel_interpret = cfg.kernel_interpret
    self.expert_products = matmul.for_experts(dot_general)
    self.expert_kernel = matmul.for_expert_kernel(dot_general)

  def __call__(self, h_BLD: jax.Array, comms: Seam) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`h_BLD`: the normed input (inside the tensor-parallel region). Returns the experts'
    partial output (to leave the region like a row-parallel linear's) and router statistics."""
    return phases.run(self.in_phases(h_BLD, comms))

  def in_phases(self, h_BLD: jax.Array, comms: Seam
                ) -> phases.Phases[tuple[jax.Array, dict[str, jax.Array]]]:
    """The call as phases (`jscale.model.phases`): the seam's exchange boundaries."""
    b, l, d = h_BLD.shape
    g = comms.expert_groups(b)
    h_GTD = comms.activation(h_BLD.reshape(g, b // g * l, d), ("batch", None, "embed"))
    with matmul.fp32_scope("router"):
      logits_GTE = jnp.einsum("GTD,DE->GTE", comms.router_input(h_GTD).astype(jnp.float32),
                              self.router[...].astype(jnp.float32))
    if self.cfg.router == "softmax" and self.cfg.n_group == 1:
      probs_GTE, ids_GTK, gates_GTK = route(logits_GTE, self.cfg.top_k)
      scores_GTE = probs_GTE
    else:
      bias = getattr(self, router.BIAS, None)
      scores_GTE, ids_GTK, gates_GTK = router.route(logits_GTE, None if bias is None
                                                    else bias[...], self.cfg)
      probs_GTE = router.normalized(scores_GTE)
    stats = router_losses(logits_GTE, probs_GTE, ids_GTK, comms)
    if self.cfg.seq_aux_loss_weight:
      stats["seq_aux_loss"] = router.sequence_balance_loss(
          scores_GTE.reshape(b, l, -1), ids_GTK.reshape(b, l, -1), comms)
    # Cast in the seam's view (not saved by remat policies, like the dense layers' weights).
    w = ExpertWeights(*(checkpoint_name(x[...].astype(self.dtype), GATHERED)
                        for x in (self.w_gate_up, self.w_down)))
    e, d, _, f = self.w_gate_up.shape  # this device's (manual tensor parallelism: its slice)
    grouped = moe_gemm.for_model(self.cfg.gemm, self.dtype, d, f, e, self.kernel_interpret,
                                 self.expert_products, self.expert_kernel)
    y_GTD, dropped = yield from comms.expert_phases(h_GTD, ids_GTK, comms.expert_gates(gates_GTK),
                                                    w, self.cfg, self.dtype, grouped)
    n = comms.token_sum(jnp.asarray(b * l * self.cfg.top_k, jnp.float32))
    stats["dropped_fraction"] = comms.token_sum(dropped.astype(jnp.float32)) / n
    y_BLD = y_GTD.reshape(b, l, d)
    if self.cfg.shared_d_ff:
      dt, c = self.dtype, comms
      gate = checkpoint_name(einsum("BLD,DF->BLF", h_BLD, self.shared_gate, dt,
                                    self.shared_gate_dot, c), "mlp_gate")
      up = checkpoint_name(einsum("BLD,DF->BLF", h_BLD, self.shared_up, dt, self.shared_up_dot,
                                  c), "mlp_up")
      y_BLD = y_BLD + einsum("BLF,FD->BLD", jax.nn.silu(gate) * up, self.shared_down, dt,
                             self.shared_down_dot, c)
    return y_BLD, stats
