"""`jscale.predict`: each cost rule on a small program compiled by the real XLA:GPU compiler for
H100s (no GPU: `jscale.analysis.gpu_target`), loops and the pipeline's ticks as timed, and the
guard on llama3_1b's predicted MFU that a slower step must fail (the schedule's overlap
arithmetic on hand-made launches: test_schedule.py).

How well the predictions match the GPUs: scripts/predict_vs_measured.py ->
results/predict_vs_measured.md (every measured row; needs old commits' worktrees, not CI).
"""

import dataclasses
import json
import os
import re
import sys

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
from jscale import predict  # noqa: E402
from jscale.analysis import hlo  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.fp8 import dot as fp8_dot  # noqa: E402
from jscale import hardware  # noqa: E402
from jscale import mesh as jscale_mesh  # noqa: E402
from jscale.predict import timing, launches, rates, summary  # noqa: E402
from jscale.plan.__main__ import main as plan_main  # noqa: E402
from jscale.predict.__main__ import main  # noqa: E402

CHIP = rates.chip("h100")
FIT = CHIP.fit


def _compile(f, *shapes, n=1, spec=P(), options=None):
  mesh = Mesh(np.array(gpu_target.devices(f"h100x{n}")), ("x",))
  s = NamedSharding(mesh, spec)
  return jax.jit(f, in_shardings=(s,) * len(shapes), out_shardings=NamedSharding(mesh, P())
                 ).lower(*shapes).compile(compiler_options=options).as_text()


def _only(text, kind):
  (x,) = [i for i in launches.Program(text).items() if getattr(i, "kind", "") == kind]
  return x


SQUARE = 4096
GEMM_FLOPS = 2.0 * SQUARE**3


@pytest.mark.parametrize("dtype, precision, peak", [
    (jnp.bfloat16, None, "bf16"), (jnp.float32, None, "tf32"), (jnp.float32, "highest", "f32")])
def test_gemm_runs_at_its_operand_types_peak(dtype, precision, peak):
  """A square gemm: FLOPs from its dimensions, the peak of what it multiplies in (f32 at
  default precision is TF32 on Hopper, HIGHEST plain f32), the shape's efficiency."""
  a = jax.ShapeDtypeStruct((SQUARE, SQUARE), dtype)
  x = _only(_compile(lambda p, q: jnp.matmul(p, q, precision=precision), a, a), "gemm")
  assert x.flops == GEMM_FLOPS and x.mnk == (1, SQUARE, SQUARE, SQUARE)
  t = timing.time_launch(x, CHIP)
  waves = 512 / (4 * 132)  # 32 x 16 tiles of 128x256 on 132 SMs: 4 waves, the last short
  ceiling = FIT.tf32_ceiling if peak != "bf16" else FIT.gemm_ceiling
  short_k = SQUARE / (SQUARE + FIT.gemm_k_half)
  assert timing.gemm_efficiency(1, SQUARE, SQUARE, SQUARE, CHIP, ceiling) == pytest.approx(
      ceiling * waves * short_k)
  eff = timing.gemm_efficiency(1, SQUARE, SQUARE, SQUARE, CHIP, ceiling)
  assert t.seconds == pytest.approx(GEMM_FLOPS / (CHIP.peak[peak] * eff))
  assert t.bound == "compute"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cublas_gemm_reads_like_the_triton_one(dtype):
  """The gemms as the autotuner picks them (`predict.AUTOTUNED_GEMMS`: cuBLAS calls, the
  program `jscale.predict` times and a GPU run dumps) give the same FLOPs, shape and type."""
  a = jax.ShapeDtypeStruct((SQUARE, SQUARE), dtype)
  x = _only(_compile(lambda p, q: p @ q, a, a, options=predict.AUTOTUNED_GEMMS), "gemm")
  assert x.label.startswith("__cublas") and x.flops == GEMM_FLOPS
  assert x.mnk == (1, SQUARE, SQUARE, SQUARE) and x.dtype == ("bf16" if dtype == jnp.bfloat16
                                                                else "f32")


