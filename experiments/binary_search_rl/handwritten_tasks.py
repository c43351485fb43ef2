"""Hand-written tasks outside the generator, for the shipped policies' generalisation check (HOST).

Eight bug-fix tasks like the generated family's (a short file, 1-2 boundary bugs: off by one,
a wrong comparison, `low = mid`) with what the generator never makes: other file and function
names, packages, a class method, two functions in a file, tests under `tests/`, a user's
wording. Hidden tests use calls with plain data only (README "Bring your own tasks").
`python -m experiments.binary_search_rl.handwritten_tasks [out.jsonl]` writes them (default:
the shipped jsonl, which `tests/test_handwritten_tasks.py` keeps current). Two variants split
a failure on them into its causes: `--generator-wording` (the same code, the generator's
instruction sentence) and `--made-up-modules=N` / `--word-modules=N` / `--pool-modules=N`
(validation instances of the generator's own templates, paired, differing only in the file's
name).
"""
from __future__ import annotations

import sys
from dataclasses import replace

from jaxrl_agent.env.tasks import Task, _bug_record, save_tasks

DEFAULT_PATH = "experiments/binary_search_rl/handwritten_tasks.jsonl"


def _tests(header: str, checks: list[tuple[str, str]]) -> str:
    """A pytest file: `header` (imports), then one test per (name, body)."""
    return header + "\n" + "".join(f"\n\ndef test_{n}():\n    {b}\n" for n, b in checks)


def _task(short: str, family: str, path: str, sources, bugs: list[tuple[str, str]], header: str,
          checks: str, dev: str, instruction: str, fn: str, test_dir: str = "", **extra) -> Task:
    """`sources`: fixed text of `path` (or all fixed files); `bugs`: (correct, buggy) snippets put
    into `path`; `checks`: hidden tests, "name: body" a line; `dev`: the names the workspace gets."""
    files = {path: sources} if isinstance(sources, str) else dict(sources)
    reference = buggy = files[path]
    for correct, wrong in bugs:
        if reference.count(correct) != 1:
            raise ValueError(f"{short}: bug site {correct!r} must occur once")
        buggy = buggy.replace(correct, wrong)
    cases = [tuple(p.strip() for p in line.split(": ", 1)) for line in checks.strip().splitlines()]
    stem = f"{test_dir}test_{short.replace('-', '_')}"
    return Task(
        task_id=f"hw-{short}", instruction=instruction, files={**files, path: buggy},
        dev_tests={f"{stem}.py": _tests(header, [c for c in cases if c[0] in dev.split()])},
        hidden_tests={f"{stem}_hidden.py": _tests(header, cases)}, reference_files=files,
        metadata=dict(template=f"handwritten-{short}", family=family, split="handwritten", seed=0,
                      module=path[:-3].replace("/", "."), fn=fn, source_file=path,
                      n_bugs=len(bugs), bugs=[_bug_record(reference, reference.replace(c, w)) for c, w in bugs],
                      **extra))


SEARCH_UTILS = '''"""Small helpers for looking things up in sorted data."""


def position_of(sorted_ids, wanted):
    """Index of `wanted` in the ascending list `sorted_ids`, or -1 when it is missing."""
    lo, hi = 0, len(sorted_ids) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if sorted_ids[mid] == wanted:
            return mid
        if sorted_ids[mid] < wanted:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def contains(sorted_ids, wanted):
    """True when `wanted` occurs in `sorted_ids`."""
    return position_of(sorted_ids, wanted) != -1
'''

BISECT_TOOLS = '''def first_at_least(values, threshold):
    """First index i of the sorted `values` with values[i] >= threshold, else len(values)."""
    start, stop = 0, len(values)
    while start < stop:
        probe = (start + stop) // 2
        if values[probe] < threshold:
            start = probe + 1
        else:
            stop = probe
    return start
'''

PRICE_BOOK = '''class PriceBook:
    """Prices kept sorted, to answer "how many items cost at most this much?"."""

    def __init__(self, prices):
        self.prices = sorted(prices)

    def add(self, price):
        self.prices.append(price)
        self.prices.sort()

    def count_up_to(self, limit):
        """How many prices are <= limit."""
        lo, hi = 0, len(self.prices)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.prices[mid] <= limit:
                lo = mid + 1
            else:
                hi = mid
        return lo
'''

TIMELINE = '''def slot_for(starts, moment):
    """Index of the last start time <= moment in the sorted `starts`; -1 if there is none."""
    left, right = 0, len(starts) - 1
    answer = -1
    while left <= right:
        half = (left + right) // 2
        if starts[half] <= moment:
            answer = half
            left = half + 1
        else:
            right = half - 1
    return answer
'''

