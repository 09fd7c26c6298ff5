"""`jscale.predict` on XLA:GPU's dynamic-slice fusion: a kernel that reads slices of its
operands and writes into a slice of a buffer in place, by address (on by default in the XLA of
jax 0.11, which the lent GPUs run). The fusion is its hero's launch on the slices: a Pallas
kernel or a gemm with its FLOPs, not a copy of the buffers around it.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jscale import predict
from jscale.analysis import gpu_target
from jscale.predict import launches
from pallas_kernels.grouped_matmul import grouped_matmul

# Cut from the DeepSeek-V3 16B proxy's step as jax 0.11.2 compiled it on an H200
# (results/h200_measured/dsv3_proxy_step_h200.hlo.txt.gz; the kernels' modules left out): in
# the layer scan, the expert forward writes its rows into the stack of saved activations
# (fusion .2), and the weight gradient reads a layer's saved input from that stack (fusion .1).
H200_FRAGMENT = """
HloModule m, is_scheduled=true

%dynamic-slice-fusion.2 (p0.2: s32[65], p1.2: bf16[49152,2048], p2.2: bf16[64,2048,1408], p3.2: bf16[2,49152,1408], p4.2: s32[]) -> bf16[2,49152,1408] {
  %p3.2 = bf16[2,49152,1408]{2,1,0} parameter(3)
  %p0.2 = s32[65]{0} parameter(0)
  %p1.2 = bf16[49152,2048]{1,0} parameter(1)
  %p2.2 = bf16[64,2048,1408]{2,1,0} parameter(2)
  %mpmd_map.14 = bf16[49152,1408]{1,0} custom-call(%p0.2, %p1.2, %p2.2), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/backward/jvp(forward)/layers/while/body/eval_jaxpr/grouped_matmul/mpmd_map"}
  %bitcast.3121 = bf16[1,49152,1408]{2,1,0} bitcast(%mpmd_map.14)
  %p4.2 = s32[] parameter(4)
  %constant_1419 = s32[] constant(0)
  ROOT %dynamic_update_slice.229 = bf16[2,49152,1408]{2,1,0} dynamic-update-slice(%p3.2, %bitcast.3121, %p4.2, %constant_1419, %constant_1419)
}

%dynamic-slice-fusion.1 (p0.1: bf16[2,49152,2048], p1.1: s32[], p2.1: s32[64], p3.1: s32[64], p4.1: s32[64], p5.1: s32[64], p6.1: bf16[49152,1408]) -> bf16[64,2048,1408] {
  %p2.1 = s32[64]{0} parameter(2)
  %p3.1 = s32[64]{0} parameter(3)
  %p4.1 = s32[64]{0} parameter(4)
  %p5.1 = s32[64]{0} parameter(5)
  %p0.1 = bf16[2,49152,2048]{2,1,0} parameter(0)
  %constant_1417 = s32[] constant(1)
  %p1.1 = s32[] parameter(1)
  %subtract.8 = s32[] subtract(%constant_1417, %p1.1)
  %constant_1418 = s32[] constant(0)
  %dynamic_slice.287 = bf16[1,49152,2048]{2,1,0} dynamic-slice(%p0.1, %subtract.8, %constant_1418, %constant_1418), dynamic_slice_sizes={1,49152,2048}, backend_config={"dynamic_slice_config":{"byte_offset":"201326592","byte_stride":"-402653184","loop_index":"0"}}
  %bitcast.3120 = bf16[49152,2048]{1,0} bitcast(%dynamic_slice.287)
  %p6.1 = bf16[49152,1408]{1,0} parameter(6)
  ROOT %mpmd_map.13 = bf16[64,2048,1408]{2,1,0} custom-call(%p2.1, %p3.1, %p4.1, %p5.1, %bitcast.3120, /*index=5*/%p6.1), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/backward/transpose(jvp(forward))/layers/while/body/transposed_grouped_matmul/mpmd_map"}
}

