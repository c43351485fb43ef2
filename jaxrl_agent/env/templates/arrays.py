"""Array templates: ranges, windows, two pointers, partition, clamp, merge, rotate, chunk (HOST).

Bugs are the boundary kinds that survive casual testing: off by one in a range or slice end,
a strict comparison where an inclusive one is meant, a wrong pointer or index update.
"""
from __future__ import annotations

from jaxrl_agent.env.templates.base import Template, ints

_XS = ("xs", "nums", "values", "items", "data", "arr", "seq")
_I = ("i", "idx", "pos", "k", "j")
_OUT = ("out", "result", "res", "acc", "parts")
_MODULES = ("arrays", "listops", "seqtools", "ranges", "utils", "helpers")


def _typical(rng, make, n=3):
    return [("typical", make()) for _ in range(n)]


# ---- prefix sums ----


def _range_sum_cases(rng):
    def make():
        xs = ints(rng, rng.randint(5, 9))
        i = rng.randint(1, len(xs) - 3)
        return (xs, i, rng.randint(i + 1, len(xs) - 2))
    xs = ints(rng, rng.randint(4, 8))
    n = len(xs)
    return _typical(rng, make) + [
        ("whole", (xs, 0, n - 1)), ("first_only", (xs, 0, 0)), ("last_only", (xs, n - 1, n - 1)),
        ("to_end", (xs, rng.randint(1, n - 2), n - 1)), ("from_start", (xs, 0, rng.randint(1, n - 2))),
        ("single", ([rng.randint(1, 9)], 0, 0))]


RANGE_SUM = Template(
    name="range_sum", family="ranges",
    summary="returns the sum of `{xs}[{a}]` through `{xs}[{b}]`, both ends included",
    source='''def {fn}({xs}, {a}, {b}):
    """{doc}"""
    {pre} = [0]
    for {v} in {xs}:
        {pre}.append({pre}[-1] + {v})
    return {pre}[{b} + 1] - {pre}[{a}]
''',
    names=dict(fn=("range_sum", "sum_between", "interval_sum", "segment_total"), xs=_XS,
               a=("i", "lo", "start", "first"), b=("j", "hi", "stop", "last"),
               pre=("prefix", "acc", "cum", "running"), v=("v", "val", "item", "num")),
    bugs=(("{pre}[{b} + 1]", ("{pre}[{b}]",)), ("- {pre}[{a}]", ("- {pre}[{a} + 1]",)),
          ("{pre} = [0]", ("{pre} = [{xs}[0]]",))),
    oracle=lambda xs, a, b: sum(xs[a:b + 1]), cases=_range_sum_cases, modules=_MODULES,
    docs=("Inclusive range sum via prefix sums.", "Sum of a contiguous slice, ends included."))


def _count_between_cases(rng):
    xs = ints(rng, 10, 0, 20)
    lo, hi = sorted(rng.sample(xs, 2))
    hi = hi if hi > lo else lo + 3
    return _typical(rng, lambda: (ints(rng, rng.randint(5, 9), 0, 20), 5, 14)) + [
        ("edges", (xs + [lo, hi], lo, hi)), ("only_lo", ([lo, lo, hi + 1], lo, hi)),
        ("only_hi", ([hi, lo - 1], lo, hi)), ("empty", ([], 0, 5)), ("point", ([3, 3, 4], 3, 3))]


COUNT_BETWEEN = Template(
    name="count_between", family="ranges",
    summary="counts the values v of `{xs}` with `{lo} <= v <= {hi}` (both bounds included)",
    source='''def {fn}({xs}, {lo}, {hi}):
    """{doc}"""
    {n} = 0
    for {v} in {xs}:
        if {v} >= {lo} and {v} <= {hi}:
            {n} += 1
    return {n}
''',
    names=dict(fn=("count_between", "count_in_range", "num_within", "tally_range"), xs=_XS,
               lo=("lo", "low", "lower", "floor"), hi=("hi", "high", "upper", "ceiling"),
               n=("count", "total", "n", "hits"), v=("v", "val", "item", "num")),
    bugs=(("{v} >= {lo}", ("{v} > {lo}",)), ("{v} <= {hi}", ("{v} < {hi}",))),
    oracle=lambda xs, lo, hi: sum(1 for v in xs if lo <= v <= hi), cases=_count_between_cases,
    modules=_MODULES, docs=("Count values inside a closed interval.",))


# ---- windows ----


def _window_cases(rng):
    def make():
        xs = ints(rng, rng.randint(6, 10))
        return (xs, rng.randint(2, 4))
    xs = ints(rng, rng.randint(5, 8))
    best_last = [1, 2, 1, 2, 30, 40]
    return _typical(rng, make) + [
        ("k_equals_len", (xs, len(xs))), ("k_one", (xs, 1)), ("best_at_end", (best_last, 2)),
        ("best_at_start", ([50, 40] + ints(rng, 4, 0, 5), 2))]


