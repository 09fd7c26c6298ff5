"""The real XLA:GPU compiler, on this CPU-only machine (`jscale.analysis.gpu_target`: JAX's CUDA
plugin and cuDNN, no GPU): what a train step compiles to for H100s, asserted structurally — the
precision of every gemm XLA:GPU emits, cuDNN attention, FP8 gemms, and the planner's memory and
communication estimates against XLA:GPU's buffer assignment and collectives; and generation's
prefill and decode step, on one H100 and tensor-parallel on two.

`.ci/run` installs the plugin (`pip install -e '.[gpu-compile]'`); without it this file skips.
"""

import collections
import functools
import re

import pytest

from jscale.analysis import gpu_target

if not gpu_target.available():
  pytest.skip("needs JAX's CUDA plugin and cuDNN to compile for GPUs: pip install -e "
              "'.[gpu-compile]' (.ci/run does)", allow_module_level=True)

# pylint: disable=wrong-import-position
from flax import nnx  # noqa: E402

from jscale import mesh as mesh_lib  # noqa: E402
from jscale import predict, runtime, xla_flags  # noqa: E402
from jscale.analysis import dots, hlo, introspect  # noqa: E402
from jscale.config import MeshConfig, ModelConfig  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.infer.generator import Generator  # noqa: E402
from jscale.model import llama  # noqa: E402
from jscale.model.matmul import FP32_MATMULS, SCOPE_PREFIX  # noqa: E402
from jscale import hardware  # noqa: E402
from jscale.plan.__main__ import main as plan_main  # noqa: E402
from jscale.plan.layout import Layout  # noqa: E402
from jscale.plan.rank import evaluate  # noqa: E402
from jscale.plan.verify import compare  # noqa: E402
import planner_vs_gpu  # noqa: E402  (scripts/, on the path from conftest)
from planner_vs_gpu import CHECKED  # noqa: E402

H100 = hardware.GPUS["h100"]
# Steps compile with the launcher's overlap flags (`introspect.compile_train_step`), whose
# while_loop_double_buffering unrolls each layer scan by two: a loop body's ops appear twice.
UNROLL = 2
TINY_BF16 = ["model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=8"]


def test_topology_of_h100s_without_a_gpu():
  devs = gpu_target.devices("h100x16")
  assert len(devs) == 16 and {d.device_kind for d in devs} == {"NVIDIA H100 80GB HBM3"}
  assert {d.process_index for d in devs} == {0, 1}  # two nodes of 8
  assert gpu_target.topology_name(64, 8) == "1x8x8" and gpu_target.topology_name(4, 8) == "1x1x4"
  assert gpu_target.devices("h200x1")[0].device_kind == "NVIDIA H200"  # the card measured on
  for bad in ("h100", "a100x8", "h100x0"):
    with pytest.raises(ValueError, match="expected <gpu>x<count>"):
      gpu_target.parse(bad)
  with pytest.raises(ValueError, match="whole nodes"):
    gpu_target.topology_name(12, 8)