PAGINATION = '''"""Splitting a long list into numbered pages (page numbers start at 1)."""


def page_count(n_items, per_page):
    """How many pages `n_items` items fill, `per_page` to a page (the last may be short)."""
    return (n_items + per_page - 1) // per_page


def page_items(items, page, per_page):
    """The items shown on page `page`; [] for a page below 1 or past the end."""
    if page < 1 or page > page_count(len(items), per_page):
        return []
    start = (page - 1) * per_page
    return items[start:start + per_page]
'''

STAIRCASE = '''def full_rows(coins):
    """Complete rows of a staircase of `coins` coins (row k holds k coins), coins >= 0."""
    low, high = 0, coins
    best = 0
    while low <= high:
        k = (low + high) // 2
        if k * (k + 1) // 2 <= coins:
            best = k
            low = k + 1
        else:
            high = k - 1
    return best
'''

PLAYLIST = '''"""A playlist that loops."""


def upcoming(tracks, current, count):
    """The `count` tracks played after index `current`, wrapping round (tracks not empty)."""
    queue = []
    for step in range(1, count + 1):
        queue.append(tracks[(current + step) % len(tracks)])
    return queue
'''

BUDGET = '''def affordable_pairs(prices, budget):
    """How many pairs of different items (by position) cost at most `budget` together."""
    ordered = sorted(prices)
    i, j = 0, len(ordered) - 1
    pairs = 0
    while i < j:
        if ordered[i] + ordered[j] <= budget:
            pairs += j - i
            i += 1
        else:
            j -= 1
    return pairs
'''


