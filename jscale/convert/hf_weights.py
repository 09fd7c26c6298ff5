"""HF Llama / Mixtral (DeepSeek-V3: `jscale.convert.hf_deepseek`) safetensors <-> jscale
parameter pure dicts, in numpy (no torch).

HF stores every projection as a Linear weight [out, in] per layer; jscale keeps [in, ..., out]
with heads split out and layers stacked on a leading axis. All conversions here are transposes,
reshapes and slices, so they are exact in either direction; dtype casts happen only where asked.

Mixtral's experts come in two on-disk layouts, both read (transformers >= 5 loads either):
  per expert (the published checkpoints, and what transformers 5's save_pretrained writes):
    model.layers.{i}.block_sparse_moe.gate.weight          [E, D]
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight [F, D]  (gate)
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight [F, D]  (up)
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight [D, F]  (down)
  fused (transformers 5's module state dict, e.g. saved with safetensors' own save_file):
    model.layers.{i}.mlp.gate.weight                       [E, D]
    model.layers.{i}.mlp.experts.gate_up_proj              [E, 2F, D]  (gate rows, then up)
    model.layers.{i}.mlp.experts.down_proj                 [E, D, F]
As transformers does on load, `block_sparse_moe.` and `mlp.` are read as the same prefix.
Exports use the per-expert layout, which transformers 4.x and 5.x both load.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Iterator

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors' np API reads it)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jscale.config import ConfigError, ModelConfig
from jscale.convert import hf_deepseek

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_Fn = Callable[[np.ndarray], np.ndarray]
_MOE = "block_sparse_moe."  # Mixtral's MoE prefix on disk; transformers 5 renames it `mlp.`


def _specs(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, tuple[int, ...], _Fn, _Fn]]:
  """(jscale path, HF name, HF shape, hf->jscale, jscale->hf) per tensor; `{}` is the layer."""
  d, h, g, k, f = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.d_ff)
  same = lambda w: w
  t = lambda w: w.T
  lay = "model.layers.{}."
  specs = [
      (("embed",), "model.embed_tokens.weight", (cfg.vocab_size, d), same, same),
      (("blocks", "attn_norm", "scale"), lay + "input_layernorm.weight", (d,), same, same),
      (("blocks", "attn", "wq"), lay + "self_attn.q_proj.weight", (h * k, d),
       lambda w: w.T.reshape(d, h, k), lambda w: w.reshape(d, h * k).T),
      (("blocks", "attn", "wk"), lay + "self_attn.k_proj.weight", (g * k, d),
       lambda w: w.T.reshape(d, g, k), lambda w: w.reshape(d, g * k).T),
      (("blocks", "attn", "wv"), lay + "self_attn.v_proj.weight", (g * k, d),
       lambda w: w.T.reshape(d, g, k), lambda w: w.reshape(d, g * k).T),
      (("blocks", "attn", "wo"), lay + "self_attn.o_proj.weight", (d, h * k),
       lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
      (("blocks", "mlp_norm", "scale"), lay + "post_attention_layernorm.weight", (d,), same, same),
  ]
  if cfg.moe is None:
    specs += [
        (("blocks", "mlp", "w_gate"), lay + "mlp.gate_proj.weight", (f, d), t, t),
        (("blocks", "mlp", "w_up"), lay + "mlp.up_proj.weight", (f, d), t, t),
        (("blocks", "mlp", "w_down"), lay + "mlp.down_proj.weight", (d, f), t, t),
    ]
  else:  # the experts themselves: _experts_from_hf / _experts_to_hf
    specs.append((("blocks", "mlp", "router"), lay + _MOE + "gate.weight",
                  (cfg.moe.n_experts, d), t, t))
  specs.append((("final_norm", "scale"), "model.norm.weight", (d,), same, same))
  if not cfg.tie_embeddings:
    specs.append((("lm_head",), "lm_head.weight", (cfg.vocab_size, d), t, t))
  return specs


class SafetensorsReader:
  """Lazy name -> numpy array access over a single-file or sharded HF checkpoint. Opening it
  reads every file's header: a truncated or missing file is a ConfigError naming it."""

  def __init__(self, path: str):
    index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    self._open: dict[str, Any] = {}  # file -> its open safetensors handle
    if os.path.isfile(index):
      with open(index, encoding="utf-8") as fh:
        weight_map = json.load(fh)["weight_map"]
      self.files = {name: os.path.join(path, f) for name, f in weight_map.items()}
      for f in sorted(set(self.files.values())):
        self._handle(f)
    elif os.path.isfile(single):
      self.files = {name: single for name in self._handle(single).keys()}
    else:
      raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} there (only safetensors "
                              "checkpoints are supported; re-save with safe_serialization=True)")

  def __enter__(self) -> "SafetensorsReader":
    return self

  def __exit__(self, *exc) -> None:
    self._open.clear()  # drops the memory maps

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise ConfigError(f"checkpoint lacks tensor {name}")
    return self._handle(self.files[name]).get_tensor(name)

  def _handle(self, f: str) -> Any:
    """The open handle of file `f` (its header read and checked against its size)."""
    if f not in self._open:
      if not os.path.isfile(f):
        raise ConfigError(f"{f}: the checkpoint's index names this file, and it is missing")
      try:
        self._open[f] = safe_open(f, framework="np")
      except SafetensorError as e:  # safetensors checks the header against the file's size
        raise ConfigError(f"{f} is damaged (safetensors: {e}): copy or download it again") \
            from None
    return self._open[f]


