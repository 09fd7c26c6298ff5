"""Packed documents masked (`data.document_mask`): the windows' document starts; the model on a
packed batch equals each document run alone (logits and gradients; plain XLA and the flash
kernel, GQA and MLA); every parallel layout's steps equal one device's with the same documents
(context parallelism splits documents across shards: the ring, the K/V all-gather and Ulysses,
in both modes; TP + SP; a pipeline); cuDNN's mask is the reference mask, and `auto` runs the
flash kernel on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import deepseek_case
from conftest import small_config
from jscale import predict, runtime
from jscale.analysis import gpu_target
from jscale.data.windows import Windows
from jscale.model import attention as attn_lib
from jscale.model import llama
from jscale.model.positions import Positions
from jscale.parallel.context.order import Reorder
from parity import BASE, doc_starts, losses, reference

DOCS = ("data.document_mask=true",)
L = 32


def test_windows_mark_documents():
  eos = 0
  stream = np.array([5, 6, eos, 7, eos, eos, 8, 9, 10, eos, 11], np.uint16)
  w = Windows(stream, seq_len=8, pad_id=eos, eos_id=eos)
  first = w[0]  # tokens 5 6 E 7 E E 8 9: documents start at 0, 3, 5, 6
  np.testing.assert_array_equal(first["doc_starts"], [0, 0, 0, 3, 3, 5, 6, 6])
  # The next window starts a document at its edge (10, the rest of the cut 8 9 10), and its
  # padding (EOS, out of the loss) ends 11's document, then makes documents of one token each.
  second = w[1]
  np.testing.assert_array_equal(second["tokens"][:3], [10, eos, 11])
  np.testing.assert_array_equal(second["doc_starts"], [0, 0, 2, 2, 4, 5, 6, 7])
  assert "doc_starts" not in Windows(stream, 8, eos)[0]
  # Context parallelism's order permutes the documents with the tokens.
  out = Reorder(8, 2, "zigzag")(first)
  np.testing.assert_array_equal(out["doc_starts"], first["doc_starts"][out["positions"]])


def _packed_vs_alone(cfg, alone_cfg):
  """(packed logits, per-document logits placed alike; packed grads, summed per-document
  grads) of a function of the logits, on 2 rows of 4 random documents each."""
  model = llama.create(cfg, seed=0)
  graphdef, params = nnx.split(model, nnx.Param)
  alone_graphdef = nnx.split(llama.create(alone_cfg, seed=0), nnx.Param)[0]
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, L)), jnp.int32)
  starts = doc_starts(rng, 2, L)
  weight = jnp.asarray(rng.normal(size=(2, L, cfg.vocab_size)), jnp.float32)
  index = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (2, L))

  def packed(p):
    logits = nnx.merge(graphdef, p)(tokens, Positions(index, jnp.asarray(starts)))
    return jnp.sum(logits * weight), logits

  docs = [(r, s, e) for r in range(2) for s, e in zip(*_bounds(starts[r]))]

  def alone(p):
    m = nnx.merge(alone_graphdef, p)
    outs = [(r, s, e, m(tokens[r:r + 1, s:e])[0]) for r, s, e in docs]
    total = sum(jnp.sum(o * weight[r, s:e]) for r, s, e, o in outs)
    return total, outs

  (_, got), g_got = jax.value_and_grad(packed, has_aux=True)(params)
  (_, outs), g_want = jax.value_and_grad(alone, has_aux=True)(params)
  want = jnp.zeros_like(got)
  for r, s, e, o in outs:
    want = want.at[r, s:e].set(o)
  return got, want, g_got, g_want


def _bounds(starts_L: np.ndarray):
  begins = np.flatnonzero(np.r_[True, starts_L[1:] != starts_L[:-1]])
  return begins, np.r_[begins[1:], len(starts_L)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_packed_documents_equal_each_document_alone(impl, arch):
  """Logits and every parameter's gradient; the flash kernel (interpreted) against documents
  run alone in plain XLA."""
  model = ((*deepseek_case.DS, "model.moe=null", "model.mtp=null", "model.rope_scaling=null")
           if arch == "mla" else ())
  cfg = small_config(None, *model, "model.n_layers=1", "model.kernel_interpret=true",
                     f"train.seq_len={L}", f"model.attention_impl={impl}").model
  alone = small_config(None, *model, "model.n_layers=1", "model.attention_impl=xla").model
  got, want, g_got, g_want = _packed_vs_alone(cfg, alone)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4), g_got,
               g_want)


# Every layout against one device with the same documents (`parity.batches`: 4 random documents
# a row, cut anywhere, so the zig-zag chunks split them across shards).
CP4 = ("mesh.sequence=4", "mesh.data=2")
MANUAL = ("parallel.collectives=manual",)
ULYSSES = ("parallel.context_impl=ulysses",)
LAYOUTS = {
    "xla_ring_cp4": CP4 + ("model.attention_impl=ring",),
    "xla_allgather_cp4": CP4 + ("model.attention_impl=xla",),
    "manual_ring_cp4": CP4 + MANUAL,
    "manual_ring_cp2_tp2_sp": ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2",
                               "parallel.sequence_parallel=true") + MANUAL,
    "xla_ulysses_cp4": CP4 + ULYSSES,
    "manual_ulysses_cp2_tp2": ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2") + ULYSSES +
                              MANUAL,
    "xla_ulysses_cp2_flash": ("mesh.sequence=2", "mesh.data=4", "model.attention_impl=pallas",
                              "model.kernel_interpret=true") + ULYSSES,
    "xla_tp2_sp_dp4": ("mesh.tensor=2", "mesh.data=4", "parallel.sequence_parallel=true"),
    "pipeline_1f1b": ("mesh.stage=2", "mesh.data=1", "pipeline.microbatches=4"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_device(layout):
  devices = jax.devices()[:2] if "mesh.stage=2" in layout else None
  np.testing.assert_allclose(losses(DOCS + layout, devices), reference(*DOCS), rtol=1e-5)


def test_documents_change_the_loss():
  """The mask is on: the same batches without it give other losses."""
  assert not np.allclose(reference(*DOCS), reference(), rtol=1e-3)


def test_cudnns_document_mask_is_the_reference_mask():
  """cuDNN reads documents as `jax.nn.dot_product_attention`'s boolean mask
  (`attention.nn_attention`); the same call with XLA's implementation, on CPU, equals plain
  attention within documents, values and gradients."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, L, 4, 16)), jnp.float32) for _ in range(3))
  docs = jnp.asarray(doc_starts(rng, 2, L))
  p = Positions(jnp.broadcast_to(jnp.arange(L), (2, L)), docs)
  ours = lambda q, k, v: attn_lib.nn_attention(q, k, v, True, docs, "xla")
  ref = lambda q, k, v: attn_lib.xla_attention(q, k, v, positions=(p, p))
  np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), atol=1e-5)
  g = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g(ours), g(ref))


H100_DOCS = (*DOCS, "model.dtype=bfloat16", "model.d_model=128", "model.n_heads=2",
             "model.n_kv_heads=2", "train.seq_len=256", "mesh.data=1")


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_on_a_gpu_auto_is_the_flash_kernel_and_cudnn_takes_a_mask():
  rt = runtime.build(small_config(None, *H100_DOCS), gpu_target.devices("h100x1"))
  assert rt.cfg.model.attention_impl == "pallas"
  assert "document" in rt.kernels.attention_why
  cfg = small_config(None, *H100_DOCS, "model.attention_impl=cudnn", "checkpoint.every=0")
  text = predict.compile_for(cfg, "h100x1")[0]
  assert "__cudnn$fmhaScaleBiasSoftmax" in text and "__cudnn$fmhaSoftmax\"" not in text


def test_a_batch_without_document_starts_is_an_error():
  rt = runtime.build(small_config(None, *BASE, *DOCS), jax.devices()[:1])
  b = {k: np.zeros((16, 32), np.int32) for k in ("tokens", "labels", "loss_mask")}
  with pytest.raises(ValueError, match="doc_starts"):
    rt.train_step()(rt.init_state(), jax.device_put(b, rt.layouts.batch()))
