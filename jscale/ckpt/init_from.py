"""Starting a run from a pretrained checkpoint: `checkpoint.init_from=DIR`.

DIR is a jscale params checkpoint (`params/` + `model.yaml`, from `python -m jscale.convert
hf-to-jscale`) or a Hugging Face Llama / Mixtral directory (`config.json` + safetensors), read
directly.

- The model is the checkpoint's: `merge_model` (called by `config_load.load_config`) takes the
  checkpoint's model config and applies on top only the `model.*` keys the user wrote (YAML or
  `key=value`), never a preset's or a default. Keys that shape parameters must equal the
  checkpoint's (every differing one is listed in one error); the others (dtype, rope_theta,
  norm_eps, attention_impl, ...) may change, and `overrides` lists those that change numerics.
- `check(cfg)`, before anything compiles: the shape keys, every stored parameter's shape
  (orbax metadata), and the tokenizer.
- `load_into(cfg, model)`: the weights.

Tokenizer rule (`check_tokenizer`). A checkpoint "has a tokenizer" when DIR/tokenizer.json
exists (an HF dir's own, or the copy `hf-to-jscale` puts beside model.yaml). Then
`data.tokenizer` must be a tokenizer.json with the same vocabulary: the same token -> id map,
added tokens included (compared by content, not by path). Without one, the tokenizer's
vocabulary size must equal the checkpoint's `vocab_size` exactly (the byte tokenizer: 256); a
model whose embedding is padded past its tokenizer needs the tokenizer.json beside it.
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jscale.ckpt import integrity, legacy_experts, params_io
from jscale.config import Config, ConfigError, ModelConfig
from jscale.config_dict import from_dict
from jscale.convert import hf_deepseek, hf_weights
from jscale.convert.hf_config import config_from_hf, read_hf_config
from jscale.data.tokenizer import tokenizer_vocab_size
from jscale.model import llama

# Model keys that parameter shapes depend on (`moe.*`: each expert layer's).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "d_ff", "tie_embeddings")
MOE_SHAPE_FIELDS = ("n_experts", "d_ff", "shared_d_ff", "every")
_SHAPE_KEYS = ("model.moe", *(f"model.{f}" for f in SHAPE_FIELDS),
               *(f"model.moe.{f}" for f in MOE_SHAPE_FIELDS))
# Keys that pick a kernel, not the function the model computes: never reported as overrides.
_IMPL_FIELDS = ("preset", "attention_impl", "norm_impl", "kernel_interpret", "gemm")
# An HF dir records no compute dtype: use what `hf-to-jscale` records by default, so a run from
# the dir and a run from its conversion are the same run.
_HF_DTYPE, _HF_PARAM_DTYPE = "bfloat16", "float32"
TOKENIZER = "tokenizer.json"


def is_hf_dir(path: str) -> bool:
  """Whether `path` is read as a Hugging Face dir (config.json, no model.yaml)."""
  return (not os.path.isfile(os.path.join(path, "model.yaml"))
          and os.path.isfile(os.path.join(path, "config.json")))


def checkpoint_model(path: str) -> ModelConfig:
  """The ModelConfig of checkpoint `path`: its model.yaml, or its HF config.json converted."""
  if not os.path.isdir(path):
    raise ConfigError(f"checkpoint.init_from={path}: no such directory; give a params checkpoint "
                      "(from `python -m jscale.convert hf-to-jscale`) or a Hugging Face model "
                      "dir (config.json + safetensors)")
  if not is_hf_dir(path):
    return params_io.load_model_config(path)  # names the fix when model.yaml is missing
  try:
    cfg = config_from_hf(read_hf_config(path), dtype=_HF_DTYPE, param_dtype=_HF_PARAM_DTYPE)
  except ConfigError as e:
    raise ConfigError(f"checkpoint.init_from={path} (config.json): {e}") from None
  with _open_safetensors(path) as reader:  # (headers only) DeepSeek: MTP only if stored
    return hf_deepseek.without_absent_mtp(cfg, reader.files)


def merge_model(raw: dict[str, Any]) -> dict[str, Any]:
  """The raw config `raw` (YAML + overrides, presets not applied) with its `model` section
  replaced by the checkpoint's model config plus the model keys written in `raw`.

  `model.preset` is dropped: the checkpoint is the model. Nested sections (rope_scaling, moe)
  merge key by key. Raises one ConfigError listing every shape key that differs.
  """
  path = raw["checkpoint"]["init_from"]
  written = raw.get("model") or {}
  if not isinstance(written, dict) or not isinstance(path, str):
    return raw  # from_dict names the problem
  saved = checkpoint_model(path)
  model = dataclasses.asdict(saved)
  for key, value in written.items():
    if key == "preset":
      continue
    base = model.get(key)
    model[key] = ({**base, **value} if isinstance(value, dict) and isinstance(base, dict)
                  else value)
  model["preset"] = None
  _raise_shape_diffs(path, from_dict({"model": model}).model, saved)
  return {**raw, "model": model}


def shape_diffs(model: ModelConfig, saved: ModelConfig) -> list[str]:
  """`model.KEY=value (checkpoint: value)` for every shape key where `model` differs from
  `saved` (head_dim and moe.d_ff compared as resolved)."""
  got, want = _shape_keys(model), _shape_keys(saved)
  if got["moe"] is not None and want["moe"] is not None:  # both MoE: key by key
    for keys in (got, want):
      keys.update({f"moe.{k}": v for k, v in keys.pop("moe").items()})
  return [f"model.{k}={_fmt(got[k])} (checkpoint: {_fmt(want[k])})"
          for k in want if got[k] != want[k]]


def _shape_keys(m: ModelConfig) -> dict[str, Any]:
  keys = {f: getattr(m, f) for f in SHAPE_FIELDS}
  keys["head_dim"] = m.resolved_head_dim
  keys["moe"] = None if m.moe is None else {
      **{f: getattr(m.moe, f) for f in MOE_SHAPE_FIELDS}, "d_ff": m.moe.d_ff or m.d_ff}
  return keys


def _raise_shape_diffs(path: str, model: ModelConfig, saved: ModelConfig) -> None:
  diffs = shape_diffs(model, saved)
  if diffs:
    raise ConfigError(
        f"checkpoint.init_from={path}: the model comes from the checkpoint, and these model "
        f"keys change its parameter shapes: {'; '.join(diffs)}. Remove these keys, or set them "
        "to the checkpoint's values")


def overrides(cfg: Config) -> list[str]:
  """`model.KEY=value (checkpoint: value)` for every model key of `cfg` that differs from
  checkpoint.init_from's model config: the user's overrides of its numerics (shape keys are
  equal by `check`; kernel choices such as attention_impl are not listed)."""
  return _diffs(cfg.model, checkpoint_model(cfg.checkpoint.init_from), "model.")


def _diffs(a, b, prefix: str) -> list[str]:
  out = []
  for f in dataclasses.fields(a):
    key, x, y = prefix + f.name, getattr(a, f.name), getattr(b, f.name)
    if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
      out += _diffs(x, y, key + ".")
    elif x != y and f.name not in _IMPL_FIELDS and key not in _SHAPE_KEYS:
      out.append(f"{key}={_fmt(x)} (checkpoint: {_fmt(y)})")
  return out


def _fmt(value: Any) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return str(value).lower()
  if dataclasses.is_dataclass(value):
    value = dataclasses.asdict(value)
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
  return str(value)


def check(cfg: Config) -> None:
  """Everything about checkpoint.init_from that can fail, before anything compiles: shape
  keys, stored parameter shapes, tokenizer. Raises ConfigError."""
  path = cfg.checkpoint.init_from
  saved = checkpoint_model(path)
  _raise_shape_diffs(path, cfg.model, saved)  # configs not built by load_config
  if is_hf_dir(path):
    _open_safetensors(path)  # the weights are there (one file, or an index of shards)
  else:
    abstract = nnx.eval_shape(lambda: llama.create(cfg.model))
    _check_stored(path, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)),
                  cfg.checkpoint.verify)
  check_tokenizer(cfg, saved)


def _open_safetensors(path: str) -> hf_weights.SafetensorsReader:
  try:
    return hf_weights.SafetensorsReader(path)
  except (FileNotFoundError, ConfigError) as e:
    raise ConfigError(f"checkpoint.init_from={path}: {e}") from None


def _check_stored(path: str, want: dict, read_arrays: bool) -> None:
  """Params checkpoint `path` reads back (`integrity`; `read_arrays`: every value, else the
  index), and every parameter against `want`'s shapes, read from orbax's metadata (no array
  is loaded); one ConfigError naming the damage or listing each mismatch."""
  params = os.path.join(os.path.abspath(path), "params")
  if not os.path.isdir(params):
    raise ConfigError(f"checkpoint.init_from={path}: no params/ there; create the checkpoint "
                      "with `python -m jscale.convert hf-to-jscale` (or params_io.save_params)")
  found = integrity.check_store(params, f"checkpoint.init_from={path}", read_arrays=read_arrays)
  if found:
    raise ConfigError(f"{found.line()}; convert it again (`python -m jscale.convert`)")
  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.metadata(params).item_metadata.tree
  if legacy_experts.is_old(want, stored):  # restored through the old names, then stacked
    want = legacy_experts.old_target(want)
  problems = param_mismatches(want, stored)
  if problems:
    raise ConfigError(
        f"checkpoint.init_from={path}: {len(problems)} stored parameters do not fit the model "
        f"its model.yaml describes: {'; '.join(problems)}. model.yaml and params/ disagree: "
        "re-create the checkpoint with `python -m jscale.convert hf-to-jscale` (or "
        "params_io.save_params)")


def param_mismatches(want: dict, have: dict) -> list[str]:
  """`path: stored S, model S'` for each parameter whose shape differs between the trees, and
  the parameters only one of them has."""
  w, h = _shapes(want), _shapes(have)
  out = [f"{k}: stored {h[k]}, model {w[k]}" for k in w if k in h and h[k] != w[k]]
  out += [f"{k}: missing from the checkpoint (model {w[k]})" for k in w if k not in h]
  out += [f"{k}: stored {h[k]}, not in the model" for k in h if k not in w]
  return out


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in leaves}


def check_tokenizer(cfg: Config, saved: ModelConfig) -> None:
  """`data.tokenizer` against checkpoint.init_from's tokenizer (the rule in the module doc)."""
  path = cfg.checkpoint.init_from
  if path is None:
    return
  n = tokenizer_vocab_size(cfg.data)  # a missing or invalid data.tokenizer fails here, named
  ckpt_tok = os.path.join(path, TOKENIZER)
  where = f"data.tokenizer={cfg.data.tokenizer} (data.source={cfg.data.source})"
  fix = (f"train with the checkpoint's tokenizer, e.g. on your own text: data.source=text "
         f"data.path=<text files> data.tokenizer={ckpt_tok}")
  if os.path.isfile(ckpt_tok):
    if cfg.data.tokenizer == "byte":
      raise ConfigError(f"{where} does not match checkpoint.init_from's tokenizer {ckpt_tok}: "
                        f"the checkpoint's embeddings are indexed by its own token ids; {fix}")
    differ = _vocab_diff(os.path.expanduser(cfg.data.tokenizer), ckpt_tok)
    if differ:
      raise ConfigError(f"{where} has another vocabulary than checkpoint.init_from's tokenizer "
                        f"{ckpt_tok} ({differ}); {fix}")
    return
  if n != saved.vocab_size:
    raise ConfigError(
        f"{where} has {n} tokens, but checkpoint.init_from={path} has vocab_size "
        f"{saved.vocab_size} and no {TOKENIZER} to compare vocabularies with: a tokenizer of "
        f"another size is not the model's. Put the model's {TOKENIZER} in {path} "
        f"(`python -m jscale.convert hf-to-jscale` copies it from the HF dir) and {fix}")


