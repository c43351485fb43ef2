"""Bug-fix task templates: small algorithms with realistic boundary bugs (HOST).

A `Template` is the reference source of one small function with `{placeholders}` for
identifiers, the bug sites (a correct snippet and buggy variants of it), an independent
oracle that computes expected outputs, and a case generator. `jaxrl_agent.env.tasks` turns
templates into `Task`s (random names, values, docstrings and files; 1-3 injected bugs) and
checks every instance. `Template` and the shared input generators live in `base.py`, the
templates in `search.py` (binary-search variants) and `arrays.py` (ranges, windows, pointers,
partitions, ...); `TEMPLATES` here is the registry.
"""
from __future__ import annotations

from jaxrl_agent.env.templates import arrays, search
from jaxrl_agent.env.templates.base import Template


def _registry() -> dict[str, Template]:
    reg: dict[str, Template] = {}
    for t in [*search.TEMPLATES, *arrays.TEMPLATES]:
        if t.name in reg:
            raise ValueError(f"duplicate template name {t.name}")
        reg[t.name] = t
    return reg


TEMPLATES: dict[str, Template] = _registry()

# Templates never used for training: the "heldout_templates" split draws only from these.
HELDOUT_TEMPLATES: tuple[str, ...] = ("last_occurrence", "isqrt_floor", "chunk", "count_between")
TRAIN_TEMPLATES: tuple[str, ...] = tuple(n for n in TEMPLATES if n not in HELDOUT_TEMPLATES)