def _resolve(reader: SafetensorsReader, name: str) -> str:
  """`name`, or its `mlp.` spelling where only that is in the checkpoint (transformers 5 reads
  Mixtral's `block_sparse_moe.` as `mlp.`)."""
  if name not in reader and "." + _MOE in name:
    alt = name.replace("." + _MOE, ".mlp.")
    if alt in reader:
      return alt
  return name


def _get(reader: SafetensorsReader, name: str, shape: tuple[int, ...]) -> np.ndarray:
  w = reader.get(name)
  if tuple(w.shape) != shape:
    raise ConfigError(f"tensor {name} has shape {tuple(w.shape)}, config.json implies {shape}")
  return w


def _experts_from_hf(reader: SafetensorsReader, cfg: ModelConfig, i: int, param_dtype
                     ) -> tuple[list[np.ndarray], list[str]]:
  """Layer i's experts as jscale's [w_gate_up [E, D, 2, F], w_down [E, F, D]], from either
  on-disk layout, and the HF tensor names they came from."""
  e, d, f = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_ff or cfg.d_ff
  pre = f"model.layers.{i}.{_MOE}experts."
  fused = _resolve(reader, pre + "gate_up_proj")
  if fused in reader:
    down = _resolve(reader, pre + "down_proj")
    gate_up = _get(reader, fused, (e, 2 * f, d))  # gate_up_proj[e] @ x = [gate; up]
    ws = [gate_up.reshape(e, 2, f, d).transpose(0, 3, 1, 2),
          _get(reader, down, (e, d, f)).transpose(0, 2, 1)]
    return [w.astype(param_dtype) for w in ws], [fused, down]
  ws, names = [], []
  for hf_name, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
    experts = [_resolve(reader, f"{pre}{j}.{hf_name}.weight") for j in range(e)]
    ws.append(np.stack([_get(reader, n, shape).T.astype(param_dtype) for n in experts]))
    names += experts
  return [np.stack(ws[:2], axis=2), ws[2]], names


def hf_to_pure(reader: SafetensorsReader, cfg: ModelConfig, param_dtype) -> dict:
  """jscale's parameter pure dict, read tensor by tensor from `reader` and cast to param_dtype."""
  if hf_deepseek.is_deepseek(cfg):
    return hf_deepseek.hf_to_pure(reader, cfg, param_dtype)
  pure: dict = {}
  used: set[str] = set()
  for path, name, shape, to_jscale, _ in _specs(cfg):
    names = [_resolve(reader, name.format(i)) for i in range(cfg.n_layers)] if "{}" in name \
        else [name]
    arrays = [to_jscale(_get(reader, n, shape)).astype(param_dtype) for n in names]
    node = pure
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.stack(arrays) if "{}" in name else arrays[0]
    used.update(names)
  if cfg.moe is not None:
    layers = []
    for i in range(cfg.n_layers):
      ws, names = _experts_from_hf(reader, cfg, i, param_dtype)
      layers.append(ws)
      used.update(names)
    for key, ws in zip(("w_gate_up", "w_down"), zip(*layers)):
      pure["blocks"]["mlp"][key] = np.stack(ws)
  # Tensors jscale has no place for mean a model it would not reproduce: refuse, naming them.
  # The rotary cache of old checkpoints and a duplicate head of tied models carry nothing.
  extra = sorted(n for n in reader.files if n not in used and not n.endswith("rotary_emb.inv_freq")
                 and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if extra:
    more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
    raise ConfigError(f"checkpoint has tensors jscale's model lacks: {', '.join(extra[:5])}{more}")
  return pure


def pure_to_hf(pure: dict, cfg: ModelConfig, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, array) pairs for jscale's parameter pure dict; cast to `dtype` if given.

  Mixtral experts are written per expert (w1 / w2 / w3), the published layout."""
  if hf_deepseek.is_deepseek(cfg):
    yield from hf_deepseek.pure_to_hf(pure, cfg, dtype)
    return
  def out(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w if dtype is None else w.astype(dtype))

  for path, name, _, _, to_hf in _specs(cfg):
    value = pure
    for key in path:
      value = value[key]
    stack = np.asarray(value)
    layers = list(enumerate(stack)) if "{}" in name else [(None, stack)]
    for i, w in layers:
      yield name.format(i), out(to_hf(w))
  if cfg.moe is not None:
    gate_up, down = (np.asarray(pure["blocks"]["mlp"][k]) for k in ("w_gate_up", "w_down"))
    for i in range(cfg.n_layers):
      for j in range(cfg.moe.n_experts):
        for hf_name, w in (("w1", gate_up[i, j, :, 0]), ("w2", down[i, j]),
                           ("w3", gate_up[i, j, :, 1])):
          yield f"model.layers.{i}.{_MOE}experts.{j}.{hf_name}.weight", out(w.T)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


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
    os.chmod(f, 0o666 & ~_umask())  # safetensors creates 0600: give the usual file mode
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
