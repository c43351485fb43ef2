"""HOST: how one flush splits its rows' staged text into prefill calls (leaf: no project imports).

    staged chunks {row: tokens}  --plan_prefill-->  [PrefillCall(rows, num_rows R, length T), ...]
                                                      each: one compiled prefill of R x T
                                                      (`SamplingEngine._prefill`)

A prefill call runs the model on R rows x T slots, R and T from the engine's buckets, so a
call's cost is set by its padded shape, not by the tokens in it. In a multi-turn rollout a
flush mostly holds one or a few rows of short tool results: one call per length bucket, each
padded to a row bucket of at least B/4 (the former flush), ran mostly padding. Here the rows
are split to minimise an estimated cost over every way of grouping them (`call_cost`);
benchmarks/bench_prefill_plan.py runs the agent benchmark's rollout both ways.

Why contiguous runs suffice: with a call's cost nondecreasing in its row count and its
longest chunk, any grouping can be redrawn, group sizes kept, as runs of the rows sorted by
length in which no group's longest chunk grows. So a dynamic programme over the sorted rows
finds the optimum (tests/test_prefill_plan.py checks it against every partition).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

CALL_SLOTS = 64
"""A call's fixed cost (dispatch, the logits gather, the cache rows' copies), in slots of T.
benchmarks/bench_prefill_plan.py fits `ms = c0 + R * (c1 + c2 * T)` to timed calls: c1 (a
row's own fixed cost) comes out near 0 and c0 / c2 near this."""


@dataclass(frozen=True)
class PrefillCall:
    """One prefill: `rows` (by ascending chunk length) padded to `num_rows` rows of `length`."""

    rows: tuple[int, ...]
    num_rows: int
    length: int


def call_cost(num_rows: int, length: int) -> int:
    """Estimated cost of one R x T prefill, in slots: `R * T + CALL_SLOTS`."""
    return num_rows * length + CALL_SLOTS


def plan_prefill(staged: Mapping[int, int], row_buckets: Sequence[int],
                 length_buckets: Sequence[int]) -> list[PrefillCall]:
    """The calls that prefill every row with staged text at the least `call_cost` in total.

    Args:
      staged: {row: number of staged tokens}; rows with 0 are skipped.
      row_buckets, length_buckets: the compiled shapes' row counts and lengths (any order).
    Returns:
      calls covering each staged row once, every row's chunk <= its call's length.

    The dynamic programme: rows sorted by length; best[j] = the cheapest plan of the first j.
    A call of bucket R ending at row j costs the same however few rows it holds, and best is
    nondecreasing (dropping a row never costs more), so it takes the R rows before j:
    best[j] = min over R of best[max(0, j - R)] + call_cost(R, bucket(len[j-1])).
    O(rows x row buckets).
    """
    rows_b, lens_b = sorted(set(row_buckets)), sorted(set(length_buckets))
    todo = sorted((n, r) for r, n in staged.items() if n > 0)
    for n, r in todo:
        if n > lens_b[-1]:
            raise ValueError(f"row {r} stages {n} tokens, more than the largest prefill bucket {lens_b[-1]}: "
                             f"flush before staging more, or add a bucket that holds it")
    best, choice = [0] + [None] * len(todo), [0] * (len(todo) + 1)
    for j in range(1, len(todo) + 1):
        length = next(t for t in lens_b if t >= todo[j - 1][0])
        for r in rows_b:
            c = best[max(0, j - r)] + call_cost(r, length)
            if best[j] is None or c < best[j]:
                best[j], choice[j] = c, r
    calls, j = [], len(todo)
    while j > 0:
        i = max(0, j - choice[j])
        group = todo[i:j]
        calls.append(PrefillCall(rows=tuple(r for _, r in group),
                                 num_rows=next(b for b in rows_b if b >= len(group)),
                                 length=next(t for t in lens_b if t >= group[-1][0])))
        j = i
    return calls[::-1]