def test_an_fp8_product_upcast_by_the_compile_here_is_timed_as_fp8():
  """XLA:GPU compiled without a GPU never forms cuBLASLt's FP8 gemm: an FP8 product
  (`jscale.fp8.dot`) becomes a bf16 cuBLAS call on fusions that round to e4m3 and back. The
  predictor times that call as the FP8 gemm a GPU runs (measured FP8 rows: docs/predict.md);
  a bf16 product beside it stays bf16."""
  a = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
  fp8 = lambda p, q: fp8_dot.fp8_dot_general(p, q, (((1,), (0,)), ((), ())),
                                             fp8_dot.Recipe(delayed=False))
  text = _compile(lambda p, q: (fp8(p, q), p @ q), a, a, options=predict.AUTOTUNED_GEMMS)
  assert "__cublas$lt$matmul$f8" not in text
  gemms = [i for i in launches.Program(text).items() if getattr(i, "kind", "") == "gemm"]
  assert sorted(g.dtype for g in gemms) == ["bf16", "f8"], [(g.label, g.dtype) for g in gemms]
  assert all(g.label.startswith("__cublas") for g in gemms)


def test_gemm_efficiency_sees_waves_and_short_k():
  # 132 SMs: 133 tiles of 128x256 take two waves; a k of 64 reaches half the ceiling.
  full = timing.gemm_efficiency(1, 128 * 12, 256 * 11, 4096, CHIP)
  spill = timing.gemm_efficiency(1, 128 * 12 + 1, 256 * 11, 4096, CHIP)
  assert spill < 0.8 * full
  k_half = rates.chip("h100", dataclasses.replace(FIT, gemm_k_half=64))
  short = timing.gemm_efficiency(1, 128 * 12, 256 * 11, 64, k_half)
  assert short == pytest.approx(FIT.gemm_ceiling / 2)  # one full wave, half the ceiling


def test_memory_bound_fusion_moves_its_bytes():
  x = jax.ShapeDtypeStruct((8192, 8192), jnp.float32)
  f = _only(_compile(lambda v: v * 2 + 1, x), "memory")
  assert f.bytes == 2 * 8192 * 8192 * 4  # read once, written once
  t = timing.time_launch(f, CHIP)
  assert t.seconds == pytest.approx(f.bytes / (CHIP.hbm_bytes_s * FIT.memory))
  assert t.gap == FIT.launch_s and t.bound == "memory"


def _online(a, b):  # (max, sum-exp) pairs -> of their union: the one-pass softmax's combiner
  (m1, s1), (m2, s2) = a, b
  m = jnp.maximum(m1, m2)
  return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)


def test_an_online_softmax_reduction_runs_at_its_measured_rate():
  """A variadic reduction with exps in its combiner (the chunked loss's one-pass (max, sum-exp)
  until 2026-11-30) is timed per element at the rate the H200 ran it (on an H100, 2.5x its
  bytes' time); a plain max reduction by its bytes."""
  x = jax.ShapeDtypeStruct((4096, 25600), jnp.bfloat16)
  one_pass = lambda v: jax.lax.reduce((v.astype(jnp.float32), jnp.ones(v.shape, jnp.float32)),
                                      (jnp.float32(-jnp.inf), jnp.float32(0)), _online, (1,))
  launches_ = [i for i in launches.Program(_compile(one_pass, x)).items() if i.kind == "memory"]
  online = [i for i in launches_ if i.online]
  big = max(online, key=lambda i: i.online)  # XLA splits it: the partial pairs, then theirs
  assert big.online == 4096 * 25600
  t = timing.time_launch(big, CHIP)
  assert t.bound == "measured" and t.seconds == pytest.approx(big.online / rates.ONLINE_SOFTMAX)
  assert t.seconds > 2 * big.bytes / CHIP.hbm_bytes_s
  plain = [i for i in launches.Program(_compile(lambda v: jnp.max(v, axis=1), x)).items()
           if i.kind == "memory"]
  assert plain and not any(i.online for i in plain)
  assert timing.time_launch(max(plain, key=lambda i: i.bytes), CHIP).bound == "memory"


@pytest.mark.parametrize("label, rate", [("grouped_matmul", 732e12),
                                         ("transposed_grouped_matmul", 501e12)])
