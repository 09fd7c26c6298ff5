"""SwiGLU MLP (Llama's): down(silu(gate(x)) * up(x)).

One of the block's swappable MLP modules (`jscale.model.llama.Block`; `jscale.model.moe.MoE` is
the other): constructed as `Mlp(cfg, rngs, dot_general=...)` (each linear's product is
`matmul.for_linear(dot_general, <weight name>)`), called as
`(h_BLD, comms) -> (out_BLD, stats)` on the normed input inside the tensor-parallel region;
`out_BLD` is the row-parallel partial sum the block takes out of the region, `stats` the
module's statistics averaged over layers by the model (none here).

Shape suffixes: B batch, L sequence, D d_model, F mlp hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jscale.config import ModelConfig
from jscale.model import matmul
from jscale.model.layers import einsum, param
from jscale.model.seam import Seam


class Mlp(nnx.Module):
  """Gate and up projections D -> F (column-parallel), down F -> D (row-parallel)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs,
               dot_general: matmul.DotGeneral = jax.lax.dot_general):
    d, f = cfg.d_model, cfg.d_ff
    pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
    self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std, pd)
    self.w_up = param(rngs, (d, f), ("embed", "mlp"), std, pd)
    self.w_down = param(rngs, (f, d), ("mlp", "embed"), std, pd)
    self.dtype = cfg.dtype
    self.w_gate_dot, self.w_up_dot, self.w_down_dot = (
        matmul.for_linear(dot_general, n) for n in ("w_gate", "w_up", "w_down"))

  def __call__(self, h_BLD: jax.Array, comms: Seam) -> tuple[jax.Array, dict[str, jax.Array]]:
    dt, c = self.dtype, comms
    gate_BLF = checkpoint_name(einsum("BLD,DF->BLF", h_BLD, self.w_gate, dt, self.w_gate_dot, c),
                               "mlp_gate")
    up_BLF = checkpoint_name(einsum("BLD,DF->BLF", h_BLD, self.w_up, dt, self.w_up_dot, c),
                             "mlp_up")
    gate_BLF = comms.activation(gate_BLF, ("batch", "seq", "mlp"))
    up_BLF = comms.activation(up_BLF, ("batch", "seq", "mlp"))
    out_BLD = einsum("BLF,FD->BLD", jax.nn.silu(gate_BLF) * up_BLF, self.w_down, dt,
                     self.w_down_dot, c)
    return out_BLD, {}  # a partial sum under TP: the block names it "mlp_out" once reduced
