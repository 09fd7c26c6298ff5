"""Ring attention (context parallelism) on simulated CPU devices against dense causal attention:
values and gradients, zig-zag and contiguous, MHA and GQA; the balance of the schedule it
executes; its residuals and the largest array it materialises."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jscale.analysis import hlo
from jscale.parallel.context.order import token_order
from jscale.model.attention import xla_attention
from jscale.parallel.context import ring as ra

B, S, H, K = 2, 64, 4, 8


def _mesh(n):
  return jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:n])


def _inputs(g, dtype=jnp.float32, s=S, b=B, h=H):
  rng = np.random.default_rng(g)
  shapes = [(b, s, h, K), (b, s, g, K), (b, s, g, K), (b, s, h, K)]
  return [jnp.asarray(rng.normal(size=x), jnp.float32).astype(dtype) for x in shapes]


def _ring_fn(n, layout, causal=True):
  """Global [B, S, ...] in natural order -> (out, dq, dk, dv) through the ring, in natural order."""
  order = token_order(S, n, layout)
  ring = jax.shard_map(lambda q, k, v: ra.ring_attention(q, k, v, "sequence", layout=layout,
                                                         causal=causal),
                       mesh=_mesh(n), in_specs=P(None, "sequence"), out_specs=P(None, "sequence"),
                       check_vma=False)

  def f(q, k, v, do):
    out, vjp = jax.vjp(lambda *a: ring(*(x[:, order] for x in a)), q, k, v)
    grads = vjp(do[:, order])
    back = np.argsort(order)
    return (out[:, back],) + grads

  return jax.jit(f)


def _dense(q, k, v, do, causal=True):
  out, vjp = jax.vjp(lambda *a: xla_attention(*a, causal=causal), q, k, v)
  return (out,) + vjp(do)


@pytest.mark.parametrize("g", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_matches_dense_fp32(n, layout, g):
  args = _inputs(g)
  for name, got, want in zip(("out", "dq", "dk", "dv"), _ring_fn(n, layout)(*args),
                             _dense(*args)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)


def test_matches_dense_bf16():
  args = _inputs(2, jnp.bfloat16)
  want = _dense(*(x.astype(jnp.float32) for x in args))  # fp32 math on the same inputs
  for name, got, w in zip(("out", "dq", "dk", "dv"), _ring_fn(4, "zigzag")(*args), want):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), w, atol=2e-2, rtol=0, err_msg=name)


def test_not_causal():
  args = _inputs(2)
  for got, want in zip(_ring_fn(4, "zigzag", causal=False)(*args), _dense(*args, causal=False)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_schedule_skips_blocks_above_the_diagonal():
  # contiguous: device i computes its diagonal and the i blocks of earlier devices, no more.
  table = ra.schedule(4, "contiguous")
  assert [sum(len(step) > 0 for step in row) for row in table] == [1, 2, 3, 4]
  # zigzag: every device computes at every step.
  assert all(len(step) > 0 for row in ra.schedule(4, "zigzag") for step in row)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_balance_of_the_executed_schedule(n):
  """Score elements each device computed, counted by the executor while it ran."""
  q, k, v, _ = _inputs(2)
  ratios = {}
  for layout in ("zigzag", "contiguous"):
    order = token_order(S, n, layout)
    count = jax.shard_map(
        lambda q, k, v: ra.blocks_computed(q, k, v, "sequence", layout=layout)[None],
        mesh=_mesh(n), in_specs=P(None, "sequence"), out_specs=P("sequence"), check_vma=False)
    done = np.asarray(jax.jit(count)(q[:, order], k[:, order], v[:, order]))
    np.testing.assert_array_equal(done, ra.work(n, layout))  # the table is what ran
    ratios[layout] = done.max() / done.min()
  assert ratios["zigzag"] <= 1.05
  assert ratios["contiguous"] == pytest.approx(n)  # device n-1 does n blocks, device 0 one


def test_backward_saves_only_local_qkv_out_and_lse():
  q, k, v, _ = _inputs(2)
  saved = []

  def inner(q, k, v):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      print_saved_residuals(lambda *a: ra.ring_attention(*a, "sequence").sum(), q, k, v)
    saved.extend(line.split()[0].replace("float32", "f32")  # spelling differs across jax
                 for line in buf.getvalue().splitlines())
    return q

  jax.shard_map(inner, mesh=_mesh(4), in_specs=P(None, "sequence"),
                out_specs=P(None, "sequence"), check_vma=False)(q, k, v)
  lq = S // 4
  q_, kv, lse = f"f32[{B},{lq},{H},{K}]", f"f32[{B},{lq},2,{K}]", f"f32[{B},{lq},{H}]"
  assert sorted(saved) == sorted([q_, kv, kv, q_, lse])  # q, k, v, out, lse


def test_no_score_buffer_beyond_block_size():
  """Forward + backward at S=1024 over 4 devices: nothing in the compiled program is as large as
  one (S/n) x (S/n) score block per head, while the all-gather variant's (S/n) x S scores are."""
  s, n = 1024, 4
  q, k, v, do = _inputs(4, s=s, b=1)
  mesh = _mesh(n)
  spec = NamedSharding(mesh, P(None, "sequence"))
  bound = 1 * H * (s // n) ** 2

  def grad_of(attend):
    return jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do), in_shardings=spec)

  ring = jax.shard_map(lambda q, k, v: ra.ring_attention(q, k, v, "sequence"), mesh=mesh,
                       in_specs=P(None, "sequence"), out_specs=P(None, "sequence"),
                       check_vma=False)
  replicated = NamedSharding(mesh, P())

  def gathered(q, k, v):
    k, v = (jax.lax.with_sharding_constraint(x, replicated) for x in (k, v))
    pos = jnp.arange(s)[None]
    return jax.lax.with_sharding_constraint(
        xla_attention(q, k, v, positions=(pos, pos)), spec)

  sizes = {}
  for name, attend in (("ring", ring), ("all_gather", gathered)):
    compiled = grad_of(attend).lower(q, k, v, do).compile()
    sizes[name] = hlo.largest_array(compiled.as_text())[0]
  assert sizes["ring"] <= bound
  assert sizes["all_gather"] >= 4 * bound  # the test would catch an (S/n) x S buffer


def test_traces_at_long_context():
  """128k tokens over 2 devices: the executor's block count stays an int32 (it counted score
  elements once: 65536² x 3/4 overflowed while tracing)."""
  q = jax.ShapeDtypeStruct((1, 131072, 1, 8), jnp.bfloat16)
  ring = jax.shard_map(lambda q, k, v: ra.ring_attention(q, k, v, "sequence"), mesh=_mesh(2),
                       in_specs=P(None, "sequence"), out_specs=P(None, "sequence"),
                       check_vma=False)
  assert jax.eval_shape(ring, q, q, q).shape == q.shape
