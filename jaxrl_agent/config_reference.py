"""HOST: generate docs/config_reference.md from the config dataclasses' field docstrings.

    python -m jaxrl_agent.config_reference            # rewrite docs/config_reference.md
    python -m jaxrl_agent.config_reference --check    # exit 1 if the file is stale

Every config field is followed by a docstring literal (DESIGN §10). Python drops those at
run time, so the docstrings are read with `ast` from the modules' source; defaults are the
values of the instantiated dataclasses. The reference has two parts:
  1. per CLI command, its `--section.field` sections and the defaults the command changes;
  2. one table per config class (field, type, default, meaning): every dataclass in
     config.py and every one a CLI command reaches.
A field without a docstring is an error, so the reference cannot silently lose a field.
tests/test_config_reference.py checks the committed file equals this output.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(os.path.dirname(PACKAGE_DIR), "docs", "config_reference.md")


# ---- docstrings from the source ----
def field_docs(cls) -> tuple[str, dict[str, tuple[str, str]]]:
    """(class docstring, {field: (annotation source, docstring)}) of a dataclass, via ast.

    A field's docstring is the string literal statement right after its annotated assignment.
    """
    source = inspect.getsource(sys.modules[cls.__module__])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            break
    else:
        raise ValueError(f"class {cls.__qualname__} not found in {cls.__module__}")
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            doc = ""
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                doc = inspect.cleandoc(nxt.value.value)
            docs[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return inspect.cleandoc(ast.get_docstring(node) or ""), docs


# ---- rendering ----
def _value(v, cli: bool = False) -> str:
    """A default as Python repr (`cli=False`) or as typed after `--section.field=`, with the
    package directory written `<jaxrl_agent>` so the file is the same on every machine."""
    if isinstance(v, str) and v.startswith(PACKAGE_DIR):
        v = "<jaxrl_agent>" + v[len(PACKAGE_DIR):]
    if not cli:
        return repr(v)
    if v is None or isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return ",".join(_value(x, cli=True) for x in v)
    return str(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(cls) -> str:
    return cls.__name__.lower()


def _is_config(v) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def leaf_classes(instance, found: dict) -> dict:
    """Every dataclass type reachable from a config instance (itself included), by name."""
    found.setdefault(type(instance).__name__, type(instance))
    for f in dataclasses.fields(instance):
        v = getattr(instance, f.name)
        if _is_config(v):
            leaf_classes(v, found)
    return found


def class_table(cls) -> list[str]:
    """The reference table of one config class (field, type, default, meaning)."""
    doc, docs = field_docs(cls)
    default = cls()
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, ("", ""))[1]]
    if missing:
        raise ValueError(f"{cls.__module__}.{cls.__name__}: fields without a docstring: {missing}")
    lines = [f"### {cls.__name__}", "", f"`{cls.__module__}.{cls.__name__}`: {doc}".rstrip(), "",
             "| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        v = getattr(default, f.name)
        shown = f"[{type(v).__name__}](#{_anchor(type(v))})" if _is_config(v) else f"`{_cell(_value(v))}`"
        lines.append(f"| `{f.name}` | `{_cell(docs[f.name][0])}` | {shown} | {_cell(docs[f.name][1])} |")
    return lines + [""]


def changed_defaults(value, base, prefix: str) -> list[str]:
    """`--prefix.field=value` for every leaf where a command's default differs from the class's."""
    out = []
    for f in dataclasses.fields(value):
        v, b = getattr(value, f.name), getattr(base, f.name)
        if _is_config(v):
            out += changed_defaults(v, b if type(b) is type(v) else type(v)(), f"{prefix}.{f.name}")
        elif v != b:
            out.append(f"`--{prefix}.{f.name}={_value(v, cli=True)}`")
    return out


def command_section(name: str, run_cfg) -> list[str]:
    lines = [f"### `python -m jaxrl_agent {name}`", "", "| option | kind | this command's defaults (where they differ) |",
             "|---|---|---|"]
    for f in dataclasses.fields(run_cfg):
        v = getattr(run_cfg, f.name)
        if _is_config(v):
            changed = changed_defaults(v, type(v)(), f.name)
            lines.append(f"| `--{f.name}.*` | [{type(v).__name__}](#{_anchor(type(v))}) | "
                         f"{_cell(', '.join(changed)) or 'class defaults'} |")
        else:
            lines.append(f"| `--{f.name}` | `{type(v).__name__}` | `--{f.name}={_cell(_value(v, cli=True))}` |")
    return lines + [""]


def option_lines(run_cfg, prefix: str = "") -> list[tuple[str, str]]:
    """(`--section.field=default`, meaning) for every leaf option of a command's config, in
    field order; the defaults are the command's own, the meanings the field docstrings."""
    _, docs = field_docs(type(run_cfg))
    out = []
    for f in dataclasses.fields(run_cfg):
        v, name = getattr(run_cfg, f.name), f"{prefix}{f.name}"
        if _is_config(v):
            out += option_lines(v, f"{name}.")
        else:
            out.append((f"--{name}={_value(v, cli=True)}", " ".join(docs.get(f.name, ("", ""))[1].split())))
    return out


def command_help(name: str, summary: str, run_cfg, width: int = 100) -> str:
    """`python -m jaxrl_agent <name> --help`: what the command does and every option with its
    default and meaning (the same docstrings as docs/config_reference.md)."""
    import textwrap

    out = [f"usage: python -m jaxrl_agent {name} [--section.field=value ...]", "",
           *textwrap.wrap(summary, width=width), "",
           "options, with this command's defaults (tuples comma-separated, none is None, <jaxrl_agent> the "
           "installed package directory; docs/config_reference.md has them as tables):"]
    for opt, doc in option_lines(run_cfg):
        out.append(f"  {opt}")
        out += textwrap.wrap(doc, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"


def generate() -> str:
    """The whole reference as Markdown."""
    from jaxrl_agent import cli
    from jaxrl_agent import config as config_module

    commands = {name: factory()() for name, (factory, _) in sorted(cli.COMMANDS.items())}
    classes: dict = {}
    for obj in vars(config_module).values():  # every config class in config.py, in file order
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == config_module.__name__:
            classes[obj.__name__] = obj
    run_types = {type(c).__name__ for c in commands.values()}
    for run_cfg in commands.values():
        for cname, cls in leaf_classes(run_cfg, {}).items():
            if cname not in run_types:
                classes.setdefault(cname, cls)

    out = ["# Configuration reference", "",
           "<!-- Generated by `python -m jaxrl_agent.config_reference` from the field docstrings; do not edit. -->",
           "",
           "Every field of every config dataclass, with its default and the docstring that follows it in the "
           "source. On the command line a field is `--section.field=value` (nested sections chain: "
           "`--train.loss.clip_high=0.28`); tuples are comma-separated, `none` is None. "
           "`<jaxrl_agent>` stands for the installed package directory.", "",
           "## Commands", ""]
    for name, run_cfg in commands.items():
        out += command_section(name, run_cfg)
    out += ["## Config classes", ""]
    for cls in classes.values():
        out += class_table(cls)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl_agent.config_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write (default: docs/config_reference.md)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if --out differs")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = open(args.out).read() if os.path.exists(args.out) else ""
        if current != text:
            print(f"{args.out} is stale: run `python -m jaxrl_agent.config_reference`", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
