"""Mixed precision that is what it says: with model.dtype=bfloat16 every matmul of the lowered
train step — forward and both backward products — takes bf16 operands, except those listed in
`jscale.model.matmul.FP32_MATMULS` (under their named scope). On an H100 an fp32 operand means
a TF32 gemm at half rate: this is the CPU-checkable form of that GPU finding."""

import jax
import jax.numpy as jnp
import pytest

from conftest import small_config
from jscale import runtime
from jscale.analysis import dots
from jscale.analysis.introspect import abstract_batch
from jscale.model.matmul import FP32_MATMULS, SCOPE_PREFIX

ALLOWED = tuple(SCOPE_PREFIX + name for name in FP32_MATMULS)
BF16 = ("model.dtype=bfloat16", "model.n_kv_heads=4", "train.batch_size=16",
        "train.warmup_steps=0")
MOE = ("model.moe.n_experts=4", "model.moe.top_k=2")


def _dots(n: int, *overrides: str) -> list[dots.Dot]:
  cfg = small_config(None, *BF16, *overrides)
  rt = runtime.build(cfg, jax.devices()[:n])
  return dots.dot_generals(rt.train_step().lower(rt.abstract_state(), abstract_batch(cfg)))


CASES = {
    "dense": (1, ("mesh.data=1",)),
    "dense manual tp+sp": (4, ("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                               "parallel.collectives=manual")),
    "dense xla zero3 + tp": (8, ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                 "parallel.zero_stage=3", "train.remat=selective")),
    "dense manual ring (cp)": (4, ("mesh.sequence=2", "mesh.data=2",
                                   "parallel.collectives=manual")),
    "chunked loss": (2, ("mesh.data=2", "train.logits_chunk_mb=0.01")),
    "moe xla": (2, ("mesh.data=2", *MOE)),
    "moe manual ep dropless": (4, ("mesh.expert=2", "mesh.data=2", "parallel.collectives=manual",
                                   *MOE)),
    "moe manual capacity + shared": (2, ("mesh.data=2", "parallel.collectives=manual", *MOE,
                                         "model.moe.dispatch=capacity",
                                         "model.moe.shared_d_ff=64")),
    "pipeline xla 1f1b": (4, ("mesh.stage=2", "mesh.data=2", "pipeline.microbatches=2")),
    "pipeline manual zero_bubble moe": (4, ("mesh.stage=2", "mesh.data=2",
                                            "pipeline.schedule=zero_bubble",
                                            "pipeline.microbatches=2",
                                            "parallel.collectives=manual", *MOE)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_matmul_takes_bf16_operands(case):
  n, overrides = CASES[case]
  found = _dots(n, *overrides)
  assert len(found) >= 6, found  # the layers' forward and backward products are there
  bad = dots.not_in(found, "bf16", ALLOWED)
  assert not bad, "\n".join(f"{d.lhs} x {d.rhs} -> {d.out} at {d.location[:160]}" for d in bad)
  fp32 = [d for d in found if set(d.operands) != {"bf16"}]
  if "moe" in case:  # the router's logits and their two backward products, on purpose
    assert len(fp32) >= 3 and all("fp32_router" in d.location for d in fp32)
  else:
    assert not fp32


def test_the_check_sees_an_fp32_cotangent():
  """The pattern the H100 profile found: a bf16 matmul asked for an fp32 result and cast back
  runs its backward products with fp32 operands; `dots.not_in` reports both."""
  def loss(x, w):
    y = jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  args = (jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16))
  bad = dots.not_in(dots.dot_generals(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)),
                    "bf16")
  assert len(bad) == 2 and all(d.operands == ("f32", "f32") for d in bad)
  assert all("transpose" in d.location for d in bad)


@pytest.mark.parametrize("chunk_mb", ["0", "0.01"])
def test_bf16_logits_leave_only_the_chunked_head_gradient_in_fp32(chunk_mb):
  """`train.logits_dtype=bfloat16`: the head's product writes bf16 logits (by default, fp32
  from its accumulator); of the head's products only the chunked loss's dW, summed over chunks,
  still writes fp32. Chunked, each product is in the program twice: the first chunk's, which
  starts the sums, and the loop's."""
  vocab = str(small_config(None, *BF16).model.vocab_size)
  head = lambda d: vocab in d.lhs_shape.split("x") + d.rhs_shape.split("x")
  outs = {}
  for dtype in ("float32", "bfloat16"):
    found = [d for d in _dots(1, "mesh.data=1", f"train.logits_chunk_mb={chunk_mb}",
                              f"train.logits_dtype={dtype}") if head(d)]
    assert found and all(d.operands == ("bf16", "bf16") for d in found), found
    outs[dtype] = sum(d.out == "f32" for d in found)
  chunked = chunk_mb != "0"
  copies = 2 if chunked else 1
  assert outs == {"float32": copies * (1 + chunked), "bfloat16": copies * int(chunked)}, outs
