"""DeepSeek-V3's routing: sigmoid affinities, group-limited top-k on affinity + a balancing bias,
gates from the unbiased affinities, and the sequence-wise balance loss.

For each token t and expert e, s_te = sigmoid(u_t · w_e) (or, `moe.router: softmax` with
groups, DeepSeek-V2's softmax). The experts are chosen on s_te + b_e, b the per-expert bias
(`BIAS`, in the params, zero at init): with `n_group` groups of experts, a group scores the
sum of its two best biased affinities, the token keeps its best `topk_group` groups and picks
its top-k experts inside them (the playbook's node-limited routing when a group is a node's
experts). The gates are the chosen experts' unbiased s_te, renormalised to sum to one
(`norm_topk_prob`), times `routed_scaling_factor`.

Aux-loss-free balancing: b is not trained. Its cotangent is replaced by the number of this
layer's token assignments each expert received (`carry_load`), so the step's gradient
machinery sums the loads over micro-batches, pipeline stages and devices into a tree laid out
like the bias; the train step then moves b by `bias_update_rate` · sign(mean load - load)
(`jscale.step.router_bias`) instead of handing it to the optimizer.

The sequence-wise balance loss (DeepSeek-V3 eq. 17-20) per sequence: Σ_e f_e P_e with
f_e = E / (K·T) · #(tokens choosing e) and P_e = mean over tokens of s_te / Σ_e' s_te';
averaged over sequences. Under manual context parallelism a sequence's parts are summed over
`sequence` first (`Seam.sequence_sum`).

Shape suffixes: G token groups, T tokens per group, E experts, K experts per token, B
sequences, L tokens per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jscale.config import MoeConfig
from jscale.model.seam import Seam

BIAS = "router_bias"  # the bias's parameter name (the train step finds its leaves by it)
WEIGHT = "router"  # the router weight's (fp32 logits on purpose: `step.compute_copies`)


@jax.custom_vjp
def carry_load(scores_GTE: jax.Array, bias_E: jax.Array, load_E: jax.Array) -> jax.Array:
  """`scores_GTE` unchanged; in the backward, `bias_E`'s cotangent is `load_E` (the bias is
  moved by its load, not by a gradient). The scores' own gradient passes through: since the
  gates read them, the backward always reaches this function."""
  del bias_E, load_E
  return scores_GTE


def _carry_fwd(scores, bias, load):
  del bias  # fp32, as the load (`MoE` creates it so, and no gather casts it)
  return scores, load


def _carry_bwd(load, g):
  return g, load, jnp.zeros_like(load)


carry_load.defvjp(_carry_fwd, _carry_bwd)


def affinities(logits_GTE: jax.Array, moe: MoeConfig) -> jax.Array:
  """Token-to-expert affinities in fp32: sigmoid (DeepSeek-V3) or softmax."""
  if moe.router == "sigmoid":
    return jax.nn.sigmoid(logits_GTE)
  return jax.nn.softmax(logits_GTE, axis=-1)


def group_limited_top_k(choice_GTE: jax.Array, k: int, n_group: int,
                        topk_group: int) -> jax.Array:
  """[G, T, K] expert ids: each token's k best experts among its `topk_group` best groups (a
  group's score: the sum of its two best entries); n_group 1: plain top-k."""
  if n_group == 1:
    return jax.lax.top_k(choice_GTE, k)[1]
  *lead, e = choice_GTE.shape
  by_group = choice_GTE.reshape(*lead, n_group, e // n_group)
  group_score = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)
  _, groups = jax.lax.top_k(group_score, topk_group)
  keep = jnp.sum(jax.nn.one_hot(groups, n_group, dtype=jnp.bool_), axis=-2)
  masked = jnp.where(keep[..., None], by_group, -jnp.inf).reshape(choice_GTE.shape)
  return jax.lax.top_k(masked, k)[1]


def route(logits_GTE: jax.Array, bias_E: jax.Array | None, moe: MoeConfig):
  """(affinities [G, T, E], expert ids [G, T, K], gates [G, T, K]) for DeepSeek routing;
  with a bias, its cotangent is this call's per-expert assignment count (`carry_load`)."""
  scores_GTE = affinities(logits_GTE, moe)
  choice_GTE = jax.lax.stop_gradient(scores_GTE)
  if bias_E is not None:
    choice_GTE = choice_GTE + bias_E.astype(jnp.float32)
  ids_GTK = group_limited_top_k(choice_GTE, moe.top_k, moe.n_group, moe.topk_group)
  if bias_E is not None:
    load_E = jnp.zeros(bias_E.shape, jnp.float32).at[ids_GTK.reshape(-1)].add(1.0)
    scores_GTE = carry_load(scores_GTE, bias_E, load_E)
  gates_GTK = jnp.take_along_axis(scores_GTE, ids_GTK, axis=-1)
  if moe.norm_topk_prob:
    gates_GTK = gates_GTK / (jnp.sum(gates_GTK, axis=-1, keepdims=True) + 1e-20)
  return scores_GTE, ids_GTK, gates_GTK * moe.routed_scaling_factor


def normalized(scores_GTE: jax.Array) -> jax.Array:
  """Affinities as a distribution over experts (what the balance losses average)."""
  return scores_GTE / jnp.sum(scores_GTE, axis=-1, keepdims=True)


def sequence_balance_loss(scores_BLE: jax.Array, ids_BLK: jax.Array, comms: Seam) -> jax.Array:
  """DeepSeek-V3's sequence-wise balance loss, averaged over every sequence of the batch
  (1.0 when each sequence spreads its tokens evenly and its affinities uniformly)."""
  b, l, e = scores_BLE.shape
  k = ids_BLK.shape[-1]
  counts_BE = comms.sequence_sum(jnp.sum(jax.nn.one_hot(ids_BLK, e, dtype=jnp.float32),
                                         axis=(1, 2)))
  mass_BE = comms.sequence_sum(jnp.sum(normalized(scores_BLE), axis=1))
  tokens = comms.sequence_sum(jnp.asarray(l, jnp.float32))
  per_seq_B = jnp.sum(jax.lax.stop_gradient(counts_BE) * e / (k * tokens) * mass_BE / tokens,
                      axis=-1)
  return comms.token_sum(jnp.sum(per_seq_B)) / comms.token_sum(jnp.asarray(b, jnp.float32))
