"""Activation recomputation (playbook: "Activation recomputation"): what a layer keeps for its
backward, `train.remat`.

  * none: every intermediate is saved (but ZeRO-3's gathered weights, `GATHERED`, which the
    backward gathers again);
  * selective: the named matmul outputs (`SELECTIVE_SAVE`) and fused attention kernels'
    forward outputs (with the softmax statistics their backward reads); scores, softmax and
    pointwise ops are recomputed;
  * offload: what selective saves, moved to the host's pinned memory during the forward and
    back for the backward (`OFFLOAD_TO`): XLA:GPU copies them asynchronously beside the
    compute, so device memory holds what full remat does while the backward reruns only what
    selective reruns;
  * full: nothing; the backward reruns the layer's forward.
  * full_offload: full, with each layer's input (`LAYER_INPUT`) moved to the host's pinned
    memory during the forward and back for the layer's backward (MaxText's offloaded
    `decoder_layer_input`): device memory holds no layer's input but the few in flight.

The model wraps each layer of its scan in `checkpointed`; the planner's memory model reads
the same names (`jscale.plan.memory`).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

from jscale import jax_compat
from jscale.config import ModelConfig
from jscale.model import attention as attn_lib
from jscale.model.seam import GATHERED

# Matmul outputs kept by `remat: selective`; scores, softmax and pointwise ops are recomputed.
# "attn_lse" (ring attention's log-sum-exp) lets the backward ring run without a forward ring.
# MoE: the experts' input rows and output ("moe_in", "moe_out": dispatched, and before the
# gated combine) besides gate and up, and expert parallelism's exchanged per-expert counts
# ("moe_counts"), so the backward reruns no grouped matmul and no all-to-all, only the router,
# the sort and the gathers.
SELECTIVE_SAVE = ("q_proj", "k_proj", "v_proj", attn_lib.CP_EXCHANGED, "attn_ctx", "attn_lse",
                  "attn_out", "mlp_gate", "mlp_up", "mlp_out", "moe_in", "moe_out",
                  "moe_counts")


def _save_all_but_gathered(prim, *_, **params) -> bool:
  # Layout changes (sharding constraints, barriers) are cheap to redo and are not saved either:
  # the chain that gathers ZeRO-3 weights ends in them, and saving any link of it (XLA lays the
  # saved value out like its consumer, whole) would keep every layer's weights alive. In manual
  # mode the link is the all-gather over fsdp itself.
  if prim.name == "name":
    return params["name"] != GATHERED
  if prim.name == "all_gather":
    axes = params["axis_name"]
    return "fsdp" not in (axes if isinstance(axes, tuple) else (axes,))
  return prim.name not in ("sharding_constraint", "optimization_barrier")


def _attention_kernel_forward(prim, params) -> bool:
  # A fused attention kernel's forward (cuDNN's custom call; the Pallas flash kernels): its
  # outputs are the attention output and the softmax statistics the backward kernel reads.
  # Saving them spares the backward a second attention forward. (The kernels' output is not
  # also named "attn_ctx": the same values would be saved twice.)
  return (prim.name == "dot_product_attention_fwd_wrapper" or
          any("flash_attention_fwd" in name for name in jax_compat.kernel_names(prim, params)))


# Where `remat: offload` keeps what selective saves: the host's page-locked memory, which the
# GPU's copy engines reach without the CPU (jax's memory kind "pinned_host").
OFFLOAD_TO = "pinned_host"


def _selective(prim, params) -> bool:
  return _attention_kernel_forward(prim, params) or (
      prim.name == "name" and params["name"] in SELECTIVE_SAVE)


# The name a layer function gives its input under `full_offload` (`layer_input`).
LAYER_INPUT = "layer_input"


def layer_input(x: jax.Array, remat: str) -> jax.Array:
  """A layer function's input `x`, named for `full_offload`'s policy; as it is otherwise (a
  named copy would be one more residual under the policies that save names)."""
  return checkpoint_name(x, LAYER_INPUT) if remat == "full_offload" else x


def remat_policy(remat: str):
  """`train.remat` -> a jax.checkpoint policy for one layer.

  Every policy drops ZeRO-3's gathered weights (`GATHERED`); "none" saves everything else;
  "selective" the named matmul outputs and fused attention kernels' forward outputs; "offload"
  the same residuals, offloaded to host memory; "full_offload" the layer's input alone, in
  host memory.
  """
  if remat == "none":
    return _save_all_but_gathered
  if remat == "full":
    return jax.checkpoint_policies.nothing_saveable
  if remat == "selective":
    return lambda prim, *_, **params: _selective(prim, params)
  if remat == "offload":
    to_host = Offloadable(src="device", dst=OFFLOAD_TO)
    return lambda prim, *_, **params: to_host if _selective(prim, params) else Recompute
  if remat == "full_offload":
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device", offload_dst=OFFLOAD_TO)
  raise ValueError(f"train.remat={remat!r}: choose none, selective, offload, full or "
                   "full_offload")


def ordered_effects(cfg: ModelConfig) -> bool:
  """Whether the layers hold kernels run by JAX's Mosaic GPU interpreter (the MoE grouped
  matmul with model.kernel_interpret): ordered host callbacks, which jax.checkpoint cannot
  replay, so the layers run without it (validation asks for train.remat=none)."""
  return bool(cfg.kernel_interpret and cfg.moe is not None and cfg.moe.gemm == "pallas")


def checkpointed(layer: Callable, remat: str, cfg: ModelConfig) -> Callable:
  """`layer` under `remat`'s policy (`remat_policy`), or as it is where it cannot be
  rematerialised (`ordered_effects`). Inside the layer loop XLA cannot merge the backward's
  recomputation with the forward; unrolled (`model.scan_layers: false`) it could, and would
  keep what the policy drops, so there the recomputation is fenced off (`prevent_cse`)."""
  if ordered_effects(cfg):
    return layer
  return jax.checkpoint(layer, policy=remat_policy(remat), prevent_cse=not cfg.scan_layers)
