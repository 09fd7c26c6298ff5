"""The gradient taken with respect to compute-dtype copies of the layer stacks' matrices.

The model keeps fp32 master weights and casts each to the compute dtype (`model.dtype`) where a
layer uses it, so every layer's product makes its weight's gradient in bf16 and autodiff
converts it to fp32 at the cast. Under the layer scan that conversion writes each stack's whole
fp32 gradient (zeroed first, then layer by layer), which the global norm and Adam then read.
The step differentiates with respect to bf16 copies of the stacked matrices instead: the same
gradient values (each is one product's bf16 output), kept in bf16 until the optimizer's fusions
read them, so half the bytes are zeroed, written and read twice. On the DeepSeek-V3 16B proxy,
XLA:GPU's step is predicted 2.6 ms (2.5%) shorter. The train state keeps the copies across
steps (`KEY`, Megatron's bf16 parameters beside its fp32 main ones): each update writes the
next ones in Adam's own pass over the masters, where a cast at the step's start read the fp32
masters again (6 bytes a parameter where 2 do): the proxy 103.6 -> 101.4 ms predicted, 0.4 GiB
more at its peak. Checkpoints hold the masters only; a restore casts the copies from them.

Exact for a weight that the step casts whole once and whose uses all read that one cast: every
matrix of a layer stack (ndim >= 3: a leading layers axis) except the MoE router's, whose
logits are fp32 on purpose (`matmul.FP32_MATMULS`), and the untied head (`HEAD`: the main and
MTP losses read the one bf16 head `Llama.head_inputs` casts, so their gradients already sum in
bf16 before the cast's transpose; kept, its cast of 0.84 GB of fp32 a step on the DeepSeek-V3
16B proxy is gone, 0.42 ms on an H100). Left fp32: the router, norm scales and the balancing
bias (2-D stacks), the embedding (its gradient sums over tokens in a scatter), and all
weights under FP8 (its scales are the fp32 masters' amaxes).
Gradients are converted to fp32 before any accumulation or data-parallel sum
(`accumulate.accumulate_grads`), except where the backward itself sums a layer's gradient over
devices in the dtype it is made in: ZeRO-2 over fsdp reduce-scatters each layer's fp32
gradient there, so it differentiates the masters (`applies`). So does ZeRO-3, which casts
each layer's shard before gathering it already: there the copies gained 0.7% of an 8B-shaped
step on 8 H100s, and held through the step they gave XLA:GPU's scheduler under predicted
costs 6% more memory (tests/predict/test_schedule_costs.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jscale.config import MeshConfig
from jscale.model import router


def applies(fp8: bool, zero_stage: int, fsdp: int, stages: int) -> bool:
  """Whether the step differentiates compute copies (see the module docstring): not under FP8
  (`fp8.enabled`), nor ZeRO-2/3 over fsdp > 1, nor in a pipeline (`stages` > 1), whose executor
  differentiates each chunk's masters."""
  return not fp8 and not (zero_stage >= 2 and fsdp > 1) and stages == 1


def fsdp_of(mesh: MeshConfig) -> int:
  """The fsdp degree `applies` weighs: within and across nodes (`mesh.fsdp * mesh.dcn_fsdp`);
  -1, all the devices the other axes leave, counts as more than one."""
  return 2 if mesh.fsdp == -1 else mesh.fsdp * mesh.dcn_fsdp


# The untied head's parameter name (`Llama.lm_head`): copied beside the layer stacks.
HEAD = "lm_head"


def copied(path: tuple, leaf: jax.Array) -> bool:
  """Whether `compute_copies` casts the parameter at `path` (a pytree key path)."""
  keys = [str(getattr(k, "key", k)) for k in path]
  return (leaf.ndim >= 3 and router.WEIGHT not in keys) or keys == [HEAD]


def compute_copies(params: dict, dtype: Any) -> dict:
  """`params` with each `copied` leaf cast to the compute `dtype`: what the step differentiates
  with respect to where the state keeps no copies (a no-op where `dtype` is the parameters'
  own)."""
  return merged(params, stored(params, dtype))


# The copies kept across steps: the train state's "copies" (`init_state`), written by each
# step's update from the new masters, in the same fusion as Adam's (one pass over the weights
# where a cast at the next step's start reads the fp32 masters again: 4 bytes a parameter less).
# Never checkpointed: restored states get them cast from the masters (`state.from_saved`).
KEY = "copies"


def stored(params: dict, dtype: Any) -> dict:
  """The `copied` leaves of `params` (a pure nested dict) cast to `dtype`, in a nested dict
  holding only them: the train state's "copies"."""
  def pick(path: tuple, node: Any) -> Any:
    if not isinstance(node, dict):
      return node.astype(dtype) if copied(path, node) else None
    held = {k: pick(path + (jax.tree_util.DictKey(k),), v) for k, v in node.items()}
    held = {k: v for k, v in held.items() if v is not None}
    return held or None
  return pick((), params) or {}


def merged(params: dict, copies: dict) -> dict:
  """`params` with each leaf that `copies` holds replaced by its copy (what the step
  differentiates)."""
  return {k: (merged(v, copies[k]) if isinstance(v, dict) else copies[k]) if k in copies else v
          for k, v in params.items()}


def kept(fp8: bool, zero_stage: int, fsdp: int, stages: int, dtype: Any) -> bool:
  """Whether the train state keeps the copies: where the step differentiates them (`applies`)
  and the compute dtype is not the masters' fp32."""
  return applies(fp8, zero_stage, fsdp, stages) and jnp.dtype(dtype) != jnp.float32
