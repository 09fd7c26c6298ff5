"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, transformers >= 5) <-> jscale: the
`config.json` and the safetensors, in numpy. `jscale.convert.hf_config` and `hf_weights`
dispatch here (`is_deepseek`); the `reader` arguments are `hf_weights.SafetensorsReader`s.

A jscale model with `model.mla` is a DeepSeek-V3 model: MLA (with or without the low-rank
query), sigmoid group-limited routing, shared experts (`n_shared_experts` x
`moe_intermediate_size` = `moe.shared_d_ff`), the first `first_k_dense_replace` layers dense
(`moe.first_dense`), YaRN or plain RoPE. jscale's stacks map to HF's layer numbers: the dense
prefix `dense_blocks` to layers 0..k-1, `blocks` to k..n-1, and the MTP modules (`mtp`) to
layers n..n+D-1 in DeepSeek's own checkpoint layout (`enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, the block's weights, and copies of the embedding and head, as the
published checkpoint has them). transformers builds no MTP module: it drops those tensors on
load (`model.layers.61.*` of the 671B checkpoint), so HF keeps nothing of MTP; jscale reads
them back when `num_nextn_predict_layers` > 0.

Tensor layouts (HF Linear weights are [out, in]):
- `q_b_proj` / `q_proj` [H (N+P), Q or D]; `kv_a_proj_with_mqa` [R+P, D]; `kv_b_proj`
  [H (N+V), R] (each head's key rows, then its value rows) -> `wk_b`, `wv_b`; `o_proj`.
  With `rope_interleave` (DeepSeek's default) the rope dims are stored in interleaved pairs;
  jscale rotates halves, so those columns are permuted (`_DEINTERLEAVE`).
- experts per expert `mlp.experts.{j}.{gate,up,down}_proj.weight` (the published layout,
  written on export) or fused `mlp.experts.gate_up_proj` / `down_proj` (read); the balancing
  bias is `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax
import numpy as np

from jscale.config import (
  ConfigError,
  MlaConfig,
  ModelConfig,
  MoeConfig,
  MtpConfig,
  RopeScalingConfig,
)
from jscale.model.router import BIAS

MODEL_TYPE = "deepseek_v3"
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def is_deepseek(cfg: ModelConfig) -> bool:
  """Whether `cfg` converts as DeepSeek-V3 (it has MLA)."""
  return cfg.mla is not None


def _checked(reader, name: str, shape: tuple[int, ...]) -> np.ndarray:
  w = reader.get(name)
  if tuple(w.shape) != shape:
    raise ConfigError(f"tensor {name} has shape {tuple(w.shape)}, config.json implies {shape}")
  return w


def _deinterleave(p: int) -> np.ndarray:
  """Column order taking interleaved rope pairs (x0, x1), (x2, x3) ... to halves."""
  return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig | None]:
  rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "yarn":
    raise ConfigError(f"rope_parameters.rope_type={rope_type!r}: jscale's MLA takes 'default' "
                      "or 'yarn' RoPE")
  if rp.get("truncate") is False or rp.get("attention_factor") is not None:
    raise ConfigError("rope_parameters: YaRN with truncate=false or an explicit "
                      "attention_factor is not DeepSeek-V3's; jscale implements its YaRN only")
  d = RopeScalingConfig(rope_type="yarn")
  get = lambda k: float(rp[k]) if rp.get(k) is not None else float(getattr(d, k))
  return theta, RopeScalingConfig(
      rope_type="yarn", factor=get("factor"),
      original_max_position_embeddings=int(get("original_max_position_embeddings")),
      beta_fast=get("beta_fast"), beta_slow=get("beta_slow"), mscale=get("mscale"),
      mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32",
                   param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a DeepseekV3 `config.json` dict; ConfigError for what jscale lacks."""
  if hf.get("hidden_act", "silu") not in ("silu", "swish"):
    raise ConfigError(f"hidden_act={hf['hidden_act']!r}: jscale's MLP is SwiGLU (silu) only")
  if hf.get("attention_bias"):
    raise ConfigError("attention_bias=true: jscale's MLA has no bias terms")
  heads = int(hf["num_attention_heads"])
  if int(hf.get("num_key_value_heads") or heads) != heads:
    raise ConfigError(f"num_key_value_heads={hf['num_key_value_heads']}: MLA has one key / value "
                      f"head per query head ({heads})")
  theta, scaling = _rope(hf)
  n_layers, first = int(hf["num_hidden_layers"]), int(hf.get("first_k_dense_replace", 0))
  moe_ff, shared = int(hf["moe_intermediate_size"]), int(hf.get("n_shared_experts") or 0)
  nextn = int(hf.get("num_nextn_predict_layers") or 0)
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), n_layers=n_layers,
      n_heads=heads, n_kv_heads=heads, d_ff=int(hf["intermediate_size"]),
      max_seq_len=int(hf.get("max_position_embeddings", 4096)), rope_theta=theta,
      rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)),
      mla=MlaConfig(q_lora_rank=int(hf.get("q_lora_rank") or 0),
                    kv_lora_rank=int(hf["kv_lora_rank"]),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"])),
      moe=MoeConfig(n_experts=int(hf["n_routed_experts"]), top_k=int(hf["num_experts_per_tok"]),
                    d_ff=moe_ff, shared_d_ff=moe_ff * shared, router="sigmoid",
                    n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    first_dense=first, aux_loss_weight=0.0, z_loss_weight=0.0),
      mtp=MtpConfig(depth=nextn) if nextn else None, dtype=dtype, param_dtype=param_dtype)


def without_absent_mtp(cfg: ModelConfig, names) -> ModelConfig:
  """`cfg` without MTP when the checkpoint (tensor `names`) has no MTP layers: transformers'
  save_pretrained writes `num_nextn_predict_layers` (default 1) but no MTP weights."""
  if not is_deepseek(cfg) or cfg.mtp is None or \
      f"model.layers.{cfg.n_layers}.eh_proj.weight" in names:
    return cfg
  return dataclasses.replace(cfg, mtp=None)


def config_to_hf(cfg: ModelConfig, *, dtype: str) -> dict[str, Any]:
  """The transformers-5 DeepseekV3ForCausalLM `config.json` dict for `cfg` (with `cfg.mla`)."""
  m, e = cfg.mla, cfg.moe
  if e is None or e.router != "sigmoid" or e.every != 1:
    raise ConfigError("model.mla without model.moe (router=sigmoid, every=1): DeepSeek-V3 on "
                      "Hugging Face has routed experts after the dense prefix; no equivalent")
  if e.shared_d_ff % (e.d_ff or cfg.d_ff) or not e.shared_d_ff:
    raise ConfigError(f"model.moe.shared_d_ff={e.shared_d_ff}: HF DeepSeek-V3's shared experts "
                      f"are n_shared_experts >= 1 x moe_intermediate_size ({e.d_ff or cfg.d_ff})")
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  rs = cfg.rope_scaling
  if rs is not None:
    if rs.rope_type != "yarn":
      raise ConfigError("model.mla with rope_scaling.rope_type=llama3: HF DeepSeek-V3 takes "
                        "YaRN or plain RoPE")
    rope.update({"rope_type": "yarn", **{k: getattr(rs, k) for k in _YARN_KEYS}})
  return {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "moe_intermediate_size": e.d_ff or cfg.d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
      "n_shared_experts": e.shared_d_ff // (e.d_ff or cfg.d_ff),
      "n_routed_experts": e.n_experts, "num_experts_per_tok": e.top_k, "n_group": e.n_group,
      "topk_group": e.topk_group, "norm_topk_prob": e.norm_topk_prob,
      "routed_scaling_factor": e.routed_scaling_factor, "first_k_dense_replace": e.first_dense,
      "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
      "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
      "v_head_dim": m.v_head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
      "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
      "num_nextn_predict_layers": cfg.mtp.depth if cfg.mtp is not None else 0,
      "use_cache": True, "dtype": dtype, "rope_parameters": rope,
  }


def _linears(cfg: ModelConfig, moe: bool) -> list[tuple[tuple[str, ...], str, Any, Any]]:
  """(jscale path in one layer, HF suffix, hf -> jscale, jscale -> hf) of a block's tensors
  with a 1:1 mapping (kv_b_proj and the experts: `_layer_from_hf` / `_layer_to_hf`)."""
  m, d, h = cfg.mla, cfg.d_model, cfg.n_heads
  n, p, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
  k, perm = n + p, np.concatenate([np.arange(n), n + _deinterleave(p)])
  inv, rperm = np.argsort(perm), _deinterleave(p)
  cols = np.concatenate([np.arange(m.kv_lora_rank), m.kv_lora_rank + rperm])
  t = lambda w: w.T
  same = lambda w: w
  heads = lambda rows: (lambda w: w.T.reshape(rows, h, k)[..., perm],
                        lambda w: w[..., inv].reshape(rows, h * k).T)
  specs = [(("attn_norm", "scale"), "input_layernorm.weight", same, same),
           (("mlp_norm", "scale"), "post_attention_layernorm.weight", same, same),
           (("attn", "wkv_a"), "self_attn.kv_a_proj_with_mqa.weight", lambda w: w.T[:, cols],
            lambda w: w[:, np.argsort(cols)].T),
           (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", same, same),
           (("attn", "wo"), "self_attn.o_proj.weight", lambda w: w.T.reshape(h, v, d),
            lambda w: w.reshape(h * v, d).T)]
  if m.q_lora_rank:
    specs += [(("attn", "wq_a"), "self_attn.q_a_proj.weight", t, t),
              (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", same, same),
              (("attn", "wq_b"), "self_attn.q_b_proj.weight", *heads(m.q_lora_rank))]
  else:
    specs.append((("attn", "wq"), "self_attn.q_proj.weight", *heads(d)))
  if not moe:
    return specs + [(("mlp", w), f"mlp.{w[2:]}_proj.weight", t, t)
                    for w in ("w_gate", "w_up", "w_down")]
  return specs + [(("mlp", "router"), "mlp.gate.weight", t, t),
                  (("mlp", BIAS), "mlp.gate.e_score_correction_bias", same, same),
                  *[(("mlp", f"shared_{w}"), f"mlp.shared_experts.{w}_proj.weight", t, t)
                    for w in ("gate", "up", "down")]]


_MTP = [(("enorm", "scale"), "enorm.weight"), (("hnorm", "scale"), "hnorm.weight"),
        (("eh_proj",), "eh_proj.weight"), (("norm", "scale"), "shared_head.norm.weight")]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _layer_from_hf(reader, cfg: ModelConfig, pre: str, moe: bool,
                   used: set[str]) -> dict:
  """One block's jscale parameters (unstacked) from HF layer prefix `pre`."""
  def get(name: str) -> np.ndarray:
    used.add(pre + name)
    return reader.get(pre + name)

  out: dict = {}
  for path, name, to_js, _ in _linears(cfg, moe):
    _set(out, path, to_js(get(name)))
  m, h = cfg.mla, cfg.n_heads
  kv = get("self_attn.kv_b_proj.weight").T.reshape(m.kv_lora_rank, h, -1)
  _set(out, ("attn", "wk_b"), kv[..., :m.qk_nope_head_dim])
  _set(out, ("attn", "wv_b"), kv[..., m.qk_nope_head_dim:])
  if moe:
    e, ex = cfg.moe.n_experts, pre + "mlp.experts."
    if ex + "gate_up_proj" in reader:  # transformers 5's fused module layout
      gate_up, down = get("mlp.experts.gate_up_proj"), get("mlp.experts.down_proj")
      f = gate_up.shape[1] // 2
      gate, up = gate_up[:, :f].transpose(0, 2, 1), gate_up[:, f:].transpose(0, 2, 1)
      down = down.transpose(0, 2, 1)
    else:
      gate, up, down = (np.stack([get(f"mlp.experts.{j}.{w}_proj.weight").T for j in range(e)])
                        for w in ("gate", "up", "down"))
    _set(out, ("mlp", "w_gate_up"), np.stack([gate, up], axis=2))
    _set(out, ("mlp", "w_down"), down)
  return out


def _layer_to_hf(layer: dict, cfg: ModelConfig, pre: str, moe: bool
                 ) -> Iterator[tuple[str, np.ndarray]]:
  for path, name, _, to_hf in _linears(cfg, moe):
    yield pre + name, to_hf(np.asarray(_get(layer, path)))
  wk, wv = np.asarray(layer["attn"]["wk_b"]), np.asarray(layer["attn"]["wv_b"])
  r = wk.shape[0]
  yield pre + "self_attn.kv_b_proj.weight", np.concatenate([wk, wv], -1).reshape(r, -1).T
  if moe:
    gate_up, down = (np.asarray(layer["mlp"][k]) for k in ("w_gate_up", "w_down"))
    for j in range(cfg.moe.n_experts):
      for w, m in (("gate", gate_up[j, :, 0]), ("up", gate_up[j, :, 1]), ("down", down[j])):
        yield f"{pre}mlp.experts.{j}.{w}_proj.weight", m.T


def _stacks(cfg: ModelConfig) -> list[tuple[tuple[str, ...], range, bool]]:
  """(jscale stack path, HF layer numbers, MoE?) for the dense prefix, the MoE stack and the
  MTP modules (whose block is at `block`)."""
  k, n = cfg.first_dense, cfg.n_layers
  out = [(("dense_blocks",), range(k), False)] if k else []
  out.append((("blocks",), range(k, n), True))
  if cfg.mtp is not None:
    out.append((("mtp", "block"), range(n, n + cfg.mtp.depth), True))
  return out


def hf_to_pure(reader, cfg: ModelConfig, param_dtype) -> dict:
  """jscale's parameter pure dict (cast to `param_dtype`) from a DeepseekV3 checkpoint."""
  used: set[str] = set()
  pure: dict = {"embed": _checked(reader, "model.embed_tokens.weight",
                                      (cfg.vocab_size, cfg.d_model)),
                "final_norm": {"scale": _checked(reader, "model.norm.weight",
                                                     (cfg.d_model,))}}
  used |= {"model.embed_tokens.weight", "model.norm.weight"}
  if not cfg.tie_embeddings:
    pure["lm_head"] = _checked(reader, "lm_head.weight", (cfg.vocab_size, cfg.d_model)).T
    used.add("lm_head.weight")
  for path, layers, moe in _stacks(cfg):
    per = [_layer_from_hf(reader, cfg, f"model.layers.{i}.", moe, used) for i in layers]
    _set(pure, path, jax.tree.map(lambda *a: np.stack(a), *per))
  if cfg.mtp is not None:
    for path, name in _MTP:
      names = [f"model.layers.{i}.{name}" for i in _stacks(cfg)[-1][1]]
      ws = [reader.get(x) for x in names]
      _set(pure["mtp"], path, np.stack([w.T if path == ("eh_proj",) else w for w in ws]))
      used.update(names)
  # The published MTP layers carry copies of the embedding and head: shared in jscale.
  extra = sorted(x for x in reader.files if x not in used and not x.endswith(
      ("rotary_emb.inv_freq", ".embed_tokens.weight", "shared_head.head.weight")))
  if extra:
    more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
    raise ConfigError(f"checkpoint has tensors jscale's model lacks: {', '.join(extra[:5])}"
                      f"{more} (MTP layers need num_nextn_predict_layers in config.json)")
  return jax.tree.map(lambda w: np.asarray(w).astype(param_dtype), pure)


def pure_to_hf(pure: dict, cfg: ModelConfig, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, array) pairs of a DeepSeek-V3 jscale parameter pure dict, cast to `dtype`."""
  def out(w) -> np.ndarray:
    w = np.asarray(w)
    return np.ascontiguousarray(w if dtype is None else w.astype(dtype))

  embed = out(pure["embed"])
  head = out(np.asarray(pure["embed"] if cfg.tie_embeddings else pure["lm_head"].T))
  yield "model.embed_tokens.weight", embed
  yield "model.norm.weight", out(pure["final_norm"]["scale"])
  if not cfg.tie_embeddings:
    yield "lm_head.weight", head
  for path, layers, moe in _stacks(cfg):
    stack = _get(pure, path)
    for j, i in enumerate(layers):
      layer = jax.tree.map(lambda a, j=j: np.asarray(a)[j], stack)
      for name, w in _layer_to_hf(layer, cfg, f"model.layers.{i}.", moe):
        yield name, out(w)
  if cfg.mtp is not None:
    for j, i in enumerate(_stacks(cfg)[-1][1]):
      for path, name in _MTP:
        w = np.asarray(_get(pure["mtp"], path))[j]
        yield f"model.layers.{i}.{name}", out(w.T if path == ("eh_proj",) else w)
      yield f"model.layers.{i}.embed_tokens.weight", embed
      yield f"model.layers.{i}.shared_head.head.weight", head
