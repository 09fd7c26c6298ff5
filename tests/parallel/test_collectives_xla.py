"""Which collectives XLA actually runs for each xla-mode layout (from the compiled HLO).

XLA:CPU does not form reduce-scatter from all-reduce + dynamic-slice (GPU XLA does), so on the
simulated CPU mesh gradient reductions appear as all-reduce for every ZeRO stage (that ZeRO-2/3
keep only gradient shards is asserted from compiled memory in test_zero_memory.py). XLA:CPU
also runs bf16 collectives in f32. The facts asserted here hold on both backends.
"""

import functools

import pytest

from conftest import small_config
from jscale import metrics
from jscale.analysis import hlo, introspect

V = 256


@functools.lru_cache(maxsize=None)
def _compiled(*layout):
  cfg = small_config(None, "train.batch_size=16", "model.n_kv_heads=4", *layout)
  compiled, _ = introspect.compile_train_step(cfg)
  return cfg, hlo.collectives(compiled.as_text())


def _kinds(colls):
  return {c.kind for c in colls}


def _dims(shape: str) -> list[int]:
  inside = shape[shape.index("[") + 1:shape.index("]")]
  return [int(d) for d in inside.split(",") if d]


def _bytes(colls, kind):
  return sum(c.bytes_per_step for c in colls if c.kind == kind)


LAYOUTS = {
    "dp": ("mesh.data=8",),
    "zero1": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=1"),
    "zero2": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=2"),
    "zero3": ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3"),
    "tp": ("mesh.data=2", "mesh.tensor=4"),
    "tp_sp": ("mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"),
}


def test_dp_all_reduces_every_gradient_once():
  cfg, colls = _compiled(*LAYOUTS["dp"])
  grad_bytes = 4 * metrics.param_counts(cfg.model)["total"]  # fp32 gradients
  assert _kinds(colls) == {"all-reduce"}
  assert grad_bytes <= _bytes(colls, "all-reduce") <= 1.01 * grad_bytes + 64


def test_zero1_gathers_updated_params_zero3_gathers_weights_per_layer():
  cfg, z1 = _compiled(*LAYOUTS["zero1"])
  param_bytes = 4 * metrics.param_counts(cfg.model)["total"]
  assert "all-gather" in _kinds(z1) and _bytes(z1, "all-gather") >= 0.99 * param_bytes
  _, z3 = _compiled(*LAYOUTS["zero3"])
  in_scan = [c for c in z3 if c.kind == "all-gather" and c.in_while]
  assert in_scan, "ZeRO-3 must gather layer weights inside the layer scan"


def _layer_gathers(colls, backward: bool) -> int:
  return sum(c.bytes_per_step for c in colls if c.kind == "all-gather" and c.in_while
             and ("transpose(" in c.op_name) == backward)


@pytest.mark.parametrize("remat,dtype", [("none", "float32"), ("selective", "float32"),
                                         ("full", "float32"), ("none", "bfloat16")])
def test_zero3_backward_gathers_weights_again(remat, dtype):
  # FSDP frees each gathered layer after use: the backward gathers it again (playbook: 2L-1
  # gathers), whatever the remat policy; saving it would keep all layers' weights alive.
  _, colls = _compiled(*LAYOUTS["zero3"], f"train.remat={remat}", f"model.dtype={dtype}")
  forward = _layer_gathers(colls, backward=False)
  assert forward > 0 and _layer_gathers(colls, backward=True) >= 0.99 * forward


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_zero2_3_reduce_each_layer_gradient_inside_the_backward_scan(name):
  # Reduced (to a shard: a reduce-scatter on GPU) as the backward produces each layer's
  # gradient, rather than once for the stacked gradients of all layers after the scan.
  cfg, colls = _compiled(*LAYOUTS[name])
  m = cfg.model
  layer = m.n_layers * (4 * m.d_model * m.n_heads * m.resolved_head_dim + 3 * m.d_model * m.d_ff
                        + 2 * m.d_model)
  in_scan = sum(c.bytes_per_step for c in colls if c.kind in ("all-reduce", "reduce-scatter")
                and c.in_while and "transpose(" in c.op_name)
  assert in_scan >= 4 * layer


def test_tp_all_reduces_and_sp_gathers_along_sequence():
  _, tp = _compiled(*LAYOUTS["tp"])
  assert "all-reduce" in _kinds(tp)
  _, sp = _compiled(*LAYOUTS["tp_sp"])
  assert "all-gather" in _kinds(sp)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_no_layout_gathers_full_vocab_logits(name):
  _, colls = _compiled(*LAYOUTS[name])
  assert colls and all(_dims(s) is not None for c in colls for s in c.shapes)
  logits_like = [c for c in colls for s in c.shapes
                 if len(_dims(s)) >= 3 and _dims(s)[-1] == V]
  assert not logits_like, [(c.kind, c.shapes, c.op_name) for c in logits_like]


def _grad_reductions(colls) -> tuple[int, int]:
  """(executions, bytes per step) of the non-scalar all-reduces / reduce-scatters."""
  ours = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")
          and any("[]" not in s for s in c.shapes)]
  return sum(c.executions for c in ours), sum(c.bytes_per_step for c in ours)


@pytest.mark.parametrize("layout, share", [
    (("mesh.data=8",), 1.0),
    (("mesh.data=2", "mesh.fsdp=4", "parallel.zero_stage=1"), 0.5)], ids=["dp", "zero1"])
def test_gradients_reduced_once_per_step_with_microbatches(layout, share):
  """With gradient accumulation each batch shard sums its own micro-batches' gradients and the
  shards are reduced once, in fp32 (`XlaComms.over_batch`): under GSPMD alone XLA reduced every
  micro-batch's gradient, layer by layer, in the compute dtype (XLA:GPU: 16 all-reduces of
  48 MiB at data=8 and 4 micro-batches where one of 25 MiB does). ZeRO-1 reduce-scatters the
  sum over fsdp (each shard's optimizer needs only its slice) and all-reduces that quarter over
  data: half the gradient's bytes (result sizes) where an all-reduce over both moved all of
  them (XLA:GPU, llama3_1b fsdp=8 with 2 micro-batches: 13.8 -> 9.2 GiB per step in all)."""
  cfg, colls = _compiled(*layout, "train.microbatches=2", "model.dtype=bfloat16")
  ours = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")
          and any("[]" not in s for s in c.shapes)]
  assert all(c.executions == 1 and not c.in_while and set(c.dtypes) == {"f32"} for c in ours), \
      ours
  runs, moved = _grad_reductions(colls)
  grad_bytes = 4 * metrics.param_counts(cfg.model)["total"]
  assert share * grad_bytes <= moved <= 1.01 * share * grad_bytes + 64, colls
  if share == 1.0:
    assert runs <= 2  # one combined all-reduce


def test_pipeline_reduces_gradients_once_per_step():
  """xla mode's stage region is manual over `data` too: no gradient reduction per tick (it
  was one per tick and layer: 217 GiB per step for llama3_1b at data=2 x stage=4 on XLA:GPU,
  4.8 GiB now), and the grad norm reads each stage's layers where they live."""
  cfg, colls = _compiled("mesh.data=4", "mesh.stage=2", "pipeline.microbatches=4")
  in_loop = [c for c in colls if c.in_while and c.kind in ("all-reduce", "all-gather")
             and any("[]" not in s for s in c.shapes)]
  assert not in_loop, [(c.kind, c.shapes, c.op_name) for c in in_loop]
  _, moved = _grad_reductions(colls)
  assert moved <= 1.01 * 4 * metrics.param_counts(cfg.model)["total"] + 64
