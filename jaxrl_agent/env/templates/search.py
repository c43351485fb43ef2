"""Binary-search templates: find, lower/upper bound, insertion point, first/last, isqrt (HOST).

Bound-update bugs such as `lo = mid` make the buggy code loop forever on some inputs; the
hidden tests include such inputs, the sandbox's per-test and wall timeouts catch them.
"""
from __future__ import annotations

import bisect
import math
import random

from jaxrl_agent.env.templates.base import Template, absent_value, sorted_distinct, sorted_dups

_LO = ("lo", "low", "left", "start", "begin")
_HI = ("hi", "high", "right", "end", "stop")
_MID = ("mid", "middle", "m", "center", "probe")
_ARR = ("arr", "nums", "values", "items", "data", "xs", "seq")
_TARGET = ("target", "key", "x", "needle", "value", "goal")
_RES = ("result", "found", "answer", "best", "pos")
_MODULES = ("search", "bsearch", "lookup", "finder", "bisection", "sorted_ops")


def _search_cases(rng: random.Random, dups: bool = False) -> list:
    """Present (middle, first, last), absent (inside, below, above), empty, one element."""
    gen = sorted_dups if dups else sorted_distinct
    cases = []
    for _ in range(3):
        xs = gen(rng, rng.randint(5, 9))
        cases.append(("typical", (xs, xs[len(xs) // 2 + rng.randint(-1, 1)])))
    xs = gen(rng, rng.randint(4, 8))
    cases += [("first", (xs, xs[0])), ("last", (xs, xs[-1])),
              ("absent", (xs, absent_value(rng, xs))), ("below", (xs, xs[0] - rng.randint(1, 5))),
              ("above", (xs, xs[-1] + rng.randint(1, 5))), ("empty", ([], rng.randint(0, 9)))]
    v = rng.randint(0, 9)
    cases += [("single", ([v], v)), ("single_absent", ([v], v + rng.choice([-1, 1])))]
    xs = gen(rng, 2)
    cases += [("pair_last", (xs, xs[1])), ("pair_first", (xs, xs[0]))]
    if dups:
        v = rng.randint(20, 30)
        xs = sorted(gen(rng, 4) + [v] * rng.randint(2, 4) + [v + 5, v + 9])
        cases += [("duplicates", (xs, v)), ("all_equal", ([v] * 5, v))]
    return cases


def _first(xs, t):
    return xs.index(t) if t in xs else -1


def _last(xs, t):
    return len(xs) - 1 - xs[::-1].index(t) if t in xs else -1


_HEADER = '''def {fn}({arr}, {target}):
    """{doc}"""
    {lo} = 0
'''

BSEARCH_FIND = Template(
    name="bsearch_find", family="binary_search",
    summary="returns the index of `{target}` in the sorted list `{arr}`, or -1 if absent",
    source=_HEADER + '''    {hi} = len({arr}) - 1
    while {lo} <= {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {arr}[{mid}] == {target}:
            return {mid}
        if {arr}[{mid}] < {target}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid} - 1
    return -1
''',
    names=dict(fn=("binary_search", "find_index", "search", "locate", "index_of"), arr=_ARR,
               target=_TARGET, lo=_LO, hi=_HI, mid=_MID),
    bugs=(("{lo} = {mid} + 1", ("{lo} = {mid}",)), ("{hi} = {mid} - 1", ("{hi} = {mid}",)),
          ("while {lo} <= {hi}:", ("while {lo} < {hi}:",)),
          ("{hi} = len({arr}) - 1", ("{hi} = len({arr}) - 2",))),
    oracle=_first, cases=_search_cases, modules=_MODULES,
    docs=("Return the index of target in the sorted list, or -1.",
          "Binary search over a sorted list; -1 when the value is missing.",
          "Locate a value in ascending data using binary search."))

LOWER_BOUND = Template(
    name="lower_bound", family="binary_search",
    summary="returns the first index i such that `{arr}[i] >= {target}` (len if none)",
    source=_HEADER + '''    {hi} = len({arr})
    while {lo} < {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {arr}[{mid}] < {target}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid}
    return {lo}
''',
    names=dict(fn=("lower_bound", "bisect_left", "first_not_less", "left_index"), arr=_ARR,
               target=_TARGET, lo=_LO, hi=_HI, mid=_MID),
    bugs=(("{arr}[{mid}] < {target}", ("{arr}[{mid}] <= {target}",)),
          ("{lo} = {mid} + 1", ("{lo} = {mid}",)),
          ("{hi} = len({arr})", ("{hi} = len({arr}) - 1",))),
    oracle=bisect.bisect_left, cases=lambda rng: _search_cases(rng, dups=True),
    modules=_MODULES,
    docs=("Leftmost insertion index for target in a sorted list.",
          "First position whose value is not less than target."))

UPPER_BOUND = Template(
    name="upper_bound", family="binary_search",
    summary="returns the first index i such that `{arr}[i] > {target}` (len if none)",
    source=_HEADER + '''    {hi} = len({arr})
    while {lo} < {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {arr}[{mid}] <= {target}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid}
    return {lo}
''',
    names=dict(fn=("upper_bound", "bisect_right", "first_greater", "right_index"), arr=_ARR,
               target=_TARGET, lo=_LO, hi=_HI, mid=_MID),
    bugs=(("{arr}[{mid}] <= {target}", ("{arr}[{mid}] < {target}",)),
          ("{lo} = {mid} + 1", ("{lo} = {mid}",)),
          ("{hi} = len({arr})", ("{hi} = len({arr}) - 1",))),
    oracle=bisect.bisect_right, cases=lambda rng: _search_cases(rng, dups=True),
    modules=_MODULES,
    docs=("Rightmost insertion index for target in a sorted list.",
          "First position whose value is greater than target."))

INSERTION_POINT = Template(
    name="insertion_point", family="binary_search",
    summary="returns where `{target}` should be inserted to keep the sorted list `{arr}` sorted"
            " (its index if present)",
    source=_HEADER + '''    {hi} = len({arr}) - 1
    while {lo} <= {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {arr}[{mid}] < {target}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid} - 1
    return {lo}
''',
    names=dict(fn=("insertion_point", "search_insert", "insert_position", "where_to_insert"),
               arr=_ARR, target=_TARGET, lo=_LO, hi=_HI, mid=_MID),
    bugs=(("{hi} = {mid} - 1", ("{hi} = {mid}",)),
          ("while {lo} <= {hi}:", ("while {lo} < {hi}:",)),
          ("{arr}[{mid}] < {target}", ("{arr}[{mid}] <= {target}",))),
    oracle=bisect.bisect_left, cases=_search_cases, modules=_MODULES,
    docs=("Index at which target would be inserted into the sorted list.",
          "Search-insert position in ascending data."))

_OCC = _HEADER + '''    {hi} = len({arr}) - 1
    {res} = -1
    while {lo} <= {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {arr}[{mid}] == {target}:
            {res} = {mid}
            {step}
        elif {arr}[{mid}] < {target}:
            {lo} = {mid} + 1
        else:
            {hi} = {mid} - 1
    return {res}
'''
_OCC_NAMES = dict(arr=_ARR, target=_TARGET, lo=_LO, hi=_HI, mid=_MID, res=_RES)

FIRST_OCCURRENCE = Template(
    name="first_occurrence", family="binary_search",
    summary="returns the index of the first occurrence of `{target}` in the sorted list"
            " `{arr}` (which may repeat values), or -1",
    source=_OCC.replace("{step}", "{hi} = {mid} - 1  # keep looking left"),
    names=dict(fn=("first_occurrence", "find_first", "leftmost_index", "first_index"),
               **_OCC_NAMES),
    bugs=(("{hi} = {mid} - 1  # keep looking left", ("{lo} = {mid} + 1  # keep looking left",)),
          ("{lo} = {mid} + 1\n", ("{lo} = {mid}\n",)),
          ("else:\n            {hi} = {mid} - 1", ("else:\n            {hi} = {mid}",))),
    oracle=_first, cases=lambda rng: _search_cases(rng, dups=True), modules=_MODULES,
    docs=("Leftmost index of target in a sorted list with duplicates, -1 if missing.",
          "Find where a run of equal values starts."))

LAST_OCCURRENCE = Template(
    name="last_occurrence", family="binary_search",
    summary="returns the index of the last occurrence of `{target}` in the sorted list"
            " `{arr}` (which may repeat values), or -1",
    source=_OCC.replace("{step}", "{lo} = {mid} + 1  # keep looking right"),
    names=dict(fn=("last_occurrence", "find_last", "rightmost_index", "last_index"),
               **_OCC_NAMES),
    bugs=(("{lo} = {mid} + 1  # keep looking right", ("{hi} = {mid} - 1  # keep looking right",)),
          ("{lo} = {mid} + 1\n", ("{lo} = {mid}\n",)),
          ("{hi} = len({arr}) - 1", ("{hi} = len({arr}) - 2",))),
    oracle=_last, cases=lambda rng: _search_cases(rng, dups=True), modules=_MODULES,
    docs=("Rightmost index of target in a sorted list with duplicates, -1 if missing.",
          "Find where a run of equal values ends."))


def _isqrt_cases(rng: random.Random) -> list:
    cases = [("typical", (rng.randint(10, 400),)) for _ in range(3)]
    k = rng.randint(2, 15)
    cases += [("square", (k * k,)), ("below_square", (k * k - 1,)), ("zero", (0,)),
              ("one", (1,)), ("two", (2,)), ("three", (3,)), ("large", (rng.randint(10**5, 10**6),))]
    return cases


ISQRT_FLOOR = Template(
    name="isqrt_floor", family="binary_search",
    summary="returns the largest integer r with r * r <= `{n}` (for `{n}` >= 0)",
    source='''def {fn}({n}):
    """{doc}"""
    {lo} = 0
    {hi} = {n}
    {res} = 0
    while {lo} <= {hi}:
        {mid} = ({lo} + {hi}) // 2
        if {mid} * {mid} <= {n}:
            {res} = {mid}
            {lo} = {mid} + 1
        else:
            {hi} = {mid} - 1
    return {res}
''',
    names=dict(fn=("isqrt", "int_sqrt", "floor_sqrt", "integer_root"), n=("n", "num", "value", "x"),
               lo=_LO, hi=_HI, mid=_MID, res=_RES),
    bugs=(("{mid} * {mid} <= {n}", ("{mid} * {mid} < {n}",)),
          ("{lo} = {mid} + 1", ("{lo} = {mid}",)),
          ("{hi} = {n}\n", ("{hi} = {n} // 2\n",))),
    oracle=math.isqrt, cases=_isqrt_cases, modules=("mathutil", "roots", "numeric", "intmath"),
    docs=("Integer square root by binary search.", "Floor of the square root of {n}."))

TEMPLATES = [BSEARCH_FIND, LOWER_BOUND, UPPER_BOUND, INSERTION_POINT, FIRST_OCCURRENCE,
             LAST_OCCURRENCE, ISQRT_FLOOR]
