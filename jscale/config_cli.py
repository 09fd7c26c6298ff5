"""Config keys on the command line: the reference `--help` prints, `--section.key=value`
overrides, `--print-config`.

The reference is generated from the config dataclasses (`jscale.config`): every key with its
type (a `Literal`'s values), its default and the comment written beside or above its field, each
section with its class docstring. `docs/config.md` is the same reference as Markdown
(`python -m jscale.config_cli > docs/config.md`; a test keeps the two equal).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any, Sequence

import yaml

from jscale import config as config_lib
from jscale import config_conditional, presets
from jscale.config import Config, ConfigError

USAGE_NOTE = ("Config keys: in the YAML file as `section:` then `key: value`; on the command line "
              "as section.key=value or --section.key=value (later ones win). --print-config "
              "prints the config resolved (presets, overrides) as YAML and exits.")


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key: `name` (dotted), its allowed values, default and documentation."""
  name: str
  kind: str
  default: str
  doc: str


def _comments(cls) -> dict[str, str]:
  """field name -> the comment beside its line, after the comment lines right above it."""
  path = inspect.getsourcefile(cls)
  with open(path, encoding="utf-8") as f:
    source = f.read()
  alone, beside = {}, {}  # line -> comment: on a line of its own, or after code
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      own_line = tok.line.strip().startswith("#")
      (alone if own_line else beside)[tok.start[0]] = tok.string.lstrip("#").strip()
  node = next(n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
  out = {}
  for stmt in node.body:
    if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
      continue
    above, line = [], stmt.lineno - 1
    while line in alone:
      above.insert(0, alone[line])
      line -= 1
    after = [beside[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in beside]
    out[stmt.target.id] = re.sub(r"\bNone\b", "null", " ".join(above + after))  # YAML's word
  return out


def _doc(cls) -> str:
  """The class docstring, one paragraph ('' for a dataclass's generated signature)."""
  doc = cls.__doc__ or ""
  if doc.startswith(cls.__name__ + "("):
    return ""
  return " ".join(doc.split("\n\n")[0].split())


def _section_type(tp) -> type | None:
  """The dataclass a field of type `tp` holds (`X` or `X | None`), if any."""
  args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
  one = args[0] if len(args) == 1 else None
  return one if isinstance(one, type) and dataclasses.is_dataclass(one) else None


def _kind(tp) -> str:
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    return " | ".join(_kind(a) for a in rest) + " | null"
  if origin is typing.Literal:
    return " | ".join(str(a) for a in typing.get_args(tp))
  if origin in (list, tuple):
    return f"list of {_kind(typing.get_args(tp)[0])}"
  if tp is dict or origin is dict:
    return "mapping"
  return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
  """A default as YAML writes it: null, true, [attention, mlp]."""
  if isinstance(value, tuple):
    value = list(value)
  return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def sections(cls=Config, prefix: str = "") -> list[tuple[str, str, list[Key]]]:
  """(section name, its doc, its keys) for `cls` and, after it, each nested section."""
  hints = typing.get_type_hints(cls)
  notes = _comments(cls)
  keys, nested = [], []
  defaults = cls()  # every config section has a default for every field
  for f in dataclasses.fields(cls):
    name, tp = f"{prefix}{f.name}", hints[f.name]
    sub = _section_type(tp)
    if sub is not None and prefix == "":  # a top-level section
      nested += sections(sub, f"{name}.")
      continue
    default = getattr(defaults, f.name)
    if sub is not None:  # an optional section inside one (model.moe): its keys follow
      switch = (f"off unless a preset has it or {name}.{sub.SWITCH} is written (another of its "
                "keys alone is refused)" if hasattr(sub, "SWITCH") else "")
      keys.append(Key(name, "section | null", _show(None if default is None else "{...}"),
                      "; ".join(x.rstrip(".") for x in (notes.get(f.name, ""), _doc(sub),
                                                        switch) if x)))
      nested += sections(sub, f"{name}.")
      continue
    kind = " | ".join([*presets.PRESETS, "null"]) if name == "model.preset" else _kind(tp)
    keys.append(Key(name, kind, _show(default), notes.get(f.name, "")))
  own = [(prefix.rstrip("."), _doc(cls), keys)] if keys else []
  return own + nested


def all_keys() -> list[str]:
  """Every dotted key a config may set."""
  return [k.name for _, _, keys in sections() for k in keys]


def reference(only: Sequence[str] = (), width: int = 100) -> str:
  """Every key (or those under the prefixes `only`) as plain text, for `--help`."""
  out = []
  for name, doc, keys in sections():
    keys = [k for k in keys if not only or any(k.name == p or k.name.startswith(p + ".")
                                               for p in only)]
    if not keys:
      continue
    out.append("")
    out.append(textwrap.fill(f"{name}: {doc}" if doc else f"{name}:", width))
    for k in keys:
      out.append(f"  {k.name} = {k.default}  ({k.kind})")
      if k.doc:
        out.append(textwrap.fill(k.doc, width, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6))
  return "\n".join(out).lstrip("\n")


def markdown() -> str:
  """The reference as Markdown: docs/config.md."""
  out = ["# Config reference", "",
         "Every key of a jscale config, generated from the dataclasses in `jscale/config.py` "
         "(`python -m jscale.config_cli > docs/config.md`; "
         "`tests/config/test_config_cli.py` keeps this file equal to them). "
         "`python -m jscale.train --help` prints the same.", "",
         USAGE_NOTE.replace("--print-config", "`--print-config`")]
  for name, doc, keys in sections():
    out += ["", f"## {name}", ""]
    if doc:
      out += [doc, ""]
    out += ["| key | default | values | what |", "|---|---|---|---|"]
    for k in keys:
      cells = [f"`{k.name}`", f"`{k.default}`", k.kind.replace("|", "\\|"),
               k.doc.replace("|", "\\|")]
      out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out + _conditional_markdown()) + "\n"


def _conditional_markdown() -> list[str]:
  """The keys that take effect only under others (`config_conditional.RULES`), as a table."""
  out = ["", "## Keys that take effect only under others", "",
         "A key still at its default is never reported. Where one you set has no effect, the "
         "run is refused before anything compiles, or warned about once at startup.", "",
         config_conditional.POLICY, "",
         "| key | with no effect where | what gives it one | then |", "|---|---|---|---|"]
  for r in config_conditional.RULES:
    out.append(f"| `{r.key}` | {r.why} | {r.fix} | {'refused' if r.refuse else 'warned'} |")
  return out


def to_yaml(cfg) -> str:
  """A config as the YAML a `--config` file would hold."""
  def plain(v):
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v
  return yaml.safe_dump(plain(config_lib.to_dict(cfg)), sort_keys=False)


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(the other arguments, the config overrides): `--section.key=value` and `--section.key
  value` become `section.key=value`; an option that is no config key is refused naming the
  closest one."""
  rest, overrides = [], []
  args = list(argv)
  while args:
    a = args.pop(0)
    name, eq, value = a[2:].partition("=")
    if a.startswith("--") and "." in name:
      if not eq:
        if not args:
          raise ConfigError(f"{a}: give a value, e.g. {a}=<value>")
        value = args.pop(0)
      overrides.append(f"{name}={value}")
    else:
      rest.append(a)
  return rest, overrides


def unknown_option(arg: str) -> str:
  """The error for an option that is neither the CLI's nor a config key."""
  name = arg.lstrip("-").partition("=")[0]
  matches = [k for k in all_keys() if k.rsplit(".", 1)[-1] == name]
  hint = (f"did you mean {' or '.join(matches)}? " if matches else "")
  return (f"unrecognized argument {arg}: {hint}config keys are written section.key=value or "
          "--section.key=value (--help lists them all)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the reference's own line breaks."""


def add_print_config(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--print-config", action="store_true",
                      help="print the resolved config as YAML and exit (nothing is compiled)")


def main(argv: list[str] | None = None) -> int:
  """`python -m jscale.config_cli`: the reference as Markdown (docs/config.md)."""
  del argv
  sys.stdout.write(markdown())
  return 0


if __name__ == "__main__":
  sys.exit(main())


def parse(parser, argv):
  """(args, overrides): `argv` (sys.argv[1:] if None) through `parser`, `--section.key=value`
  split off as `section.key=value`; a bad or unknown option is `parser.error` with a hint."""
  try:
    rest, overrides = split_argv(sys.argv[1:] if argv is None else argv)
  except ConfigError as e:
    parser.error(str(e))
  args, unknown = parser.parse_known_args(rest)
  if unknown:
    parser.error(unknown_option(unknown[0]))
  return args, overrides
