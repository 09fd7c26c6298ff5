"""SwiGLU MLP (Llama's): down(silu(gate(x)) * up(x)).

One of the block's swappable MLP modules (`jscale.model.llama.Block`; `jscale.model.moe.MoE` is
the other): constructed as `Mlp(cfg, rngs, dot_general=...)` (each linear's product is
`matmul.for_linear(dot_general, <weight name>)`), called as
`(h_BLD, comms) -> (out_BLD, stats)` on the normed input; it enters and leaves the
tensor-parallel region itself (`seam.EntersTensorParallel`: `comms.tp_column` for gate / up,
`comms.tp_row` for down), so `out_BLD` is reduced; `stats` are the module's statistics
averaged over layers by the model (none here).

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
from jscale.model.seam import EntersTensorParallel, Seam


class Mlp(EntersTensorParallel, nnx.Module):
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
    gate_BLF, up_BLF = comms.tp_column(h_BLD, [
        lambda h: einsum("BLD,DF->BLF", h, self.w_gate, dt, self.w_gate_dot, c),
        lambda h: einsum("BLD,DF->BLF", h, self.w_up, dt, self.w_up_dot, c)])
    gate_BLF = comms.activation(checkpoint_name(gate_BLF, "mlp_gate"), ("batch", "seq", "mlp"))
    up_BLF = comms.activation(checkpoint_name(up_BLF, "mlp_up"), ("batch", "seq", "mlp"))
    out_BLD = comms.tp_row(jax.nn.silu(gate_BLF) * up_BLF, lambda a: einsum(
        "BLF,FD->BLD", a, self.w_down, dt, self.w_down_dot, c))
    return out_BLD, {}  # reduced: the block names it "mlp_out"