def test_grouped_matmul_kernels_run_at_their_measured_rates(label, rate):
  """The Hopper grouped matmul's kernels (forward / dX, and dW) at the rates measured on the
  H200, not a roofline: 2·M·K·N FLOPs, M rows of K times their group's [K, N]."""
  m, n, k = 32768, 2048, 2048
  x = launches.Launch("mpmd_map_1", "custom-call", "kernel", label, "", bytes=2.0 * m * k,
                      mnk=(1, m, n, k))
  t = timing.time_launch(x, CHIP)
  assert t.bound == "measured" and x.flops == 2.0 * m * n * k
  assert t.seconds == pytest.approx(x.flops / rate)


def test_collective_over_the_link_its_group_spans():
  """A psum of 64 MiB over 8 H100s of one node: all-reduce volume 2 x 64 MiB over NVLink's
  measured all-reduce bus bandwidth (`jscale.hardware.busbw`)."""
  x = jax.ShapeDtypeStruct((8 * 2048, 1024), jnp.float32)
  text = _compile(lambda v: jnp.sum(v, axis=0), x, n=8, spec=P("x"))
  (c,) = [i for i in launches.Program(text).items() if getattr(i, "kind", "") == "collective"]
  t = timing.time_launch(c, CHIP)
  assert c.collective.kind == "all-reduce" and c.collective.group_size == 8
  want = 2 * c.collective.bytes / hardware.busbw("all-reduce", 1) + FIT.collective_s
  assert t.seconds == pytest.approx(want)


def test_collectives_are_priced_on_the_devices_their_partitions_run_on():
  """A hybrid mesh whose in-node axis is not the innermost (fsdp 8 inside each node, expert
  across 2 nodes: `mesh.fsdp=8 mesh.dcn_expert=2`) assigns partitions to devices out of order.
  The replica groups name partitions; priced as devices, a psum over fsdp stays in its node
  (NVLink) and one over expert crosses the nodes. Read as device ids, each is the other's."""
  cfg = load_config(None, ["mesh.data=1", "mesh.fsdp=8", "mesh.dcn_expert=2"]).mesh
  m = jscale_mesh.make_mesh(cfg, gpu_target.devices("h100x16"))
  devices = jscale_mesh.partition_devices(m)
  assert devices != tuple(range(16))
  x = jax.ShapeDtypeStruct((16 * 256, 1024), jnp.float32)
  for axis, nodes in (("fsdp", 1), ("expert", 2)):
    psum = jax.shard_map(lambda v, a=axis: jax.lax.psum(v, a), mesh=m,
                         in_specs=P(("fsdp", "expert")), out_specs=P(("fsdp", "expert")))
    text = jax.jit(psum).lower(x).compile().as_text()
    (c,) = [i for i in launches.Program(text, devices=devices).items()
            if getattr(i, "kind", "") == "collective" and i.collective.group_size == m.shape[axis]]
    want = 2 * c.collective.bytes / hardware.busbw("all-reduce", nodes) + FIT.collective_s
    assert timing.time_launch(c, CHIP).seconds == pytest.approx(want), axis
    (blind,) = [i for i in launches.Program(text).items() if i.name == c.name]
    assert timing.time_launch(blind, CHIP).seconds != pytest.approx(want), axis


DSV3_1024 = ("model.preset=deepseek_v3_671b", "model.moe.exchange=node_limited",
             "model.moe.receive_factor=1.25", "mesh.data=1", "mesh.fsdp=16", "mesh.expert=64",
             "train.seq_len=4096", "train.batch_size=8192", "train.microbatches=4",
             "train.accumulate=layer", "parallel.overlap_microbatches=2")


@pytest.mark.parametrize("overrides, want", [
    # 8 sequences a device in 4 micro-batches: 8,192 tokens a call, each to 4 of 8 nodes;
    # hop 1's blocks hold 1.25 times that (8 sources x 5,120 rows), the experts' rows 8 x.
    (DSV3_1024, ((40960, 32768), 65536)),
    (DSV3_1024 + ("parallel.expert_chunks=2",), ((20480, 16384), 32768)),
    (DSV3_1024 + ("model.moe.receive_factor=0",), ((65536, 32768), 65536)),
    (DSV3_1024 + ("model.moe.exchange=flat",), (None, 65536)),
], ids=["bounded", "chunks", "unbounded", "flat"])
def test_the_exchange_rows_a_layout_routes(overrides, want):
  """The rows `jscale.predict` prices the expert exchange's all-to-alls at, from the config:
  the node-limited exchange's first hop (its blocks' rows, a copy per token and chosen group:
  `launches.Program`, tests/parallel/test_node_limited.py) and the experts' routed rows."""
  cfg = load_config(None, list(overrides))
  assert (predict.node_rows(cfg, 1024), predict.routed_rows(cfg, 1024)) == want


