"""Config loading, overrides and validation: every bad case fails before compile, naming the key."""

import ast
import glob
import os

import pytest

from jscale import train
from jscale import validate
from jscale.config import ConfigError, ModelConfig, ParallelConfig, PipelineConfig, choices
from jscale.config_load import load_config
from jscale.model import attention
from jscale.parallel.context import order
from jscale.parallel.pipeline import schedules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_config_file_loads(path):
  cfg = load_config(path)
  assert cfg.model.n_layers > 0


def test_overrides_and_presets():
  cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                    ["train.steps=100", "model.n_layers=4", "train.lr=3e-4",
                     "model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8"])
  assert (cfg.train.steps, cfg.model.n_layers, cfg.train.lr) == (100, 4, 3e-4)
  assert cfg.model.rope_scaling.factor == 8.0
  big = load_config(None, ["model.preset=llama3_8b"])
  assert (big.model.d_model, big.model.n_kv_heads, big.model.vocab_size) == (4096, 8, 128256)
  assert big.model.rope_scaling.factor == 8.0


@pytest.mark.parametrize("overrides, key", [
    (["model.n_layrs=4"], "model.n_layrs"),  # typo
    (["trian.steps=4"], "trian"),
    (["model.d_model=0"], "model.d_model"),
    (["train.batch_size=-8"], "train.batch_size"),
    (["model.n_heads=6", "model.n_kv_heads=4", "model.head_dim=32"], "model.n_kv_heads"),
    (["train.batch_size=10", "train.microbatches=4"], "train.microbatches"),
    (["train.remat=sometimes"], "train.remat"),
    (["train.steps=ten"], "train.steps"),
    (["model.preset=llama9"], "model.preset"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "mesh"),
    (["data.source=bin"], "data.path"),
    (["trainsteps=3"], "section.key=value"),
    (["fp8.enabled=true", "fp8.targets=[mlp,lm_head]"], "fp8.targets"),  # never the head
    (["fp8.enabled=true", "fp8.targets=[w_qkv]"], "fp8.targets"),  # unknown linear
    (["fp8.enabled=true", "fp8.amax_history=0"], "fp8.amax_history"),
    (["fp8.recipe=late"], "fp8.recipe"),
    (["parallel.scheduler_memory_percent=0"], "parallel.scheduler_memory_percent"),
])
def test_bad_values_name_the_key(overrides, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    load_config(None, overrides)


def test_unknown_key_suggests_fix():
  with pytest.raises(ConfigError, match=r"did you mean model\.n_layers"):
    load_config(None, ["model.n_layrs=4"])


def test_missing_and_invalid_files(tmp_path):
  with pytest.raises(ConfigError, match="no such file"):
    load_config(tmp_path / "nope.yaml")
  bad = tmp_path / "bad.yaml"
  bad.write_text("model: [unclosed\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    load_config(bad)
  scalar = tmp_path / "scalar.yaml"
  scalar.write_text("42\n")
  with pytest.raises(ConfigError, match="mapping"):
    load_config(scalar)


def test_cli_reports_config_errors_before_compiling(capsys, tmp_path):
  assert train.main(["--config", os.path.join(ROOT, "configs/tiny.yaml"),
                     "model.n_heads=6", "model.head_dim=16"]) == 2
  assert "model.n_kv_heads" in capsys.readouterr().err
  assert train.main(["--config", str(tmp_path / "missing.yaml")]) == 2
  assert "no such file" in capsys.readouterr().err


def test_runtime_checks(tmp_path):
  cfg = load_config(None, ["model.attention_impl=cudnn", f"data.cache_dir={tmp_path}"])
  with pytest.raises(ConfigError, match="model.attention_impl=cudnn"):
    validate.check_runtime(cfg)
  cfg = load_config(None, ["model.vocab_size=100", f"data.cache_dir={tmp_path}"])
  with pytest.raises(ConfigError, match="model.vocab_size"):
    validate.check_runtime(cfg)


def test_config_imports_no_jscale_module():
  """config.py is the leaf every other module imports: an import back would be a cycle."""
  with open(os.path.join(ROOT, "jscale", "config.py"), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  names += ["jscale" if n.level else n.module for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)]
  assert not [n for n in names if n == "jscale" or n.startswith("jscale.")], names


def test_registries_match_the_config_literals():
  """Lower layers' registries name exactly the values the config's Literal types allow."""
  assert schedules.SCHEDULES == choices(PipelineConfig, "schedule")
  assert order.LAYOUTS == choices(ParallelConfig, "context_layout")
  impls = set(choices(ModelConfig, "attention_impl"))
  assert set(attention.IMPLS) == impls - {"auto"}  # auto resolves to one of the others
  assert set(attention.BACKENDS) == impls
  # check_backend looks norm impls up in the same table.
  assert set(choices(ModelConfig, "norm_impl")) <= set(attention.BACKENDS)
