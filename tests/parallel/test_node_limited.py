"""DeepSeek-V3's node-limited dispatch (`expert_exchange.node_limited_exchange`) on 8 simulated
devices taken as nodes: values and gradients equal a one-device reference (and so the flat
exchange's); the compiled HLO shows every row that crosses nodes going, one copy per token and
chosen group, to the device at the same place of a chosen node, against the flat exchange's
copy per expert; XLA:GPU compiles the native ragged exchange with the same replica groups; the
tiny DeepSeek model trains with it as on one device (test_deepseek_parallel)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import deepseek_case
import node_limited_bytes  # scripts/ (on the path: conftest)
from jscale import runtime
from jscale.analysis import gpu_target, hlo
from jscale.config import ConfigError
from jscale.model import moe_dispatch as md
from jscale.model import router
from jscale.parallel import expert_exchange as ex
from jscale.predict import launches

N, T, D, F, E, K = 8, 16, 8, 8, 16, 4  # devices, tokens per device, model, hidden, experts, top-k
W_SPEC = md.ExpertWeights(P("expert"), P("expert"))


def _inputs(n_group, topk_group, dtype=jnp.float32):
  rng = np.random.default_rng(n_group)
  x = jnp.asarray(rng.normal(size=(N * T, D)), dtype)
  scores = jnp.asarray(rng.normal(size=(N * T, E)), jnp.float32)
  ids = router.group_limited_top_k(scores, K, n_group, topk_group)
  gates = jax.nn.softmax(jnp.take_along_axis(scores, ids, -1), -1)
  w = md.ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.3, dtype)
                         for s in ((E, D, 2, F), (E, F, D))))
  return x, ids, gates, w


def _objective(y):
  return jnp.sum(jnp.sin(y) * 3)


def _step(exchange, devices):
  """jit(shard_map) over `expert`: (loss, y, grads wrt x, gates, w) of `exchange`."""
  def body(x, ids, gates, w):
    loss = lambda x, gates, w: (_objective(y := exchange(x, ids, gates, w)), y)
    (l, y), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, gates, w)
    return jax.lax.psum(l, "expert"), y, g
  mesh = Mesh(np.array(devices), ("expert",))
  rows = P("expert")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, W_SPEC),
                               out_specs=(P(), rows, (rows, rows, W_SPEC)), check_vma=False))


def _flat(native=False, dtype=jnp.float32, receive_factor=0.0):
  return lambda x, i, g, w: ex.dropless_exchange(x, i, g, w, dtype, ex.Peers.whole("expert", N),
                                                 native, receive_factor=receive_factor)[0]


def _node_limited(n_group, native=False, dtype=jnp.float32, topk_group=1, receive_factor=0.0):
  return lambda x, i, g, w: ex.node_limited_exchange(x, i, g, w, dtype, "expert", N, n_group,
                                                     topk_group, native,
                                                     receive_factor=receive_factor)[0]


@functools.cache
def _compiled(name):
  """(jitted step, its optimized HLO) on the 8 CPU devices, 2 groups, topk_group 1."""
  fn = _step(_flat() if name == "flat" else _node_limited(2), jax.devices()[:N])
  return fn, fn.lower(*_inputs(2, 1)).compile().as_text()


@pytest.mark.parametrize("n_group, topk_group", [(2, 1), (4, 2)],
                         ids=["2-nodes-of-4-top1-group", "4-nodes-of-2-top2-groups"])
def test_node_limited_values_and_grads_equal_one_device(n_group, topk_group):
  args = _inputs(n_group, topk_group)
  x, ids, gates, w = args
  ref = lambda x, gates, w: (_objective(y := md.dropless(x, ids, gates, w, jnp.float32)), y)
  (want_loss, want_y), want_g = jax.value_and_grad(ref, (0, 1, 2), has_aux=True)(x, gates, w)
  fn = (_compiled("node_limited")[0] if n_group == 2 else
        _step(_node_limited(n_group), jax.devices()[:N]))
  loss, y, g = fn(*args)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(y, want_y, atol=1e-5)
  for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(got, want, atol=2e-5)


def _most_sent(ids, n_group):
  """(the most rows one device sends one node in hop 1, the most assignments one relay sends
  one device of its node in hop 2) of the routing `ids`, counted by hand."""
  ids, m = np.asarray(ids), N // n_group
  e_l, e_g = E // N, E // n_group
  hop1, hop2 = 0, np.zeros((N, N), int)
  for d in range(N):
    for g in range(n_group):
      chosen = [row[row // e_g == g] for row in ids[d * T:(d + 1) * T] if np.any(row // e_g == g)]
      hop1 = max(hop1, len(chosen))
      for experts in chosen:
        np.add.at(hop2[g * m + d % m], experts // e_l, 1)
  return hop1, int(hop2.max())


def _dropped(args, n_group, topk_group, factor):
  def body(x, ids, gates, w):
    _, dropped = ex.node_limited_exchange(x, ids, gates, w, jnp.float32, "expert", N, n_group,
                                          topk_group, receive_factor=factor)
    return jax.lax.psum(dropped, "expert")
  rows = P("expert")
  return int(jax.jit(jax.shard_map(body, mesh=Mesh(np.array(jax.devices()[:N]), ("expert",)),
                                   in_specs=(rows, rows, rows, W_SPEC), out_specs=P(),
                                   check_vma=False))(*args))


def test_receive_factor_bounds_both_hops():
  """`model.moe.receive_factor` sizes hop 1's blocks by T·topk_group / n_group and hop 2's by
  T·K / m: with room for the most this routing sends, nothing drops and values and gradients
  are the unbounded exchange's, in blocks of those rows (hop 1: fewer than T); with half that
  room assignments drop and are counted."""
  n_group, topk_group = 4, 2
  args = _inputs(n_group, topk_group)
  hop1, hop2 = _most_sent(args[1], n_group)
  m = N // n_group
  factor = max(hop1 * n_group / (T * topk_group), hop2 * m / (T * K))  # exact in binary here
  cap1 = ex.node_rows(T, topk_group, n_group, factor)
  cap2 = ex.receive_rows(n_group * cap1, K, E // N, m, factor, share_tokens=T)
  unbounded2 = ex.receive_rows(n_group * T, K, E // N, m, 0.0)
  assert cap1 == hop1 < T and hop2 <= cap2 < unbounded2, (cap1, cap2)
  assert _dropped(args, n_group, topk_group, factor) == 0
  assert _dropped(args, n_group, topk_group, factor / 2) > 0
  bounded = _step(_node_limited(n_group, topk_group=topk_group, receive_factor=factor),
                  jax.devices()[:N])
  want = _step(_node_limited(n_group), jax.devices()[:N])(*args)
  for got, ref in zip(jax.tree.leaves(bounded(*args)), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
  rows = _row_all_to_alls(bounded.lower(*args).compile().as_text())
  across = [c for c in rows if len(c.groups[0]) == n_group]
  assert {c.shapes[0] for c in across} == {f"f32[1,{cap1},{D}]"}, [c.shapes for c in rows]


def _row_all_to_alls(text):
  """The all-to-alls carrying model rows (D wide), forward and backward."""
  return [c for c in hlo.collectives(text) if c.kind == "all-to-all"
          and c.shapes[0].endswith(f",{D}]") and c.dtypes[0] == "f32"]


def test_rows_cross_nodes_once_per_chosen_group_in_the_hlo():
  per_node, n_group = N // 2, 2
  across = {tuple(p + a * per_node for a in range(n_group)) for p in range(per_node)}
  within = {tuple(range(a * per_node, (a + 1) * per_node)) for a in range(n_group)}
  rows = _row_all_to_alls(_compiled("node_limited")[1])
  crossing = [c for c in rows if hlo.bytes_across_nodes(c, per_node)]
  # Every exchange stays inside a node or joins the devices at one place of every node ...
  assert all(set(c.groups) in (across, within) for c in rows), [c.groups for c in rows]
  assert crossing and all(set(c.groups) == across for c in crossing)
  # ... where each peer gets T rows: one copy of each token for its chosen group (fwd: x; bwd:
  # the gated sums' gradients), not one per expert.
  assert {c.shapes[0] for c in crossing} == {f"f32[1,{T},{D}]"}
  flat = _row_all_to_alls(_compiled("flat")[1])
  assert {c.shapes[0] for c in flat} == {f"f32[1,{T * min(K, E // N)},{D}]"}
  got = sum(hlo.bytes_across_nodes(c, per_node) for c in crossing)
  want = sum(hlo.bytes_across_nodes(c, per_node) for c in flat)
  # Four exchanges (forward out and back, and their transposes). Flat: T·min(K, E_l) = 2T rows
  # to each of the 4 devices of the other node; node-limited: T rows to 1 device. Both padded
  # on CPU (the GPU's ragged exchange moves the real rows only: scripts/node_limited_bytes.py).
  assert (got, want) == (4 * T * D * 4, 4 * 4 * (2 * T) * D * 4)


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_native_exchange_compiles_for_8_h100_in_node_groups():
  mesh_devices = gpu_target.devices("h100x8")
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = jax.tree.map(sds, _inputs(2, 1, jnp.bfloat16))
  text = _step(_node_limited(2, True, jnp.bfloat16), mesh_devices).lower(*args).compile().as_text()
  ragged = [c for c in hlo.collectives(text) if c.kind == "ragged-all-to-all"]
  groups = {c.groups for c in ragged}
  assert groups == {((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))}, groups
  # Hop 1 carries the token rows, their group-local expert ids and gates, both ways.
  assert {c.shapes[0] for c in ragged if len(c.groups[0]) == 2} == {
      f"bf16[{2 * T},{D}]", f"s32[{2 * T},{K}]", f"f32[{2 * T},{K}]"}


@pytest.mark.parametrize("overrides, match", [
    (("parallel.collectives=xla",), "set parallel.collectives=manual"),
    (("parallel.collectives=manual", "model.moe.n_group=1", "model.moe.topk_group=1"),
     "model.moe.n_group=1 groups to tile mesh.expert=4"),
    (("parallel.collectives=manual", "model.moe.n_group=4", "model.moe.topk_group=2",
      "mesh.expert=2", "mesh.data=4"), "model.moe.n_group=4 groups to tile mesh.expert=2"),
    (("model.moe.exchange=ring",), "model.moe.exchange='ring': choose one of flat, node_limited"),
])
def test_bad_node_limited_configs_fail_before_compile(overrides, match):
  with pytest.raises(ConfigError, match=match):
    runtime.build(deepseek_case.config("mesh.data=2", "mesh.expert=4",
                                       "model.moe.exchange=node_limited", *overrides),
                  jax.devices()[:8])


def test_crossing_rows_counts_experts_and_groups_on_other_nodes():
  # scripts/node_limited_bytes.py's routing figure: 4 tokens on 4 devices (2 nodes of 2), 8
  # experts (2 per device, 4 per node = per group), top-2. Token 0 (node 0) picks experts 6, 7
  # (node 1): flat 2 rows across, node-limited 1; token 3 (node 1) picks 0 and 5: flat 1,
  # node-limited 1 (group 0); tokens 1 and 2 stay home.
  ids = np.array([[6, 7], [0, 3], [4, 5], [0, 5]])
  assert node_limited_bytes.crossing_rows(ids, 4, 2, 8, 2) == (3 / 4, 2 / 4)


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
@pytest.mark.parametrize("factor", [1.0, 0.0], ids=["bounded", "unbounded"])
def test_ragged_exchanges_send_and_land_in_their_blocks(factor):
  """Every ragged all-to-all of hop 1, forward and transposed, sends from and lands in [N·cap]
  blocks (`exchange_slots`): its rows are no [T·n_group] array of every (token, group) pair,
  and its transposes no longer write one. `jscale.predict` prices each at the rows the hop
  carries with balanced routing, a copy per token and chosen group (`node_rows`), where its
  blocks hold more: unbounded (`receive_factor` 0) they hold T rows per source, n_group /
  topk_group times those; and at no more rows than its input holds (fewer than the routed
  T·K). Told nothing of hop 1, it prices the blocks."""
  n_group, topk_group = 2, 1
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = jax.tree.map(sds, _inputs(n_group, topk_group, jnp.bfloat16))
  step = _step(_node_limited(n_group, True, jnp.bfloat16, topk_group, factor),
               gpu_target.devices("h100x8"))
  text = step.lower(*args).compile().as_text()
  blocks = n_group * ex.node_rows(T, topk_group, n_group, factor)
  carried = T * topk_group
  priced = lambda node_rows: {
      c.name: c for c in (x.collective for x in launches.Program(
          text, routed_rows=T * K, node_rows=node_rows).items()
          if isinstance(x, launches.Launch) and x.collective is not None)}
  hop1, unaware = priced((blocks, carried)), priced(None)
  across = [c for c in hlo.collectives(text) if c.kind == "ragged-all-to-all"
            and c.shapes[0].startswith("bf16") and len(c.groups[0]) == n_group]
  assert across and blocks == (n_group * T if factor == 0 else carried) < T * K
  for c in across:  # out and back, forward and transposed
    assert c.shapes[0] == f"bf16[{blocks},{D}]", c.shapes
    assert hop1[c.name].bytes == carried * D * 2, (c.name, hop1[c.name].bytes)
    assert unaware[c.name].bytes == blocks * D * 2, (c.name, unaware[c.name].bytes)