def test_loop_runs_its_body_trip_count_times():
  a = jax.ShapeDtypeStruct((SQUARE, SQUARE), jnp.bfloat16)
  text = _compile(lambda p, q: jax.lax.fori_loop(0, 10, lambda i, v: jnp.tanh(v @ q), p), a, a)
  (loop,) = [i for i in launches.Program(text).items() if isinstance(i, launches.Loop)]
  assert loop.trips == 10
  sched = predict.predict(text, "h100")
  (gemm,) = [t for t in sched.timed if t.launch.kind == "gemm"]
  assert gemm.runs == 10 and not sched.unknown_trips
  assert sched.seconds == pytest.approx(sum((t.seconds + t.gap) * t.runs for t in sched.timed))


# The guard: llama3_1b as configured, compiled for one H100 as launched, one compile per config.
CONFIG = "configs/llama3_1b.yaml"


@pytest.fixture(scope="module")
def llama3_1b():
  texts = {}

  def run(*overrides):
    """(prediction, optimised HLO text) of llama3_1b.yaml with `overrides`."""
    cfg = load_config(CONFIG, ["checkpoint.every=0", *overrides])
    if overrides not in texts:
      texts[overrides] = predict.compile_for(cfg, "h100x1")
    text, memory, remat = texts[overrides]
    return predict.predict_config(cfg, "h100x1", text, memory_bytes=memory, remat=remat), text
  return run


def test_llama3_1b_as_configured_predicts_at_least_45_percent_mfu(llama3_1b):
  r, text = llama3_1b()
  assert r.mfu >= 0.45, r
  # Compiled with the launcher's device memory (`introspect.compile_as_launched`), XLA
  # rematerialises nothing; with a topology's default (0.8 x the card) it recomputed 86
  # instructions of this step.
  assert ".remat" not in text
  # (exposed = step - busy time: two float sums, equal up to rounding on one device)
  assert r.by_category["gemm"] > 0.5 * r.step_s and r.exposed_collectives_s < 1e-9
  assert r.fits and 10 * 2**30 < r.memory_bytes < r.memory_limit < 80 * 2**30


@pytest.mark.parametrize("batch, fits", [(4, True), (8, False)])
def test_memory_is_the_buffer_assignment_and_the_remat_warning_a_note(llama3_1b, batch, fits):
  """llama3_1b without recomputation: at batch 8 the compiled step holds more than XLA may use
  (DOES NOT FIT); at batch 4 its buffers fit, though XLA's remat pass warned that its own
  estimate did not (read from the compiler's log). On an H200 the same pair (batch 8 warned,
  16 over) ran and ran out of memory: the buffers decide, the warning is a note."""
  r, _ = llama3_1b(f"train.batch_size={batch}", "train.remat=none")
  assert r.fits is fits
  assert r.remat_reached_bytes > r.remat_limit_bytes > 60 * 2**30
  lines = summary.format_summary(r, f"llama3_1b b{batch}").splitlines()
  if fits:
    assert lines[2].endswith("XLA may use: fits") and lines[3].startswith("note: XLA's remat ")
  else:
    assert lines[2].startswith("DOES NOT FIT: the compiled step needs ")
    assert lines[3].startswith("XLA's remat pass estimated the step at") and "too" in lines[3]


@pytest.mark.parametrize("slower", [("model.dtype=float32",), ("train.remat=full",)],
                         ids=["f32-matmuls", "recompute-everything"])
def test_guard_fails_a_slower_step(llama3_1b, slower):
  """f32 matmuls (TF32 gemms) or recomputing every kernel in the backward fall under 45%."""
  assert llama3_1b(*slower)[0].mfu < 0.45


