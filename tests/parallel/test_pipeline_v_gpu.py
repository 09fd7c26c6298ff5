"""DualPipeV's pairs in the program XLA:GPU compiles for 8 H100s (on this CPU-only machine:
`jscale.analysis.gpu_target`), an MoE model with its experts split over 4 GPUs inside each of
2 stages: in every pair's branch, the expert all-to-alls of one half start and are waited for
around matmuls of the other half (`jscale.predict.launches`: the launches in stream order), so
the halves hide each other's all-to-alls. Skips without JAX's CUDA plugin."""

import pytest

from jscale.analysis import gpu_target

if not gpu_target.available():
  pytest.skip("needs JAX's CUDA plugin and cuDNN to compile for GPUs: pip install -e "
              "'.[gpu-compile]' (.ci/run does)", allow_module_level=True)

# pylint: disable=wrong-import-position
from jscale.analysis import introspect  # noqa: E402
from jscale.config_load import load_config  # noqa: E402
from jscale.predict import launches as launches  # noqa: E402

# 2 stages x 4 expert GPUs, 1 layer per chunk (one compile, ~4 min on 2 busy cores), capacity
# dispatch: a plain all-to-all each way.
DUALPIPEV_MOE = ["model.dtype=bfloat16", "checkpoint.every=0", "train.batch_size=16",
                 "model.n_layers=4", "model.moe.n_experts=8", "model.moe.top_k=2",
                 "model.moe.d_ff=256", "model.moe.dispatch=capacity", "mesh.stage=2",
                 "mesh.expert=4", "mesh.data=1", "pipeline.schedule=dualpipev",
                 "pipeline.virtual_stages=2", "pipeline.microbatches=4"]
HALVES = ("pair_forward", "pair_backward")


def _pair_branches(items):
  """The launches of every conditional branch that runs a pair (both halves' scopes)."""
  for it in items:
    if isinstance(it, launches.Loop):
      yield from _pair_branches(it.body)
    elif isinstance(it, launches.Branches):
      for branch in it.branches:
        names = " ".join(x.op_name for x in branch if isinstance(x, launches.Launch))
        if all(h in names for h in HALVES):
          yield [x for x in branch if isinstance(x, launches.Launch)]
        yield from _pair_branches(branch)


def _hidden(branch):
  """{half: [(all-to-all, gemms of the other half between its start and its done)]}."""
  out = {h: [] for h in HALVES}
  for i, x in enumerate(branch):
    if x.kind != "collective" or not x.op.startswith("all-to-all"):
      continue
    half = next(h for h in HALVES if h in x.op_name)
    other = HALVES[1 - HALVES.index(half)]
    done = next(j for j in range(i + 1, len(branch)) if branch[j].done_of == x.name)
    gemms = [y.name for y in branch[i + 1:done] if y.kind == "gemm" and other in y.op_name]
    out[half].append((x.name, gemms))
  return out


def test_pairs_hide_the_expert_all_to_alls():
  cfg = load_config("configs/tiny.yaml", [*DUALPIPEV_MOE, "parallel.collectives=manual"])
  compiled, _ = introspect.compile_train_step(cfg, gpu_target.devices("h100x8"))
  branches = list(_pair_branches(launches.Program(compiled.as_text()).items()))
  # The pair codes DualPipeV runs on 2 stages (f_first+bw, f+bw, f_last+bw_first), each in
  # every copy XLA keeps of the tick loop's body.
  assert len(branches) >= 3
  for branch in branches:
    hidden = _hidden(branch)
    # Each half runs its layer's two all-to-alls (dispatch, combine): the forward's both
    # with the backward's matmuls running meanwhile, the backward's at least one.
    assert [len(hidden[h]) for h in HALVES] == [2, 2], hidden
    assert all(gemms for _, gemms in hidden["pair_forward"]), hidden
    assert any(gemms for _, gemms in hidden["pair_backward"]), hidden