def _vocab_diff(path: str, ckpt_tok: str) -> str | None:
  """None if the two tokenizer.json files map the same tokens to the same ids, else a summary."""
  import tokenizers
  if filecmp.cmp(path, ckpt_tok, shallow=False):
    return None
  a, b = (set(tokenizers.Tokenizer.from_file(p).get_vocab(with_added_tokens=True).items())
          for p in (path, ckpt_tok))
  if a == b:
    return None
  return (f"{len(a)} vs {len(b)} tokens, {len(a - b)} of this tokenizer's (token, id) pairs "
          "not in the checkpoint's")


def load_into(cfg: Config, model: nnx.Module) -> None:
  """Replaces `model`'s parameters with checkpoint.init_from's, in place, each placed with the
  sharding the model's own parameter has. Raises ConfigError listing every shape mismatch."""
  path = cfg.checkpoint.init_from
  state = nnx.state(model, nnx.Param)
  want = nnx.to_pure_dict(state)
  if not is_hf_dir(path):
    _check_stored(path, want, read_arrays=False)  # `check` read the values before compiling
    params_io.load_params_into(path, model)
    return
  # The safetensors are read tensor by tensor into host memory (load_hf's reader), then each
  # is placed shard by shard: a model larger than one device never exists whole on one.
  with _open_safetensors(path) as reader:
    pure = hf_weights.hf_to_pure(reader, cfg.model, jnp.dtype(cfg.model.param_dtype))
  problems = param_mismatches(want, pure)
  if problems:
    raise ConfigError(f"checkpoint.init_from={path}: its safetensors do not fit the model: "
                      f"{'; '.join(problems)}")
  nnx.replace_by_pure_dict(state, jax.tree.map(_place, pure, want))
  nnx.update(model, state)


def _place(host: np.ndarray, like) -> jax.Array:
  sharding = getattr(like, "sharding", None)
  if sharding is None:
    return jnp.asarray(host)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
