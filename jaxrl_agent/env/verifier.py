"""The independent judge: final workspace -> reward (HOST).

`verify(task, workspace_dir, sandbox)`:
1. copies only the task's source files (the paths of `task.files`) from the workspace into a
   fresh directory; anything else the agent left there (a conftest.py, pytest.ini, edited
   or deleted test files, symlinks) is ignored;
2. runs the pristine hidden tests with `Sandbox.judge`: the tests, their expected values,
   every comparison and the report live in a judge process; the agent's code runs in a
   jailed child (own uid, PID and IPC namespace) that only answers calls, as plain data
   (`judge.py`, `code_server.py`). The child never holds a test's source, an expected
   value, a nonce or the reporter, so frame walking, gc searches, globals injection and
   patching pytest, builtins or the test's helpers have nothing to act on. An answer that
   is not plain data, a missed answer (timeout, crash, exit) or a malformed one fails
   the test;
3. returns reward 1.0 only if every expected hidden test ran and passed: the expected test
   ids come from a run of the same hidden tests on `task.reference_files` (cached per
   task). A collection error, a timeout, a missing test or a bad exit gives 0.0.

Guarantees for users' tasks (ordinary pytest files in `hidden_tests`) are the same as
for generated ones as long as the tests reach the code through calls and plain values
(see `judge` for what a hidden test may do with the task's modules); a test that needs
the agent's objects in the judge (isinstance against the task's classes, catching its own
exception classes, passing callables) fails on the reference too, so `check_task`
rejects it. The hidden tests of generated tasks compare with exact types (`tasks.same`).
`info` says why (never affects the reward).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field

from jaxrl_agent.env.judge import module_names
from jaxrl_agent.env.sandbox import RunResult, Sandbox
from jaxrl_agent.env.tasks import Task, TaskFormatError, load_tasks


@dataclass
class VerifyResult:
    reward: float
    info: dict = field(default_factory=dict)
    """reason, passed, expected, failures [{test, message}], missing, tampered, ..."""


# Wall limit for one hidden-test run and per test; looping buggy code costs at most these.
TIMEOUT_S = 20.0
TEST_TIMEOUT_S = 1.0
_MAX_FAILS = 1  # stop at the first failure: the reward is 0 already (and loops cost 1s each)

_expected_cache: dict[str, list[str] | str] = {}
_cache_lock = threading.Lock()


def pytest_args(paths: list[str]) -> list[str]:
    """pytest's arguments for a hidden-test run of `paths` (also the benchmarks' baseline)."""
    # -c /dev/null + --rootdir: no ini file anywhere is read; --noconftest: no conftest.py;
    # --confcutdir: collection starts at the rootdir, not at / (pytest would list every
    # directory above it, /tmp among them, on each run).
    return ["-q", "-c", os.devnull, "--rootdir", ".", "--confcutdir", ".", "--noconftest",
            f"--maxfail={_MAX_FAILS}", *paths]


def _run_hidden(task: Task, sources: dict[str, str], sandbox: Sandbox,
                timeout_s: float, test_timeout_s: float) -> RunResult:
    """Write `sources` into a fresh directory and run the hidden tests on it."""
    fresh = tempfile.mkdtemp(prefix="jxa-verify-")
    try:
        for rel, text in sources.items():
            path = os.path.join(fresh, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return sandbox.judge(fresh, pytest_args(sorted(task.hidden_tests)),
                             dict(task.hidden_tests), module_names(task.files),
                             timeout_s=timeout_s, test_timeout_s=test_timeout_s)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def _analyse(res: RunResult) -> dict:
    """Outcome records -> passed ids, failures, session end, tampering."""
    tests = res.tests or []
    end = next((r for r in tests if r.get("event") == "end"), None)
    passed, failures = [], []
    for r in tests:
        if r.get("event") != "test":
            continue
        if r.get("outcome") == "passed":
            passed.append(r.get("id"))
        else:
            failures.append({"test": r.get("id"), "when": r.get("when"),
                             "outcome": r.get("outcome"), "message": str(r.get("message"))[:300]})
    return dict(passed=passed, failures=failures, end=end,
                tampered=(end or {}).get("tampered") or [])


def expected_tests(task: Task, sandbox: Sandbox, timeout_s: float = TIMEOUT_S,
                   test_timeout_s: float = TEST_TIMEOUT_S) -> list[str] | str:
    """Hidden test ids that pass on the reference solution (cached); an error text if the
    reference itself does not pass them (a broken task)."""
    key = hashlib.sha1(json.dumps([task.reference_files, task.hidden_tests, test_timeout_s],
                                  sort_keys=True).encode()).hexdigest()  # the limit: a slow reference
    with _cache_lock:
        if key in _expected_cache:
            return _expected_cache[key]
    sources = {rel: task.reference_files.get(rel, text) for rel, text in task.files.items()}
    res = _run_hidden(task, sources, sandbox, timeout_s, test_timeout_s)
    a = _analyse(res)
    if res.error or res.timed_out:  # transient: do not cache
        return f"reference run failed: {res.error or 'timeout'}"
    if res.returncode != 0 or a["failures"] or not a["passed"] or a["end"] is None:
        out: list[str] | str = (f"task {task.task_id}: the reference solution does not pass the "
                                f"hidden tests ({a['failures'][:1] or res.stdout[-300:]})")
    else:
        out = sorted(a["passed"])
    with _cache_lock:
        _expected_cache[key] = out
    return out


def verify(task: Task, workspace_dir, sandbox: Sandbox | None = None, *,
           timeout_s: float = TIMEOUT_S, test_timeout_s: float = TEST_TIMEOUT_S) -> VerifyResult:
    """Score the final workspace of an episode; never raises for anything in the workspace.

    Without a `sandbox`, a one-worker pool is started for this call (slow: pass one).
    """
    if sandbox is None:
        with Sandbox(num_workers=1, timeout_s=timeout_s) as sb:
            return verify(task, workspace_dir, sb, timeout_s=timeout_s,
                          test_timeout_s=test_timeout_s)
    # ---- 1. the agent's sources, nothing else ----
    sources, unreadable = {}, []
    for rel in task.files:
        path = os.path.join(str(workspace_dir), rel)
        try:
            if os.path.islink(path) or not os.path.isfile(path):
                unreadable.append(rel)
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                sources[rel] = f.read(1 << 20)
        except OSError:
            unreadable.append(rel)
    info: dict = {"missing_sources": unreadable} if unreadable else {}
    # ---- 2. what must pass ----
    expected = expected_tests(task, sandbox, timeout_s, test_timeout_s)
    if isinstance(expected, str):
        return VerifyResult(0.0, {**info, "reason": "invalid_task", "detail": expected})
    # ---- 3. the hidden tests on the agent's code ----
    res = _run_hidden(task, sources, sandbox, timeout_s, test_timeout_s)
    a = _analyse(res)
    missing = sorted(set(expected) - set(a["passed"]))
    info.update(passed=len(set(a["passed"]) & set(expected)), expected=len(expected),
                failures=a["failures"][:_MAX_FAILS], missing=missing[:20],
                tampered=a["tampered"], returncode=res.returncode)
    if res.error:
        reason = "sandbox_error"
        info["detail"] = res.error
    elif res.timed_out:
        reason = "timeout"
    elif res.forged_records:
        reason = "forged_report"
    elif a["tampered"]:
        reason = "tampered"
    elif any(f["when"] == "collect" for f in a["failures"]):
        reason = "collection_error"
    elif a["failures"]:
        reason = "failed"
    elif a["end"] is None:
        reason = "no_report"  # the process ended before pytest finished (exit tricks)
    elif missing:
        reason = "missing_tests"
    elif res.returncode != 0 or a["end"].get("exitstatus") != 0:
        reason = "bad_exit"
    else:
        reason = "passed"
    info["reason"] = reason
    return VerifyResult(1.0 if reason == "passed" else 0.0, info)


def check_task(task: Task, sandbox: Sandbox) -> list[str]:
    """Problems that make a (user-provided) task unusable; empty when it is sound.

    Generated tasks are checked in-process at generation time; a task loaded from JSONL
    is foreign code, so it is checked here, in the sandbox: the reference solution must pass
    every hidden test, and the buggy files must not.
    """
    problems = []
    expected = expected_tests(task, sandbox)
    if isinstance(expected, str):
        problems.append(expected)
    with tempfile.TemporaryDirectory(prefix="jxa-check-") as ws:
        for rel, text in task.files.items():
            os.makedirs(os.path.dirname(os.path.join(ws, rel)), exist_ok=True)
            with open(os.path.join(ws, rel), "w", encoding="utf-8") as f:
                f.write(text)
        if not problems and verify(task, ws, sandbox).reward > 0:
            problems.append(f"task {task.task_id}: the buggy files already pass the hidden tests")
    return problems


def load_checked_tasks(path: str, sandbox: Sandbox) -> list[Task]:
    """Tasks from a JSONL file (`tasks.save_tasks` format), each checked with `check_task`.

    Raises FileNotFoundError for a missing file and `TaskFormatError` (a ValueError) for an
    empty file, a malformed line (naming it) or tasks that fail the check (listing them), so
    a run never starts on tasks whose reward cannot be trusted.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file {path!r} does not exist (write one with jaxrl_agent.env.tasks.save_tasks)")
    tasks = load_tasks(path)
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks in the file")
    problems = [p for task in tasks for p in check_task(task, sandbox)]
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise TaskFormatError(f"{path}: {len(problems)} problem(s) with its tasks:\n  {shown}")
    return tasks
