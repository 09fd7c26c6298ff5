"""What `jscale.predict` counts a launch as moving or running: in-place updates and scatters,
gathers through conversions, allocations, and tuple elements, on small programs compiled by
the real XLA:GPU compiler for an H100 (no GPU: `jscale.analysis.gpu_target`) or cut from one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jscale.analysis import gpu_target

if not gpu_target.available():
  pytest.skip("needs JAX's CUDA plugin and cuDNN to compile for GPUs: pip install -e "
              "'.[gpu-compile]' (.ci/run does)", allow_module_level=True)

# pylint: disable=wrong-import-position
from jscale.analysis import dots  # noqa: E402
from jscale.predict import launches, rates, timing  # noqa: E402
from pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402


def test_in_place_update_moves_the_slice_not_the_buffer():
  buf = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)
  row = jax.ShapeDtypeStruct((1, 1024, 1024), jnp.float32)
  mesh = Mesh(np.array(gpu_target.devices("h100x1")), ("x",))
  s = NamedSharding(mesh, P())
  text = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r * 2, (i, 0, 0)),
                 in_shardings=(s, s, s), out_shardings=s, donate_argnums=0).lower(
      buf, row, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
  moved = sum(x.bytes for x in launches.Program(text).items() if x.kind == "memory")
  assert moved <= 2 * 1024 * 1024 * 4 + 64  # the row read and written, not 64 rows



def test_an_in_place_scatter_moves_its_rows_not_the_buffer():
  """A scatter-add into a buffer XLA updates in place (the embedding's gradient: 16,384 rows
  into a 0.84 GB fp32 [vocab, embed], traced at 0.11 ms a step on an H200, 2026-11-30): the
  rows it updates, read and written, not the whole buffer (0.64 ms priced so on an H100)."""
  buf = jax.ShapeDtypeStruct((65536, 1024), jnp.float32)
  rows = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
  ids = jax.ShapeDtypeStruct((64,), jnp.int32)
  mesh = Mesh(np.array(gpu_target.devices("h100x1")), ("x",))
  s = NamedSharding(mesh, P())
  text = jax.jit(lambda b, i, r: b.at[i].add(r * 2), in_shardings=(s, s, s), out_shardings=s,
                 donate_argnums=0).lower(buf, ids, rows).compile().as_text()
  assert "scatter" in text
  moved = sum(x.bytes for x in launches.Program(text).items() if x.kind == "memory")
  assert moved <= 4 * 64 * 1024 * 4 + 4096  # the rows in, and read and written in the buffer

def test_a_gather_through_a_conversion_moves_what_it_takes():
  """The chunked loss's label logit: XLA fuses the logits' fp32 convert before the gather, so
  the fused parameter is read through a convert (and bitcasts); the kernel reads one element a
  row, not the bf16 [rows, vocab] it is handed (4 x 0.28 ms a step on the DeepSeek-V3 16B proxy
  priced as whole reads)."""
  logits = jax.ShapeDtypeStruct((2, 2048, 51200), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((2, 2048), jnp.int32)
  mesh = Mesh(np.array(gpu_target.devices("h100x1")), ("x",))
  s = NamedSharding(mesh, P())
  pick = lambda x, i: jnp.take_along_axis(x.astype(jnp.float32), i[..., None], axis=-1) * 2.0
  text = jax.jit(pick, in_shardings=(s, s), out_shardings=s).lower(logits, labels).compile(
  ).as_text()
  moved = sum(x.bytes for x in launches.Program(text).items() if x.kind == "memory")
  assert 0 < moved <= 2 * 2048 * (2 + 4 + 4) + 64  # each row's bf16 label logit, its index,
  assert "convert" in text and "gather" in text    # its fp32 product; not the 420 MB logits



def test_an_allocated_scan_output_launches_no_kernel():
  """A scan's stacked output, allocated by XLA:GPU's zero-init elimination (`xla_flags`) and
  written row by row in the loop: the AllocateBuffer is no kernel, so nothing is priced for
  the 64 MiB the zero fill wrote (on the DeepSeek-V3 16B proxy 1.45 ms a step)."""
  mesh = Mesh(np.array(gpu_target.devices("h100x1")), ("x",))
  xs = jax.ShapeDtypeStruct((16, 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
  scan = lambda xs: jax.lax.scan(lambda c, x: (c + x, c * x), xs[0], xs)[1]
  flag = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}
  text = jax.jit(scan).lower(xs).compile(compiler_options=flag).as_text()
  assert 'custom_call_target="AllocateBuffer"' in text
  items = [i for i in launches.Program(text).items() if not isinstance(i, launches.Loop)]
  assert not [i for i in items if i.kind == "memory" and i.bytes >= 64 * 2**20], items

# XLA as shipped with jaxlib 0.11 names an element of a tuple-shaped value `%name#i` instead of
# writing a get-tuple-element (this fragment is cut from the step an H200 compiled): each
# operand is the element, not the whole tuple (a loop's carry of every layer's weights).
TUPLE_ELEMENTS = """
HloModule m, is_scheduled=true

%fused_scale (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%p0, %p0)
}

ENTRY %main (t: (f32[1024], f32[67108864], bf16[256,512], bf16[512,128])) -> f32[1024] {
  %t = (f32[1024]{0}, f32[67108864]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  %g = (bf16[256,128]{1,0}, s8[1024]{0}) custom-call(%t#2, %t#3), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %f = f32[1024]{0} fusion(%t#0), kind=kLoop, calls=%fused_scale
}
"""


def test_tuple_element_operands_are_the_element_not_the_tuple():
  items = launches.Program(TUPLE_ELEMENTS).items()
  (fusion,) = [i for i in items if i.kind == "memory"]
  assert fusion.bytes == 2 * 1024 * 4  # not the 256 MiB element beside it
  (gemm,) = [i for i in items if i.kind == "gemm"]
  assert gemm.flops == 2 * 256 * 512 * 128
  (dot,) = dots.compiled_dots(TUPLE_ELEMENTS)
  assert dot.operands == ("bf16", "bf16")
  assert (dot.lhs_shape, dot.rhs_shape) == ("256x512", "512x128")


def test_a_grouped_matmul_launch_on_some_columns_reads_those_of_the_weights():
  """DeepSeek-V3 16B's 1408-wide expert products run as two launches on one [E, K, 1408] weight
  stack (`hopper_config.column_parts`: 1280 columns on whole tiles, 128 on 64-column ones); each
  reads its columns of the stack, not all of it, and the narrow one is timed at the 64-column
  tiles' rate."""
  m, k, n, g = 2048, 512, 1408, 4
  mesh = Mesh(np.array(gpu_target.devices("h100x1")), ("x",))
  s = NamedSharding(mesh, P())
  spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  text = jax.jit(grouped_matmul, in_shardings=(s, s, s), out_shardings=s).lower(
      spec(m, k), spec(g, k, n), spec(g, dt=jnp.int32)).compile().as_text()
  kernels = {x.mnk[2]: x for x in launches.Program(text).items()
             if "grouped_matmul" in (x.label or "")}
  assert sorted(kernels) == [128, 1280]
  for cols, x in kernels.items():  # lhs, its columns of rhs, the output (+ the group table)
    assert x.bytes == pytest.approx(2 * (m * k + g * k * cols + m * cols), abs=16384)
  chip = rates.chip("h100")
  assert timing.time_launch(kernels[128], chip).note.startswith("grouped_matmul: 64-column")
