"""The MoE keys (`model.moe`) alone, and expert parallelism over `mesh.expert`."""

from __future__ import annotations

from jscale import metrics
from jscale.config import Config, ConfigError, MoeConfig
from jscale.fp8 import linears as fp8_linears
from jscale.validate import deepseek


def check_values(e: MoeConfig, n_layers: int) -> None:
  """`model.moe` (= `e`)'s sizes, grouping and loss weights, then DeepSeek-V3's routing keys."""
  if e.n_experts < 1 or not 1 <= e.top_k <= e.n_experts:
    raise ConfigError(f"model.moe.top_k={e.top_k} with model.moe.n_experts={e.n_experts}: need "
                      "1 <= top_k <= n_experts")
  if (e.d_ff is not None and e.d_ff <= 0) or e.shared_d_ff < 0:
    raise ConfigError(f"model.moe.d_ff={e.d_ff} / shared_d_ff={e.shared_d_ff}: give positive "
                      "sizes (d_ff null: model.d_ff; shared_d_ff 0: no shared expert)")
  if e.every < 1 or n_layers % e.every:
    raise ConfigError(f"model.moe.every={e.every} must be >= 1 and divide model.n_layers="
                      f"{n_layers} (layers are stacked in groups of every-1 dense + 1 MoE)")
  if e.capacity_factor <= 0:
    raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} must be positive")
  if e.receive_factor < 0:
    raise ConfigError(f"model.moe.receive_factor={e.receive_factor} must be >= 0 (0: a receive "
                      "buffer with room for the most a device can be sent)")
  if e.aux_loss_weight < 0 or e.z_loss_weight < 0 or e.seq_aux_loss_weight < 0:
    raise ConfigError("model.moe.aux_loss_weight, z_loss_weight and seq_aux_loss_weight must be "
                      ">= 0 (0 disables)")
  deepseek.check_routing(e, n_layers)


def slot_buffers(cfg: Config, sizes: dict[str, int]) -> bool:
  """Whether the experts run GShard slot buffers (batched dense matmuls) rather than the
  grouped matmul: xla mode with the experts split over `expert` or `tensor` (`sizes`: the
  mesh's axis sizes)."""
  return cfg.parallel.collectives == "xla" and (sizes["expert"] > 1 or sizes["tensor"] > 1)


def check_experts(cfg: Config, sizes: dict[str, int]) -> None:
  """What expert parallelism over mesh.expert needs."""
  moe, ep = cfg.model.moe, sizes["expert"]
  if moe is None:
    raise ConfigError(f"mesh.expert={ep} needs an MoE model: set model.moe.n_experts (or "
                      "model.preset=tiny_moe), or use mesh.data for data parallelism")
  if moe.n_experts % ep:
    raise ConfigError(f"model.moe.n_experts={moe.n_experts} is not divisible by mesh.expert={ep}: "
                      "each device must hold the same number of experts")
  if moe.exchange == "node_limited" and ep > 1:
    deepseek.check_node_limited(moe, cfg.parallel.collectives, ep)
  if fp8_linears.experts_in(cfg.fp8) and slot_buffers(cfg, sizes):
    raise ConfigError("fp8.targets=[experts] with mesh.expert or mesh.tensor > 1 in xla mode: "
                      "xla mode dispatches split experts through a slot buffer, not the grouped "
                      "matmul; set parallel.collectives=manual")
  _check_chunks(cfg, sizes)


def _check_chunks(cfg: Config, sizes: dict[str, int]) -> None:
  """parallel.expert_chunks slices the tokens one device sends through the experts per
  micro-batch (its rows times its share of the sequence) into equal parts."""
  chunks = cfg.parallel.expert_chunks
  tokens = metrics.routed_tokens(cfg, sizes)
  if tokens % chunks:
    raise ConfigError(f"parallel.expert_chunks={chunks} does not divide the {tokens} tokens "
                      "each device sends through the experts per micro-batch: pick a divisor "
                      "of it")
