"""`jscale.parallel.zero_prefetch.Chunked`: a layer's ZeRO-3 gather in pieces on 4 simulated
devices. The backward's pieces give the gathered layer as it is; the forward's carry the routed
experts' weights as e4m3 columns (`jscale.fp8.weight_columns`) in fewer bytes and give the
values the forward's FP8 product takes, bit for bit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jscale.fp8 import scaling, weight_columns
from jscale.parallel.zero_prefetch import Chunked

N, E, D, F = 4, 2, 16, 6
DT = jnp.bfloat16
# The leaves and the dim ZeRO-3 splits: gate / up along K (the scales' amax spans devices),
# down along N (each device's columns), a linear along its first dim, a norm not split.
DIMS = {"down": 2, "gate_up": 1, "norm": -1, "wq": 0}
E4M3 = (True, True, False, False)  # in jax.tree.leaves order (sorted keys)


def _layer():
  """fp32 masters whose columns span ~12 binades (one scale for all would flush most)."""
  keys = jax.random.split(jax.random.key(0), 4)
  col = lambda k, shape: 10.0 ** jax.random.uniform(k, shape, minval=-6, maxval=6)
  return {"gate_up": jax.random.normal(keys[0], (E, D, 2, F)) * col(keys[1], (E, 1, 2, F)),
          "down": jax.random.normal(keys[2], (E, F, D)) * col(keys[3], (E, 1, D)),
          "wq": jax.random.normal(keys[0], (D, 5)), "norm": jnp.arange(5.0)}


def _specs():
  spec = lambda d, rank: P(*[("fsdp" if i == d else None) for i in range(rank)])
  return {k: spec(DIMS[k], x.ndim) for k, x in _layer().items()}


def _chunked(chunks: int = 2) -> Chunked:
  return Chunked(tuple(DIMS[k] for k in sorted(DIMS)), DT, chunks, "fsdp", N, E4M3)


def _gathered(pieces: Chunked, at_once: bool):
  """The layer `pieces` assemble on every device: fetched a piece at a time, or `whole`."""
  mesh = Mesh(np.array(jax.devices()[:N]), ("fsdp",))

  def on_device(layer):
    if at_once:
      got = pieces.whole(layer)
    else:
      got = pieces.empty(layer)
      for t in range(pieces.chunks):
        got = pieces.fetch(got, layer, jnp.int32(t))
    return pieces.assemble(got, layer)

  return jax.jit(jax.shard_map(on_device, mesh=mesh, in_specs=(_specs(),), out_specs=P(),
                               check_vma=False))(_layer())


def test_backward_pieces_are_the_gathered_layer():
  want = jax.tree.map(lambda x: x.astype(DT), _layer())
  want["norm"] = _layer()["norm"]  # not split: used as stored
  for at_once in (False, True):
    got = _gathered(_chunked(), at_once)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)


def test_forward_pieces_give_what_the_fp8_product_takes():
  """The experts' leaves arrive as the per-column e4m3 values the forward's product quantises
  the bf16 gather to (`weight_columns.per_column`), and quantise to those values again, so the
  product is the same; the other leaves as the bf16 gather."""
  layer = _layer()
  for at_once in (False, True):
    got = _gathered(_chunked().forward, at_once)
    for k in ("gate_up", "down"):
      w = layer[k].astype(DT)
      taken = scaling.dequantize(*weight_columns.per_column(w), jnp.float32)
      np.testing.assert_array_equal(got[k].astype(jnp.float32), taken, err_msg=k)
      again = scaling.dequantize(*weight_columns.per_column(got[k]), jnp.float32)
      np.testing.assert_array_equal(again, taken, err_msg=k)
    np.testing.assert_array_equal(got["wq"], layer["wq"].astype(DT))


def _gathered_bytes(pieces: Chunked) -> int:
  """Bytes of one piece's all-gather result in the lowered program."""
  mesh = Mesh(np.array(jax.devices()[:N]), ("fsdp",))
  fetch = jax.shard_map(lambda layer: pieces.fetch(pieces.empty(layer), layer, jnp.int32(0)),
                        mesh=mesh, in_specs=(_specs(),), out_specs=P(), check_vma=False)
  text = jax.jit(fetch).lower(_layer()).as_text(dialect="hlo")
  (shape,) = re.findall(r"= bf16\[([\d,]+)\][^\n]* all-gather\(", text)  # words of 2 bytes
  return 2 * int(np.prod([int(s) for s in shape.split(",")]))


def test_forward_pieces_carry_a_byte_a_weight():
  """The experts' weights, most of this layer, cross at 1 byte each (and their scales at 4
  a column) against the bf16 gather's 2; the buffer the pieces fill is the same."""
  layer = _layer()
  experts = layer["gate_up"].size + layer["down"].size
  scales = (E * 2 * F) + (E * D // N)  # a device's column scales: all of K's, its own N's
  bf16, fp8 = _gathered_bytes(_chunked(1)), _gathered_bytes(_chunked(1).forward)
  assert bf16 - fp8 == experts - N * 4 * scales, (bf16, fp8)
  assert jax.eval_shape(_chunked().empty, jax.eval_shape(lambda: layer)).shape == \
      jax.eval_shape(_chunked().forward.empty, jax.eval_shape(lambda: layer)).shape