def test_a_layout_across_nodes_compiles_with_a_node_per_dcn_index():
  """The planner's multi-node overrides (`mesh.dcn_*`) on 16 H100s in 2 nodes: each dcn index
  is one node (the topology's devices carry one slice, so JAX's hybrid rule refused them), the
  tensor groups stay inside a node and the data groups cross the two."""
  devs = gpu_target.devices("h100x16")
  mesh = mesh_lib.make_mesh(MeshConfig(data=1, dcn_data=2, tensor=8), devs)
  nodes = [{d.process_index for d in mesh.devices[i].flat} for i in range(2)]
  assert nodes == [{0}, {1}]
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, "mesh.data=1", "mesh.dcn_data=2",
                                          "mesh.tensor=8", "model.n_kv_heads=8"])
  compiled, _ = introspect.compile_train_step(cfg, devs)
  spans = collections.defaultdict(set)  # group size -> how many nodes its groups span
  for c in hlo.collectives(compiled.as_text()):
    for group in (c.groups or ()) if c.kind != "collective-permute" else ():
      spans[len(group)].add(len({d // 8 for d in group}))
  assert spans[8] == {1} and spans[2] == {2}, dict(spans)


def test_context_split_across_nodes_compiles():
  """Context parallelism whose ring crosses nodes (`mesh.dcn_sequence`, as the planner offers
  for Llama 3 70B on 128 H100s): the abstract batch carries positions for it too."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, "mesh.data=1", "mesh.dcn_sequence=2",
                                          "mesh.tensor=8", "model.n_kv_heads=8"])
  assert "positions" in introspect.abstract_batch(cfg)
  introspect.compile_train_step(cfg, gpu_target.devices("h100x16"))


def _compiled_text(*overrides: str, devices: int = 1) -> str:
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, *overrides])
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices(f"h100x{devices}"))
  return compiled.as_text()


def test_every_gemm_on_h100_is_bf16_and_attention_is_cudnn():
  """Issue 16's finding (fp32 operands -> TF32 gemms at half rate) checked where it happened:
  in the program XLA:GPU builds for an H100, every gemm's operands are bf16 (outside the fp32
  matmuls listed on purpose), and attention_impl=auto runs cuDNN's fused kernels."""
  text = _compiled_text()
  found = dots.compiled_dots(text)
  assert len(found) >= 14, found  # 7 forward + 7 backward products of the layer, the head's 3
  allowed = tuple(SCOPE_PREFIX + name for name in FP32_MATMULS)
  bad = dots.not_in(found, "bf16", allowed)
  assert not bad, "\n".join(f"{d.lhs} x {d.rhs} at {d.location[-120:]}" for d in bad)
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  # Each kernel once per (unrolled) layer: the forward as often as the backward (none rerun).
  assert calls["__cudnn$fmhaSoftmax"] == calls["__cudnn$fmhaSoftmaxBackward"] == UNROLL, calls
  # `remat: selective` stores the kernel's output for the backward once per layer (named as
  # "attn_ctx" too, it was stored twice: 1 GiB more per step at llama3_1b batch 4).
  outs = re.findall(r"%(\S+) = \S+ get-tuple-element\(%dot_product_attention_fwd[\w.]*\), "
                    r"index=0", text)
  assert len(outs) == UNROLL, outs
  for out in outs:
    stores = re.findall(r"dynamic_update_slice[\w.]* = .*fusion\([^)]*%" + re.escape(out) +
                        r"[,)]", text)
    assert len(stores) == 1, stores


# MLA with DeepSeek-V3's head sizes (q / k 192, v 128) at CPU width: more than the 128 cuDNN
# takes before Hopper, which JAX's cuDNN checks assume without a local GPU.
MLA_192 = ("model.preset=deepseek_v3_tiny", "model.mla.qk_nope_head_dim=128",
           "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128", "train.seq_len=256")


def test_mla_runs_cudnn_attention_on_h100_at_its_own_head_sizes():
  """attention_impl=auto for MLA on an H100: cuDNN's fused kernels with Q and K at 192 and V at
  its own 128 (cuDNN >= 9.10 on Hopper, `jax_compat.cudnn_mla_attention`; before, V was
  zero-padded to 192, `attention.with_v_padded`), forward and backward once per layer — no
  materialised scores (plain XLA's [B, H, L, L] fusions were the DeepSeek proxy's largest
  kernels) and no padded V: the forward writes [B, H, L, 128], the backward's dV is 128 wide."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, *MLA_192])
  rt = runtime.build(cfg, gpu_target.devices("h100x1"))
  assert rt.cfg.model.attention_impl == "cudnn" and "128 as it is" in rt.kernels.attention_why
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices("h100x1"))
  text = compiled.as_text()
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  layers = cfg.model.n_layers + cfg.model.mtp.depth
  assert calls["__cudnn$fmhaSoftmax"] == calls["__cudnn$fmhaSoftmaxBackward"] >= 2, calls
  assert calls["__cudnn$fmhaSoftmax"] <= layers * UNROLL, calls
  fwd = re.findall(r"= \(bf16\[\d+,\d+,\d+,(\d+)\]\S*, f32\[[^]]*\]\S*, u8\[0\]\S*\) "
                   r'custom-call\(([^)]*)\), custom_call_target="__cudnn\$fmhaSoftmax"', text)
  assert fwd and all(dim == "128" and "pad" not in operands for dim, operands in fwd), fwd
  bwd = re.findall(r"= \(bf16\[[\d,]+\]\S*, bf16\[[\d,]+\]\S*, bf16\[\d+,\d+,\d+,(\d+)\]\S*, "
                   r'u8\[0\]\S*\) custom-call\([^)]*\), custom_call_target="__cudnn\$fmhaSoftmaxBackward"',
                   text)
  assert len(bwd) == calls["__cudnn$fmhaSoftmaxBackward"] and set(bwd) == {"128"}, bwd


MOE_GPU = ("model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_ff=256",
           "model.d_model=256", "train.seq_len=512", "train.remat=none")


@pytest.mark.parametrize("gemm,low,high", [("ragged_dot", 7.9, 8.1), ("tiled", 1.0, 1.35)])
def test_dropless_expert_flops_on_h100(gemm, low, high):
  """What XLA:GPU makes of the experts' grouped matmul, in FLOPs against the rows present
  (forward and backward: 3 products of 2·A·D·F each, three times): `ragged_dot` becomes one
  dense dot of the rows against all 8 experts (8x: why dropless measured 9.5% MFU on an H100),
  the tiled batched matmul costs the rows plus partly filled tiles (`model.moe.gemm: auto`'s
  pick where the Hopper kernel does not run)."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, *MOE_GPU, f"model.moe.gemm={gemm}"])
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices("h100x1"))
  expert = sum(d.flops for d in dots.compiled_dots(compiled)
               if re.search(r"ragged_dot|grouped_tiles", d.location))
  rows = cfg.train.batch_size * cfg.train.seq_len * 2  # top-2 copies of every token
  ideal = UNROLL * 9 * 2 * rows * 256 * 256  # per loop body: its layers
  assert low <= expert / ideal <= high, expert / ideal


@functools.cache
def _moe_step_on_h100() -> str:
  """The tiny MoE's train step (`MOE_GPU`, `model.moe.gemm: auto`) compiled for one H100."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, *MOE_GPU])
  return introspect.compile_train_step(cfg, gpu_target.devices("h100x1"))[0].as_text()


def test_auto_runs_the_hopper_grouped_matmul_on_h100s():
  """`model.moe.gemm: auto` is resolved for the mesh's devices (H100s here, on a CPU machine):
  the step runs the Hopper kernels, six per layer ([gate | up] and down: 2 forward, 4
  backward), no XLA expert dot."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, *MOE_GPU])
  assert runtime.build(cfg, gpu_target.devices("h100x1")).cfg.model.moe.gemm == "pallas"
  text = _moe_step_on_h100()
  assert text.count('custom_call_target="mosaic_gpu') == 6 * UNROLL
  assert not [d for d in dots.compiled_dots(text) if re.search(r"ragged|tiles", d.location)]


def test_the_layer_scans_stacks_are_allocated_not_zero_filled_on_h100():
  """The layer scan's stacked outputs (the forward's saved activations, the backward's weight
  gradients: [layers, ...]) are allocated (AllocateBuffer: XLA:GPU's zero-init elimination,
  `xla_flags`, proves the loop writes every row before reading it), not zero-filled by a
  kernel first: no parameterless broadcast fusion of the step makes a [layers, ...] array
  (without the flag 28 did in this step)."""
  text = _moe_step_on_h100()
  layers = load_config("configs/tiny.yaml", []).model.n_layers
  fills = re.findall(r"= (\S+|\([^)]*\)) fusion\(\), kind=kLoop, calls=%fused_broadcast", text)
  assert not [f for f in fills if re.search(rf"\[{layers},", f)], fills
  assert text.count('custom_call_target="AllocateBuffer"') >= 6


def _kernel_calls(text: str) -> collections.Counter:
  """The custom calls of a compiled program that launch kernels (an AllocateBuffer, a loop's
  stacked output left unfilled by XLA's zero-init elimination, is an allocation)."""
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  del calls["AllocateBuffer"]
  return calls


@pytest.mark.parametrize("mode", ["xla", "manual"])
def test_pallas_attention_runs_the_hopper_kernels_on_h100s(mode):
  """`attention_impl: pallas` picks its kernels for the mesh's devices (`Seam.kernel_device`),
  so the step compiled here for an H100 runs the Mosaic GPU ones: forward, dK/dV and dQ, the
  forward once (`remat: selective` keeps its outputs), no Triton kernel."""
  text = _compiled_text("model.attention_impl=pallas", "model.n_heads=4", "model.n_kv_heads=2",
                        f"parallel.collectives={mode}")  # head_dim 64: the Hopper kernels tile it
  calls = _kernel_calls(text)
  assert calls["mosaic_gpu_v2"] == 3 * UNROLL and len(calls) == 1, calls


def test_pallas_norm_runs_the_hopper_kernels_on_h100s():
  """`norm_impl: pallas` picks the Mosaic GPU RMSNorm kernels for the mesh's H100: per layer
  two norms forward and two backward (their forward is not rerun), plus the final norm's."""
  cfg = load_config("configs/tiny.yaml", [*TINY_BF16, "model.norm_impl=pallas"])
  assert runtime.norm_kernels(cfg, runtime.build(cfg, gpu_target.devices("h100x1")).mesh)[
      0] == "hopper"
  text = _compiled_text("model.norm_impl=pallas", "model.d_model=256")
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  assert calls["mosaic_gpu_v2"] == 4 * UNROLL + 2, calls
  kernels = collections.Counter(re.findall(r"rms_norm_(?:fwd|bwd)_hopper_mosaic_gpu", text))
  assert kernels["rms_norm_fwd_hopper_mosaic_gpu"] == kernels[
      "rms_norm_bwd_hopper_mosaic_gpu"] == 2 * UNROLL + 1, kernels


def test_fp8_linears_run_fp8_gemms_on_h100():
  """Issue 18: XLA:GPU keeps the scaled FP8 products as FP8 gemms (e4m3 x e4m3 forward, e5m2
  gradients backward) for the targeted linears, and the head stays bf16. Deviceless, XLA picks
  its Triton gemm fusions; on a GPU, autotuning may choose cuBLASLt's FP8 kernels instead."""
  found = dots.compiled_dots(_compiled_text("fp8.enabled=true"))
  kinds = collections.Counter(tuple(sorted({d.lhs, d.rhs})) for d in found)
  linears = 7  # wq, wk, wv, wo, gate, up, down: one forward and two backward products each
  assert kinds[("f8e4m3fn",)] == linears * UNROLL
  assert kinds[("f8e4m3fn", "f8e5m2")] == 2 * linears * UNROLL
  assert all("head" in d.location for d in found if "f8" not in d.lhs + d.rhs)


# The planner against XLA:GPU at real sizes (seq 4096), one H100 and 8: the model state exactly,
# the rest (gradients, activations, transients at the peak) within 15%, the collective volume
# within 10% (manual mode: the collectives jscale writes, in its dtypes). One layout per axis
# (data-parallel devices in the TP, CP and PP layouts; ZeRO-3's fsdp, which ZeRO-2's shares);
# scripts/planner_vs_gpu.py runs the whole sweep, CHECKED's ZeRO-2 and data-only layouts too.
TESTED = [c for c in CHECKED if c[2].zero_stage != 2 and not c[2].data == c[2].devices > 1]


@pytest.mark.parametrize("model,n,lay", TESTED, ids=lambda x: x.describe().replace(" ", "-")
                         if isinstance(x, Layout) else f"h100x{x}" if isinstance(x, int)
                         else x[0])
def test_estimate_against_xla_gpu(model, n, lay):
  r = planner_vs_gpu.check(model, n, lay)
  assert r["state_compiled"] == pytest.approx(r["state_estimate"], rel=1e-3), r
  assert r["rest_compiled"] == pytest.approx(r["rest_estimate"], rel=0.15), r
  assert r["volume_compiled"] == pytest.approx(r["volume_estimate"], rel=0.10, abs=1), r


@pytest.mark.parametrize("zero", [3])  # ZeRO-2 leaves the same flag out (figures below)
def test_accumulation_leaves_out_the_pipelined_all_gather(zero):
  """The launcher's overlap flags leave XLA's pipelined all-gather out with micro-batches: to
  move a gather across the micro-batch loop the pipeliner peels its first iteration, and the
  copy's saved activations get buffers of their own (Llama-3 70B's planned layout under ZeRO-3:
  74.9 GiB per step, over an H100; llama3_1b under ZeRO-2: 67.3 against 40.6 GiB; its first
  4 layers, compiled here: 7.2 against 5.3 (ZeRO-2), 6.4 against 4.3 (ZeRO-3); since the
  chunked loss's first chunk starts its sums, 5.1 against 4.3 GiB and 5.3 against 4.4). If this
  stops holding, the flag can come back."""
  cfg = load_config(None, ["model.preset=llama3_1b", "model.n_layers=4", "model.dtype=bfloat16",
                           "train.seq_len=4096", "train.remat=selective", "mesh.data=1",
                           "mesh.fsdp=8", f"parallel.zero_stage={zero}", "train.batch_size=32",
                           "train.microbatches=4"])
  rt = runtime.build(cfg, gpu_target.devices("h100x8"))
  lowered = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg))
  temp = lambda o: lowered.compile(compiler_options=o).memory_analysis().temp_size_in_bytes
  leaves_out = xla_flags.compiler_options(cfg)
  assert "xla_gpu_enable_pipelined_all_gather" not in leaves_out  # jax < 0.11's boolean
  assert "xla_gpu_pipeline_all_gather" not in leaves_out  # its mode since
  assert temp(xla_flags.compiler_options()) > 1.15 * temp(xla_flags.compiler_options(cfg))


