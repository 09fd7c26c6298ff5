"""A trained run in the user's hands: `jscale.ckpt.model_source` reads runs, step dirs, params
checkpoints and HF dirs; `jscale.convert jscale-to-hf` exports a run (transformers' logits =
jscale's, dense and MoE); `jscale.eval` = the training loop's val loss; `jscale.generate` from a
run = from its export. Each run trains 2 steps of a small model once for the module."""

from __future__ import annotations

import contextlib
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from conftest import small_config
from jscale import eval as eval_cli
from jscale import generate as generate_cli
from jscale import runtime
from jscale.ckpt import model_source
from jscale import sharding
from jscale import train as train_lib
from jscale.convert.__main__ import main as convert_main
from jscale.infer import setup
from jscale.parallel.pipeline import placement
from jscale.step import state as state_lib

TOKENS = [[5, 17, 99, 3, 250, 41, 7, 128, 64, 9, 200, 33]]


def _train(out, data_cache, *extra):
  cfg = small_config(None, f"train.output_dir={out}", f"data.cache_dir={data_cache}",
                     "train.steps=2", "checkpoint.every=2", "train.eval_every=2",
                     "train.eval_batches=2", *extra)
  with contextlib.redirect_stdout(io.StringIO()):
    return train_lib.run(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
  """{name: (run dir, train.run's summary)}: a dense model stored by an interleaved pipeline
  (its layers in chunk order) and an MoE model."""
  root = tmp_path_factory.mktemp("model_use")
  return {
      "dense_interleaved": (root / "dense", _train(
          root / "dense", data_cache, "mesh.stage=2", "pipeline.schedule=interleaved",
          "pipeline.virtual_stages=2", "pipeline.microbatches=2", "model.n_layers=4")),
      "moe": (root / "moe", _train(root / "moe", data_cache, "model.moe.n_experts=4",
                                   "model.moe.top_k=2", "model.moe.d_ff=64")),
  }


def _run(fn, argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = fn(argv)
  return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", ["dense_interleaved", "moe"])
def test_export_run_logits_equal_transformers(runs, name, tmp_path):
  run_dir, summary = runs[name]
  cfg, model = model_source.load(str(run_dir))
  # The loaded parameters are the run's final ones, in model layer order.
  trained = jax.device_get(summary["state"]["params"])
  stages, v = (2, 2) if name == "dense_interleaved" else (1, 1)
  want = {**trained, "blocks": placement.to_model(trained["blocks"], cfg.n_layers, stages, v)}
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  out = tmp_path / "hf"
  code, printed, err = _run(convert_main, ["jscale-to-hf", "--ckpt", str(run_dir), "--out",
                                           str(out)])
  assert code == 0, err
  assert "from step 2 of run" in printed
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # the temp dir was renamed
  assert os.stat(out / "model.safetensors").st_mode & 0o044  # readable beyond the owner
  arch = transformers.MixtralForCausalLM if name == "moe" else transformers.LlamaForCausalLM
  hf = arch.from_pretrained(str(out), attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(TOKENS)))
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)


def test_sources_resolve_the_same_weights(runs, tmp_path):
  """A run dir, its step dir (--step or the path) give the same model; a params checkpoint and
  an HF export of it load back equal."""
  run_dir, _ = runs["moe"]
  _, a = model_source.load(str(run_dir))
  _, b = model_source.load(str(run_dir / "checkpoints" / "2"))
  _, c = model_source.load(str(run_dir), step=2)
  for x, y, z in zip(*(jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (a, b, c))):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)
  assert [model_source.describe(str(p)).kind for p in
          (run_dir, run_dir / "checkpoints" / "2")] == ["run", "step"]
  # An unfinished save (orbax's temporary dir) is never the latest step.
  (run_dir / "checkpoints" / "4.orbax-checkpoint-tmp-99" / "state").mkdir(parents=True)
  assert model_source.describe(str(run_dir)).step == 2
  assert model_source.data_config(str(run_dir)).source == "stdlib"
  assert model_source.train_config(str(run_dir)).seq_len == 32


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
  """The dense run exported to an HF dir, and that read back as a params checkpoint."""
  root = tmp_path_factory.mktemp("exports")
  run_dir, _ = runs["dense_interleaved"]
  assert _run(convert_main, ["jscale-to-hf", "--ckpt", str(run_dir), "--out",
                             str(root / "hf")])[0] == 0
  assert _run(convert_main, ["hf-to-jscale", "--hf", str(root / "hf"), "--out",
                             str(root / "params")])[0] == 0
  return {"hf": root / "hf", "params": root / "params"}


