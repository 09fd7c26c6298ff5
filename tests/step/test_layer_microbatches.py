"""`train.accumulate: layer` (`jscale.model.layer_microbatches`): each layer runs the step's
micro-batches in turn. The same gradients as accumulation over the step (one device and
sharded layouts, both modes), and the point of it: ZeRO-3 gathers each layer's weights and
reduces its gradient as often as with one micro-batch."""

import functools
import re

import jax
import numpy as np
import pytest

import deepseek_case
import parity
from conftest import small_config
from jscale import predict, runtime, xla_flags
from jscale.analysis import gpu_target, hlo, introspect, overlap
from jscale.config import ConfigError
from jscale.config_load import load_config
from jscale.model import layer_microbatches
from jscale.step import accumulate
from jscale.step.train_step import make_loss_fn

MB = ("train.microbatches=2", "train.batch_size=16")


def _batch(cfg):
  return parity.batches(cfg, steps=1)[0]


@functools.lru_cache(maxsize=None)
def _grads(remat: str, where: str):
  """(grads, loss, stats) of the tiny DeepSeek's first batch on one device."""
  cfg = deepseek_case.config(*MB, f"train.remat={remat}", f"train.accumulate={where}")
  rt = runtime.build(cfg, jax.devices()[:1])
  params = parity.initial_state(rt)["params"]
  loss_fn = make_loss_fn(rt.graphdef, cfg)
  out = jax.jit(lambda p, b: accumulate.accumulate_grads(
      loss_fn, p, b, cfg.train.step_microbatches))(params, _batch(cfg))
  return jax.device_get((out.grads, out.loss, out.stats))


@pytest.mark.parametrize("remat", ["selective"])
def test_gradients_equal_accumulation_over_the_step(remat):
  """Every gradient (MLA, routed and shared experts, the bias's loads, the dense prefix, MTP),
  the loss and the router statistics, against the same micro-batches accumulated over the
  step. (Under selective remat the outer recompute keeps the micro-batches' matmul outputs;
  full remat's path is the sharded layouts' below.)"""
  (g_step, loss_step, stats_step), (g_layer, loss_layer, stats_layer) = (
      _grads(remat, "step"), _grads(remat, "layer"))
  np.testing.assert_allclose(loss_layer, loss_step, rtol=1e-5)
  for k in stats_step:
    np.testing.assert_allclose(stats_layer[k], stats_step[k], rtol=1e-4, atol=1e-7, err_msg=k)
  flat_step = jax.tree_util.tree_leaves_with_path(g_step)
  flat_layer = jax.tree.leaves(g_layer)
  assert len(flat_step) == len(flat_layer)
  for (path, a), b in zip(flat_step, flat_layer):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * np.abs(a).max(),
                               err_msg=jax.tree_util.keystr(path))


LAYOUTS = [
    ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3", "parallel.collectives=manual"),
    ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3", "parallel.collectives=xla"),
    ("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "parallel.zero_stage=3",
     "parallel.collectives=manual"),
]
EACH_TRIP = "parallel.scatter_each_trip=true"


@pytest.mark.parametrize("layout", LAYOUTS, ids=["z3_manual", "z3_xla", "z3_ep_manual"])
def test_sharded_layouts_train_as_one_device(layout):
  """Two steps' loss and gradient norm (the second on updated weights and bias) against one
  device accumulating over the step."""
  numerics = (*deepseek_case.DS, "train.microbatches=2", "train.remat=full")
  want = parity.reference(*numerics)[:2]
  got = parity.losses((*layout, *numerics, "train.accumulate=layer"), jax.devices(), steps=2)
  np.testing.assert_allclose(got, want, rtol=1e-4)


@functools.lru_cache(maxsize=None)
def _fsdp_collectives(*overrides) -> dict[str, int]:
  """Executions per step of the fsdp gathers and reduce-scatters of manual ZeRO-3 on 8
  devices (XLA:CPU's program: the hand-written collectives are the same ops on any backend)."""
  cfg = small_config(None, "mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3",
                     "parallel.collectives=manual", "train.remat=full",
                     "train.batch_size=32", "model.n_layers=4", *overrides)
  compiled, _ = introspect.compile_train_step(cfg)
  out: dict[str, int] = {}
  for c in hlo.collectives(compiled.as_text()):
    if c.kind in ("all-gather", "reduce-scatter") and c.group_size == 8:
      out[c.kind] = out.get(c.kind, 0) + c.executions
  return out


