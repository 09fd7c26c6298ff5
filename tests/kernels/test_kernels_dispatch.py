"""model.attention_impl=pallas / model.norm_impl=pallas inside the trainer (interpret mode on
CPU): the first losses match the XLA impls (fp32), on one device and under meshes in both
collective modes, and configs the kernels cannot run fail at validation, naming the key.

The kernels' own numerics are tested in test_pallas_*; this is the dispatch and the comms seam
(shard_map over batch / heads in xla mode, per-device shards in manual mode).
"""

import functools

import jax
import numpy as np
import pytest

import parity
from conftest import small_config
from jscale import runtime
from jscale.config import ConfigError

STEPS = 3
# head_dim 64 / 4 = 16 and seq 32: the smallest shapes the flash kernel tiles (powers of two
# >= 16; its 64 / 128 blocks clamp to 32). kv_heads 2: GQA (2 query heads per kv head).
BASE = ("train.warmup_steps=0", "train.steps=3")
KERNELS = ("model.attention_impl=pallas", "model.norm_impl=pallas", "model.kernel_interpret=true")


def _losses(overrides, devices) -> np.ndarray:
  """[STEPS, 2]: loss and gradient norm of each step on fixed random batches."""
  cfg = small_config(None, *BASE, *overrides)
  rt = runtime.build(cfg, devices)
  state, step = parity.initial_state(rt), rt.train_step()
  out = []
  for batch in parity.batches(cfg)[:STEPS]:
    batch = jax.device_put(batch, rt.layouts.batch())
    if not out:  # trace once, check the kernels are really in the step, compile that trace
      traced = step.trace(state, batch)
      if "model.kernel_interpret=true" in overrides:
        jaxpr = str(traced.jaxpr)
        assert "name=flash_attention_fwd" in jaxpr and "name=rms_norm_fwd" in jaxpr
      step = traced.lower().compile()
    state, m = step(state, batch)
    out.append((float(m["loss"]), float(m["grad_norm"])))
  return np.array(out)


@functools.lru_cache(maxsize=None)
def _reference() -> np.ndarray:
  """The single-device XLA-impl run every kernel run is compared with."""
  return _losses(("mesh.data=1",), jax.devices()[:1])


def _check(overrides, devices):
  # The meshes' XLA-impl runs equal the single-device one (test_parallel_*), so one reference.
  want = _reference()
  got = _losses(overrides + KERNELS, devices)
  rel = np.max(np.abs(got - want) / np.abs(want), axis=0)
  print(f"\n{overrides}: xla losses {want[:, 0]}, pallas {got[:, 0]}; max rel diff loss "
        f"{rel[0]:.2e}, grad norm {rel[1]:.2e}")
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_single_device_matches_xla():
  _check(("mesh.data=1",), jax.devices()[:1])


@pytest.mark.parametrize("mode", ["xla", "manual"])
def test_data_tensor_mesh_matches_xla(mode):
  # batch split over data, heads (and kv heads) over tensor, sequence-parallel norms: the
  # attention kernel sees [B/2, L, H/2, K] blocks, the norm kernel [B/2, L/2, D] rows.
  _check(("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
          f"parallel.collectives={mode}"), jax.devices()[:4])


def test_pipeline_stage_region_matches_xla():
  # xla mode inside the pipeline's stage shard_map (manual over `stage`): the kernels' own
  # shard_map nests in it, over the remaining axes (tensor here).
  _check(("mesh.stage=2", "mesh.tensor=2", "mesh.data=1", "pipeline.microbatches=2"),
         jax.devices()[:4])


@pytest.mark.parametrize("overrides, match", [
    (("model.attention_impl=pallas",), "model.attention_impl=pallas.*model.kernel_interpret"),
    (("model.norm_impl=pallas",), "model.norm_impl=pallas.*model.kernel_interpret"),
    (("model.attention_impl=cudnn",), "model.attention_impl=cudnn"),
    (KERNELS + ("train.seq_len=48",), r"train.seq_len=48.*block_q=48"),
    (KERNELS + ("train.seq_len=200", "model.max_seq_len=256"), r"train.seq_len=200.*block_q"),
    (KERNELS + ("model.head_dim=8",), r"model.head_dim=8"),
    # Context parallelism: the kernel runs on the ring's chunks, 32 / (2 x 2) = 8 tokens here.
    (KERNELS + ("mesh.sequence=2",), r"train.seq_len=32.*block_q=8"),
])
def test_unrunnable_configs_fail_at_validation(overrides, match):
  with pytest.raises(ConfigError, match=match):
    runtime.build(small_config(None, "mesh.data=-1", *overrides), jax.devices()[:2])