MAX_WINDOW_SUM = Template(
    name="max_window_sum", family="windows",
    summary="returns the largest sum of `{k}` consecutive values of `{xs}` (1 <= `{k}` <= len)",
    source='''def {fn}({xs}, {k}):
    """{doc}"""
    {cur} = sum({xs}[:{k}])
    {best} = {cur}
    for {i} in range({k}, len({xs})):
        {cur} += {xs}[{i}] - {xs}[{i} - {k}]
        {best} = max({best}, {cur})
    return {best}
''',
    names=dict(fn=("max_window_sum", "best_window", "max_run_total", "window_max"), xs=_XS,
               k=("k", "width", "size", "w"), cur=("cur", "window", "running", "total"),
               best=("best", "top", "max_sum", "peak"), i=_I),
    bugs=(("range({k}, len({xs}))", ("range({k}, len({xs}) - 1)",)),
          ("{xs}[{i} - {k}]", ("{xs}[{i} - {k} + 1]",)),
          ("sum({xs}[:{k}])", ("sum({xs}[:{k} - 1])",))),
    oracle=lambda xs, k: max(sum(xs[i:i + k]) for i in range(len(xs) - k + 1)),
    cases=_window_cases, modules=_MODULES,
    docs=("Maximum sum over all windows of size {k}.", "Sliding-window maximum total."))

WINDOW_SUMS = Template(
    name="window_sums", family="windows",
    summary="returns the list of sums of every window of `{k}` consecutive values of `{xs}`",
    source='''def {fn}({xs}, {k}):
    """{doc}"""
    {out} = []
    for {i} in range(len({xs}) - {k} + 1):
        {out}.append(sum({xs}[{i}:{i} + {k}]))
    return {out}
''',
    names=dict(fn=("window_sums", "rolling_sums", "sliding_totals", "block_sums"), xs=_XS,
               k=("k", "width", "size", "w"), out=_OUT, i=_I),
    bugs=(("len({xs}) - {k} + 1", ("len({xs}) - {k}",)), ("{i} + {k}]", ("{i} + {k} - 1]",))),
    oracle=lambda xs, k: [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)],
    cases=_window_cases, modules=_MODULES, docs=("Sums of all length-{k} windows.",))


# ---- two pointers, merge ----


def _pair_cases(rng):
    def make():
        xs = sorted(rng.sample(range(0, 60), rng.randint(6, 9)))
        i, j = sorted(rng.sample(range(len(xs)), 2))
        return (xs, xs[i] + xs[j])
    xs = sorted(rng.sample(range(1, 40), 7))
    return _typical(rng, make) + [
        ("ends", (xs, xs[0] + xs[-1])), ("last_two", (xs, xs[-2] + xs[-1])),
        ("first_two", (xs, xs[0] + xs[1])), ("none", ([1, 3, 5, 7], 100)),
        ("self_pair", ([2, 5, 9], 10)), ("empty", ([], 4)), ("single", ([5], 10))]


def _pair_oracle(xs, t):
    i, j = 0, len(xs) - 1
    while i < j:  # the reference answer is the pair the two-pointer scan meets first
        s = xs[i] + xs[j]
        if s == t:
            return [i, j]
        i, j = (i + 1, j) if s < t else (i, j - 1)
    return None


PAIR_WITH_SUM = Template(
    name="pair_with_sum", family="two_pointers",
    summary="returns indices [i, j] with i < j and `{xs}[i] + {xs}[j] == {t}` in the sorted list"
            " of distinct values `{xs}` (scanning from both ends), or None",
    source='''def {fn}({xs}, {t}):
    """{doc}"""
    {i} = 0
    {j} = len({xs}) - 1
    while {i} < {j}:
        {s} = {xs}[{i}] + {xs}[{j}]
        if {s} == {t}:
            return [{i}, {j}]
        if {s} < {t}:
            {i} += 1
        else:
            {j} -= 1
    return None
''',
    names=dict(fn=("pair_with_sum", "two_sum_sorted", "find_pair", "pair_indices"), xs=_XS,
               t=("target", "total", "goal", "want"), i=("i", "left", "lo", "a"),
               j=("j", "right", "hi", "b"), s=("s", "pair_sum", "current", "both")),
    bugs=(("while {i} < {j}:", ("while {i} <= {j}:",)),
          ("{j} = len({xs}) - 1", ("{j} = len({xs}) - 2",)), ("if {s} < {t}:", ("if {s} > {t}:",))),
    oracle=_pair_oracle, cases=_pair_cases, modules=_MODULES,
    docs=("Two-pointer search for a pair with the given sum.",))


