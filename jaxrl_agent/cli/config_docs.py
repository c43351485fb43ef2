"""HOST: what a config field means, read from the docstring that follows it in the source.

Every config field is followed by a docstring literal (DESIGN §10). Python drops those at
run time, so they are read with `ast` from the modules' source; defaults are the values of
the instantiated dataclasses. Two readers render them:

    field_docs(cls) --> config_reference.py  (docs/config_reference.md: tables per class)
                    --> command_help()       (`python -m jaxrl_agent <command> --help`, cli/main.py)

Leaf module: no project imports.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxrl_agent/


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
def render_value(v, cli: bool = False) -> str:
    """A default as Python repr (`cli=False`) or as typed after `--section.field=`, with the
    package directory written `<jaxrl_agent>` so the file is the same on every machine."""
    if isinstance(v, str) and v.startswith(PACKAGE_DIR):
        v = "<jaxrl_agent>" + v[len(PACKAGE_DIR):]
    if not cli:
        return repr(v)
    if v is None or isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return ",".join(render_value(x, cli=True) for x in v)
    return str(v)


def is_config(v) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def option_lines(run_cfg, prefix: str = "") -> list[tuple[str, str]]:
    """(`--section.field=default`, meaning) for every leaf option of a command's config, in
    field order; the defaults are the command's own, the meanings the field docstrings."""
    _, docs = field_docs(type(run_cfg))
    out = []
    for f in dataclasses.fields(run_cfg):
        v, name = getattr(run_cfg, f.name), f"{prefix}{f.name}"
        if is_config(v):
            out += option_lines(v, f"{name}.")
        else:
            out.append((f"--{name}={render_value(v, cli=True)}", " ".join(docs.get(f.name, ("", ""))[1].split())))
    return out


def command_help(name: str, summary: str, run_cfg, width: int = 100) -> str:
    """`python -m jaxrl_agent <name> --help`: what the command does and every option with its
    default and meaning (the same docstrings as docs/config_reference.md)."""
    out = [f"usage: python -m jaxrl_agent {name} [--section.field=value ...]", "",
           *textwrap.wrap(summary, width=width), "",
           "options, with this command's defaults (tuples comma-separated, none is None, <jaxrl_agent> the "
           "installed package directory; docs/config_reference.md has them as tables):"]
    for opt, doc in option_lines(run_cfg):
        out.append(f"  {opt}")
        out += textwrap.wrap(doc, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"
