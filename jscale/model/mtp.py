"""Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules after the trunk, module d
(1-based) predicting token t+1+d from position t.

Module d at position i: h'_i = W [RMSNorm(Emb(t_{i+d})); RMSNorm(h^{d-1}_i)] (`eh_proj`,
[2D, D]), then one transformer block (the model's own kind: MLA / GQA attention, MoE or
dense MLP), then its own final RMSNorm; its output is h^d and its logits are the model's
head of h^d. h^0 is the trunk's output after the model's final norm, the hidden states the
main head reads. The embedding and the head are the model's (shared, not copied). Token
t_{i+d} is the label of position i+d-1 (`shift(labels, d-1)`); the target is
`shift(labels, d)`, masked where it falls past the window.

Training only: generation never calls them. Their loss, λ / D · Σ_d CE_d (each CE_d a sum
over the step's target tokens over the main loss's token count in the step, the paper's 1/T,
whatever the split into micro-batches), is added to the objective by the step
(`jscale.step.loss.mtp_terms`); their MoE blocks' router
statistics are not added to the metrics or the router losses (their balancing bias is still
moved by their loads).

Shape suffixes: B batch, L sequence, D d_model, X = 2D.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jscale.config import ModelConfig
from jscale.model import matmul
from jscale.model.layers import RMSNorm, einsum, param
from jscale.model.positions import Positions
from jscale.model.seam import Seam


def shift(x_BL: jax.Array, d: int) -> jax.Array:
  """x moved d positions left along the sequence, zero-filled: position i holds x[i + d]."""
  if d == 0:
    return x_BL
  return jnp.pad(x_BL[:, d:], ((0, 0), (0, d)))


class MtpModule(nnx.Module):
  """One depth: the two input norms, the projection, a block (`block(cfg, rngs, ...)`, the
  model's `Block`) and the module's final norm."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, block: Callable[..., nnx.Module],
               dot_general: matmul.DotGeneral = jax.lax.dot_general, **modules: Any):
    d, pd = cfg.d_model, jnp.dtype(cfg.param_dtype)
    norm = lambda: RMSNorm(d, cfg.norm_eps, cfg.dtype, pd, impl=cfg.norm_impl,
                           interpret=cfg.kernel_interpret)
    self.enorm, self.hnorm = norm(), norm()
    self.eh_proj = param(rngs, (2 * d, d), ("embed", "embed"), cfg.init_std, pd)
    self.block = block(cfg, rngs, dot_general=dot_general, **modules)
    self.norm = norm()
    self.dtype = cfg.dtype
    self.eh_dot = matmul.for_linear(dot_general, "eh_proj")

  def __call__(self, h_BLD: jax.Array, e_BLD: jax.Array, positions: Positions,
               inv_freq: jax.Array, comms: Seam) -> jax.Array:
    """h^d (after the module's final norm) from h^{d-1} and the embedded tokens t_{i+d}."""
    x_BLX = jnp.concatenate([self.enorm(e_BLD, comms), self.hnorm(h_BLD, comms)], axis=-1)
    x_BLD = einsum("BLX,XD->BLD", x_BLX, self.eh_proj, self.dtype, self.eh_dot, comms)
    x_BLD = comms.activation(x_BLD, ("batch", "res_seq", "embed"))
    x_BLD, _ = self.block(x_BLD, positions, inv_freq, comms)
    # RMSNorm returns (x, h) only when given a residual.
    return self.norm(x_BLD, comms)  # pyright: ignore[reportReturnType]
