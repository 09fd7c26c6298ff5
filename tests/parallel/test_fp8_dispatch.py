"""The FP8 dispatch (`model.moe.dispatch_dtype: e4m3`, `jscale.fp8.wire`): rows go out as e4m3
with a power-of-two scale per row, D + 4 bytes; results and gradients come back in the compute
dtype (with `model.moe.dispatch_grad_dtype: e4m3` the backward's output gradients go out to
the experts in e4m3 too, rounded per row and hop). Checked: the wire format against the row-scaled quantisation it encodes; the flat and
node-limited exchanges on 8 simulated devices equal one device on the rows rounded once (hop 2
re-encodes hop 1's rows exactly), gradients passing straight through; with the experts' FP8
products scaled per row the tiny DeepSeek trains under node-limited EP as one device (the
dispatch adds no rounding); XLA:GPU's H100 program sends u8 rows of D + 4 bytes forward and
compute-dtype rows back, and `jscale.predict` prices their bytes. With
`model.moe.combine_dtype: e4m3` the outputs come back rounded per row and hop, and the H100
program's only bf16 rows are the inputs' gradients; with `model.moe.combine_grad_dtype: e4m3`
those come back rounded per row and hop too, and no bf16 row is left."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import deepseek_case
import parity
from jscale.analysis import gpu_target, hlo
from jscale.fp8 import grouped, scaling, wire
from jscale.model import moe_dispatch as md
from jscale.model import router
from jscale.parallel import exchange_slots as slots_lib
from jscale.parallel import expert_exchange as ex
from jscale.predict import launches

N, T, D, F, E, K = 8, 16, 8, 8, 16, 4  # devices, tokens per device, model, hidden, experts, top-k
W_SPEC = md.ExpertWeights(P("expert"), P("expert"))
WIRE = wire.e4m3_rows(jnp.float32)


def _inputs(n_group, topk_group, dtype=jnp.float32):
  rng = np.random.default_rng(n_group)
  # Rows across 8 binades: a scale per row keeps each row's values on its own e4m3 grid.
  x = rng.normal(size=(N * T, D)) * 2.0 ** rng.integers(-8, 0, size=(N * T, 1))
  scores = jnp.asarray(rng.normal(size=(N * T, E)), jnp.float32)
  ids = router.group_limited_top_k(scores, K, n_group, topk_group)
  gates = jax.nn.softmax(jnp.take_along_axis(scores, ids, -1), -1)
  w = md.ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.3, dtype)
                         for s in ((E, D, 2, F), (E, F, D))))
  return jnp.asarray(x, dtype), ids, gates, w


def test_the_wire_carries_each_row_in_e4m3_with_its_scale():
  x = _inputs(2, 1)[0].astype(jnp.bfloat16)
  b = wire.e4m3_rows(jnp.bfloat16).encode(x)
  assert b.dtype == jnp.uint8 and b.shape == (N * T, D + 4)
  s = grouped.scales_along(x, 1, scaling.E4M3)
  want = scaling.dequantize(scaling.quantize(x, s, scaling.E4M3), s, jnp.bfloat16)
  got = wire.e4m3_rows(jnp.bfloat16).decode(b)
  np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))
  assert float(jnp.max(jnp.abs(got - x) / jnp.max(jnp.abs(x), 1, keepdims=True))) < 2 ** -4
  # A receive buffer's untouched (zero) bytes read as zero rows.
  assert not np.any(wire.e4m3_rows(jnp.bfloat16).decode(jnp.zeros((3, D + 4), jnp.uint8)))


def test_row_scaled_products_quantise_a_decoded_row_exactly():
  """What makes the dispatch free under `fp8.experts_scaling: row`: the products' own per-row
  quantisation of a decoded row gives back its values, including rows whose largest value
  rounded down a binade (224·s)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(512, D)).astype(np.float32)
  x[:, 0] = 225.0 + rng.random(512) * 20  # amax/s in (224, 245): some round down to 224
  x *= 2.0 ** rng.integers(-20, 20, size=(512, 1))
  sent = WIRE.decode(WIRE.encode(jnp.asarray(x)))
  s = grouped.scales_along(sent, 1, scaling.E4M3)
  again = scaling.dequantize(scaling.quantize(sent, s, scaling.E4M3), s, jnp.float32)
  np.testing.assert_array_equal(again, sent)
  assert np.any(np.max(np.abs(np.asarray(sent)), 1) < np.max(np.abs(x), 1))  # rounded down