def test_xla_zero3_reduce_scatters_start_as_their_gradients_are_ready():
  """xla mode's ZeRO-3 compiles with the launcher's 8 MiB reduce-scatter combine threshold: each
  layer's gradient reduce-scatters stay apart, so they start before the layer's backward ends
  and the predicted exposed collectives fall (8B's layer on 8 H100s; scripts/overlap_flags.py).
  At 128 MiB they merge into one per layer, waited for at the end of the loop iteration."""
  cfg = load_config(None, ["model.preset=llama3_8b", "model.n_layers=8", "model.dtype=bfloat16",
                           "train.seq_len=4096", "train.remat=selective", "mesh.data=1",
                           "mesh.fsdp=8", "parallel.zero_stage=3", "train.batch_size=16",
                           "train.microbatches=2", "checkpoint.every=0"])
  assert xla_flags.compiler_options(cfg)["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 2**23
  rt = runtime.build(cfg, gpu_target.devices("h100x8"))
  lowered = rt.train_step().lower(rt.abstract_state(), introspect.abstract_batch(cfg))
  texts = {t: introspect.compile_as_launched(lowered, rt, {
      **predict.AUTOTUNED_GEMMS, "xla_gpu_reduce_scatter_combine_threshold_bytes": t}).as_text()
      for t in (2**23, 2**27)}
  starts = {t: text.count("reduce-scatter-start(") for t, text in texts.items()}
  assert starts[2**23] > 2 * starts[2**27], starts
  exposed = {t: predict.predict_config(cfg, "h100x8", text).exposed_collectives_s
             for t, text in texts.items()}
  assert exposed[2**23] < 0.8 * exposed[2**27], exposed


def test_collectives_parse_from_xla_gpu():
  """XLA:GPU's async collectives (`all-reduce-start` / `-done`, Shardy mesh replica groups)
  parse: a data=2 x tensor=4 step's gradient all-reduce spans 2 devices, TP's spans 4."""
  colls = hlo.collectives(_compiled_text("mesh.data=2", "mesh.tensor=4", devices=8))
  sizes = {c.group_size for c in colls if c.kind == "all-reduce"}
  assert {2, 4} <= sizes, colls


@pytest.mark.parametrize("lay", [Layout(data=8, accum=4, remat="selective"),
                                 Layout(data=2, stage=4, accum=8, remat="selective")],
                         ids=lambda lay: lay.describe().replace(" ", "-"))
def test_xla_mode_reduces_gradients_once_on_h100(lay):
  """xla mode with gradient accumulation / a pipeline, compiled by XLA:GPU: the data-parallel
  gradient reduction runs once per step in fp32 (`XlaComms.over_batch`), so the step moves no
  more than the estimate (which counts manual mode's separate embedding/head all-reduce over
  stages) instead of 32x it (pipeline, before: 217 GiB per step)."""
  model = load_config(None, ["model.preset=llama3_1b"]).model
  row = evaluate(model, lay, 4096, H100)
  r = compare("llama3_1b", [], row, 4096, H100, gpu_target.devices("h100x8"))
  assert 0.6 * r["volume_estimate"] <= r["volume_compiled"] <= 1.01 * r["volume_estimate"], r


@pytest.mark.parametrize("n", [1, 2], ids=["h100x1", "h100x2-tensor2"])
def test_generation_compiles_for_h100(n):
  """Issue 21's generation where a GPU would run it: a bf16 Llama's prefill and decode step
  (`Generator.lower`), alone and split over 2 H100s by tensor parallelism. The prefill's
  attention is cuDNN's fused kernel, every gemm is bf16, and the decode step's cache is
  donated: updated in place, not copied."""
  cfg = ModelConfig(vocab_size=1024, d_model=512, n_layers=2, n_heads=8, n_kv_heads=2,
                    d_ff=1024, dtype="bfloat16", max_seq_len=1024, attention_impl="cudnn")
  mesh = mesh_lib.make_mesh(MeshConfig(data=1, tensor=n), gpu_target.devices(f"h100x{n}"))
  gen = Generator(nnx.eval_shape(lambda: llama.create(cfg)), mesh)
  prefill, decode = (x.compile() for x in gen.lower(batch=4, prompt_len=64, length=256))
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', prefill.as_text()))
  assert calls["__cudnn$fmhaSoftmax"] == 1, calls
  for step in (prefill, decode):
    found = dots.compiled_dots(step.as_text())
    assert found and all({d.lhs, d.rhs} == {"bf16"} for d in found), found
  cache_bytes = 2 * 2 * 4 * 256 * cfg.n_kv_heads * cfg.resolved_head_dim * cfg.n_layers // n
  assert decode.memory_analysis().alias_size_in_bytes >= cache_bytes
  if n > 1:
    assert any(c.kind == "all-reduce" for c in hlo.collectives(decode.as_text()))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_zero3_chunked_head_gradient_is_reduce_scattered(tied):
  """xla mode, ZeRO-3 over 8 H100s, the chunked loss: the head's fp32 gradient, summed over the
  token shards by the loss itself, is reduce-scattered into the weight's fsdp shard
  (`Seam.weight_grad`), never all-reduced whole (llama3_1b fsdp=8, 4 micro-batches: 33.5 ->
  27.7 GiB per step)."""
  text = _compiled_text("mesh.fsdp=8", "parallel.zero_stage=3", "train.logits_chunk_mb=0.05",
                        f"model.tie_embeddings={str(tied).lower()}", "train.microbatches=2",
                        "train.batch_size=16",
                        devices=8)
  cfg = load_config("configs/tiny.yaml", TINY_BF16)
  head = cfg.model.d_model * cfg.model.vocab_size
  colls = hlo.collectives(text)
  whole = [c for c in colls if c.kind == "all-reduce" and c.bytes_per_step >= 4 * head]
  assert not whole, whole
  assert any(c.kind == "reduce-scatter" and c.dtypes == ("f32",) for c in colls), colls


@pytest.mark.parametrize("flag, how", [("--schedule-costs", "predicted costs"),
                                       ("--scan-layers", "unrolled")])
def test_plan_compiles_each_layout_both_ways(flag, how, capsys):
  """`python -m jscale.plan --schedule-costs both` (XLA's own schedule and the predicted
  kernel times) and `--scan-layers both` (the layers in a loop and unrolled): each verified
  layout compiled both ways, both programs ranked."""
  assert plan_main(["--model", "configs/tiny.yaml", "--gpus", "8", "--seq", "256",
                    "--global-batch-tokens", "16k", "--top", "1", "--verify", "1", "--target",
                    "h100x8", "--rank", "compiled", "--collectives", "manual", flag,
                    "both"]) == 0
  printed = capsys.readouterr()
  assert "compiled 2/2" in printed.err and f"(manual, {how}) in" in printed.err
  assert printed.out.count("verify ") == 2 and f"(manual, {how})" in printed.out
  steps = [float(x) for x in re.findall(r"compiled ([\d.]+) ms, MFU", printed.out)]
  assert len(steps) == 2 and steps == sorted(steps), printed.out  # fastest first