ENTRY %main (sizes: s32[65], x: bf16[49152,2048], w: bf16[64,2048,1408], saved: bf16[2,49152,1408], i: s32[], inputs: bf16[2,49152,2048], g: s32[64], dout: bf16[49152,1408]) -> (bf16[2,49152,1408], bf16[64,2048,1408]) {
  %sizes = s32[65]{0} parameter(0)
  %x = bf16[49152,2048]{1,0} parameter(1)
  %w = bf16[64,2048,1408]{2,1,0} parameter(2)
  %saved = bf16[2,49152,1408]{2,1,0} parameter(3)
  %i = s32[] parameter(4)
  %inputs = bf16[2,49152,2048]{2,1,0} parameter(5)
  %g = s32[64]{0} parameter(6)
  %dout = bf16[49152,1408]{1,0} parameter(7)
  %dynamic_slice_fusion.2 = bf16[2,49152,1408]{2,1,0} fusion(%sizes, %x, %w, %saved, %i), kind=kCustom, calls=%dynamic-slice-fusion.2, metadata={op_name="jit(step)/backward/jvp(forward)/layers/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}, backend_config={"fusion_backend_config":{"custom_fusion_config":{"kernel_index":0,"name":"dynamic_slice_fusion"},"kind":"__custom_fusion"},"operation_queue_id":"0"}
  %dynamic_slice_fusion.1 = bf16[64,2048,1408]{2,1,0} fusion(%inputs, %i, %g, %g, %g, %g, %dout), kind=kCustom, calls=%dynamic-slice-fusion.1, metadata={op_name="jit(step)/backward/transpose(jvp(forward))/layers/while/body/jit(dynamic_index_in_dim)/dynamic_slice"}, backend_config={"fusion_backend_config":{"custom_fusion_config":{"kernel_index":0,"name":"dynamic_slice_fusion"},"kind":"__custom_fusion"},"operation_queue_id":"0"}
  ROOT %out = (bf16[2,49152,1408]{2,1,0}, bf16[64,2048,1408]{2,1,0}) tuple(%dynamic_slice_fusion.2, %dynamic_slice_fusion.1)
}
"""

ROWS, D, F, E = 49152, 2048, 1408, 64


def test_sliced_kernels_are_their_kernels_on_the_slices():
  """Each fusion is its Pallas kernel (FLOPs of every routed row, under the fusion's name):
  the forward reads its operands and writes one layer's rows, the weight gradient reads one
  layer's saved input; neither moves the two-layer stack around it."""
  forward, weight_grad = launches.Program(H200_FRAGMENT).items()
  assert (forward.name, forward.kind, forward.label) == (
      "dynamic_slice_fusion.2", "kernel", "grouped_matmul")
  assert (weight_grad.name, weight_grad.label) == ("dynamic_slice_fusion.1",
                                                   "transposed_grouped_matmul")
  assert forward.mnk == (1, ROWS, F, D) and weight_grad.mnk == (1, ROWS, F, D)
  assert "layers/while/body/eval_jaxpr/grouped_matmul" in forward.op_name
  assert forward.bytes == 65 * 4 + 2 * (ROWS * D + E * D * F + ROWS * F)
  assert weight_grad.bytes == 4 * E * 4 + 2 * (ROWS * D + ROWS * F + E * D * F)
  timed = predict.predict(H200_FRAGMENT, "h200").timed
  assert {t.bound for t in timed} == {"measured"}  # the kernels' measured rates, no copies


def _scan_of_kernel(dynamic_slice_fusion: bool) -> str:
  """A two-layer scan of the grouped matmul kernel and its gradient, compiled for one H100."""
  layers, groups, k, n, m = 2, 8, 256, 512, 1024

  def loss(x_MK, w_LGKN, sizes_G):
    def layer(x, w):
      return grouped_matmul(x, w, sizes_G)[:, :k], None
    return jax.lax.scan(layer, x_MK, w_LGKN)[0].astype(jnp.float32).sum()

  on = SingleDeviceSharding(gpu_target.devices("h100x1")[0])
  shapes = [jax.ShapeDtypeStruct(s, t, sharding=on) for s, t in (
      ((m, k), jnp.bfloat16), ((layers, groups, k, n), jnp.bfloat16), ((groups,), jnp.int32))]
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes)
  options = {"xla_gpu_enable_dynamic_slice_fusion": dynamic_slice_fusion}
  return lowered.compile(compiler_options=options).as_text()


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_the_same_kernels_with_the_slices_read_in_place():
  """XLA:GPU's own compile of a layer scan, with and without dynamic-slice fusion: the same
  kernels with the same FLOPs, and with the fusion the weight slices and gradient updates are
  no longer copies of their own."""
  plain, fused = (_scan_of_kernel(f) for f in (False, True))

  def kernels_and_copied_bytes(text):
    kernels, copied = [], 0.0
    for t in predict.predict(text, "h100").timed:
      if t.launch.kind == "kernel":
        kernels.append((t.launch.label, t.launch.mnk, t.runs,
                        t.launch.name.startswith("dynamic_slice_fusion")))
      else:
        copied += t.launch.bytes * t.runs
    return sorted(kernels), copied

  (plain_kernels, plain_copied), (fused_kernels, fused_copied) = map(
      kernels_and_copied_bytes, (plain, fused))
  assert not any(sliced for *_, sliced in plain_kernels)
  assert sum(sliced for *_, sliced in fused_kernels) >= 2  # the forward's and the dW's
  assert [k[:3] for k in fused_kernels] == [k[:3] for k in plain_kernels]
  assert {label for label, *_ in fused_kernels} == {"grouped_matmul",
                                                     "transposed_grouped_matmul"}
  assert fused_copied < plain_copied