def test_zero3_gathers_each_layer_once_per_pass():
  """With 4 micro-batches accumulated over the step, every layer is gathered and its gradient
  reduce-scattered 4 times as often as with one; taking turns inside the layers, as often as
  with one."""
  one = _fsdp_collectives("train.microbatches=1")
  step = _fsdp_collectives("train.microbatches=4")
  layer = _fsdp_collectives("train.microbatches=4", "train.accumulate=layer")
  assert layer == one, (layer, one)
  assert step["all-gather"] > 3 * one["all-gather"], (step, one)
  assert step["reduce-scatter"] > 3 * one["reduce-scatter"], (step, one)


def test_scattered_each_trip_reduces_each_layer_once_per_trip():
  """`parallel.scatter_each_trip`: the gathers stay once per layer and pass; each layer's
  gradient is reduce-scattered in every trip of its micro-batch loop (4 here), the weights
  outside the layer stack (embedding, head) still once."""
  one = _fsdp_collectives("train.microbatches=1")
  layer = _fsdp_collectives("train.microbatches=4", "train.accumulate=layer")
  each = _fsdp_collectives("train.microbatches=4", "train.accumulate=layer", EACH_TRIP)
  assert each["all-gather"] == layer["all-gather"] == one["all-gather"], (each, one)
  per_layer = _fsdp_collectives("train.microbatches=1", "model.n_layers=5")["reduce-scatter"] \
      - one["reduce-scatter"]
  assert per_layer > 0
  assert each["reduce-scatter"] == one["reduce-scatter"] + 3 * 4 * per_layer, (each, one)


def test_prefetch_gathers_each_layer_in_the_trips_of_the_layer_after():
  """`parallel.prefetch_layers`: the backward gathers each layer in one chunk a trip (4 here)
  of the loop of the layer after it (`jscale.model.layer_prefetch`), one all-gather a chunk
  for all its weights instead of one per weight, and the top layer's chunks in one, once;
  the forward's gathers (its micro-batches not skewed) and the reduce-scatters do not
  change."""
  each = _fsdp_collectives("train.microbatches=4", "train.accumulate=layer", EACH_TRIP)
  got = _fsdp_collectives("train.microbatches=4", "train.accumulate=layer", EACH_TRIP,
                          "parallel.prefetch_layers=true")
  one = _fsdp_collectives("train.microbatches=1")
  weights = (_fsdp_collectives("train.microbatches=1", "model.n_layers=5")["all-gather"]
             - one["all-gather"]) // 2  # a layer's split weights (gathered twice a step)
  assert weights > 1
  layers = 4
  assert got["all-gather"] == each["all-gather"] - layers * weights + layers * 4 + 1, (
      got, each, weights)
  assert got["reduce-scatter"] == each["reduce-scatter"], (got, each)


PREFETCH_671B_LIKE = ("mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", "parallel.zero_stage=3",
                      "parallel.collectives=manual", "model.moe.exchange=node_limited",
                      "parallel.overlap_microbatches=2", "parallel.overlap_skew=true",
                      "train.accumulate=layer", EACH_TRIP, "parallel.prefetch_layers=true")


FP8_EXPERTS = ("fp8.enabled=true", "fp8.recipe=current", "fp8.targets=[experts]",
               "fp8.experts_scaling=row")
# 1 dense and 2 MoE layers, 4 micro-batches two side by side, layer inputs on the host, the
# routed experts in FP8 scaled per row
PREFETCH_NUMERICS = (*deepseek_case.DS, "train.microbatches=4", "train.batch_size=32",
                     "train.remat=full_offload", *FP8_EXPERTS)


