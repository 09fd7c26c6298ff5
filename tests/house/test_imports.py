"""The house's import rules, read from the source of every module (ast, nothing imported):
no import circle anywhere, function-local imports only where listed with their reason, and the
layering: config < model < parallel < step / runtime < the run and the CLIs, with checkpoints
that never load config files and analysis that never reaches into the planner."""

import ast
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jscale", "pallas_kernels")

# Function-local imports of jscale / pallas_kernels modules that are there on purpose, by file
# and module, with the reason. None of them may hide an import circle
# (`test_no_import_circle_counting_function_local_imports`).
_MOSAIC = ("the Hopper kernels import Pallas' Mosaic GPU backend (~0.5 s at import): loaded "
           "only where a GPU runs them")
LAZY = {
    ("jscale/model/attention.py", "pallas_kernels.flash_attention.hopper"): _MOSAIC,
    ("jscale/model/layers.py", "pallas_kernels.rms_norm.hopper"): _MOSAIC,
    ("jscale/model/moe_gemm.py", "pallas_kernels.grouped_matmul"): _MOSAIC,
    ("jscale/fp8/grouped_kernel.py", "pallas_kernels.grouped_matmul"): _MOSAIC,
    # `python -m jscale.plan --verify N` sets XLA_FLAGS (N simulated devices) before anything
    # imports JAX; the estimate alone never imports it.
    **{("jscale/plan/__main__.py", m): "the CLI sets XLA_FLAGS before JAX is imported"
       for m in ("jscale.config_load", "jscale.presets", "jscale.analysis.gpu_target",
                 "jscale.plan.listing", "jscale.plan.rank",
                 "jscale.plan.plot", "jscale.plan.verify")},
}