def test_cli_prints_the_prediction_and_its_json(llama3_1b, tmp_path, capsys):
  path = tmp_path / "step.hlo"
  path.write_text(llama3_1b()[1])
  args = ["--config", CONFIG, "checkpoint.every=0", "--target", "h100x1", "--hlo", str(path)]
  assert main([*args, "--top", "5"]) == 0
  out = capsys.readouterr().out
  assert "predicted step" in out and "top 5 kernels" in out and "55% MFU" in out
  assert main([*args, "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert set(r) == {f.name for f in dataclasses.fields(summary.Summary)}
  assert r["mfu"] == pytest.approx(llama3_1b()[0].mfu)
  assert main(["--target", "h100x0"]) == 2 and "expected <gpu>x<count>" in \
      capsys.readouterr().err


def test_bench_train_predicts_the_program_its_run_compiled(llama3_1b, tmp_path):
  """scripts/bench_train.py writes jscale.predict's figures beside each GPU row, from the step
  program XLA dumped while the run compiled it (here: the CPU compile of llama3_1b for H100s
  standing in for a GPU run's dump)."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))
  import bench_train  # pylint: disable=import-outside-toplevel
  r, text = llama3_1b()
  (tmp_path / "module_0042.jit_step.sm_9.0_gpu_after_optimizations.txt").write_text(text)
  (tmp_path / "module_0001.jit_init.sm_9.0_gpu_after_optimizations.txt").write_text("x")
  row = {"device": "NVIDIA H100 80GB HBM3", "step_time_s": 2 * r.step_s, "mfu": r.mfu / 2}
  got = bench_train.predicted(str(tmp_path), row)
  assert got["predicted_step_s"] == pytest.approx(r.step_s)
  assert got["predicted_mfu"] == pytest.approx(r.mfu)
  assert got["predicted_ms_gemm"] == pytest.approx(1e3 * r.by_category["gemm"])
  assert bench_train.predicted(str(tmp_path), {**row, "device": "cpu"}) == {}


def test_plan_ranks_verified_layouts_by_their_compiled_step(capsys):
  """`python -m jscale.plan --verify 2 --target h100x8 --rank compiled` with its compile budget
  spent: the first layout always compiles, with its predicted step and MFU beside the planner's
  estimate, and the line says what was left out. (Two compiled programs ranked fastest first:
  tests/plan/test_gpu_compile.py's test_plan_compiles_each_layout_both_ways.)"""
  assert plan_main(["--model", "configs/tiny.yaml", "--gpus", "8", "--seq", "256",
                    "--global-batch-tokens", "16k", "--top", "2", "--verify", "2", "--target",
                    "h100x8", "--rank", "compiled", "--compile-budget-s", "0"]) == 0
  printed = capsys.readouterr()
  out = printed.out.split("--verify's 1 compiled program, the fastest that fits first")[1]
  assert len(re.findall(r"compiled ([\d.]+) ms, MFU", out)) == 1, out
  assert re.search(r"^compiled 1/2: .* in \d+ s$", printed.err, re.M), printed.err
  assert "compiles 2-2 left out (raise --compile-budget-s)" in printed.err


# XLA:GPU leaves `known_trip_count` off some loops: this one (cut from llama3_1b's micro-batch
# scan under tensor + sequence parallelism, first step peeled) counts from 1 while < 31.
UNANNOTATED_LOOP = """
HloModule m, is_scheduled=true

%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %limit = s32[] constant(31)
  ROOT %lt = pred[] compare(%p, %limit), direction=LT
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %c = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%fused_step (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  ROOT %t = f32[1024]{0} tanh(%a)
}

%body (b: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %b = (s32[], f32[1024]{0}) parameter(0)
  %one = s32[] constant(1)
  %next = s32[] add(%b#0, %one)
  %v = f32[1024]{0} fusion(%b#1), kind=kLoop, calls=%fused_step
  ROOT %r = (s32[], f32[1024]{0}) tuple(%next, %v)
}

ENTRY %main (x: f32[1024]) -> (s32[], f32[1024]) {
  %x = f32[1024]{0} parameter(0)
  %start = s32[] constant(1)
  %copied = s32[] copy(%start)
  %init = (s32[], f32[1024]{0}) tuple(%copied, %x)
  ROOT %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_without_known_trip_count_reads_it_from_its_condition():
  (loop,) = [i for i in launches.Program(UNANNOTATED_LOOP).items()
             if isinstance(i, launches.Loop)]
  assert loop.trips == 30
  comps, entry, _ = hlo.parse(UNANNOTATED_LOOP)
  assert hlo.executions(comps, entry)["body"] == (30, True, True)


# The pipeline executor's tick loop, cut down: 4 trips of a per-tick switch whose branch 0 is a
# small kernel and branch 1 one 1,024x larger (an idle tick against a layer's backward).
TICK_LOOP = """
HloModule m, is_scheduled=true

%fused_small (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  ROOT %t = f32[1024]{0} tanh(%a)
}

%fused_large (a: f32[1048576]) -> f32[1024] {
  %a = f32[1048576]{0} parameter(0)
  %t = f32[1048576]{0} tanh(%a)
  ROOT %s = f32[1024]{0} slice(%t), slice={[0:1024]}
}

%idle (p: (f32[1024], f32[1048576])) -> f32[1024] {
  %p = (f32[1024]{0}, f32[1048576]{0}) parameter(0)
  %s = f32[1024]{0} get-tuple-element(%p), index=0
  ROOT %small = f32[1024]{0} fusion(%s), kind=kLoop, calls=%fused_small
}

%backward (p: (f32[1024], f32[1048576])) -> f32[1024] {
  %p = (f32[1024]{0}, f32[1048576]{0}) parameter(0)
  %l = f32[1048576]{0} get-tuple-element(%p), index=1
  ROOT %large = f32[1024]{0} fusion(%l), kind=kLoop, calls=%fused_large
}

%cond (c: (s32[], f32[1024], f32[1048576])) -> pred[] {
  %c = (s32[], f32[1024]{0}, f32[1048576]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[1024], f32[1048576])) -> (s32[], f32[1024], f32[1048576]) {
  %b = (s32[], f32[1024]{0}, f32[1048576]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[1024]{0} get-tuple-element(%b), index=1
  %y = f32[1048576]{0} get-tuple-element(%b), index=2
  %ops = (f32[1024]{0}, f32[1048576]{0}) tuple(%x, %y)
  %tick = f32[1024]{0} conditional(%i, %ops, %ops), branch_computations={%idle, %backward}, metadata={op_name="jit(step)/shard_map/while/body/pipeline_tick/cond"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[1024]{0}, f32[1048576]{0}) tuple(%next, %tick, %y)
}

ENTRY %main (x: f32[1024], y: f32[1048576]) -> (s32[], f32[1024], f32[1048576]) {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1048576]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}, f32[1048576]{0}) tuple(%zero, %x, %y)
  ROOT %w = (s32[], f32[1024]{0}, f32[1048576]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_pipeline_ticks_are_timed_at_the_ops_their_stages_run():
  """Without the executed table every tick is priced at the switch's longest branch; with it,
  each tick at the longest op its stages run: here 2 ticks where a stage runs the large
  branch, 2 where both idle (the lockstep tick lasts as long as its slowest stage)."""
  items = launches.Program(TICK_LOOP).items()
  chip = rates.chip("h100")
  (loop,) = items
  branches, counter = loop.body  # the switch, then the loop counter's add
  small, large = (timing.time_launch(b[0], chip) for b in branches.branches)
  add = timing.time_launch(counter, chip)
  each = lambda t: t.seconds + t.gap + add.seconds + add.gap  # a tick's branch, then the add
  assert timing.schedule(items, chip).seconds == pytest.approx(4 * each(large))
  ticks = np.array([[0, 1], [0, 0], [1, 1], [0, 0]])  # [T, p]: the branch per tick and stage
  s = timing.schedule(items, chip, ticks)
  assert s.seconds == pytest.approx(2 * each(large) + 2 * each(small))
  assert s.ticks.startswith("pipeline: 4 ticks") and "check the loop" not in s.ticks
  assert not s.branches  # ticks are not "timed by their longest branch"
  runs = {t.launch.name: t.runs for t in s.timed}
  assert runs == {small.launch.name: 2, large.launch.name: 2, counter.name: 4}
  # A table that does not match the loop's ticks is said.
  assert "the table has 6" in timing.schedule(items, chip, np.zeros((6, 2), int)).ticks
  # A conditional inside a tick's branch is not a tick: timed by its longest branch.
  inner = launches.Branches("inner", branches.branches,
                            branches.op_name + "/branch_1_fun/moe/cond")
  s = timing.schedule([inner], chip, ticks)
  assert s.branches == ["inner: branch 1 of 2"] and s.ticks.startswith("pipeline: 0 ticks")
