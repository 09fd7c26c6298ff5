"""Each comms-seam operation alone, on the same global inputs in three ways: the plain
single-device math (`LOCAL`), xla mode (sharding constraints) and manual mode (collectives inside
shard_map). Forward values and gradients must agree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_config
from jscale import runtime
from jscale.analysis import hlo
from jscale.step.loss import cross_entropy_sums
from jscale.parallel import buckets
from jscale.parallel.comms import LOCAL
from jscale.parallel.manual import ManualComms
from jscale.parallel.xla import XlaComms

B, L, D, F, V = 4, 8, 16, 32, 256


@functools.lru_cache(maxsize=None)
def _comms(*overrides, collective_matmul=False):
  rt = runtime.build(small_config(None, "model.n_kv_heads=4", "train.batch_size=16", *overrides))
  return rt, XlaComms(rt.layouts), ManualComms(rt.layouts, rt.cfg.parallel.bucket_mb,
                                               collective_matmul)


def _three_ways(fn, args, in_specs, grad_specs, sp, collective_matmul=False, loss_atol=0.0):
  """value_and_grad of `fn(comms, *args)` with LOCAL, xla and manual comms. Manual sums the
  loss over `data` (each device saw its rows) and, under SP, over `tensor` (its sequence
  slice), and the gradients of data-replicated arguments over `data`."""
  rt, xla, manual = _comms("mesh.data=2", "mesh.tensor=4", f"parallel.sequence_parallel={sp}",
                           collective_matmul=collective_matmul)
  argnums = tuple(range(len(grad_specs)))
  ref = jax.value_and_grad(functools.partial(fn, LOCAL), argnums)(*args)
  got_xla = jax.jit(jax.value_and_grad(functools.partial(fn, xla), argnums))(*args)

  def local(*a):
    loss, grads = jax.value_and_grad(functools.partial(fn, manual), argnums)(*a)
    grads = [g if "data" in s else jax.lax.psum(g, "data") for g, s in zip(grads, grad_specs)]
    return jax.lax.psum(loss, ("data", "tensor") if sp else "data"), tuple(grads)

  got_manual = jax.jit(jax.shard_map(local, mesh=rt.mesh, in_specs=in_specs,
                                     out_specs=(P(), tuple(grad_specs)), check_vma=False))(*args)
  for got in (got_xla, got_manual):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=loss_atol)
    for g, r in zip(got[1], ref[1]):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(r).max())


def _normal(key, *shape):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_f_and_g_around_column_and_row_linears(sp):
  """enter (f, or SP's all-gather) -> column linear -> row linear -> leave (g, or SP's
  reduce-scatter), as in every block."""
  def fn(comms, x_BLD, w1_DF, w2_FD, ct_BLD):
    h_BLF = jnp.tanh(jnp.einsum("BLD,DF->BLF", comms.enter_tensor_parallel(x_BLD), w1_DF))
    y_BLD = comms.leave_tensor_parallel(jnp.einsum("BLF,FD->BLD", h_BLF, w2_FD))
    return jnp.sum(y_BLD * ct_BLD)

  seq = "tensor" if sp else None
  args = (_normal(0, B, L, D), _normal(1, D, F), _normal(2, F, D), _normal(3, B, L, D))
  _three_ways(fn, args, (P("data", seq), P(None, "tensor"), P("tensor", None), P("data", seq)),
              [P("data", seq), P(None, "tensor"), P("tensor", None)], sp)


@pytest.mark.parametrize("sp, cm", [(False, False), (True, False), (True, True)],
                         ids=["tp", "tp_sp", "collective_matmul"])
def test_column_linears_and_row_linear_entering_the_region_themselves(sp, cm):
  """`tp_column` (two column linears sharing the gathered input) and `tp_row`, as the block's
  GQA and MLP call them; with collective matmul the collectives are ring steps fused with the
  products (`ring_gather_linears`, `ring_linear_scatter`)."""
  def fn(comms, x_BLD, wa_DF, wb_DF, w2_FD, ct_BLD):
    a_BLF, b_BLF = comms.tp_column(x_BLD, [lambda h: jnp.einsum("BLD,DF->BLF", h, wa_DF),
                                           lambda h: jnp.einsum("BLD,DF->BLF", h, wb_DF)])
    y_BLD = comms.tp_row(jnp.tanh(a_BLF) * b_BLF,
                         lambda h: jnp.einsum("BLF,FD->BLD", h, w2_FD))
    return jnp.sum(y_BLD * ct_BLD)

  seq = "tensor" if sp else None
  args = (_normal(0, B, L, D), _normal(1, D, F), _normal(4, D, F), _normal(2, F, D),
          _normal(3, B, L, D))
  col = P(None, "tensor")
  _three_ways(fn, args, (P("data", seq), col, col, P("tensor", None), P("data", seq)),
              [P("data", seq), col, col, P("tensor", None)], sp, cm,
              loss_atol=1e-5 * float(jnp.sum(jnp.abs(args[-1]))))  # a sum that cancels


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_vocab_parallel_embedding(sp):
  def fn(comms, table_VD, tokens_BL, ct_BLD):
    return jnp.sum(comms.embed(table_VD, tokens_BL) * ct_BLD)

  tokens = jax.random.randint(jax.random.key(4), (B, L), 0, V)
  _three_ways(fn, (_normal(5, V, D), tokens, _normal(6, B, L, D)),
              (P("tensor", None), P("data"), P("data", "tensor" if sp else None)),
              [P("tensor", None)], sp)


def test_vocab_parallel_cross_entropy():
  """max, sum-exp and the label logit reduced over tensor; no rank holds the full vocab."""
  def fn(comms, logits_BLV, labels_BL, mask_BL):
    loss_sum, count = cross_entropy_sums(logits_BLV, labels_BL, mask_BL, comms)
    return loss_sum / 1000.0 + 0.0 * count

  labels = jax.random.randint(jax.random.key(7), (B, L), 0, V)
  mask = (jax.random.uniform(jax.random.key(8), (B, L)) > 0.3).astype(jnp.float32)
  _three_ways(fn, (3.0 * _normal(9, B, L, V), labels, mask),
              (P("data", None, "tensor"), P("data"), P("data")), [P("data", None, "tensor")],
              False)


@pytest.mark.parametrize("zero", [0, 1])
def test_bucketed_gradient_reduction(zero):
  """sync_grads on 8 different per-device gradients gives their sum (ZeRO-1: each device its
  fsdp shard of it), with small buckets so that several collectives run."""
  rt, _, _ = _comms("mesh.data=2", "mesh.fsdp=4", f"parallel.zero_stage={zero}",
                    "parallel.bucket_mb=0.05")
  manual = ManualComms(rt.layouts, 0.05)
  shapes = rt.state_shapes["params"]
  keys = iter(range(100, 200))
  per_device = jax.tree.map(lambda s: _normal(next(keys), 8, *s.shape), shapes)
  opt = rt.layouts.opt
  sync = jax.jit(jax.shard_map(
      lambda g: manual.sync_grads(jax.tree.map(lambda x: x[0], g)), mesh=rt.mesh,
      in_specs=(jax.tree.map(lambda _: P(("data", "fsdp")), shapes),), out_specs=opt,
      check_vma=False))
  got = sync(per_device)
  jax.tree.map(lambda g, x: np.testing.assert_allclose(g, np.sum(x, 0), rtol=1e-5, atol=1e-5),
               got, per_device)
  # One [1, N] operand per bucket (XLA's combiner may merge them into one tuple-shaped op).
  leaves, treedef = jax.tree.flatten(shapes)
  n_buckets = len(buckets.pack(leaves, treedef.flatten_up_to(manual.step_plans), 50_000))
  assert n_buckets >= 8  # 460 kB of gradients
  kind = "reduce-scatter" if zero else "all-reduce"
  ops = [c for c in hlo.collectives(sync.lower(per_device).compile().as_text()) if c.kind == kind]
  assert sum(s.startswith("f32[1,") for c in ops for s in c.shapes) == n_buckets


def test_buckets_follow_the_backward():
  """Head first, then layers from last to first, the embedding last; buckets respect the size."""
  rt, _, _ = _comms("mesh.data=8")
  manual = ManualComms(rt.layouts, 0.05)
  leaves, treedef = jax.tree.flatten(rt.state_shapes["params"])
  plans = treedef.flatten_up_to(manual.step_plans)
  names = [jax.tree_util.keystr(k) for k, _ in
           jax.tree_util.tree_flatten_with_path(rt.state_shapes["params"])[0]]
  order = [(names[i], layer) for _, members in buckets.pack(leaves, plans, 50_000)
           for i, layer in members]
  layers = [layer for _, layer in order if layer is not None]
  assert "lm_head" in order[0][0] or "final_norm" in order[0][0]
  assert "embed" in order[-1][0]
  assert layers == sorted(layers, reverse=True)
  for _, members in buckets.pack(leaves, plans, 50_000):
    sizes = [leaves[i].dtype.itemsize * np.prod(leaves[i].shape[1 if l is not None else 0:])
             for i, l in members]
    assert len(members) == 1 or sum(sizes) <= 50_000