@pytest.mark.parametrize("kind", ["run", "step", "params", "hf", "moe run"])
def test_a_tensor_parallel_load_reads_each_parameter_onto_its_shards(runs, exports, kind):
  """`model_source.load(mesh=)` (generate --tensor N): every parameter arrives split over
  `tensor` as a matmul wants it, never whole on one device first; values equal the plain load.
  The run was stored by an interleaved pipeline: its layer reorder runs on the shards."""
  run_dir = runs["moe" if kind == "moe run" else "dense_interleaved"][0]
  path = {"step": run_dir / "checkpoints" / "2", **exports}.get(kind, run_dir)
  mesh = setup.tensor_mesh(2)
  _, whole = model_source.load(str(path))
  _, split = model_source.load(str(path), mesh=mesh)
  want = sharding.tensor_parallel(split, mesh)
  pure = nnx.to_pure_dict(nnx.state(split, nnx.Param))
  n_split = 0
  for (where, x), y, s in zip(jax.tree_util.tree_flatten_with_path(pure)[0],
                              jax.tree.leaves(nnx.state(whole, nnx.Param)), jax.tree.leaves(want)):
    assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(where)
    shard = x.addressable_shards[0].data
    n_split += shard.size < x.size
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert n_split >= 7  # q, k, v, o, gate / up / down or the experts', embedding / head


def test_eval_equals_the_training_val_loss(runs):
  run_dir, summary = runs["dense_interleaved"]
  # By default a run is evaluated on what its own eval covered (train.eval_batches=2), and says so.
  code, printed, err = _run(eval_cli.main, ["--model", str(run_dir), "--json"])
  assert code == 0, err
  assert "val split of data.source=stdlib: 2 batches of 8 x 32 tokens (the run's " in err
  result = json.loads(printed.strip().splitlines()[-1])
  # Same batches (the run's val split, its seq_len and batch size), same compiled eval step,
  # here on one device layout instead of the run's pipeline: equal to float rounding.
  assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
  assert result["tokens"] == 2 * 8 * 32 and result["batches"] == 2
  assert result["perplexity"] == pytest.approx(np.exp(result["loss"]), rel=1e-6)
  # Another split and an override of the data's batch shape.
  code, printed, _ = _run(eval_cli.main, ["--model", str(run_dir), "--split", "train",
                                          "--batches", "1", "train.batch_size=16"])
  assert code == 0 and "over 512 tokens (train split of data.source=stdlib" in printed
  # A batch the 8 devices cannot split is refused by name, before anything compiles.
  code, _, err = _run(eval_cli.main, ["--model", str(run_dir), "train.batch_size=4"])
  assert code == 2 and "train.batch_size=4" in err


@pytest.mark.parametrize("layout_overrides", [
    ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3"),
    ("mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "pipeline.schedule=interleaved",
     "pipeline.virtual_stages=2", "pipeline.microbatches=2")])
def test_eval_reads_each_parameter_onto_the_eval_layout(runs, layout_overrides):
  """`jscale.eval` with a training layout: every parameter is read from the checkpoint straight
  onto its shards of that layout (a model too large for one device never is whole on one),
  stored in that layout's layer order, with the plain load's values."""
  run_dir, _ = runs["dense_interleaved"]
  path = str(run_dir)
  cfg = eval_cli.config_for(path, model_source.model_config(path), list(layout_overrides))
  rt = runtime.build(cfg)
  params = eval_cli.load_params(path, None, rt)
  _, whole = model_source.load(path)
  want = state_lib.params_to_storage(nnx.to_pure_dict(nnx.state(whole, nnx.Param)),
                                     cfg.model.n_layers, rt.mesh.shape["stage"], rt.cfg.pipeline)
  n_split = 0
  for (where, x), y, s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                              jax.tree.leaves(want), jax.tree.leaves(rt.state_shardings["params"])):
    assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(where)
    n_split += x.addressable_shards[0].data.size < x.size
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(where))
  assert n_split >= 9  # every weight matrix of the layers, the embedding (norm scales may not be)


