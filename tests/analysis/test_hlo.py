"""jscale.hlo: the collectives XLA:CPU actually runs for small programs on 8 host devices."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jscale.analysis import hlo

ALL8 = ((0, 1, 2, 3, 4, 5, 6, 7),)


def _mesh(shape=(8,), names=("data",), kind=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _shard_map(fn, mesh, in_specs, out_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False))


def _arg(mesh, shape, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _only(fn, *args):
  """The single collective of fn compiled for args."""
  (c,) = hlo.collectives(fn.lower(*args).compile().as_text())
  return c


def test_psum_is_one_all_reduce():
  mesh = _mesh()
  c = _only(_shard_map(lambda a: jax.lax.psum(a, "data"), mesh, P("data"), P("data")),
            _arg(mesh, (8 * 1024,), P("data")))
  assert (c.kind, c.shapes, c.dtypes, c.bytes) == ("all-reduce", ("f32[1024]",), ("f32",), 4096)
  assert (c.groups, c.group_size, c.executions, c.in_while) == (ALL8, 8, 1, False)
  assert c.op_name.endswith("shard_map/psum") and c.computation


@pytest.mark.parametrize("name, fn, out_spec, kind, shape", [
    ("all_gather", lambda a: jax.lax.all_gather(a, "data", tiled=True), P(), "all-gather",
     "f32[1024]"),
    ("psum_scatter", lambda a: jax.lax.psum_scatter(a, "data", tiled=True), P("data"),
     "reduce-scatter", "f32[16]"),   # stays a reduce-scatter on CPU (not all-reduce + slice)
    ("ppermute", lambda a: jax.lax.ppermute(a, "data", [(i, (i + 1) % 8) for i in range(8)]),
     P("data"), "collective-permute", "f32[128]"),
])
def test_shard_map_collective_kinds(name, fn, out_spec, kind, shape):
  del name
  mesh = _mesh()
  c = _only(_shard_map(fn, mesh, P("data"), out_spec), _arg(mesh, (8 * 128,), P("data")))
  assert (c.kind, c.shapes) == (kind, (shape,))
  assert c.bytes == 4 * int(shape[4:-1])
  if kind == "collective-permute":
    assert c.groups == tuple((i, (i + 1) % 8) for i in range(8)) and c.group_size is None
  else:
    assert (c.groups, c.group_size) == (ALL8, 8)


def test_all_to_all_is_one_tuple_shaped_op():
  """XLA:CPU splits all_to_all into one slice per peer: a tuple of 8 f32[1,128], 4096 bytes."""
  mesh = _mesh()
  a2a = lambda a: jax.lax.all_to_all(a.reshape(8, 128), "data", 0, 0, tiled=True).reshape(-1)
  c = _only(_shard_map(a2a, mesh, P("data"), P("data")), _arg(mesh, (8 * 1024,), P("data")))
  assert (c.kind, c.shapes, c.bytes, c.group_size) == ("all-to-all", ("f32[1,128]",) * 8, 4096, 8)


def test_psums_are_combined_and_bf16_runs_as_f32():
  """XLA:CPU combines independent psums into one tuple all-reduce and promotes bf16 to f32."""
  mesh = _mesh()
  f = _shard_map(lambda a, b: (jax.lax.psum(a, "data"), jax.lax.psum(b, "data")), mesh,
                 P("data"), P("data"))
  c = _only(f, _arg(mesh, (8 * 64,), P("data")), _arg(mesh, (8 * 32,), P("data"), jnp.bfloat16))
  assert (c.kind, c.shapes, c.bytes) == ("all-reduce", ("f32[64]", "f32[32]"), 4 * 96)


def test_scan_multiplies_by_trip_count():
  mesh = _mesh()
  body = lambda c, _: (c * 0.5 + jax.lax.psum(c, "data"), None)
  scan = lambda n: (lambda c: jax.lax.scan(body, c, None, length=n)[0])
  nested = lambda a: jax.lax.scan(lambda c, _: (scan(3)(c), None), a, None, length=2)[0]
  arg = _arg(mesh, (8 * 1024,), P("data"))
  for fn, runs in ((scan(4), 4), (nested, 6)):
    text = _shard_map(fn, mesh, P("data"), P("data")).lower(arg).compile().as_text()
    (c,) = hlo.collectives(text)
    assert (c.in_while, c.executions, c.executions_known) == (True, runs, True)
    assert (c.bytes, c.bytes_per_step) == (4096, runs * 4096)
    assert hlo.summary(text) == {"all-reduce": {"count": runs, "bytes": runs * 4096}}


def test_group_size_on_2x4_mesh():
  """Reducing over the size-2 axis: shard_map prints explicit groups, jit(Auto) Shardy's mesh."""
  mesh = _mesh((2, 4), ("data", "model"), AxisType.Auto)
  pairs = ((0, 4), (1, 5), (2, 6), (3, 7))
  arg = _arg(mesh, (8, 64), P("data", "model"))
  c = _only(_shard_map(lambda a: jax.lax.psum(a, "data"), mesh, P("data", "model"),
                       P(None, "model")), arg)
  assert (c.kind, c.replica_groups, c.groups, c.group_size) == (
      "all-reduce", "{{0,4},{1,5},{2,6},{3,7}}", pairs, 2)
  c = _only(jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P("model"))), arg)
  assert c.replica_groups.startswith("mesh[")
  assert (c.kind, c.groups, c.group_size, c.bytes) == ("all-reduce", pairs, 2, 16 * 4)


