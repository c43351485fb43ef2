"""The `Template` record of one bug-fix task family and the input generators the templates
share (HOST). The template modules (`search.py`, `arrays.py`) build on this; the package's
`__init__` collects them into the registry.

Leaf module: no project imports.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

Case = tuple[str, tuple]  # (kind, args): kind "typical" cases may become dev tests


@dataclass(frozen=True)
class Template:
    """One family of bug-fix tasks."""

    name: str
    """Registry key, also recorded in `Task.metadata["template"]`."""
    summary: str
    """What the function does, for the instruction (may use the placeholders)."""
    source: str
    """Reference (correct) module source; `{fn}` and the other names are placeholders."""
    names: dict[str, tuple[str, ...]]
    """Placeholder -> candidate identifiers (`fn` is the function under test)."""
    bugs: tuple[tuple[str, tuple[str, ...]], ...]
    """Bug sites: (correct snippet in `source`, buggy replacements). Each snippet occurs once."""
    oracle: Callable[..., Any]
    """Independent implementation: expected output for the args (or the mutated first arg)."""
    cases: Callable[[random.Random], list[Case]]
    """Random test inputs covering typical and edge behaviour."""
    modules: tuple[str, ...] = ("solution", "algo", "utils", "core", "lib")
    """Candidate module (file) names."""
    docs: tuple[str, ...] = ("",)
    """Docstring variants (first line of the function's docstring)."""
    family: str = "misc"
    """Coarse group for reporting (binary_search, ranges, windows, ...)."""
    extra: dict = field(default_factory=dict)
    """Free-form notes (e.g. why a site loops forever)."""

    def __post_init__(self):
        for correct, variants in self.bugs:
            if self.source.count(correct) != 1:
                raise ValueError(f"template {self.name}: bug site {correct!r} must occur once")
            if not variants or correct in variants:
                raise ValueError(f"template {self.name}: bad variants for {correct!r}")


# ---- shared input generators ----


def sorted_distinct(rng: random.Random, n: int, lo: int = -50, hi: int = 100) -> list[int]:
    return sorted(rng.sample(range(lo, hi), n))


def sorted_dups(rng: random.Random, n: int) -> list[int]:
    return sorted(rng.choice(range(0, 12)) for _ in range(n))


def absent_value(rng: random.Random, xs: list[int], lo: int = -60, hi: int = 110) -> int:
    """A value not in `xs` (strictly inside its range when possible)."""
    inner = [v for v in range(xs[0] + 1, xs[-1]) if v not in xs] if len(xs) > 1 else []
    return rng.choice(inner) if inner else rng.choice([v for v in range(lo, hi) if v not in xs])


def ints(rng: random.Random, n: int, lo: int = -20, hi: int = 30) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]
