"""The DeepSeek-V3 keys' checks (`model.moe` routing, `model.mla` with YaRN, `model.mtp`, the
node-limited exchange), called by `jscale.validate`'s values and mesh checks; each ConfigError
names the key and the fix."""

from __future__ import annotations

from jscale.config import ConfigError, ModelConfig, MoeConfig, MtpConfig


def check_routing(e: MoeConfig, n_layers: int) -> None:
  """DeepSeek-V3's routing keys (`jscale.model.router`) of `model.moe` = `e`."""
  if e.n_group < 1 or e.n_experts % e.n_group:
    raise ConfigError(f"model.moe.n_group={e.n_group} must be >= 1 and divide "
                      f"model.moe.n_experts={e.n_experts} (equal groups of experts)")
  if e.n_group > 1 and e.n_experts // e.n_group < 2:
    raise ConfigError(f"model.moe.n_group={e.n_group} leaves {e.n_experts // e.n_group} expert "
                      "per group: a group is scored by its two best experts; use fewer groups")
  if not 1 <= e.topk_group <= e.n_group:
    raise ConfigError(f"model.moe.topk_group={e.topk_group} must lie in [1, model.moe.n_group="
                      f"{e.n_group}]")
  if e.top_k > e.topk_group * (e.n_experts // e.n_group):
    raise ConfigError(f"model.moe.top_k={e.top_k} exceeds the {e.topk_group} x "
                      f"{e.n_experts // e.n_group} experts of topk_group groups: raise "
                      "model.moe.topk_group or lower top_k")
  if e.bias_update_rate < 0 or (e.bias_update_rate and e.router != "sigmoid"):
    raise ConfigError(f"model.moe.bias_update_rate={e.bias_update_rate}: must be >= 0, and the "
                      "balancing bias exists with model.moe.router=sigmoid only")
  if e.routed_scaling_factor <= 0:
    raise ConfigError(f"model.moe.routed_scaling_factor={e.routed_scaling_factor} must be "
                      "positive")
  if e.first_dense < 0 or e.first_dense >= n_layers:
    raise ConfigError(f"model.moe.first_dense={e.first_dense} must lie in [0, model.n_layers="
                      f"{n_layers}) (the leading dense layers, then the MoE stack)")
  if e.first_dense and e.every != 1:
    raise ConfigError(f"model.moe.first_dense={e.first_dense} with model.moe.every={e.every}: "
                      "use one of them (DeepSeek: every=1 after the dense prefix)")


def node_limited_why_not(e: MoeConfig, collectives: str, ep: int) -> str | None:
  """Why `model.moe.exchange=node_limited` cannot run on mesh.expert = `ep` > 1 devices in
  `parallel.collectives` mode `collectives` (None: it can); the planner offers no such layout."""
  fix = "or set model.moe.exchange=flat"
  if collectives != "manual" or e.dispatch != "dropless":
    return ("model.moe.exchange=node_limited is the hand-written dropless exchange: "
            "set parallel.collectives=manual and model.moe.dispatch=dropless, " + fix)
  if e.n_group < 2 or ep % e.n_group:
    return (f"model.moe.exchange=node_limited needs model.moe.n_group={e.n_group} "
            f"groups to tile mesh.expert={ep} (n_group > 1 dividing it: a group per "
            f"node), {fix}")
  return None


def check_node_limited(e: MoeConfig, collectives: str, ep: int) -> None:
  """`node_limited_why_not` as a ConfigError."""
  why = node_limited_why_not(e, collectives, ep)
  if why is not None:
    raise ConfigError(why)


def check_mla(m: ModelConfig) -> None:
  """Multi-head latent attention and YaRN (`jscale.model.mla`, `jscale.model.rope`)."""
  if m.mla is None:
    raise ConfigError("model.rope_scaling.rope_type=yarn needs model.mla: jscale applies YaRN's "
                      "attention scales in MLA only (DeepSeek-V3's); use rope_type=llama3")
  a = m.mla
  for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    if getattr(a, key) <= 0:
      raise ConfigError(f"model.mla.{key}={getattr(a, key)} must be positive")
  if a.q_lora_rank < 0:
    raise ConfigError(f"model.mla.q_lora_rank={a.q_lora_rank} must be >= 0 (0: no low-rank "
                      "query)")
  if a.qk_rope_head_dim % 2:
    raise ConfigError(f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim} must be even for RoPE")
  if m.n_kv_heads != m.n_heads:
    raise ConfigError(f"model.mla with model.n_kv_heads={m.n_kv_heads}: MLA's keys and values "
                      f"have one head per query head; set model.n_kv_heads={m.n_heads}")
  rs = m.rope_scaling
  if rs is not None and rs.rope_type == "yarn" and (rs.beta_fast <= rs.beta_slow or
                                                    rs.beta_slow <= 0):
    raise ConfigError(f"model.rope_scaling (yarn) needs beta_fast > beta_slow > 0, got "
                      f"{rs.beta_fast} and {rs.beta_slow}")


def check_mtp(mtp: MtpConfig, seq_len: int) -> None:
  """Multi-token prediction (`jscale.model.mtp`) with windows of `train.seq_len` tokens."""
  if mtp.depth < 1:
    raise ConfigError(f"model.mtp.depth={mtp.depth} must be >= 1 (or model.mtp: null)")
  if mtp.loss_weight < 0:
    raise ConfigError(f"model.mtp.loss_weight={mtp.loss_weight} must be >= 0")
  if mtp.depth >= seq_len:
    raise ConfigError(f"model.mtp.depth={mtp.depth} must be below train.seq_len="
                      f"{seq_len}: depth d predicts token t+1+d within the window")