def handwritten_tasks() -> list[Task]:
    """The eight hand-written tasks (deterministic; the shipped jsonl is this list)."""
    xs, book, starts = "[2, 4, 6, 8, 10]", "book = PriceBook([30, 10, 20]); assert book", "[0, 60, 120, 180]"
    return [
        _task("search-utils", "binary_search", "search_utils.py", SEARCH_UTILS,
              [("while lo <= hi:", "while lo < hi:"), ("lo = mid + 1", "lo = mid")],
              "from search_utils import contains, position_of", f"""
              middle: assert position_of({xs}, 6) == 2
              ends: assert position_of({xs}, 2) == 0 and position_of({xs}, 10) == 4
              absent_inside: assert position_of({xs}, 7) == -1
              outside: assert position_of({xs}, 1) == -1 and position_of({xs}, 11) == -1
              empty: assert position_of([], 3) == -1
              single: assert position_of([4], 4) == 0
              negatives: assert position_of([-7, -3, 0, 12], -3) == 1
              contains: assert contains([1, 5, 9], 9) is True and contains([1, 5, 9], 4) is False""", "middle single",
              "Lookups in search_utils.py misbehave: `position_of(sorted_ids, wanted)` should give the index of "
              "`wanted` in the sorted list or -1, but some come back wrong or never return. Please fix it.",
              "position_of"),
        _task("bisect-tools", "binary_search", "toolkit/bisect_tools.py",
              {"toolkit/__init__.py": '"""Helpers for sorted lists."""\n',
               "toolkit/bisect_tools.py": BISECT_TOOLS},
              [("values[probe] < threshold", "values[probe] <= threshold")],
              "from toolkit.bisect_tools import first_at_least", """
              gap: assert first_at_least([1, 3, 5, 7], 4) == 2
              repeats: assert first_at_least([1, 3, 3, 3, 9], 3) == 1
              exact_last: assert first_at_least([1, 3, 5, 7], 7) == 3
              outside: assert first_at_least([1, 3, 5, 7], 0) == 0 and first_at_least([1, 3], 8) == 2
              empty: assert first_at_least([], 5) == 0
              all_equal: assert first_at_least([2, 2, 2, 2], 2) == 0
              negatives: assert first_at_least([-5, -1, 0, 0, 4], 0) == 2""", "gap repeats",
              "In the toolkit package, `first_at_least(values, threshold)` must return the first index whose "
              "value is >= threshold, or len(values). It is wrong on repeated values. Tests are in tests/.",
              "first_at_least", test_dir="tests/"),
        _task("price-book", "binary_search", "price_book.py", PRICE_BOOK,
              [("lo, hi = 0, len(self.prices)", "lo, hi = 0, len(self.prices) - 1"),
               ("self.prices[mid] <= limit", "self.prices[mid] < limit")],
              "from price_book import PriceBook", f"""
              between: {book}.count_up_to(15) == 1
              equal: {book}.count_up_to(20) == 2
              above_all: {book}.count_up_to(100) == 3
              below_all: {book}.count_up_to(5) == 0
              empty: assert PriceBook([]).count_up_to(7) == 0
              ties: assert PriceBook([8, 1, 3, 3]).count_up_to(3) == 3
              after_add: book = PriceBook([5]); book.add(2); book.add(9); assert book.count_up_to(5) == 2
              sorted_prices: assert PriceBook([8, 1, 3]).prices == [1, 3, 8]""", "between ties",
              "PriceBook.count_up_to(limit) in price_book.py should say how many prices are at most `limit`, "
              "but the counts are off, mostly when a price equals the limit.", "count_up_to", cls="PriceBook"),
        _task("pkg", "binary_search", "pkg/timeline.py",
              {"pkg/__init__.py": '"""Scheduling helpers."""\nfrom .timeline import slot_for\n',
               "pkg/timeline.py": TIMELINE},
              [("if starts[half] <= moment:", "if starts[half] < moment:"),
               ("left, right = 0, len(starts) - 1", "left, right = 0, len(starts)")],
              "from pkg import slot_for", f"""
              inside: assert slot_for({starts}, 90) == 1
              at_start: assert slot_for({starts}, 60) == 1
              at_first: assert slot_for({starts}, 0) == 0
              at_last: assert slot_for({starts}, 180) == 3
              after_last: assert slot_for({starts}, 500) == 3
              before_first: assert slot_for({starts}, -5) == -1
              empty: assert slot_for([], 10) == -1
              one: assert slot_for([30], 30) == 0 and slot_for([30], 29) == -1""", "inside at_start",
              "pkg.slot_for(starts, moment) gives the slot running at `moment`: the index of the last start "
              "<= moment, or -1. It breaks when moment is exactly a start or after the last one.",
              "slot_for"),
        _task("pagination", "ranges", "pagination.py", PAGINATION,
              [("(n_items + per_page - 1) // per_page", "n_items // per_page"),
               ("items[start:start + per_page]", "items[start:start + per_page - 1]")],
              "from pagination import page_count, page_items", """
              count: assert page_count(10, 4) == 3 and page_count(8, 4) == 2 and page_count(9, 3) == 3
              count_small: assert page_count(0, 5) == 0 and page_count(1, 5) == 1
              first_page: assert page_items(["a", "b", "c", "d", "e"], 1, 2) == ["a", "b"]
              middle_page: assert page_items(list(range(1, 11)), 2, 4) == [5, 6, 7, 8]
              last_partial: assert page_items(list(range(1, 11)), 3, 4) == [9, 10]
              outside: assert page_items(list(range(1, 11)), 4, 4) == [] == page_items([1, 2], 0, 2)
              short_list: assert page_items(["x"], 1, 3) == ["x"]
              empty: assert page_items([], 1, 3) == []""", "first_page",
              "pagination.py splits a list into pages numbered from 1. Pages come out one item short and a "
              "last page that is not full goes missing. Fix it.", "page_items", fns=["page_count", "page_items"]),
        _task("staircase", "binary_search", "staircase.py", STAIRCASE,
              [("low, high = 0, coins", "low, high = 0, coins // 2"),
               ("k * (k + 1) // 2 <= coins", "k * (k + 1) // 2 < coins")],
              "from staircase import full_rows", """
              small: assert [full_rows(c) for c in (0, 1, 2, 3, 5)] == [0, 1, 1, 2, 2]
              triangle: assert full_rows(6) == 3
              eight: assert full_rows(8) == 3
              ten: assert full_rows(10) == 4
              hundred: assert full_rows(100) == 13
              million: assert full_rows(1000000) == 1413""", "eight ten",
              "full_rows(coins) in staircase.py should return how many complete rows of a staircase (row k "
              "takes k coins) `coins` coins build. It is wrong for some amounts; make it right for all.", "full_rows"),
        _task("playlist", "rotating", "playlist.py", PLAYLIST,
              [("range(1, count + 1)", "range(1, count)"), ("% len(tracks)", "% (len(tracks) - 1)")],
              "from playlist import upcoming", """
              next_two: assert upcoming(["a", "b", "c", "d"], 1, 2) == ["c", "d"]
              wrap: assert upcoming(["a", "b", "c", "d"], 3, 1) == ["a"]
              full_circle: assert upcoming(["a", "b", "c", "d"], 2, 4) == ["d", "a", "b", "c"]
              none: assert upcoming(["a", "b", "c"], 0, 0) == []
              single_track: assert upcoming(["solo"], 0, 3) == ["solo", "solo", "solo"]
              repeats: assert upcoming(["x", "y"], 1, 5) == ["x", "y", "x", "y", "x"]""", "next_two none",
              "`upcoming(tracks, current, count)` in playlist.py should list the next `count` tracks after "
              "position `current`, looping back to the first track. The queue is wrong; please fix it.", "upcoming"),
        _task("budget", "two_pointers", "budget.py", BUDGET,
              [("ordered[i] + ordered[j] <= budget", "ordered[i] + ordered[j] < budget"),
               ("pairs += j - i", "pairs += j - i - 1")],
              "from budget import affordable_pairs", """
              four: assert affordable_pairs([1, 2, 3, 4], 5) == 4
              tight: assert affordable_pairs([1, 2, 3, 4], 4) == 2
              all_pairs: assert affordable_pairs([1, 2, 3, 4], 100) == 6
              exact_sum: assert affordable_pairs([5, 1], 6) == 1
              unsorted: assert affordable_pairs([9, 1, 8, 2], 10) == 4
              equal_prices: assert affordable_pairs([2, 2, 2], 4) == 3
              too_few: assert affordable_pairs([], 10) == 0 == affordable_pairs([3], 10)
              too_poor: assert affordable_pairs([10, 20], 5) == 0""", "four too_poor",
              "affordable_pairs(prices, budget) in budget.py counts the pairs of items whose two "
              "prices add up to at most `budget`. It undercounts. Find and fix the bug(s).",
              "affordable_pairs"),
    ]