@functools.lru_cache(maxsize=None)
def _prefetched() -> tuple[np.ndarray, str, str]:
  """(two steps' loss and gradient norm, the lowered HLO, the compiled HLO) of the train step on
  the 671B's layout in small with `parallel.prefetch_layers` (`PREFETCH_NUMERICS`; XLA:CPU's
  program: the hand-written collectives are the same ops on any backend). One compile."""
  got, lowered, compiled = parity.run((*PREFETCH_671B_LIKE, *PREFETCH_NUMERICS), jax.devices(),
                                      steps=2)
  return got, lowered.as_text(dialect="hlo"), compiled.as_text()


def test_skewed_forward_gathers_each_layer_in_the_trips_of_the_layer_before():
  """With the micro-batches skewed, the forward fetches each layer likewise, a chunk a trip of
  the layer before's loop beside its first phase (`phases.alongside`): inside the forward's
  layer loop one all-gather (of all the layer's weights) per MoE layer and trip, 2 x 2 here,
  and outside it layer 0's chunks, once; no weight gathered alone. Its pieces carry the routed
  experts' weights as e4m3 columns (`Chunked.forward`): fewer bytes than the backward's."""
  pieces = [c for c in hlo.collectives(_prefetched()[2])
            if c.kind == "all-gather" and c.group_size == 2 and "/layers/" in (c.op_name or "")]
  forward = [c for c in pieces if "transpose" not in c.op_name]
  assert sorted((c.in_while, c.executions) for c in forward) == [(False, 1), (True, 2 * 2)], [
      (c.op_name, c.executions) for c in forward]
  # (a trip's piece and layer 0's whole, each against the backward's same: the tiny
  # DeepSeek's routed experts are ~half a layer's weights, so ~3/4 of the bytes)
  backward = sorted({c.bytes for c in pieces if "transpose" in c.op_name})
  ratios = [f / b for f, b in zip(sorted({c.bytes for c in forward}), backward)]
  assert len(ratios) == 2 and all(0.7 < r < 0.8 for r in ratios), (forward, backward)


def test_no_zero_rows_lifted_out_of_the_prefetched_layers():
  """No zero of the exchange's rows is made from a constant alone (`jscale.model.zeros`):
  under the layer's custom VJP JAX lifts those out of the layer loops, and XLA materialises
  them (6.9 GiB per device on the 671B at 1,024 H100s). A `where` whose one operand is a
  constant is such a zero; none may be rows of the model's width (64 here). (An FP8 expert's
  per-column scales, [E, 1, 64], are one row an expert: `scaling.scale_for`'s where.)"""
  lifted = re.findall(r"= (?:f32|bf16)\[([\d,]+)\]\S* call\(%?constant[.\d]*\), "
                      r"to_apply=%?_where", _prefetched()[1])
  rows = [s for s in lifted if s.split(",")[-1] == "64" and s.split(",")[-2:-1] != ["1"]]
  assert rows == [], lifted


def test_prefetched_backward_trains_as_one_device():
  """The layer scan's backward by hand (`parallel.prefetch_layers`, and the skewed forward's
  fetches) on the 671B's layout in small (ZeRO-3 x EP, node-limited, 4 micro-batches two
  side by side and skewed, layer inputs on the host, the routed experts in FP8 scaled per
  row, so the forward's pieces carry their weights as e4m3 columns): two steps' loss and
  gradient norm against one device."""
  want = parity.reference(*PREFETCH_NUMERICS)[:2]
  np.testing.assert_allclose(_prefetched()[0], want, rtol=1e-4)


def test_scattered_each_trip_keeps_each_weights_reduce_scatter_apart():
  """The launcher's reduce-scatter combine threshold under `parallel.scatter_each_trip`: 8 MiB,
  so each weight's reduce-scatter starts as its gradient is ready inside the trip (at 128 MiB
  XLA:GPU merges a layer's into one that waits for the trip's last gradient)."""
  rs = "xla_gpu_reduce_scatter_combine_threshold_bytes"
  layout = ("mesh.data=1", "mesh.fsdp=8", "parallel.zero_stage=3", "parallel.collectives=manual",
            "train.microbatches=2", "train.accumulate=layer")
  assert xla_flags.compiler_options(load_config(None, [*layout, EACH_TRIP]))[rs] == 2**23
  assert xla_flags.compiler_options(load_config(None, list(layout)))[rs] == 2**27