def _step(exchange, devices):
  """jit(shard_map) over `expert`: (y, grads wrt x, gates, w) of `exchange`."""
  def body(x, ids, gates, w):
    loss = lambda x, gates, w: (jnp.sum(jnp.sin(y := exchange(x, ids, gates, w)) * 3), y)
    (_, y), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, gates, w)
    return y, g
  rows = P("expert")
  return jax.jit(jax.shard_map(body, mesh=Mesh(np.array(devices), ("expert",)),
                               in_specs=(rows, rows, rows, W_SPEC),
                               out_specs=(rows, (rows, rows, W_SPEC)), check_vma=False))


def _wires(dtype, grads: bool, back: bool, back_grads: bool = False) -> wire.Wires:
  """The rows out in e4m3; the output gradients out, the outputs back and the inputs'
  gradients back too where asked."""
  e4m3 = wire.e4m3_rows(dtype)
  return wire.Wires(e4m3, e4m3 if grads else None, e4m3 if back else None,
                    e4m3 if back_grads else None)


def _flat(native=False, dtype=jnp.float32, grads=False, back=False, back_grads=False):
  return lambda x, i, g, w: ex.dropless_exchange(
      x, i, g, w, dtype, ex.Peers.whole("expert", N), native,
      wires=_wires(dtype, grads, back, back_grads))[0]


def _node_limited(n_group, topk_group, native=False, dtype=jnp.float32, factor=0.0,
                  grads=False, back=False, back_grads=False):
  return lambda x, i, g, w: ex.node_limited_exchange(
      x, i, g, w, dtype, "expert", N, n_group, topk_group, native, receive_factor=factor,
      wires=_wires(dtype, grads, back, back_grads))[0]


def _rounded(x):
  """Straight through: x rounded as the wire rounds it, the gradient of the unrounded."""
  return x + jax.lax.stop_gradient(WIRE.decode(WIRE.encode(x)) - x)


@jax.custom_vjp
def _grad_rounded(y):
  """The identity whose gradient is rounded as the wire rounds it."""
  return y


_grad_rounded.defvjp(lambda y: (y, None), lambda _, g: (WIRE.decode(WIRE.encode(g)),))


def _matches_one_device(one_device, exchange, x, ids, gates, w):
  """(y, grads) of `exchange` on 8 devices, checked against `one_device(x, ids, gates, w)`
  (values and gradients wrt x, gates and w, under the same loss)."""
  ref = lambda x, gates, w: (jnp.sum(jnp.sin(y := one_device(x, ids, gates, w)) * 3), y)
  (_, want_y), want_g = jax.value_and_grad(ref, (0, 1, 2), has_aux=True)(x, gates, w)
  y, g = _step(exchange, jax.devices()[:N])(x, ids, gates, w)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
  return y, g


@pytest.mark.parametrize("name, n_group, topk_group", [
    ("flat", 2, 1), ("node_limited", 2, 1), ("node_limited", 4, 2)])
def test_fp8_dispatch_equals_one_device_on_the_rounded_rows(name, n_group, topk_group):
  x, ids, gates, w = _inputs(n_group, topk_group)
  y, _ = _matches_one_device(
      lambda x, ids, gates, w: md.dropless(_rounded(x), ids, gates, w, jnp.float32),
      _flat() if name == "flat" else _node_limited(n_group, topk_group), x, ids, gates, w)
  # ... and the rounding is there: the unrounded rows give other values.
  assert not np.allclose(y, md.dropless(x, ids, gates, w, jnp.float32), rtol=1e-3)