def test_explicit_axes_and_compiled_collectives():
  mesh = _mesh()
  x = _arg(mesh, (64, 16), P("data", None))
  assert hlo.compiled_collectives(lambda a: a.sum(0), x) == {
      "all-reduce": {"count": 1, "bytes": 16 * 4}}
  assert hlo.compiled_collectives(jax.jit(lambda a: a * 2), x) == {}
  assert hlo.compiled_collectives(lambda a: a + 1, jnp.ones(8)) == {}


# GPU-style optimized HLO, instructions wrapped as XLA's parser allows (CPU emits none of this).
GPU_STYLE = """HloModule m, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_rs (p: f32[1024]) -> f32[128] {
  %p = f32[1024]{0} parameter(0)
  ROOT %rs = f32[128]{0} reduce-scatter(%p), channel_id=5, replica_groups=[1,8]<=[8],
      dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %v = f32[1024]{0} get-tuple-element(%t), index=1
  %rs2 = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(%v), channel_id=6,
      replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %r = (s32[], f32[1024]{0}) tuple(%i, %v)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %t = (s32[], f32[1024]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body2 (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %ra = f32[1024]{0} ragged-all-to-all(%a, %b, %c, %d, %e, %f), replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %r = (s32[], f32[1024]{0}) tuple(%i, %ra)
}

ENTRY %main (p0: f32[128]) -> f32[1024] {
  %p0 = f32[128]{0} parameter(0)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(f32[128]{0} %p0), channel_id=1,
      replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true,
      metadata={op_name="jit(f)/all_gather" source_line=3}
  %agd = f32[1024]{0} all-gather-done((f32[128]{0}, f32[1024]{0}) %ags)
  %ars = (bf16[1024]{0}, bf16[16]{0}) all-reduce-start(%x, %y), channel_id=2,
      replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %ard = (bf16[1024]{0}, bf16[16]{0}) all-reduce-done(%ars)
  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%p0), channel_id=3,
      source_target_pairs={{0,1},{1,0}}
  %cpd = f32[128]{0} collective-permute-done(%cps)
  %rss = ((f32[1024]{0}), f32[128]{0}) async-start(%agd), calls=%wrapped_rs
  %rsd = f32[128]{0} async-done(%rss), calls=%wrapped_rs
  %w = (s32[], f32[1024]{0}) while(%tup), condition=%cond, body=%body,
      backend_config={"known_trip_count":{"n":"3"}}
  ROOT %w2 = (s32[], f32[1024]{0}) while(%w), condition=%cond, body=%body2
}
"""


def test_gpu_style_async_pairs_and_unknown_trip_count():
  """Async pairs count once with the real result; iota groups; a loop without a known count."""
  by_kind = {}
  for c in hlo.collectives(GPU_STYLE):
    by_kind.setdefault(c.kind, []).append(c)
  (ag,) = by_kind["all-gather"]
  assert (ag.bytes, ag.group_size, ag.op_name) == (4096, 8, "jit(f)/all_gather")
  (ar,) = by_kind["all-reduce"]
  assert (ar.bytes, ar.groups) == (2 * 1040, ((0, 2, 4, 6), (1, 3, 5, 7)))
  (cp,) = by_kind["collective-permute"]
  assert (cp.bytes, cp.groups) == (512, ((0, 1), (1, 0)))
  wrapped, looped = by_kind["reduce-scatter"]
  assert (wrapped.computation, wrapped.executions, wrapped.bytes) == ("wrapped_rs", 1, 512)
  assert (looped.in_while, looped.executions, looped.bytes_per_step) == (True, 3, 3 * 512)
  (ra,) = by_kind["ragged-all-to-all"]
  assert (ra.in_while, ra.executions, ra.executions_known) == (True, 1, False)
  with pytest.warns(UserWarning, match="unknown trip count"):
    s = hlo.summary(GPU_STYLE)
  assert s["reduce-scatter"] == {"count": 4, "bytes": 4 * 512}
  assert s["ragged-all-to-all"] == {"count": 1, "bytes": 4096}