def test_generate_from_a_run_equals_generate_from_its_export(runs, tmp_path):
  run_dir, _ = runs["dense_interleaved"]
  args = ["--prompt", "def f(x):", "--prompt", "import", "--max-new-tokens", "6"]
  code, from_run, err = _run(generate_cli.main, ["--model", str(run_dir), *args])
  assert code == 0, err
  assert from_run.count("--- [") == 2 and "tokens/s" in from_run
  assert _run(convert_main, ["jscale-to-hf", "--ckpt", str(run_dir), "--out",
                             str(tmp_path / "hf")])[0] == 0
  # The same prompts from a file, the model split over 2 devices (tensor parallelism).
  (tmp_path / "prompts.txt").write_text("def f(x):\n\nimport\n", encoding="utf-8")
  code, from_hf, err = _run(generate_cli.main, [
      "--model", str(tmp_path / "hf"), "--tokenizer", "byte", "--prompt-file",
      str(tmp_path / "prompts.txt"), "--max-new-tokens", "6", "--tensor", "2"])
  assert code == 0, err
  completions = lambda text: text.split("\n--- 2 prompt(s)")[0]  # noqa: E731
  assert completions(from_hf) == completions(from_run)
  # Sampling is one flag set away from greedy, and says which it did.
  code, sampled, err = _run(generate_cli.main, ["--model", str(run_dir), *args, "--temperature",
                                                "0.8", "--top-p", "0.95", "--seed", "0"])
  assert code == 0 and "sampled at temperature 0.8, top-p 0.95, seed 0" in sampled, err
  assert ", greedy;" in from_run
  # An export has no run to take its eval's batch shape from: eval says which it uses.
  code, _, err = _run(eval_cli.main, ["--model", str(tmp_path / "hf"), "--batches", "1",
                                      "data.tokenizer=byte", "train.seq_len=32"])
  assert code == 0 and "batches of train.batch_size=16 x train.seq_len=32" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/run", "--prompt", "x"], "no such directory"),
    (["--model", "{run}", "--step", "7", "--prompt", "x"], "it has steps 2"),
    (["--model", "{run}"], "no prompt"),
    (["--model", "{run}", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--model", "{run}/checkpoints", "--prompt", "x"], "not a model directory"),
])
def test_generate_errors_are_named(runs, argv, message):
  run_dir, _ = runs["moe"]
  code, _, err = _run(generate_cli.main, [a.format(run=run_dir) for a in argv])
  assert code == 2 and message in err


def test_export_refuses_and_leaves_nothing(runs, tmp_path, monkeypatch):
  run_dir, _ = runs["moe"]
  taken = tmp_path / "taken"
  taken.mkdir()
  (taken / "notes.txt").write_text("mine")
  code, _, err = _run(convert_main, ["jscale-to-hf", "--ckpt", str(run_dir), "--out",
                                     str(taken)])
  assert code == 2 and "not empty" in err
  assert os.listdir(taken) == ["notes.txt"]
  code, _, err = _run(convert_main, ["jscale-to-hf", "--ckpt", str(run_dir), "--step", "9",
                                     "--out", str(tmp_path / "new")])
  assert code == 2 and "--step 9" in err
  # A failure halfway through writing (a full disk, say) leaves neither --out nor a temp dir.
  from jscale.convert import hf_weights  # pylint: disable=import-outside-toplevel
  real = hf_weights.write_safetensors

  def disk_full(tensors, path, max_shard_bytes):
    real(tensors, path, max_shard_bytes)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(hf_weights, "write_safetensors", disk_full)
  with pytest.raises(OSError, match="No space"):
    convert_main(["jscale-to-hf", "--ckpt", str(run_dir), "--out", str(tmp_path / "new")])
  assert sorted(os.listdir(tmp_path)) == ["taken"]
