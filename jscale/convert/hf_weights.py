"""HF Llama safetensors <-> jscale parameter pure dicts, in numpy (no torch).

HF stores every projection as a Linear weight [out, in] per layer; jscale keeps [in, ..., out]
with heads split out and layers stacked on a leading axis. All conversions here are transposes
and reshapes, so they are exact in either direction; dtype casts happen only where asked.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Iterator

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors' np API reads it)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jscale.config import ConfigError, ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_Fn = Callable[[np.ndarray], np.ndarray]


def _specs(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, tuple[int, ...], _Fn, _Fn]]:
  """(jscale path, HF name, HF shape, hf->jscale, jscale->hf) per tensor; `{}` is the layer."""
  d, h, g, k, f = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.d_ff)
  same = lambda w: w  # noqa: E731
  t = lambda w: w.T  # noqa: E731
  lay = "model.layers.{}."
  specs = [
      (("embed",), "model.embed_tokens.weight", (cfg.vocab_size, d), same, same),
      (("blocks", "attn_norm", "scale"), lay + "input_layernorm.weight", (d,), same, same),
      (("blocks", "wq"), lay + "self_attn.q_proj.weight", (h * k, d),
       lambda w: w.T.reshape(d, h, k), lambda w: w.reshape(d, h * k).T),
      (("blocks", "wk"), lay + "self_attn.k_proj.weight", (g * k, d),
       lambda w: w.T.reshape(d, g, k), lambda w: w.reshape(d, g * k).T),
      (("blocks", "wv"), lay + "self_attn.v_proj.weight", (g * k, d),
       lambda w: w.T.reshape(d, g, k), lambda w: w.reshape(d, g * k).T),
      (("blocks", "wo"), lay + "self_attn.o_proj.weight", (d, h * k),
       lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
      (("blocks", "mlp_norm", "scale"), lay + "post_attention_layernorm.weight", (d,), same, same),
      (("blocks", "w_gate"), lay + "mlp.gate_proj.weight", (f, d), t, t),
      (("blocks", "w_up"), lay + "mlp.up_proj.weight", (f, d), t, t),
      (("blocks", "w_down"), lay + "mlp.down_proj.weight", (d, f), t, t),
      (("final_norm", "scale"), "model.norm.weight", (d,), same, same),
  ]
  if not cfg.tie_embeddings:
    specs.append((("lm_head",), "lm_head.weight", (cfg.vocab_size, d), t, t))
  return specs


class SafetensorsReader:
  """Lazy name -> numpy array access over a single-file or sharded HF checkpoint."""

  def __init__(self, path: str):
    index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    if os.path.isfile(index):
      with open(index, encoding="utf-8") as fh:
        weight_map = json.load(fh)["weight_map"]
      self.files = {name: os.path.join(path, f) for name, f in weight_map.items()}
    elif os.path.isfile(single):
      with safe_open(single, framework="np") as fh:
        self.files = {name: single for name in fh.keys()}
    else:
      raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} there (only safetensors "
                              "checkpoints are supported; re-save with safe_serialization=True)")
    self._open: dict[str, object] = {}

  def __enter__(self) -> "SafetensorsReader":
    return self

  def __exit__(self, *exc) -> None:
    self._open.clear()  # drops the memory maps

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise ConfigError(f"checkpoint lacks tensor {name}")
    f = self.files[name]
    if f not in self._open:
      self._open[f] = safe_open(f, framework="np")
    return self._open[f].get_tensor(name)


def hf_to_pure(reader: SafetensorsReader, cfg: ModelConfig, param_dtype) -> dict:
  """jscale's parameter pure dict, read tensor by tensor from `reader` and cast to param_dtype."""
  pure: dict = {}
  used: set[str] = set()
  for path, name, shape, to_jscale, _ in _specs(cfg):
    names = [name.format(i) for i in range(cfg.n_layers)] if "{}" in name else [name]
    arrays = []
    for n in names:
      w = reader.get(n)
      if tuple(w.shape) != shape:
        raise ConfigError(f"tensor {n} has shape {tuple(w.shape)}, config.json implies {shape}")
      arrays.append(to_jscale(w).astype(param_dtype))
    node = pure
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.stack(arrays) if "{}" in name else arrays[0]
    used.update(names)
  # Tensors jscale has no place for mean a model it would not reproduce: refuse, naming them.
  # The rotary cache of old checkpoints and a duplicate head of tied models carry nothing.
  extra = sorted(n for n in reader.files if n not in used and not n.endswith("rotary_emb.inv_freq")
                 and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if extra:
    more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
    raise ConfigError(f"checkpoint has tensors jscale's Llama lacks: {', '.join(extra[:5])}{more}")
  return pure


def pure_to_hf(pure: dict, cfg: ModelConfig, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, array) pairs for jscale's parameter pure dict; cast to `dtype` if given."""
  for path, name, _, _, to_hf in _specs(cfg):
    value = pure
    for key in path:
      value = value[key]
    stack = np.asarray(value)
    layers = list(enumerate(stack)) if "{}" in name else [(None, stack)]
    for i, w in layers:
      w = to_hf(w)
      if dtype is not None:
        w = w.astype(dtype)
      yield name.format(i), np.ascontiguousarray(w)


def write_safetensors(tensors: Iterable[tuple[str, np.ndarray]], path: str,
                      max_shard_bytes: int) -> list[str]:
  """Writes `model.safetensors`, or numbered shards plus an index past `max_shard_bytes`.

  Returns the file names written. Only one shard is buffered at a time, so peak host memory
  is about one shard rather than the whole model.
  """
  shard: dict[str, np.ndarray] = {}
  shard_bytes = total_bytes = 0
  written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)

  def flush():
    # Shard count is unknown until the end, so write under temporary names and rename after.
    f = os.path.join(path, f".jscale-shard-{len(written):05d}.tmp")
    save_file(shard, f, metadata={"format": "pt"})  # transformers checks the format
    written.append((f, list(shard)))

  for name, w in tensors:
    if shard and shard_bytes + w.nbytes > max_shard_bytes:
      flush()
      shard, shard_bytes = {}, 0
    shard[name] = w
    shard_bytes += w.nbytes
    total_bytes += w.nbytes
  flush()
  if len(written) == 1:
    os.replace(written[0][0], os.path.join(path, SINGLE))
    return [SINGLE]
  weight_map, files = {}, []
  for i, (tmp, names) in enumerate(written):
    final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
    os.replace(tmp, os.path.join(path, final))
    files.append(final)
    weight_map.update({n: final for n in names})
  with open(os.path.join(path, INDEX), "w", encoding="utf-8") as fh:
    json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, fh, indent=2)
  return files + [INDEX]
