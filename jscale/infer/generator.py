"""Text generation with a KV cache: one jitted prefill, one jitted decode step.

Prompts of different lengths are right-padded into one batch (`kv_cache`: slot s holds position
s, so padding is never attended to). Prompt and cache lengths are rounded up to buckets, so a
new prompt length or token budget rarely compiles again, and a decode step never does: the
sampling settings are traced values (`sampling`). The cache is donated to each step and
updated in place.

With a mesh (`mesh.tensor` > 1) the weights are laid out by the training's sharding rules
(heads, kv heads, MLP hidden and vocab split over `tensor`) and the cache by its kv heads; XLA
partitions the rest — for models that do not fit one device.

Shape suffixes: B batch, P padded prompt length, S cache length, V vocab.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jscale import jax_compat
from jscale import sharding as sharding_lib
from jscale.config import ParallelConfig
from jscale.infer.sampling import Sampling, sample
from jscale.model import kv_cache
from jscale.model.llama import Llama

PROMPT_BUCKET = 32  # prompt lengths are padded to a multiple of this
CACHE_BUCKET = 128  # cache lengths likewise


@dataclasses.dataclass
class Generated:
  """Per prompt, the new tokens (up to and excluding EOS) and whether EOS ended it; timings:
  the prefill and the first decode step (each with its compile, if one ran), then
  `decode_steps` more decode steps in `decode_s`."""
  tokens: list[list[int]]
  finished: list[bool]
  prefill_s: float
  first_decode_s: float
  decode_s: float
  decode_steps: int

  @property
  def tokens_per_s(self) -> float:
    """Steady-state decode rate: new tokens per second over all rows, after the first decode
    step (0.0 when too few tokens were generated to time one)."""
    return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s else 0.0


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _place(x, where: NamedSharding):
  """`x` onto `where`; an abstract array gets `where` as its sharding."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
  return jax.device_put(x, where)