def _path_module(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_path_module(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str) -> str | None:
  """The module `name` (a module, or a name inside one) lives in."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _import_nodes(tree: ast.Module, local: bool):
  """(node, is function-local) for every import statement."""
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        found.append((child, inside))
      visit(child, inside)

  visit(tree, False)
  return [(n, inside) for n, inside in found if local or not inside]


def _imported(node) -> set[str]:
  """The names an import statement imports (modules, or modules' attributes)."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names}
  if node.level or not node.module:
    return set()
  return {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
          for a in node.names}


def _imports(path: pathlib.Path, local: bool = True) -> set[str]:
  """Every jscale / pallas_kernels name `path` imports (function-local ones with `local`)."""
  names = set()
  for node, _ in _import_nodes(ast.parse(path.read_text()), local):
    names |= {n for n in _imported(node) if n.split(".")[0] in PACKAGES}
  return names


def _graph(local: bool) -> dict[str, set[str]]:
  """module -> the modules it imports. A submodule importing its own package's submodules
  (`from jscale.data import tokenizer` in jscale.data.corpus) does not depend on the package's
  __init__ (Python has it half-initialised already); importing a name the __init__ defines does."""
  graph = {}
  for module, path in MODULES.items():
    deps = set()
    for name in _imports(path, local):
      target = _resolve(name)
      ancestor = (module + ".").startswith(target + ".") if target else False
      if target and target != module and not (ancestor and name != target):
        deps.add(target)
      parts = name.split(".")
      deps |= {".".join(parts[:i]) for i in range(1, len(parts))
               if ".".join(parts[:i]) in MODULES and not (module + ".").startswith(
                   ".".join(parts[:i]) + ".")}
    graph[module] = deps - {module}
  return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []
  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while (w := stack.pop()) != v:
        on.discard(w)
        comp.append(w)
      on.discard(v)
      if comp:
        out.append(sorted(comp + [v]))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_circle_at_module_level():
  assert _circles(_graph(local=False)) == []


def test_no_import_circle_counting_function_local_imports():
  # A function-local import that closes a circle exists only to dodge it: counted as if it
  # stood at the top, the graph still has no circle.
  assert _circles(_graph(local=True)) == []


def test_function_local_imports_are_listed_with_their_reason():
  found = set()
  for module, path in MODULES.items():
    if not module.startswith("jscale"):
      continue
    for node, inside in _import_nodes(ast.parse(path.read_text()), local=True):
      if inside:
        found |= {(str(path.relative_to(ROOT)), n) for n in _imported(node)
                  if n.split(".")[0] in PACKAGES}
  assert found - set(LAZY) == set()
  assert set(LAZY) - found == set(), "listed but gone: remove them from LAZY"


def _offenders(pattern: str, allowed) -> dict[str, list[str]]:
  out = {}
  found = sorted(ROOT.glob(pattern))
  assert found, pattern
  for path in found:
    bad = sorted(n for n in _imports(path) if not allowed(n))
    if bad:
      out[str(path.relative_to(ROOT))] = bad
  return out


def _under(*prefixes: str):
  return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def _not_under(*prefixes: str):
  return lambda name: not _under(*prefixes)(name)


# The model's own files: the network the seam implementations must never reach into.
_MODEL_FILES = tuple(f"jscale.model.{m}" for m in ("llama", "gqa", "mla", "mlp", "moe",
                                                   "router", "mtp", "layers", "kv_cache",
                                                   "rope", "remat"))


@pytest.mark.parametrize("pattern, allowed", [
    # The config is a leaf: every other module may read it.
    ("jscale/config.py", lambda n: False),
    # So are the GPU facts and the exit statuses: everyone may read them.
    ("jscale/hardware.py", lambda n: False),
    ("jscale/exit_codes.py", lambda n: False),
    ("jscale/jax_compat.py", lambda n: False),
    # The model owns its seam (jscale.model.seam): it never imports a parallel layout.
    ("jscale/model/*.py", _under("jscale.config", "jscale.jax_compat", "jscale.model",
                                 "pallas_kernels")),
    # Kernels are standalone (JAX's Pallas ops style).
    ("pallas_kernels/**/*.py", _under("pallas_kernels")),
    # Parallel layouts implement the seams: never the config, the step (the loss among it),
    # the model's files, data, checkpoints, the run or the runtime.
    ("jscale/parallel/**/*.py",
     _not_under("jscale.config", "jscale.config_load", "jscale.config_dict", "jscale.validate",
                "jscale.step", *_MODEL_FILES, "jscale.data", "jscale.train", "jscale.runtime",
                "jscale.distributed", "jscale.ckpt", "jscale.run")),
    # Weights come and go without loading a config file (saved configs: jscale.config_dict).
    ("jscale/ckpt/*.py", _not_under("jscale.config_load", "jscale.validate", "jscale.runtime",
                                    "jscale.step", "jscale.run", "jscale.train")),
    # Reading compiled programs never depends on the planner (the planner reads them).
    ("jscale/analysis/**/*.py", _not_under("jscale.plan")),
    # The step sees the seams, not how a run is driven.
    ("jscale/step/*.py", _not_under("jscale.runtime", "jscale.run", "jscale.train",
                                    "jscale.ckpt", "jscale.data")),
    # The loss sees only the model (its seam and matmuls).
    ("jscale/step/loss.py", _under("jscale.model")),
])
def test_no_import_against_the_layering(pattern, allowed):
  assert _offenders(pattern, allowed) == {}


# The layers, lowest first: a module imports only from its own layer or those below
# (`test_no_import_goes_up_the_layers`). A module belongs to the layer of the longest prefix
# listed (a package's `__main__`, its command line, sits with the CLIs).
LAYERS = (
    ("jscale.config", "jscale.hardware", "jscale.exit_codes", "jscale.xla_flags",
     "jscale.jax_compat", "jscale.platforms"),  # leaves
    ("jscale.config_conditional",),
    ("jscale.config_cli", "jscale.presets", "jscale.config_dict",
     "jscale.metrics", "jscale.mesh", "jscale.optim", "jscale.data"),
    ("pallas_kernels", "jscale.model"),
    ("jscale.fp8", "jscale.sharding", "jscale.parallel"),
    ("jscale.step",),
    ("jscale.convert", "jscale.distributed"),
    ("jscale.ckpt", "jscale.infer"),
    ("jscale.validate", "jscale.config_load"),  # the config as it comes in
    ("jscale.runtime",),
    ("jscale.analysis", "jscale.profile"),
    ("jscale.predict",),
    ("jscale.plan",),
    ("jscale.run", "jscale.train", "jscale.eval", "jscale.generate", "jscale.report",
     "jscale.convert.__main__", "jscale.plan.__main__", "jscale.predict.__main__"),  # CLIs
)


def _layer(module: str) -> int:
  best = max((p for layer in LAYERS for p in layer if _under(p)(module)), key=len, default=None)
  assert best is not None, f"{module} is in no layer: add it to LAYERS"
  return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_no_import_goes_up_the_layers():
  graph = _graph(local=True)
  up = sorted((m, d) for m, deps in graph.items() for d in deps
              if m != "jscale" and d != "jscale" and _layer(d) > _layer(m))
  assert up == []


def test_the_config_as_it_comes_in_never_reaches_the_trainer():
  # ConfigIn (the schema, loading, the command line, presets, every check) never imports
  # what trains (the runtime, the step, the run loop, the CLIs).
  config_in = ("jscale.config", "jscale.config_cli", "jscale.config_dict", "jscale.config_load",
               "jscale.presets", *(m for m in MODULES if _under("jscale.validate")(m)))
  trainer = _under("jscale.runtime", "jscale.step", "jscale.run", "jscale.train")
  graph = _graph(local=True)
  assert {m: sorted(filter(trainer, graph[m])) for m in config_in if m in graph
          and any(map(trainer, graph[m]))} == {}


# pyproject's dependency names -> the modules they install; ml_dtypes / jaxlib come with jax.
_DIST_MODULES = {"orbax-checkpoint": "orbax", "pyyaml": "yaml", "tensorboardX": "tensorboardX",
                 "jax": "jax"}
_WITH_JAX = {"jaxlib", "ml_dtypes"}


def _third_party(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return {n for n in names if n not in sys.stdlib_module_names
          and n not in (*PACKAGES, "__future__")}


def test_pip_install_dot_is_enough_to_run():
  """Every module jscale and its kernels import comes with `pip install -e .` (the main
  dependencies); torch / transformers / pytest (the `test` extra) are for tests only."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  deps = {re.split(r"[<>=\[ ;]", d)[0] for d in project["dependencies"]}
  installed = {_DIST_MODULES.get(d, d.replace("-", "_")) for d in deps} | _WITH_JAX
  # The `triton` extra (jax-triton, which brings triton): pallas_kernels/rms_norm/triton_kernel.py
  # only, imported explicitly by the kernel benchmark on a GPU. The `datasets` extra:
  # jscale/data/records.py reads a saved `datasets` directory through it when installed (pyarrow
  # alone otherwise), importing it only on that path.
  optional = {"jax_triton", "triton", "datasets"}
  used = {}
  for path in MODULES.values():
    for name in _third_party(path) - installed - optional:
      used.setdefault(name, []).append(str(path.relative_to(ROOT)))
  assert used == {}


def test_private_jax_lives_in_jax_compat_only():
  """`jax._src` and JAX's private keyword arguments appear in `jscale/jax_compat.py` alone (the
  kernels' hooks: `pallas_kernels/mosaic_gpu_env.py`)."""
  allowed = {"jscale/jax_compat.py", "pallas_kernels/mosaic_gpu_env.py"}
  found = sorted(str(p.relative_to(ROOT)) for p in MODULES.values()
                 if re.search(r"jax\._src|_dot_general=|\._cache_size\(", p.read_text()))
  assert set(found) <= allowed, set(found) - allowed