def _merge_cases(rng):
    def make():
        return (sorted(ints(rng, rng.randint(3, 6))), sorted(ints(rng, rng.randint(3, 6))))
    a = sorted(ints(rng, 4))
    return _typical(rng, make) + [
        ("a_empty", ([], a)), ("b_empty", (a, [])), ("a_tail", ([50, 60, 70], [1, 2])),
        ("b_tail", ([1, 2], [50, 60, 70])), ("equal", ([3, 3], [3]))]


MERGE_SORTED = Template(
    name="merge_sorted", family="merging",
    summary="merges the sorted lists `{a}` and `{b}` into one sorted list",
    source='''def {fn}({a}, {b}):
    """{doc}"""
    {out} = []
    {i} = {j} = 0
    while {i} < len({a}) and {j} < len({b}):
        if {a}[{i}] <= {b}[{j}]:
            {out}.append({a}[{i}])
            {i} += 1
        else:
            {out}.append({b}[{j}])
            {j} += 1
    {out}.extend({a}[{i}:])
    {out}.extend({b}[{j}:])
    return {out}
''',
    names=dict(fn=("merge_sorted", "merge", "merge_lists", "combine_sorted"),
               a=("a", "left", "first", "xs"), b=("b", "right", "second", "ys"), out=_OUT,
               i=("i", "p", "ia"), j=("j", "q", "ib")),
    bugs=(("{a}[{i}:]", ("{a}[{i} + 1:]",)), ("{b}[{j}:]", ("{b}[{j} + 1:]",)),
          ("{i} < len({a}) and", ("{i} < len({a}) - 1 and",))),
    oracle=lambda a, b: sorted(a + b), cases=_merge_cases, modules=_MODULES,
    docs=("Merge step of merge sort.", "Combine two ascending lists."))


# ---- partition, clamp, rotate, chunk, select ----


def _partition_cases(rng):
    def make():
        xs = ints(rng, rng.randint(5, 9), 0, 20)
        return (xs, rng.choice(xs))
    return _typical(rng, make) + [
        ("pivot_first", ([7, 1, 9, 3], 7)), ("pivot_last", ([4, 8, 2, 6], 6)),
        ("all_small", ([1, 2, 3], 10)), ("all_big", ([5, 6], 1)), ("empty", ([], 3))]


PARTITION = Template(
    name="partition", family="partitioning",
    summary="returns a new list with the values of `{xs}` smaller than `{p}` first, then the"
            " others, each group in its original order",
    source='''def {fn}({xs}, {p}):
    """{doc}"""
    {out} = []
    for {i} in range(len({xs})):
        if {xs}[{i}] < {p}:
            {out}.append({xs}[{i}])
    for {i} in range(0, len({xs})):
        if {xs}[{i}] >= {p}:
            {out}.append({xs}[{i}])
    return {out}
''',
    names=dict(fn=("partition", "stable_partition", "split_by_pivot", "pivot_order"), xs=_XS,
               p=("pivot", "p", "split", "bound"), out=_OUT, i=_I),
    bugs=(("if {xs}[{i}] < {p}:", ("if {xs}[{i}] <= {p}:",)),
          ("range(0, len({xs}))", ("range(0, len({xs}) - 1)",)),
          ("for {i} in range(len({xs})):", ("for {i} in range(1, len({xs})):",))),
    oracle=lambda xs, p: [v for v in xs if v < p] + [v for v in xs if v >= p],
    cases=_partition_cases, modules=_MODULES, docs=("Stable partition around a pivot value.",))


def _clamp_cases(rng):
    n = rng.randint(5, 12)
    return _typical(rng, lambda: (rng.randint(1, n - 2), n)) + [
        ("at_n", (n, n)), ("above", (n + rng.randint(1, 9), n)), ("last", (n - 1, n)),
        ("negative", (-rng.randint(1, 9), n)), ("zero", (0, n)), ("n_one", (3, 1))]


CLAMP_INDEX = Template(
    name="clamp_index", family="clamping",
    summary="clamps the index `{i}` into the valid range 0 .. `{n}` - 1 of a sequence of"
            " length `{n}` (`{n}` >= 1)",
    source='''def {fn}({i}, {n}):
    """{doc}"""
    if {i} < 0:
        return 0
    if {i} >= {n}:
        return {n} - 1
    return {i}
''',
    names=dict(fn=("clamp_index", "clip_index", "bound_index", "safe_index"), i=_I,
               n=("n", "length", "size", "count")),
    bugs=(("if {i} >= {n}:", ("if {i} > {n}:",)), ("return {n} - 1", ("return {n}",)),
          ("if {i} < 0:", ("if {i} < -1:",))),
    oracle=lambda i, n: min(max(i, 0), n - 1), cases=_clamp_cases,
    modules=("indexing", "bounds", "utils", "clamp"), docs=("Clamp an index into range.",))