@pytest.mark.parametrize("layout", [("parallel.collectives=xla", "parallel.zero_stage=3"),
                                    ("parallel.collectives=manual", "parallel.zero_stage=2")])
def test_scattered_each_trip_is_a_no_op_off_manual_zero3(layout):
  """Where ZeRO's gather is a custom VJP (xla mode, ZeRO-2's stored layers) the layers reduce
  after the loop as without the option (warned about, `jscale.config_conditional`)."""
  cfg = load_config(None, ["mesh.fsdp=2", "train.microbatches=2", "train.accumulate=layer",
                           EACH_TRIP, *layout])
  assert not layer_microbatches.Turns.of(cfg).scatter_each_trip


def test_refused_with_delayed_fp8_scaling():
  with pytest.raises(ConfigError, match="train.accumulate=layer.*fp8.recipe=current"):
    load_config(None, ["train.microbatches=2", "train.accumulate=layer", "fp8.enabled=true"])


def test_full_offload_trains_as_full():
  """`train.remat=full_offload`: the layers' inputs wait in host memory; the numbers are full
  remat's."""
  numerics = (*deepseek_case.DS, "train.microbatches=2")
  want = parity.reference(*numerics, "train.remat=full")[:2]
  got = parity.losses((*LAYOUTS[0], *numerics, "train.accumulate=layer",
                       "train.remat=full_offload"), jax.devices(), steps=2)
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_full_offload_refused_under_a_pipeline():
  with pytest.raises(ConfigError, match="train.remat=full_offload with mesh.stage=2"):
    runtime.build(small_config(None, "mesh.stage=2", "mesh.data=1", "train.remat=full_offload"),
                  jax.devices()[:2])


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_full_offload_keeps_the_layer_inputs_in_host_memory_on_h100():
  """XLA:GPU's program for one H100, 4 micro-batches taking turns in 8 layers: under
  full_offload the stacked layer inputs live in host memory (space S(5)), copied out and back
  by async copies, and the device holds less than full remat's."""
  programs = {}
  for remat in ("full", "full_offload"):
    cfg = load_config("configs/tiny.yaml", [
        "model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=16", "model.n_layers=8",
        "train.seq_len=512", "model.d_model=256", "model.d_ff=512", "train.microbatches=4",
        "train.accumulate=layer", f"train.remat={remat}"])
    programs[remat] = predict.compile_for(cfg, "h100x1")[:2]
  (full, full_bytes), (offload, offload_bytes) = programs["full"], programs["full_offload"]
  assert re.search(r"bf16\[8,16,512,256\]\{[\d,]+:S\(5\)\}", offload), "no stacked inputs on host"
  assert not re.search(r":S\(5\)", full)
  # 8 layers x 16 x 512 x 256 in bf16: 16 MiB of inputs no longer on the device
  assert offload_bytes < full_bytes - 12 * 2**20


@pytest.mark.parametrize("skew", [(), ("parallel.overlap_skew=true", "mesh.data=1", "mesh.fsdp=2",
                                       "mesh.expert=4", "model.moe.exchange=node_limited",
                                       EACH_TRIP)],
                         ids=["xla_order", "skewed_node_limited"])
def test_overlapped_microbatches_train_as_one_device(skew):
  """`parallel.overlap_microbatches=2`: the two micro-batches side by side in each layer's loop
  step give the numbers of one device accumulating them over the step: as XLA orders them,
  and skewed by a phase (`jscale.model.phases`; the node-limited exchange, whose second hop
  is the flat exchange's phases; each trip reduce-scattering its gradient, as the 671B's
  layout runs)."""
  numerics = (*deepseek_case.DS, "train.microbatches=2", "train.remat=full")
  want = parity.reference(*numerics)[:2]
  got = parity.losses((*LAYOUTS[2], *numerics, "train.accumulate=layer",
                       "parallel.overlap_microbatches=2", *skew), jax.devices(), steps=2)
  np.testing.assert_allclose(got, want, rtol=1e-4)


