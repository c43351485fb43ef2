"""Tasks: the canonical binary-search task, the templated bug-fix family, JSONL io (HOST).

A `Task` is a tiny buggy repository (`files`), the instruction, dev tests the agent may run
(partial coverage: at least one fails on the buggy code, not every bug is caught), hidden
tests only the verifier runs (full coverage: every injected bug fails at least one), and the
fixed sources. Generation is deterministic from (split, seed) and checked per instance:
expected values come from an independent oracle, the reference must match it on every case,
the buggy code (and each of its bugs alone) must fail the hidden cases. Buggy code may loop
forever; the check runs it in-process under a line budget (trusted template code only).

Splits: "train" and "heldout_instances" draw from the same templates with different random
streams; "heldout_templates" draws only from templates never used in training.
"""
from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jaxrl_agent.env.templates import HELDOUT_TEMPLATES, TEMPLATES, TRAIN_TEMPLATES
from jaxrl_agent.env.templates.base import Template

SPLITS = ("train", "heldout_instances", "heldout_templates")


@dataclass
class Task:
    """One bug-fix task (DESIGN §11). Paths are relative, '/'-separated."""

    task_id: str
    instruction: str
    files: dict[str, str]
    """The buggy repository: path -> text (what the agent's workspace starts with, plus
    `dev_tests`)."""
    dev_tests: dict[str, str]
    """Test files the agent can run with `run_tests` (partial coverage)."""
    hidden_tests: dict[str, str]
    """Test files only the verifier runs (full coverage)."""
    reference_files: dict[str, str]
    """The fixed sources (same paths as `files`)."""
    metadata: dict = field(default_factory=dict)
    """template, family, split, seed, bugs ([{line, buggy, fixed}]), module, fn, ..."""


# ---- running trusted template code on a case ----


class _Budget(Exception):
    """Raised by the tracer when a call exceeds its line budget (an infinite loop)."""


@functools.lru_cache(maxsize=256)
def _compiled(source: str):
    """One code object per source: an instance's check runs each variant on every case."""
    return compile(source, "<task>", "exec")


