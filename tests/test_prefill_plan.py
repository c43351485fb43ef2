"""Tests for sampling/prefill_plan.py: a flush's rows split into prefill calls of the least
estimated cost, checked against every partition of the rows (brute force)."""

import numpy as np
import pytest

from jaxrl_agent.sampling.prefill_plan import call_cost, plan_prefill

ROWS = (1, 4, 16)
LENGTHS = (64, 128, 256, 512, 1024)


def _partitions(items):
    """Every set partition of `items` (a list)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def _bucket(n, buckets):
    return next(b for b in buckets if b >= n)


def _cost(groups, lens, rows=ROWS, lengths=LENGTHS):
    return sum(call_cost(_bucket(len(g), rows), _bucket(max(lens[b] for b in g), lengths)) for g in groups)


def _check_plan(plan, lens, rows=ROWS, lengths=LENGTHS):
    """Every row with text in exactly one call; each call's shape is a bucket that holds it."""
    seen = sorted(b for call in plan for b in call.rows)
    assert seen == sorted(b for b, n in lens.items() if n > 0)
    for call in plan:
        assert call.num_rows in rows and call.length in lengths
        assert len(call.rows) <= call.num_rows
        assert max(lens[b] for b in call.rows) <= call.length


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_the_cheapest_partition(seed):
    """For up to 7 rows of random lengths, the plan costs what the best of every partition
    of the rows costs (the plan searches contiguous runs of the rows sorted by length only)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    lens = {int(b): int(rng.choice([rng.integers(1, 70), rng.integers(60, 300), rng.integers(250, 1025)]))
            for b in rng.choice(16, n, replace=False)}
    plan = plan_prefill(lens, ROWS, LENGTHS)
    _check_plan(plan, lens)
    best = min(_cost(p, lens) for p in _partitions(list(lens)))
    assert sum(call_cost(c.num_rows, c.length) for c in plan) == best


def test_one_call_per_length_bucket_is_not_always_the_plan():
    """Two short rows and one of 100 tokens: one call of 4 rows x 128 beats a call of 4 x 64
    plus one of 1 x 128 (the shapes `flush` used to make: one call per length bucket); a lone
    row takes a one-row call, not four rows of which three are padding."""
    lens = {3: 20, 7: 30, 9: 100}
    plan = plan_prefill(lens, ROWS, LENGTHS)
    by_bucket = [[3, 7], [9]]
    assert sum(call_cost(c.num_rows, c.length) for c in plan) < _cost(by_bucket, lens)
    assert [(c.num_rows, c.length) for c in plan_prefill({5: 40}, ROWS, LENGTHS)] == [(1, 64)]
    assert plan_prefill({}, ROWS, LENGTHS) == [] and plan_prefill({2: 0}, ROWS, LENGTHS) == []


def test_sixteen_rows_and_every_bucket():
    """A full flush (16 rows, lengths across all buckets) is planned fast and validly, with
    rows ordered by length inside each call."""
    lens = {b: n for b, n in enumerate([5, 900, 64, 65, 128, 129, 256, 257, 511, 512, 513, 1024, 1, 2, 30, 700])}
    plan = plan_prefill(lens, ROWS, LENGTHS)
    _check_plan(plan, lens)
    for c in plan:
        assert [lens[b] for b in c.rows] == sorted(lens[b] for b in c.rows)
    assert sum(call_cost(c.num_rows, c.length) for c in plan) <= _cost([[b] for b in lens], lens)


def test_a_row_longer_than_every_bucket_is_an_error():
    with pytest.raises(ValueError, match=r"row 4 stages 2000 tokens.*largest prefill bucket 1024"):
        plan_prefill({4: 2000}, ROWS, LENGTHS)
    # one-row calls only: each row its own call
    assert sorted(c.rows for c in plan_prefill({0: 3, 1: 300}, (1,), LENGTHS)) == [(0,), (1,)]
