"""The docs cite files that exist: every repository path in backticks, in a fenced block or as
a relative link in README.md and docs/*.md names a file or directory of this repository."""

import glob
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Paths starting with these are repository paths and must exist as written. `results/` is left
# out: benchmark outputs are cited before a GPU has produced them.
PREFIXES = ("jscale/", "pallas_kernels/", "tests/", "scripts/", "configs/", "docs/", ".ci/")
TOP_LEVEL = ("README.md", "pyproject.toml")
# File names (.py / .md / .yaml) cited without their directory are looked up by suffix; these
# are not files of this repository.
ELSEWHERE = {
    "model.yaml": "written by `jscale.convert hf-to-jscale` beside params/",
    "ragged_dot_mgpu.py": "JAX's Pallas Mosaic GPU example the grouped matmul follows",
    "transposed_ragged_dot_mgpu.py": "likewise",
    "hopper_matmul_mgpu.py": "likewise",
}
SUFFIXES = (".py", ".md", ".yaml")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NEW = " (new)"  # a worked example's file that does not exist yet: `path` (new)


def _repo_files() -> list[str]:
  out = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "__pycache__", "results")]
    out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
  return out


FILES = _repo_files()


def _exists(path: str) -> bool:
  if any(c in path for c in "*?["):
    return bool(glob.glob(os.path.join(ROOT, path)))
  return os.path.exists(os.path.join(ROOT, path))


def _missing_test(node_id: str) -> str | None:
  """`tests/test_x.py::test_name`: the file exists and defines the test."""
  path, *names = node_id.split("::")
  if not _exists(path):
    return "no such path"
  source = open(os.path.join(ROOT, path), encoding="utf-8").read()
  for name in names:
    if not re.search(rf"^\s*(def|class) {re.escape(name)}\b", source, re.M):
      return f"{path} defines no {name}"
  return None


def _problem(token: str) -> str | None:
  """Why `token` (one word of inline code or a fenced block) is a missing path, or None."""
  token = token.strip("()[],;:'\"")
  if "::" in token and token.startswith(PREFIXES):
    return _missing_test(token)
  if token.startswith(PREFIXES) or token in TOP_LEVEL:
    return None if _exists(token) else "no such path"
  if not token.endswith(SUFFIXES) or token.startswith(("-", ".", "~", "<")) or "=" in token:
    return None
  if any(c in token for c in "<>{}$") or token.startswith(("shared/", "http")):
    return None  # placeholders, and the shared project folder outside the repository
  if token in ELSEWHERE:
    return None
  if any(f == token or f.endswith("/" + token) for f in FILES) or glob.glob(
      os.path.join(ROOT, "**", token), recursive=True):
    return None
  return "no file of the repository has this name"


def _cited(doc: str):
  """(token, problem) for every problem in `doc`."""
  text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
  fences = FENCE.findall(text)
  prose = FENCE.sub("", text)
  for m in re.finditer(r"`([^`\n]+)`", prose):
    if prose[m.end():m.end() + len(NEW)] == NEW:
      continue
    for token in m.group(1).split():
      if (why := _problem(token)) is not None:
        yield token, why
  for block in fences:  # commands and trees: only paths with a repository prefix
    for token in block.split():
      token = token.strip("()[],;:'\"")
      if token.startswith(PREFIXES) and (why := _problem(token)) is not None:
        yield token, why + " (in a code block)"
  for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
    target = m.group(1).split("#")[0]
    if not target or re.match(r"[a-z]+:", target):
      continue
    path = os.path.normpath(os.path.join(os.path.dirname(doc), target))
    if not _exists(path):
      yield target, "broken link"


def test_there_are_docs():
  assert "docs/README.md" in DOCS and len(DOCS) >= 4


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc):
  problems = sorted(set(_cited(doc)))
  assert not problems, "\n".join(f"{doc}: `{t}`: {why}" for t, why in problems)


def test_script_figures_are_the_scripts_own():
  """Every figure block in README.md and docs/ (`<!-- NAME:begin -->`) is what its script wrote
  or renders from its stored results (`scripts/doc_blocks.py`), not typed figures; the README
  holds the quick start's and the two summary tables'."""
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import doc_blocks  # pylint: disable=import-outside-toplevel  (scripts/ is not a package)
  import quickstart_figures as qf  # pylint: disable=import-outside-toplevel
  assert doc_blocks.stale() == [], "rerun python scripts/doc_blocks.py (or the scripts named)"
  assert set(doc_blocks.RENDERED) <= set(doc_blocks.blocks("README.md"))
  assert {"results/zero_memory.md", "results/compare_collectives.md"} <= set(
      doc_blocks.blocks("docs/results.md"))
  with open(qf.RESULT, encoding="utf-8") as f:
    fig = json.load(f)
  assert fig["last_loss"] < fig["first_loss"] and fig["last_loss"] < qf.math.log(256) - 3

def test_usage_names_every_config_file():
  with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
    usage = f.read()
  files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
  assert [f for f in files if f"`{f}`" not in usage] == []


def test_the_index_links_every_doc():
  with open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8") as f:
    index = f.read()
  docs = [d for d in DOCS if d.startswith("docs/") and d != "docs/README.md"]
  assert [d for d in docs if f"]({os.path.basename(d)})" not in index] == []