def in_generator_wording(tasks: list[Task]) -> list[Task]:
    """The same tasks with the instruction in the generator's sentence (`env.tasks`: "The
    function `f` in `p` ... It is buggy. Fix it so ...; `test_p.py` tests only some of them."),
    the code unchanged: separates a policy's failure on a user's wording from one on the code."""
    out = []
    for t in tasks:
        dev = " and ".join(f"`{p}`" for p in sorted(t.dev_tests))
        out.append(replace(t, instruction=(
            f"The function `{t.metadata['fn']}` in `{t.metadata['source_file']}` is buggy. Fix it so it is correct "
            f"on all inputs, including edge cases; {dev} tests only some of them.")))
    return out


def validation_with_module_names(n: int, *, made_up: bool, words: bool = False) -> list[Task]:
    """`n` validation instances of the training templates (the gate's stream, seed 0 + 5555,
    never a held-out set) re-made with made-up, English-word (`words`: the validation half of
    `drills._word_name`'s words) or pool module names (`drills.module_renamed_tasks`): the
    file-name half of this check on the generator's own code, paired instance by instance."""
    from experiments.binary_search_rl.drills import module_renamed_tasks
    from experiments.binary_search_rl.stages import validation_tasks
    from experiments.binary_search_rl.config import StudyConfig

    return module_renamed_tasks(validation_tasks(StudyConfig(), n), 5555, made_up=made_up or words,
                                words=1.0 if words else 0.0, word_split="validation")


def main(argv: list[str] | None = None) -> None:
    """`[OUT.jsonl] [--generator-wording | --made-up-modules=N | --word-modules=N | --pool-modules=N]`."""
    args = sys.argv[1:] if argv is None else argv
    paths = [a for a in args if not a.startswith("--")]
    path = paths[0] if paths else DEFAULT_PATH
    flags = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in args if a.startswith("--"))
    kinds = {"made-up-modules": "made-up", "word-modules": "English-word", "pool-modules": "pool"}
    unknown = set(flags) - {"generator-wording", *kinds}
    if unknown or len(flags) > 1:
        raise SystemExit(f"unknown or combined options {sorted(flags)}: use at most one of --generator-wording, "
                         "--made-up-modules=N, --word-modules=N, --pool-modules=N")
    if set(flags) & set(kinds):
        (flag, n), = flags.items()
        tasks = validation_with_module_names(int(n), made_up=flag == "made-up-modules", words=flag == "word-modules")
        what = f"validation instances, {kinds[flag]} module names"
    elif "generator-wording" in flags:
        tasks, what = in_generator_wording(handwritten_tasks()), "hand-written, the generator's wording"
    else:
        tasks, what = handwritten_tasks(), "hand-written"
    save_tasks(path, tasks)
    print(f"wrote {len(tasks)} tasks ({what}) to {path}")


if __name__ == "__main__":
    main()