@pytest.mark.parametrize("mode", ["xla", "manual"])
def test_ring_attention_with_flash_blocks_matches_one_device(mode):
  # mesh.sequence=2, zig-zag: each device holds 2 chunks of 16 tokens; the ring's blocks are
  # flash-kernel calls merged by log-sum-exp, the backward ring calls the kernels' dK/dV / dQ.
  seq = ("train.seq_len=64", "model.attention_impl=pallas", "model.kernel_interpret=true")
  got = parity.losses((*seq, "mesh.sequence=2", "mesh.data=1", f"parallel.collectives={mode}"),
                      jax.devices()[:2])
  np.testing.assert_allclose(got, parity.reference("train.seq_len=64"), rtol=1e-4)


def _flash_calls(jaxpr, kernel: str) -> int:
  """pallas_call equations of the named flash kernel in a jaxpr and every jaxpr nested in it."""
  n = 0
  for eqn in jaxpr.eqns:
    name = str(eqn.params.get("name") or eqn.params.get("name_and_src_info"))
    n += eqn.primitive.name == "pallas_call" and kernel in name
    for v in eqn.params.values():
      for x in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(x, "jaxpr", x)
        n += _flash_calls(sub, kernel) if hasattr(sub, "eqns") else 0
  return n


def test_selective_remat_keeps_the_kernel_forward():
  """`remat: selective` saves the flash forward's outputs (with its lse): the step traces as many
  forward kernels as with remat none, not the extra one full remat runs in the backward. cuDNN's
  forward primitive is saved by the same policy."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=import-outside-toplevel
  from jscale.analysis.introspect import abstract_batch  # pylint: disable=import-outside-toplevel
  from jscale.model.remat import remat_policy  # pylint: disable=import-outside-toplevel
  calls = {}
  for remat in ("none", "selective", "full"):
    cfg = small_config(None, *BASE, *KERNELS[:1], KERNELS[2], f"train.remat={remat}",
                       "mesh.data=1")
    rt = runtime.build(cfg, jax.devices()[:1])
    jaxpr = jax.make_jaxpr(rt.train_step())(rt.abstract_state(), abstract_batch(cfg)).jaxpr
    calls[remat] = _flash_calls(jaxpr, "flash_attention_fwd")
  assert calls["selective"] == calls["none"] < calls["full"], calls
  assert remat_policy("selective")(cudnn._dot_product_attention_fwd_p_wrapper)  # pylint: disable=protected-access


SAVED_ONCE = [("xla", "selective", 1, KERNELS[0]), ("xla", "none", 1, KERNELS[0]),
              ("manual", "selective", 1, KERNELS[0]), ("manual", "none", 1, KERNELS[0]),
              ("xla", "selective", 2, KERNELS[0]),  # the ring, flash-kernel blocks
              ("xla", "selective", 2, "model.attention_impl=ring")]


@pytest.mark.parametrize("mode,remat,sequence,impl", SAVED_ONCE)
def test_the_attention_output_is_saved_once_through_the_seam(mode, remat, sequence, impl):
  """Through each mode's comms seam (a shard_map around the kernel or the ring in xla mode) the
  layer saves the attention output once: the flash kernel's output (saved by the remat policy
  as the kernel's) or the ring's (named inside it) was saved a second time as the seam's
  "attn_ctx" (1 GiB per step for llama3_1b at batch 4 on an H100). On one device the layer saves
  what the bare model does (`tests/plan/test_plan.py` equates that with the planner's estimate)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  from jscale.step import train_step as ts  # pylint: disable=import-outside-toplevel
  from jscale.analysis.introspect import abstract_batch  # pylint: disable=import-outside-toplevel
  cfg = small_config(None, *BASE, impl, KERNELS[2], f"train.remat={remat}",
                     "model.dtype=bfloat16", "train.seq_len=64", "mesh.data=1",
                     f"mesh.sequence={sequence}", f"parallel.collectives={mode}")
  rt = runtime.build(cfg, jax.devices()[:sequence])
  params, batch = rt.state_shapes["params"], abstract_batch(rt.cfg)
  layers = lambda res: [a for a, why in res if "run_layers" in why]
  loss = ts.make_loss_fn(rt.graphdef, rt.cfg, rt.comms)
  with jax.set_mesh(rt.mesh):
    seam = layers(saved_residuals(lambda p, b: loss(p, b)[0], params, batch))
  # Query-shaped [layers, B, L, H, K] residuals: q (selective: its projection; none: after
  # RoPE) and the attention output.
  m = rt.cfg.model
  q_shape = (m.n_layers, rt.cfg.train.batch_size, rt.cfg.train.seq_len, m.n_heads,
             m.resolved_head_dim)
  assert sum(a.shape == q_shape for a in seam) == 2, seam
  if sequence == 1:
    model = lambda p, t: nnx.merge(rt.graphdef, p).trunk(t, remat=remat)[0].sum()
    bare = layers(saved_residuals(model, params, batch["tokens"]))
    assert sum(a.size * a.dtype.itemsize for a in seam) == sum(
        a.size * a.dtype.itemsize for a in bare) > 0
