"""The chunked head + cross-entropy (`jscale.step.loss`) against the unchunked loss: values,
gradients, layouts, and the memory it saves at Llama-3's vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from jscale.step import loss as loss_lib
from jscale import runtime
from jscale.analysis import hlo
from jscale.analysis.introspect import abstract_batch, compile_train_step, memory
from parity import BASE, losses, reference


def _inputs(dtype, b=2, l=32, d=16, v=1000):
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (b, l, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, v), jnp.float32) * 0.3).astype(dtype)
  labels = jax.random.randint(k[2], (b, l), 0, v)
  mask = jnp.ones((b, l), jnp.float32).at[0, l // 2:].set(0.0)
  return h, w, labels, mask


def test_num_chunks():
  # [rows, positions, vocab] fp32 per device against the budget; n divides the positions.
  assert loss_lib.num_chunks((4, 4096, 128256), 0) == 1
  assert loss_lib.num_chunks((4, 4096, 128256), 1024) == 8      # 7.8 GiB -> 8 chunks of 512
  assert loss_lib.num_chunks((2, 1024, 128256), 1024) == 1      # 0.98 GiB fits
  assert loss_lib.num_chunks((2, 1024, 128256), 256) == 4
  assert loss_lib.num_chunks((1, 96, 128256), 10) == 6          # needs 5: the next divisor
  assert loss_lib.num_chunks((1, 4, 128256), 0.1) == 4          # at most one position each
  assert loss_lib.num_chunks((4, 4096, 128256), 1024, 2) == 4   # bf16 logits: half the bytes


@pytest.mark.parametrize("dtype, logits, tol", [(jnp.float32, "float32", 1e-5),
                                                 (jnp.bfloat16, "float32", 2e-2),
                                                 (jnp.bfloat16, "bfloat16", 2e-2)])
def test_chunked_equals_unchunked(dtype, logits, tol):
  """Loss, dh and dW of the chunked custom_vjp (4 chunks) equal autodiff of the unchunked
  loss, under a cotangent other than 1, with fp32 and with bf16 logits; forward-only
  evaluation gives the same loss."""
  h, w, labels, mask = _inputs(dtype)
  budget = 2 * 32 * 1000 * jnp.dtype(logits).itemsize / 2**20 / 4  # a quarter: 4 chunks
  assert loss_lib.num_chunks((2, 32, 1000), budget, jnp.dtype(logits).itemsize) == 4

  def f(h, w, budget):
    s, n = loss_lib.head_loss_sums(h, w, labels, mask, logits=loss_lib.Logits(budget, logits))
    return 0.37 * s, n

  (want, n_want), g_want = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w, 0.0)
  (got, n_got), g_got = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True),
                                static_argnums=2)(h, w, budget)
  assert float(n_got) == float(n_want) == 48.0
  np.testing.assert_allclose(got, want, rtol=tol)
  np.testing.assert_allclose(jax.jit(f, static_argnums=2)(h, w, budget)[0], want, rtol=tol)
  for a, b in zip(g_got, g_want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.dtype == b.dtype and np.abs(a - b).max() <= tol * np.abs(b).max()


CHUNKED = ("train.logits_chunk_mb=0.02",)  # one device's 16 x 32 x 256 fp32 logits: 0.5 MiB


@pytest.mark.parametrize("n, layout", [
    (1, ("mesh.data=1",)),
    (4, ("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
         "parallel.collectives=manual")),
    (4, ("mesh.data=2", "mesh.tensor=2")),
    (4, ("mesh.sequence=2", "mesh.data=2")),
    (4, ("mesh.stage=2", "mesh.data=2", "pipeline.microbatches=2",
         "parallel.collectives=manual")),
    (4, ("mesh.fsdp=4", "parallel.zero_stage=3")),  # dW laid out as its fsdp shard
])
def test_training_with_chunks_matches_one_device(n, layout):
  """Train steps with the chunked loss (vocab-parallel under tensor in both modes, strided chunks
  of a sequence split over `sequence` in xla mode, in a pipeline's last stage) give the
  unchunked single-device losses and gradient norms."""
  cfg = small_config(None, *BASE, *CHUNKED, *layout)
  rt = runtime.build(cfg, jax.devices()[:n])
  text = rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)).as_text(debug_info=True)
  assert "head_loss_chunked" in text  # every device's logits exceed the budget
  np.testing.assert_allclose(losses(CHUNKED + layout, jax.devices()[:n]), reference(),
                             rtol=2e-5)


@pytest.mark.parametrize("n, layout", [
    (4, ("mesh.data=2", "mesh.tensor=2")),
    (4, ("mesh.data=2", "mesh.sequence=2")),
])
def test_chunks_move_no_more_than_the_unchunked_loss(n, layout):
  """xla mode: the loss and dW are summed per device inside the chunk scan and reduced once
  after it; summing the sharded tokens inside the loop all-reduced dW once per chunk. Under a
  vocab split the one-pass softmax statistics (`max_sum_exp`) are combined by GSPMD as an
  all-gather of each shard's (max, sum) pair: at most 16 bytes a token, where the two-pass
  form all-reduced the max and the sum."""
  volume = {}
  for mb in ("0", "0.02"):
    cfg = small_config(None, *BASE, f"train.logits_chunk_mb={mb}", *layout)
    rt = runtime.build(cfg, jax.devices()[:n])
    text = rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)).compile().as_text()
    volume[mb] = {k: v["bytes"] for k, v in hlo.summary(text).items()}
  tokens = cfg.train.batch_size * cfg.train.seq_len // cfg.mesh.data
  assert volume["0.02"]["all-reduce"] <= volume["0"]["all-reduce"], volume
  extra = sum(volume["0.02"].values()) - sum(volume["0"].values())
  assert extra <= 16 * tokens * (cfg.mesh.tensor > 1), volume


VOCAB_128K = ("model.preset=tiny", "model.vocab_size=128256", "model.d_model=64",
              "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
              "model.dtype=bfloat16", "train.batch_size=2", "train.seq_len=1024", "mesh.data=1")


def test_chunked_loss_memory_at_llama3_vocab():
  """Compiled temp memory of a step at vocab 128,256, batch 2 x seq 1024: ~2.7x the fp32
  logits' size unchunked, under 1x in chunks of 256 MiB (4 chunks)."""
  from jscale.config_load import load_config
  logits = 2 * 1024 * 128256 * 4
  temp = {}
  for mb in (0, 256):
    cfg = load_config(None, [*VOCAB_128K, f"train.logits_chunk_mb={mb}"])
    temp[mb] = memory(compile_train_step(cfg, jax.devices()[:1])[0])["temp"] / logits
  assert temp[0] > 2.5, temp
  assert temp[256] < 1.0, temp


def test_max_sum_exp_in_one_pass():
  """(max, sum exp(x - max)) by the online reduction equals the two-pass one, with rows that
  hold -inf entries (a masked vocab) and a row of only -inf (max -inf, sum 0, no nan)."""
  x = 8.0 * jax.random.normal(jax.random.key(3), (5, 7, 300), jnp.float32)
  x = x.at[1, :, ::3].set(-jnp.inf).at[2, 4].set(-jnp.inf)
  m, s = jax.jit(loss_lib.max_sum_exp)(x)
  want_m = jnp.max(x, axis=-1, keepdims=True)
  ok = np.isfinite(np.asarray(want_m))
  want_s = jnp.sum(jnp.exp(x - jnp.where(ok, want_m, 0.0)), axis=-1, keepdims=True)
  np.testing.assert_array_equal(m, want_m)
  np.testing.assert_allclose(s, want_s, rtol=2e-6)
  assert float(m[2, 4, 0]) == -np.inf and float(s[2, 4, 0]) == 0.0



def test_the_online_combine_takes_one_exp_for_the_symmetric_forms_values():
  """The online reduction's combiner rescales only the part with the smaller max (one exp an
  element, where the symmetric s1·exp(m1 - m) + s2·exp(m2 - m) takes two): the same (max,
  sum) bit for bit over rows with -inf entries and a row of only -inf."""
  def symmetric(a, b):
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    at = jnp.where(m == -jnp.inf, 0.0, m)
    return m, s1 * jnp.exp(m1 - at) + s2 * jnp.exp(m2 - at)

  x = 8.0 * jax.random.normal(jax.random.key(4), (16, 7, 3000), jnp.float32)
  x = x.at[1, :, ::3].set(-jnp.inf).at[2, 4].set(-jnp.inf)
  start = (jnp.float32(-jnp.inf), jnp.float32(0.0))
  reduce = lambda combine: jax.jit(lambda x: jax.lax.reduce(
      (x, jnp.ones_like(x)), start, combine, (2,)))(x)
  for got, want in zip(reduce(loss_lib._online_combine), reduce(symmetric)):
    np.testing.assert_array_equal(got, want)
  pair = (jnp.float32(0.0), jnp.float32(1.0))
  eqns = jax.make_jaxpr(loss_lib._online_combine)(pair, pair).eqns
  assert [e.primitive.name for e in eqns].count("exp") == 1

def _vocab_reductions(jaxpr, vocab: int) -> list[str]:
  """Names of the reductions over a last axis of size `vocab`, in `jaxpr` and its inner ones."""
  found = []
  for eqn in jaxpr.eqns:
    shape = getattr(eqn.invars[0].aval, "shape", ()) if eqn.invars else ()
    if "reduce" in eqn.primitive.name and shape and shape[-1] == vocab and (
        len(shape) - 1 in eqn.params.get("axes", eqn.params.get("dimensions", ()))):
      found.append(eqn.primitive.name)
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
        if hasattr(inner, "eqns"):
          found += _vocab_reductions(inner, vocab)
  return found


def test_chunked_loss_reads_the_logits_twice():
  """Each chunk's fp32 logits are reduced once (max and sum-exp together) and read once more
  for the softmax gradient: no separate max over the vocab, and the label's logit gathered,
  not summed over it (on the DeepSeek-V3 16B proxy that sum was a 1.7 GB pass of its own,
  0.56 ms predicted on an H100). The chunk's code is traced twice: the first chunk, which
  starts the sums, and the loop's."""
  h, w, labels, mask = _inputs(jnp.bfloat16)
  f = lambda h, w: loss_lib.head_loss_sums(h, w, labels, mask, logits=loss_lib.Logits(0.03))[0]
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, w).jaxpr
  assert sorted(_vocab_reductions(jaxpr, 1000)) == ["reduce", "reduce"]