OVERLAP_RUNS = "parallel.overlap_microbatches=2: the layers run"
OFFLOAD_LOOP = "train.remat=offload with parallel.overlap_microbatches=2 and train.microbatches=4"


@pytest.mark.parametrize("overrides,refusal", [
    (("train.microbatches=4",), OVERLAP_RUNS),
    (("train.microbatches=3", "train.accumulate=layer"), OVERLAP_RUNS),
    (("train.microbatches=4", "train.accumulate=layer", "train.remat=offload"), OFFLOAD_LOOP)],
                         ids=["step accumulation", "not dividing", "offload in a loop"])
def test_overlap_refused_where_it_cannot_apply(overrides, refusal):
  with pytest.raises(ConfigError, match=refusal):
    load_config(None, ["train.batch_size=12", "parallel.overlap_microbatches=2", *overrides])


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_overlap_with_residuals_in_host_memory_compiles_where_allowed_on_h100():
  """XLA:GPU fails a loop over side-by-side micro-batches under `train.remat=offload` (refused
  above; `python -m jscale.predict --target h100x1 model.dtype=bfloat16 train.batch_size=8
  train.microbatches=4 train.accumulate=layer train.remat=offload
  parallel.overlap_microbatches=2` with the refusal lifted: "Expected instruction to have shape
  equal to", jax 0.10.2). What the refusal offers compiles: full_offload's layer inputs in host
  memory across that loop, and offload with one group of two (no loop)."""
  texts = {}
  for micro, remat in ((4, "full_offload"), (2, "offload")):
    cfg = load_config("configs/tiny.yaml", [
        "model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=8",
        "train.accumulate=layer", "parallel.overlap_microbatches=2",
        f"train.microbatches={micro}", f"train.remat={remat}"])
    texts[remat] = predict.compile_for(cfg, "h100x1")[0]
  assert re.search(r":S\(5\)\}", texts["full_offload"])  # the layer inputs on the host


# A tiny MoE over 8 H100s, one expert each, manual EP (as tests/parallel/test_expert_chunks.py).
MOE_H100X8 = ("model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=16",
              "model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=256",
              "model.d_model=256", "train.seq_len=256", "model.n_layers=2",
              "train.remat=full", "mesh.expert=8",
              "mesh.data=1", "parallel.collectives=manual", "train.microbatches=2",
              "train.accumulate=layer")


@functools.lru_cache(maxsize=None)
def _h100x8_windows(*overrides: str) -> list[overlap.Window]:
  """The ragged all-to-all windows of the small MoE's XLA:GPU program for 8 H100s."""
  cfg = load_config("configs/tiny.yaml", [*MOE_H100X8, *overrides])
  return overlap.windows(predict.compile_for(cfg, "h100x8")[0], "ragged-all-to-all")


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_overlapped_microbatches_share_the_exchange_windows_on_h100s():
  """In the XLA:GPU program for 8 H100s, two micro-batches side by side put one's Hopper
  grouped-matmul kernels between the start and done of the other's ragged all-to-alls, which
  one micro-batch at a time leaves empty of them."""
  held = {side: sum(w.count("mosaic_gpu") for w in _h100x8_windows(
      f"parallel.overlap_microbatches={side}")) for side in (1, 2)}
  assert held[2] >= held[1] + 4, held


@pytest.mark.skipif(not gpu_target.available(), reason=gpu_target.INSTALL)
def test_skewed_microbatches_put_attention_beside_the_dispatch_on_h100s():
  """Side by side as XLA:GPU orders them, the two micro-batches run their attention in
  lockstep, before either's exchange; skewed by a phase (`parallel.overlap_skew`), one's
  cuDNN attention runs inside the other's dispatch window."""
  held = {skew: sum(w.count("cudnn") for w in _h100x8_windows(
      "parallel.overlap_microbatches=2", *skew)) for skew in ((), ("parallel.overlap_skew=true",))}
  assert list(held.values()) == [0, 1], held