def _call(source: str, fn: str, args: tuple, budget: int = 20000):
    """Run `fn(*args)` from `source` in-process; ("ok", value) / ("error", msg) / ("loop", None)."""
    ns: dict = {"__name__": "task_check"}
    exec(_compiled(source), ns)  # a fresh namespace per call: no state survives between calls
    steps = 0

    def tracer(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > budget:
                raise _Budget
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        return "ok", ns[fn](*copy.deepcopy(args))
    except _Budget:
        return "loop", None
    except Exception as e:  # noqa: BLE001 - buggy code raising is an expected outcome
        return "error", f"{type(e).__name__}: {e}"
    finally:
        sys.settrace(old)


# ---- rendering ----

# The exact-match helper, defined once as source: the hidden test files embed this text
# (they must not import this package) and `same` below is the very same function.
_SAME_SRC = '''

def _same(actual, expected):
    """Exact match: same types all the way down, then equal (no always-equal objects)."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(_same, actual, expected))
    return actual == expected
'''
_ns: dict = {}
exec(_SAME_SRC, _ns)
same = _ns["_same"]
same.__doc__ = "Exact equality: same type all the way down, then ==. The hidden tests use it."


def workspace_files(task: "Task") -> dict[str, str]:
    """What an episode's workspace starts with: the buggy sources and the dev tests."""
    return {**task.files, **task.dev_tests}


def _args_src(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def render_tests(module: str, fn: str, cases: list[tuple[str, tuple, object]],
                 strict: bool) -> str:
    """A pytest file with one test per (kind, args, expected) case."""
    lines = [f"from {module} import {fn}\n"]
    if strict:
        lines.append(_SAME_SRC)
    seen: dict[str, int] = {}
    for kind, args, expected in cases:
        seen[kind] = seen.get(kind, 0) + 1
        call = f"{fn}({_args_src(args)})"
        check = f"_same({call}, {expected!r})" if strict else f"{call} == {expected!r}"
        lines.append(f"\n\ndef test_{kind}_{seen[kind]}():\n    assert {check}\n")
    return "".join(lines)


def _bug_record(reference: str, buggy_one: str) -> dict:
    """The changed lines between the reference and a one-bug version (for the expert)."""
    ref, bug = reference.splitlines(keepends=True), buggy_one.splitlines(keepends=True)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ref, b=bug).get_opcodes():
        if op != "equal":
            return {"line": j1 + 1, "buggy": "".join(bug[j1:j2]), "fixed": "".join(ref[i1:i2])}
    raise ValueError("bug injection changed nothing")


# ---- one instance ----


def make_instance(tpl: Template, rng: random.Random, *, split: str = "custom", seed: int = 0,
                  names: dict | None = None, module: str | None = None,
                  sites: list[tuple[int, int]] | None = None,
                  cases: list | None = None, dev_kinds: tuple[str, ...] = ("typical",),
                  max_tries: int = 30) -> Task:
    """Build and check one task from `tpl`; fixed choices may be passed for reproducibility.

    `sites` lists (bug site index, variant index) pairs; by default 1-3 random sites.
    Raises ValueError if the template is inconsistent (reference disagrees with the oracle)
    or no bug choice gives a checkable instance within `max_tries`.
    """
    for _ in range(max_tries):
        if names is None:
            pick = {k: rng.choice(v) for k, v in tpl.names.items()}
            if len(set(pick.values())) < len(pick):
                continue  # two roles drew the same identifier
        else:
            pick = dict(names)
        mod = module or rng.choice(tpl.modules)
        if mod in pick.values():
            continue
        doc = rng.choice(tpl.docs).format(**pick)
        chosen = sites if sites is not None else [
            (i, rng.randrange(len(tpl.bugs[i][1])))
            for i in sorted(rng.sample(range(len(tpl.bugs)),
                                       min(len(tpl.bugs), rng.choice([1, 1, 2, 2, 3]))))]
        fmt = lambda s: s.format(doc=doc, **pick)  # noqa: E731
        reference = fmt(tpl.source)
        singles, buggy_tpl = [], tpl.source
        for i, v in chosen:
            correct, variants = tpl.bugs[i]
            singles.append(fmt(tpl.source.replace(correct, variants[v])))
            buggy_tpl = buggy_tpl.replace(correct, variants[v])
        buggy = fmt(buggy_tpl)
        raw = cases if cases is not None else tpl.cases(rng)
        checked = []
        for kind, args in raw:
            expected = tpl.oracle(*copy.deepcopy(args))
            status, got = _call(reference, pick["fn"], args)
            if status != "ok" or not same(got, expected):
                raise ValueError(f"template {tpl.name}: reference gives {status} {got!r} != "
                                 f"{expected!r} on {kind} {args!r}")
            checked.append((kind, args, expected))

        def fails(src, case):
            status, got = _call(src, pick["fn"], case[1])
            return status != "ok" or not same(got, case[2])

        if not any(fails(buggy, c) for c in checked):
            continue
        if not all(any(fails(s, c) for c in checked) for s in singles):
            continue  # some bug is invisible to the hidden tests: choose again
        dev = [c for c in checked if c[0] in dev_kinds][:3]
        if not any(fails(buggy, c) for c in dev):
            # Make sure run_tests shows a failure: add one revealing case, preferring a wrong
            # value or an error over an infinite loop (a loop costs a per-test timeout).
            failing = [c for c in checked if c not in dev and fails(buggy, c)]
            failing.sort(key=lambda c: _call(buggy, pick["fn"], c[1])[0] == "loop")
            dev.append(failing[0])
        return _assemble(tpl, pick, mod, reference, buggy, singles, chosen, checked, dev,
                         split=split, seed=seed)
    raise ValueError(f"template {tpl.name}: no checkable instance in {max_tries} tries")


def _assemble(tpl, pick, mod, reference, buggy, singles, chosen, hidden, dev, *, split, seed):
    fn = pick["fn"]
    src_path, dev_path, hid_path = f"{mod}.py", f"test_{mod}.py", f"test_{mod}_hidden.py"
    summary = tpl.summary.format(**pick)
    instruction = (f"The function `{fn}` in `{src_path}` {summary}. It is buggy. Fix it so it "
                   f"is correct on all inputs, including edge cases; `{dev_path}` tests only "
                   f"some of them.")
    files = {src_path: buggy}
    hidden_tests = {hid_path: render_tests(mod, fn, hidden, strict=True)}
    digest = hashlib.sha1(json.dumps([files, hidden_tests], sort_keys=True).encode()).hexdigest()
    return Task(
        task_id=f"{tpl.name}-{digest[:10]}", instruction=instruction, files=files,
        dev_tests={dev_path: render_tests(mod, fn, dev, strict=False)},
        hidden_tests=hidden_tests, reference_files={src_path: reference},
        metadata=dict(template=tpl.name, family=tpl.family, split=split, seed=seed,
                      module=mod, fn=fn, source_file=src_path, n_bugs=len(chosen),
                      bugs=[_bug_record(reference, s) for s in singles],
                      bug_sites=[list(c) for c in chosen],
                      dev_kinds=[c[0] for c in dev], hidden_kinds=[c[0] for c in hidden]))


# ---- the canonical task and the family ----


def binary_search_task() -> Task:
    """The running example: `low = mid` / `high = mid` in an inclusive binary search.

    Dev tests: an element found in the middle and one found earlier (both pass on the buggy
    code) and the last element (the `low = mid` bug loops forever there). The `high = mid`
    bug only shows on absent values, which only the hidden tests have.
    """
    tpl = TEMPLATES["bsearch_find"]
    xs = [1, 3, 5, 7, 9, 11, 13]
    cases = [("middle", (xs, 7)), ("earlier", (xs, 3)), ("last", (xs, 13)),
             ("later", (xs, 11)), ("first", (xs, 1)), ("absent_inside", (xs, 6)),
             ("absent_below", (xs, 0)), ("absent_above", (xs, 20)), ("empty", ([], 4)),
             ("one_element", ([5], 5)), ("one_element_absent", ([5], 4)),
             ("two_elements_last", ([2, 8], 8)), ("two_elements_first", ([2, 8], 2)),
             ("even_length", ([10, 20, 30, 40], 40)), ("negatives", ([-9, -4, -1, 0, 6], -4))]
    task = make_instance(
        tpl, random.Random(0), split="canonical", names=dict(
            fn="binary_search", arr="arr", target="target", lo="low", hi="high", mid="mid"),
        module="bsearch", sites=[(0, 0), (1, 0)], cases=cases,
        dev_kinds=("middle", "earlier", "last"))
    task.task_id = "binary_search"
    return task


def generate_tasks(split: str, n: int, seed: int) -> list[Task]:
    """`n` checked tasks of `split`, deterministic in (split, n, seed).

    Templates are used round-robin in a seed-shuffled order, so any n >= the number of
    templates of the split covers all of them.
    """
    return list(GeneratedTasks(split, n, seed))


class GeneratedTasks(Sequence):
    """`generate_tasks(split, n, seed)` as a sequence that makes each task when it is first
    read (then keeps it): a run that trains on a few of 512 tasks does not wait to check all
    of them before its first iteration (`benchmarks/bench_startup.py`). Task i depends on
    (split, seed, i) alone, so reading in any order gives the same tasks."""

    def __init__(self, split: str, n: int, seed: int):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        self.split, self.n, self.seed = split, n, seed
        self._names = list(HELDOUT_TEMPLATES if split == "heldout_templates" else TRAIN_TEMPLATES)
        random.Random(f"order|{split}|{seed}").shuffle(self._names)
        self._made: dict[int, Task] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(f"task {i} of {self.n}")
        i %= self.n
        if i not in self._made:
            # String seeds hash with sha512: stable across processes and PYTHONHASHSEED.
            rng = random.Random(f"{self.split}|{self.seed}|{i}")
            self._made[i] = make_instance(TEMPLATES[self._names[i % len(self._names)]], rng, split=self.split,
                                          seed=self.seed)
        return self._made[i]


# ---- JSONL io ----

_DICT_FIELDS = ("files", "dev_tests", "hidden_tests", "reference_files")


class TaskFormatError(ValueError):
    """A task record is malformed; the message names the field."""


def task_to_dict(task: Task) -> dict:
    return dict(task_id=task.task_id, instruction=task.instruction, files=task.files,
                dev_tests=task.dev_tests, hidden_tests=task.hidden_tests,
                reference_files=task.reference_files, metadata=task.metadata)


def _check_paths(name: str, value, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise TaskFormatError(f"{where}: field {name!r} must be an object of path -> text")
    for path, text in value.items():
        parts = path.split("/") if isinstance(path, str) else []
        if not parts or path.startswith("/") or "\\" in path or any(p in ("", ".", "..")
                                                                   for p in parts):
            raise TaskFormatError(f"{where}: field {name!r} has a bad path {path!r} "
                                  "(relative, '/'-separated, no '..')")
        if not isinstance(text, str):
            raise TaskFormatError(f"{where}: field {name!r}[{path!r}] must be a string")
    return dict(value)


def task_from_dict(d, where: str = "task") -> Task:
    """Validate one record; raises TaskFormatError naming the offending field."""
    if not isinstance(d, dict):
        raise TaskFormatError(f"{where}: expected a JSON object, got {type(d).__name__}")
    known = {"task_id", "instruction", "metadata", *_DICT_FIELDS}
    extra = set(d) - known
    if extra:
        raise TaskFormatError(f"{where}: unknown field(s) {sorted(extra)}")
    for name in ("task_id", "instruction"):
        if not isinstance(d.get(name), str) or not d.get(name):
            raise TaskFormatError(f"{where}: field {name!r} must be a non-empty string")
    parts = {name: _check_paths(name, d.get(name, {} if name == "dev_tests" else None), where)
             for name in _DICT_FIELDS}
    for name in ("files", "hidden_tests", "reference_files"):
        if not parts[name]:
            raise TaskFormatError(f"{where}: field {name!r} must not be empty")
    if set(parts["reference_files"]) - set(parts["files"]):
        raise TaskFormatError(f"{where}: field 'reference_files' has paths not in 'files'")
    clash = set(parts["hidden_tests"]) & (set(parts["files"]) | set(parts["dev_tests"]))
    if clash:
        raise TaskFormatError(f"{where}: field 'hidden_tests' reuses path(s) {sorted(clash)}")
    meta = d.get("metadata", {})
    if not isinstance(meta, dict):
        raise TaskFormatError(f"{where}: field 'metadata' must be an object")
    return Task(task_id=d["task_id"], instruction=d["instruction"], metadata=dict(meta), **parts)


def save_tasks(path: str | os.PathLike, tasks: list[Task]) -> None:
    """Write one JSON object per line."""
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(task_to_dict(t), sort_keys=True) + "\n")


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Read tasks written by `save_tasks` (or by hand); errors name the line and field."""
    tasks, seen = [], set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: invalid JSON ({e.msg})") from None
        task = task_from_dict(record, where)
        if task.task_id in seen:
            raise TaskFormatError(f"{where}: field 'task_id' {task.task_id!r} is duplicated")
        seen.add(task.task_id)
        tasks.append(task)
    return tasks