def _experts_with_rounded_grads(x, ids, gates, w, hops: int):
  """One device's experts whose rows to the experts are rounded in the forward (straight
  through) and whose output gradients are rounded before the experts: per assignment row
  (gate·dy), and with two hops first per token (dy, hop 1's row: a group's gated sum)."""
  s = md.sort_by_expert(ids, E)
  out_AD = md.ragged_ffn(md.dispatch_sorted(_rounded(x), s), s.sizes_E, w, jnp.float32)
  y = md.combine_sorted(_grad_rounded(out_AD), s, gates)
  return _grad_rounded(y) if hops == 2 else y


@pytest.mark.parametrize("name, n_group, topk_group", [
    ("flat", 2, 1), ("node_limited", 2, 1), ("node_limited", 4, 2)])
def test_fp8_output_gradients_equal_one_device_rounding_them_before_the_experts(
    name, n_group, topk_group):
  """`model.moe.dispatch_grad_dtype: e4m3` (DeepSeek-V3 sends the gradient before the down
  projection in FP8): the backward's rows to the experts are rounded per row, once per hop."""
  x, ids, gates, w = _inputs(n_group, topk_group)
  hops = 1 if name == "flat" else 2
  _, g = _matches_one_device(
      lambda x, ids, gates, w: _experts_with_rounded_grads(x, ids, gates, w, hops),
      _flat(grads=True) if name == "flat" else _node_limited(n_group, topk_group, grads=True),
      x, ids, gates, w)
  # ... and the gradient is rounded: straight through gives another.
  _, exact = _step(_flat() if name == "flat" else _node_limited(n_group, topk_group),
                   jax.devices()[:N])(x, ids, gates, w)
  assert not np.allclose(g[0], exact[0], rtol=1e-3)


def _experts_with_rounded_outputs(x, ids, gates, w, n_group: int | None):
  """One device's experts whose rows out are rounded (straight through) and whose outputs
  are rounded on their way back (straight through): per assignment row, and with two hops
  (`n_group` groups) again per token and group (hop 1's row back: the group's gated sum)."""
  s = md.sort_by_expert(ids, E)
  out_AD = _rounded(md.ragged_ffn(md.dispatch_sorted(_rounded(x), s), s.sizes_E, w,
                                  jnp.float32))
  if n_group is None:
    return md.combine_sorted(out_AD, s, gates)
  group_TK = ids // (E // n_group)
  return sum(_rounded(md.combine_sorted(out_AD, s, jnp.where(group_TK == g, gates, 0)))
             for g in range(n_group))


@pytest.mark.parametrize("name, n_group, topk_group", [
    ("flat", 2, 1), ("node_limited", 2, 1), ("node_limited", 4, 2)])
def test_fp8_combine_equals_one_device_rounding_the_outputs_on_each_hop(
    name, n_group, topk_group):
  """`model.moe.combine_dtype: e4m3`: the experts' outputs come back rounded per row, once
  per hop (hop 1 carries each group's gated sum), their gradients straight through."""
  x, ids, gates, w = _inputs(n_group, topk_group)
  groups = None if name == "flat" else n_group
  y, _ = _matches_one_device(
      lambda x, ids, gates, w: _experts_with_rounded_outputs(x, ids, gates, w, groups),
      _flat(back=True) if name == "flat" else _node_limited(n_group, topk_group, back=True),
      x, ids, gates, w)
  # ... and the outputs are rounded: the compute-dtype combine gives other values.
  exact = _step(_flat() if name == "flat" else _node_limited(n_group, topk_group),
                jax.devices()[:N])(x, ids, gates, w)[0]
  assert not np.allclose(y, exact, rtol=1e-3)


