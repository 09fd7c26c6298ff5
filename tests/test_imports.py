"""The layering, read from the imports of every module (function-level imports included):
config < model < parallel < step / runtime < train loop. A lower layer never imports up."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return {n for n in names if n.split(".")[0] in ("jscale", "pallas_kernels")}


def _modules(pattern: str) -> list[pathlib.Path]:
  found = sorted(ROOT.glob(pattern))
  assert found, pattern
  return found


def _offenders(pattern: str, allowed) -> dict[str, list[str]]:
  out = {}
  for path in _modules(pattern):
    bad = sorted(n for n in _imports(path) if not allowed(n))
    if bad:
      out[str(path.relative_to(ROOT))] = bad
  return out


def _under(*prefixes: str):
  return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("pattern, allowed", [
    # The model owns its seam (jscale.model.seam): it never imports a parallel layout.
    ("jscale/model/*.py", _under("jscale.config", "jscale.model", "pallas_kernels")),
    # The config is a leaf: every other module may read it.
    ("jscale/config.py", lambda n: False),
    # Kernels are standalone (JAX's Pallas ops style).
    ("pallas_kernels/**/*.py", _under("pallas_kernels")),
    # Parallel layouts implement the seams; they never reach into data or the train loop.
    ("jscale/parallel/**/*.py",
     lambda n: not _under("jscale.data", "jscale.train", "jscale.step.train_step", "jscale.runtime",
                          "jscale.distributed", "jscale.ckpt.checkpoint")(n)),
])
def test_no_import_from_a_lower_layer_up(pattern, allowed):
  assert _offenders(pattern, allowed) == {}


def test_the_loss_sees_only_the_model_seam():
  assert _offenders("jscale/step/loss.py", _under("jscale.model")) == {}


# pyproject's dependency names -> the modules they install; ml_dtypes / jaxlib come with jax.
_DIST_MODULES = {"orbax-checkpoint": "orbax", "pyyaml": "yaml", "tensorboardX": "tensorboardX",
                 "jax": "jax"}
_WITH_JAX = {"jaxlib", "ml_dtypes"}


def _third_party(path: pathlib.Path) -> set[str]:
  import sys  # pylint: disable=import-outside-toplevel
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return {n for n in names if n not in sys.stdlib_module_names
          and n not in ("jscale", "pallas_kernels", "__future__")}


def test_pip_install_dot_is_enough_to_run():
  """Every module jscale and its kernels import comes with `pip install -e .` (the main
  dependencies); torch / transformers / pytest (the `test` extra) are for tests only."""
  import re  # pylint: disable=import-outside-toplevel
  import tomllib  # pylint: disable=import-outside-toplevel
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  deps = {re.split(r"[<>=\[ ;]", d)[0] for d in project["dependencies"]}
  installed = {_DIST_MODULES.get(d, d.replace("-", "_")) for d in deps} | _WITH_JAX
  # The `triton` extra (jax-triton, which brings triton): pallas_kernels/rms_norm/triton_kernel.py
  # only, imported explicitly by the kernel benchmark on a GPU.
  optional = {"jax_triton", "triton"}
  used = {}
  for path in _modules("jscale/**/*.py") + _modules("pallas_kernels/**/*.py"):
    for name in _third_party(path) - installed - optional:
      used.setdefault(name, []).append(str(path.relative_to(ROOT)))
  assert used == {}