def _rotate_cases(rng):
    def make():
        xs = ints(rng, rng.randint(4, 8))
        return (xs, rng.randint(1, len(xs) - 1))
    xs = ints(rng, 5)
    return _typical(rng, make) + [
        ("zero", (xs, 0)), ("full_turn", (xs, 5)), ("more_than_len", (xs, 7)),
        ("empty", ([], 3)), ("single", ([4], 2)), ("by_one", ([1, 2, 3, 4], 1))]


ROTATE_LEFT = Template(
    name="rotate_left", family="rotating",
    summary="returns `{xs}` rotated left by `{k}` positions (`{k}` >= 0 may exceed the length)",
    source='''def {fn}({xs}, {k}):
    """{doc}"""
    if not {xs}:
        return []
    {k} = {k} % len({xs})
    return {xs}[{k}:] + {xs}[:{k}]
''',
    names=dict(fn=("rotate_left", "rotate", "shift_left", "cycle"), xs=_XS,
               k=("k", "shift", "steps", "n")),
    bugs=(("{xs}[:{k}]", ("{xs}[:{k} - 1]",)), ("{k} % len({xs})", ("{k} % (len({xs}) - 1)",)),
          ("{xs}[{k}:]", ("{xs}[{k} + 1:]",))),
    oracle=lambda xs, k: xs[k % len(xs):] + xs[:k % len(xs)] if xs else [],
    cases=_rotate_cases, modules=_MODULES, docs=("Rotate a list to the left.",))


def _chunk_cases(rng):
    def make():
        return (ints(rng, rng.randint(5, 11)), rng.randint(2, 4))
    return _typical(rng, make) + [
        ("exact", ([1, 2, 3, 4, 5, 6], 3)), ("remainder_one", ([1, 2, 3, 4, 5], 2)),
        ("size_one", ([7, 8, 9], 1)), ("bigger_than_len", ([1, 2], 5)), ("empty", ([], 3))]


CHUNK = Template(
    name="chunk", family="chunking",
    summary="splits `{xs}` into consecutive pieces of `{size}` values (the last may be shorter)",
    source='''def {fn}({xs}, {size}):
    """{doc}"""
    {out} = []
    for {i} in range(0, len({xs}), {size}):
        {out}.append({xs}[{i}:{i} + {size}])
    return {out}
''',
    names=dict(fn=("chunk", "chunks", "batched", "split_every"), xs=_XS,
               size=("size", "n", "width", "step"), out=_OUT, i=_I),
    bugs=(("{i} + {size}]", ("{i} + {size} - 1]",)),
          ("range(0, len({xs}), {size})", ("range(0, len({xs}) - 1, {size})",))),
    oracle=lambda xs, size: [xs[i:i + size] for i in range(0, len(xs), size)],
    cases=_chunk_cases, modules=_MODULES, docs=("Split {xs} into chunks of {size} values.",))


def _kth_cases(rng):
    def make():
        xs = ints(rng, rng.randint(5, 9))
        return (xs, rng.randint(2, len(xs) - 1))
    xs = ints(rng, 6)
    return _typical(rng, make) + [("k_one", (xs, 1)), ("k_len", (xs, len(xs))),
                                  ("dups", ([3, 1, 3, 2], 3)), ("single", ([9], 1))]


KTH_SMALLEST = Template(
    name="kth_smallest", family="selection",
    summary="returns the `{k}`-th smallest value of `{xs}`, counting from 1",
    source='''def {fn}({xs}, {k}):
    """{doc}"""
    {s} = sorted({xs})
    return {s}[{k} - 1]
''',
    names=dict(fn=("kth_smallest", "select_kth", "nth_lowest", "order_stat"), xs=_XS,
               k=("k", "rank", "n", "nth"), s=("ordered", "s", "srt", "ranked")),
    bugs=(("{s}[{k} - 1]", ("{s}[{k}]", "{s}[-{k}]")),),
    oracle=lambda xs, k: sorted(xs)[k - 1], cases=_kth_cases, modules=_MODULES,
    docs=("k-th order statistic (1-based).",))

TEMPLATES = [RANGE_SUM, COUNT_BETWEEN, MAX_WINDOW_SUM, WINDOW_SUMS, PAIR_WITH_SUM, MERGE_SORTED,
             PARTITION, CLAMP_INDEX, ROTATE_LEFT, CHUNK, KTH_SMALLEST]