def test_a_relay_sends_on_the_bytes_its_rows_came_as():
  """Hop 1's rows reach the node-limited relay `Encoded`: hop 2 sends each slot's token's
  bytes as they came, zero bytes (a zero row) where a slot is empty, the decoded rows beside
  them for autodiff. Exact: re-encoding the decoded rows would give the same values
  (`test_fp8_dispatch_equals_one_device_on_the_rounded_rows` runs through it)."""
  x, ids = _inputs(2, 1)[:2]
  b = WIRE.encode(x)
  s = md.sort_by_expert(ids, E)
  sl = slots_lib.layout(s, E // N, N, 60, True)  # ~64 rows a peer: some blocks not full
  got = slots_lib.dispatch(wire.Encoded(WIRE.decode(b), b), s, sl)
  token_S = slots_lib.tokens(s, sl)
  np.testing.assert_array_equal(got.bytes, jnp.where(sl.real_S[:, None], b[token_S], 0))
  np.testing.assert_array_equal(got.rows, slots_lib.dispatch(WIRE.decode(b), s, sl))
  np.testing.assert_array_equal(WIRE.decode(got.bytes), got.rows)
  assert 0 < int(sl.real_S.sum()) < sl.real_S.shape[0]  # both kinds of slot

def _experts_with_rounded_input_grads(x, ids, gates, w, n_group: int | None):
  """One device's experts whose rows out are rounded (straight through) and whose inputs'
  gradients are rounded on their way back: per assignment row, and with two hops (`n_group`
  groups) again per token and group (hop 1's row: the sum of its assignments' gradients),
  each token's gradient then the sum over its rows."""
  s = md.sort_by_expert(ids, E)
  x_TD = _rounded(x)
  if n_group is None:
    rows_AD = md.dispatch_sorted(x_TD, s)
  else:  # each group's copy of a token (hop 1's row), its gradient rounded apart
    group_TK1 = (ids // (E // n_group))[..., None]
    x_TKD = sum(jnp.where(group_TK1 == g, _grad_rounded(x_TD)[:, None], 0)
                for g in range(n_group))
    rows_AD = md.permute(x_TKD.reshape(-1, D), s.order_A, s.rank_A)
  out_AD = md.ragged_ffn(_grad_rounded(rows_AD), s.sizes_E, w, jnp.float32)
  return md.combine_sorted(out_AD, s, gates)


@pytest.mark.parametrize("name, n_group, topk_group", [
    ("flat", 2, 1), ("node_limited", 2, 1), ("node_limited", 4, 2)])
def test_fp8_input_gradients_equal_one_device_rounding_them_after_the_experts(
    name, n_group, topk_group):
  """`model.moe.combine_grad_dtype: e4m3`: the dispatch's transpose brings the inputs'
  gradients back rounded per row, once per hop; the forward is the FP8 dispatch's."""
  x, ids, gates, w = _inputs(n_group, topk_group)
  groups = None if name == "flat" else n_group
  _, g = _matches_one_device(
      lambda x, ids, gates, w: _experts_with_rounded_input_grads(x, ids, gates, w, groups),
      _flat(back_grads=True) if name == "flat"
      else _node_limited(n_group, topk_group, back_grads=True), x, ids, gates, w)
  # ... and the gradient is rounded: straight through gives another.
  _, exact = _step(_flat() if name == "flat" else _node_limited(n_group, topk_group),
                   jax.devices()[:N])(x, ids, gates, w)
  assert not np.allclose(g[0], exact[0], rtol=1e-3)


ROW_FP8 = ("fp8.enabled=true", "fp8.targets=[experts]", "fp8.experts_scaling=row",
           "train.batch_size=8", "train.seq_len=16")


def test_with_row_scaled_fp8_experts_the_dispatch_trains_as_one_device():
  """The tiny DeepSeek (fp32 compute), 2 steps: node-limited EP over 4 devices with the FP8
  dispatch against one device with the same FP8 products, equal to summation order (without
  FP8 products the dispatch's rounding moves the gradient norm by ~2e-3 here)."""
  ds = (*deepseek_case.DS, *ROW_FP8, "mesh.data=1")
  ep = ("mesh.expert=4", "parallel.collectives=manual", "model.moe.exchange=node_limited",
        "model.moe.dispatch_dtype=e4m3")
  want = parity.losses(ds, jax.devices()[:1], 2)
  np.testing.assert_allclose(parity.losses((*ds, *ep), jax.devices()[:4], 2), want, rtol=1e-5)
  # The output gradients in FP8 too: the first loss is the same, the gradient rounded.
  got = parity.losses((*ds, *ep, "model.moe.dispatch_grad_dtype=e4m3"), jax.devices()[:4], 2)
  np.testing.assert_allclose(got[0, 0], want[0, 0], rtol=1e-5)
  np.testing.assert_allclose(got, want, rtol=2e-2)
  assert not np.allclose(got[0, 1], want[0, 1], rtol=1e-5)


@functools.cache
def _h100_program(n_group=2, topk_group=1, factor=1.0, back=False, back_grads=False):
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = jax.tree.map(sds, _inputs(n_group, topk_group, jnp.bfloat16))
  step = _step(_node_limited(n_group, topk_group, True, jnp.bfloat16, factor, grads=True,
                             back=back, back_grads=back_grads), gpu_target.devices("h100x8"))
  return step.lower(*args).compile().as_text()


def _exchanged_rows(text: str) -> list:
  """The program's ragged all-to-alls of rows (D wide, or D + 4 bytes encoded)."""
  return [c for c in hlo.collectives(text) if c.kind == "ragged-all-to-all"
          and c.shapes[0].endswith((f",{D}]", f",{D + 4}]"))]


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_h100_program_sends_u8_rows_to_the_experts_and_compute_dtype_rows_back():
  """Both dispatch directions in FP8 (the forward's rows, the backward's output gradients),
  both combine directions (the results, the inputs' gradients) in bf16, on each hop."""
  n_group, topk_group, factor = 2, 1, 1.0
  text = _h100_program(n_group, topk_group, factor)
  cap1 = ex.node_rows(T, topk_group, n_group, factor)
  rows = _exchanged_rows(text)
  shapes = {(len(c.groups[0]), c.shapes[0]) for c in rows}
  # Hop 1 (across the 2 nodes) and hop 2 (inside one): out in u8, back in bf16, both ways.
  assert (n_group, f"u8[{n_group * cap1},{D + 4}]") in shapes, shapes
  assert (n_group, f"bf16[{n_group * cap1},{D}]") in shapes, shapes
  dtypes = [c.shapes[0].split("[")[0] for c in rows]
  assert sorted(dtypes) == ["bf16"] * 4 + ["u8"] * 4, dtypes
  priced = {x.collective.name: x.collective for x in launches.Program(text).items()
            if isinstance(x, launches.Launch) and x.collective is not None}
  for c in rows:
    r = int(c.shapes[0].split("[")[1].split(",")[0])
    assert priced[c.name].bytes == r * (D + 4 if c.shapes[0].startswith("u8") else 2 * D)


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_h100_program_with_the_fp8_combine_sends_only_the_inputs_gradients_in_bf16():
  """`model.moe.combine_dtype: e4m3`: the results come back in u8 on both hops; only the
  dispatch's transpose (the inputs' gradients) stays in bf16."""
  rows = _exchanged_rows(_h100_program(back=True))
  dtypes = [c.shapes[0].split("[")[0] for c in rows]
  assert sorted(dtypes) == ["bf16"] * 2 + ["u8"] * 6, dtypes


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_h100_program_with_every_wire_in_fp8_sends_no_bf16_rows():
  """`model.moe.combine_grad_dtype: e4m3` beside the FP8 combine: the inputs' gradients go
  back in u8 too, D + 4 bytes a row, on both hops."""
  rows = _exchanged_rows(_h100_program(back=True, back_grads=True))
  assert sorted(c.shapes[0].split("[")[0] for c in rows) == ["u8"] * 8, rows
  assert all(c.shapes[0].endswith(f",{D + 4}]") for c in rows)