class Generator:
  """Generates from `model` (a `Llama`); `mesh`: lay it out for tensor parallelism. An abstract
  model (`nnx.eval_shape`) gives a generator that can only be lowered (`lower`)."""

  def __init__(self, model: Llama, mesh: Mesh | None = None):
    self.cfg = model.cfg
    self.graphdef, state = nnx.split(model)
    self.mesh = mesh
    self.cache_sharding = None
    if mesh is not None:
      params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      params = jax.tree.map(_place, params, sharding_lib.tensor_parallel(model, mesh))
      nnx.replace_by_pure_dict(state, params)
      rules = sharding_lib.make_rules(ParallelConfig())
      self.cache_sharding = NamedSharding(mesh, sharding_lib.spec(kv_cache.NAMES, rules))
    self.state = state
    self._prefill = jax.jit(self._prefill_fn, static_argnums=(0,))
    self._decode = jax.jit(self._decode_fn, donate_argnums=(2,))

  # ------------------------------------------------------------------ compiled steps

  def _model(self, state) -> Llama:
    return nnx.merge(self.graphdef, state)

  def _prefill_fn(self, length: int, state, tokens_BP, lengths_B, key, sampling):
    """(first new tokens [B], cache of `length` positions holding the prompts)."""
    model = self._model(state)
    cache = kv_cache.init(self.cfg, tokens_BP.shape[0], length)
    if self.cache_sharding is not None:
      cache = jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, self.cache_sharding),
                           cache)
    positions_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
    x_BPD, cache = model.cached_hidden(tokens_BP, positions_BP, cache, prefill=True)
    last_B1D = jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)
    return sample(model.logits(last_B1D)[:, 0], key, *sampling), cache

  def _decode_fn(self, state, tokens_B, cache, positions_B, key, sampling):
    """(next tokens [B], the cache with `tokens_B` stored at `positions_B`)."""
    model = self._model(state)
    x_B1D, cache = model.cached_hidden(tokens_B[:, None], positions_B[:, None], cache,
                                       prefill=False)
    return sample(model.logits(x_B1D)[:, 0], key, *sampling), cache

  def lower(self, batch: int, prompt_len: int, length: int
            ) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The prefill (`batch` prompts padded to `prompt_len`, a cache of `length` positions) and
    the decode step, lowered on abstract inputs over the mesh's devices: to read or compile
    them for devices that are not here (`jscale.analysis.gpu_target`)."""
    replicated = (NamedSharding(self.mesh, jax.sharding.PartitionSpec()) if self.mesh
                  else None)
    spec = lambda shape, dtype, where=None: jax.ShapeDtypeStruct(
        shape, dtype, sharding=where or replicated)
    state = jax.tree.map(lambda x: spec(x.shape, x.dtype, getattr(x, "sharding", None)),
                         self.state)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = spec(key.shape, key.dtype)
    settings = tuple(spec(a.shape, a.dtype) for a in Sampling().arrays())
    tokens_B = spec((batch,), jnp.int32)
    cache = jax.tree.map(lambda c: spec(c.shape, c.dtype, self.cache_sharding),
                         jax.eval_shape(lambda: kv_cache.init(self.cfg, batch, length)))
    prefill = self._prefill.trace(length, state, spec((batch, prompt_len), jnp.int32),
                                  tokens_B, key, settings).lower()
    decode = self._decode.trace(state, tokens_B, cache, tokens_B, key, settings).lower()
    return prefill, decode

  def compiled_decode_steps(self) -> int:
    """How many decode steps have been compiled (1 after any number of tokens)."""
    return jax_compat.jit_cache_size(self._decode)

  # ------------------------------------------------------------------ the loop

  def generate(self, prompts: list[list[int]], max_new_tokens: int,
               sampling: Sampling = Sampling(), seed: int = 0,
               eos_id: int | None = None) -> Generated:
    """Up to `max_new_tokens` new tokens per prompt (token id lists, each non-empty); a row
    stops at `eos_id`, the batch when every row has."""
    sampling.check()
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    padded = _round_up(int(lengths.max()), PROMPT_BUCKET)
    need = int(lengths.max()) + max_new_tokens
    if need > self.cfg.max_seq_len:
      raise ValueError(f"the longest prompt ({lengths.max()} tokens) + max_new_tokens "
                       f"({max_new_tokens}) = {need} exceeds model.max_seq_len="
                       f"{self.cfg.max_seq_len}: shorten the prompt or generate fewer tokens")
    length = _round_up(max(padded, need), CACHE_BUCKET)
    tokens_BP = np.zeros((len(prompts), padded), np.int32)
    for i, p in enumerate(prompts):
      tokens_BP[i, :len(p)] = p
    settings = sampling.arrays()
    keys = jax.random.split(jax.random.key(seed), length)  # bucketed: no compile per budget

    t0 = time.perf_counter()
    next_B, cache = self._prefill(length, self.state, jnp.asarray(tokens_BP),
                                  jnp.asarray(lengths), keys[0], settings)
    out = [next_B]
    jax.block_until_ready(next_B)
    t1 = time.perf_counter()
    t_first = t1  # end of the first decode step: compile time stays out of the rate
    positions_B = jnp.asarray(lengths)
    eos = -1 if eos_id is None else eos_id
    done_B = next_B == eos  # fixed shape: the check below never compiles per step count
    for step in range(1, max_new_tokens):
      next_B, cache = self._decode(self.state, next_B, cache, positions_B + (step - 1),
                                   keys[step], settings)
      out.append(next_B)
      if step == 1:
        jax.block_until_ready(next_B)
        t_first = time.perf_counter()
      if eos_id is None:
        continue
      done_B = done_B | (next_B == eos)
      # Stop once every row has emitted EOS; checked every few steps so the host rarely
      # waits on the device.
      if step % 8 == 0 and bool(jnp.all(done_B)):
        break
    tokens_TB = np.stack(jax.device_get(out))  # on the host: no compile per token count
    t2 = time.perf_counter()
    rows, finished = [], []
    for row in tokens_TB.T.tolist():
      end = row.index(eos) if eos in row else len(row)
      rows.append(row[:end])
      finished.append(end < len(row))
    return Generated(rows, finished, t1 - t0, t_first - t1, t2 - t_first, max(len(out) - 2, 0))
