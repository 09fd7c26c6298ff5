"""`jscale.parallel.major`: the all-gather and reduce-scatter of a non-major dim, run along a new
major axis. Values and gradients equal `jax.lax`'s tiled collectives on 4 simulated devices;
XLA:GPU's programs for ZeRO-2 and ZeRO-3 steps (8 H100s, both modes) copy no fp32 weight stack
into the layout a gather needs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jscale import predict
from jscale.config_load import load_config
from jscale.parallel import major

N = 4
SHAPE = (3, 8, 5)


def _on_mesh(fn):
  """`fn` of each device's shard of an array split on its first dim, results stacked."""
  mesh = Mesh(np.array(jax.devices()[:N]), ("fsdp",))
  return jax.shard_map(fn, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"),
                       check_vma=False)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gather_and_its_gradient_are_the_tiled_gathers(dim):
  x = jax.random.normal(jax.random.key(0), (N * SHAPE[0], *SHAPE[1:]))
  c = jax.random.normal(jax.random.key(1), tuple(s * (N if i == dim else 1)
                                                 for i, s in enumerate(SHAPE)))

  def loss_and_grad(gather):
    per_device = _on_mesh(lambda s: jnp.sum(jnp.sin(gather(s)) * c)[None] * (
        1 + jax.lax.axis_index("fsdp")))  # a different cotangent on each device
    return jax.jit(jax.value_and_grad(lambda x_: jnp.sum(per_device(x_))))(x)

  got = loss_and_grad(lambda s: major.all_gather(s, "fsdp", dim))
  want = loss_and_grad(lambda s: jax.lax.all_gather(s, "fsdp", axis=dim, tiled=True))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_scatter_is_the_tiled_scatter(dim):
  shape = tuple(s * (N if i == dim else 1) for i, s in enumerate(SHAPE))
  x = jax.random.normal(jax.random.key(2), (N * shape[0], *shape[1:]))
  got = jax.jit(_on_mesh(lambda s: major.psum_scatter(s, "fsdp", dim, N)))(x)
  want = jax.jit(_on_mesh(
      lambda s: jax.lax.psum_scatter(s, "fsdp", scatter_dimension=dim, tiled=True)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("mode", ["xla", "manual"])
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_copies_no_fp32_weight_stack_into_a_gather_layout(zero, mode):
  """Before: ZeRO-3 copied `w_down`'s stack [layers, f, d / fsdp] whole, in fp32, to
  [d / fsdp, layers, f] before the layer loop (the gather's dim made major) and held it for the
  step (DeepSeek-V3 671B's experts: GBs); ZeRO-2 so laid out its updated full stacks (the
  in-place gather)."""
  cfg = load_config(None, ["model.preset=tiny", "mesh.data=4", "mesh.fsdp=2",
                           f"parallel.zero_stage={zero}", f"parallel.collectives={mode}",
                           "train.batch_size=8", "train.seq_len=128", "model.dtype=bfloat16",
                           "checkpoint.every=0"])
  text = predict.compile_step(cfg, "h100x8")
  stacks = re.findall(r"= f32\[(\d+(?:,\d+){2,})\][^\n]*op_name=\"state\[", text)
  assert stacks
  # A stack laid out for a gather: an fp32 array whose dims are a permutation of a stack's
  # (sharded, or whole: ZeRO-2's stored weights) with another dim moved ahead of its layers.
  key = lambda shape: tuple(sorted(int(d) for d in shape.split(",")))
  layers = {key(s): s.split(",")[0] for s in stacks}
  made = re.findall(r"= f32\[(\d+(?:,\d+){2,})\]\{[\d,]+\} (?:fusion|copy|transpose)\(", text)
  moved = {m for m in made if key(m) in layers and m.split(",")[0] != layers[key(m)]}
  assert not moved, sorted(moved)