def _eqns(jaxpr):
  """Every equation of `jaxpr` and its inner ones."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def test_chunked_head_gradient_is_not_summed_into_zeros():
  """The first chunk's dW starts the sum over chunks: no fp32 [D, V] accumulator is filled with
  zeros (at vocab 102,400 and d_model 2048 that is 0.8 GB written before the first product)."""
  h, w, labels, mask = _inputs(jnp.bfloat16)
  f = lambda h, w: loss_lib.head_loss_sums(h, w, labels, mask, logits=loss_lib.Logits(0.03))[0]
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, w).jaxpr
  head = [e for e in _eqns(jaxpr) if e.outvars and
          getattr(e.outvars[0].aval, "shape", ())[-2:] == w.shape]
  assert any(e.primitive.name == "dot_general" for e in head)  # the dW products are found
  filled = [e for e in head if e.primitive.name == "broadcast_in_dim"]
  assert not filled, filled


def _vocab_dots(jaxpr, vocab: int) -> list[str]:
  """Output dtypes of the dot_generals that make logits ([batch, positions, `vocab]`; not the
  head's dW), in `jaxpr` and its inner ones."""
  found = []
  for eqn in jaxpr.eqns:
    shape = getattr(eqn.outvars[0].aval, "shape", ()) if eqn.outvars else ()
    if eqn.primitive.name == "dot_general" and len(shape) == 3 and shape[-1] == vocab:
      out = eqn.outvars[0].aval
      found.append(str(out.dtype))
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += _vocab_dots(inner, vocab)
  return found


@pytest.mark.parametrize("budget", [0.0, 0.03])
def test_bf16_logits_are_written_in_bf16_and_train_as_fp32(budget):
  """`train.logits_dtype=bfloat16`: every product that makes logits writes them in bf16 (what
  halves the loss's passes over them), chunked or not; the loss and both gradients stay within
  bf16's rounding of the fp32-logits loss."""
  h, w, labels, mask = _inputs(jnp.bfloat16)

  def f(h, w, dtype):
    return loss_lib.head_loss_sums(h, w, labels, mask, logits=loss_lib.Logits(budget, dtype))[0]

  grad = lambda dtype: jax.value_and_grad(f, argnums=(0, 1))
  for dtype in ("float32", "bfloat16"):
    forward = jax.make_jaxpr(lambda h, w: f(h, w, dtype))(h, w).jaxpr
    assert set(_vocab_dots(forward, 1000)) == {dtype}
  # (fp32 logits' custom backward replays the bf16 product for its pullback, dead code)
  both = jax.make_jaxpr(lambda h, w: grad("bfloat16")(h, w, "bfloat16"))(h, w).jaxpr
  assert set(_vocab_dots(both, 1000)) == {"bfloat16"}
  want, g_want = jax.jit(grad("float32"), static_argnums=2)(h, w, "float32")
  got, g_got = jax.jit(grad("bfloat16"), static_argnums=2)(h, w, "bfloat16")
  np.testing.assert_allclose(got, want, rtol=5e-3)
  for a, b in zip(g_got, g_want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 3e-2 * np.abs(b).max()
